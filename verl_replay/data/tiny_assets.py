"""Deterministic tiny local assets for CPU tests and runs: tokenizer, models, RL datasets.

Nothing is downloaded. From one seed this builds:

- a byte-level BPE tokenizer trained with ``tokenizers`` on the tiny datasets' text (any UTF-8
  text still encodes), Qwen-style chat template (``<|im_start|>role\\n...<|im_end|>\\n``; list
  content with text / image / video parts like Qwen3.5's), eos ``<|im_end|>``, pad
  ``<|endoftext|>``, Qwen's vision tokens (``<|vision_start|>``, ``<|image_pad|>``, ...), digits
  split one per token like Qwen;
- two tiny models of Qwen3.5-4B's architecture (default ``model_arch="qwen3_5"``): a
  ``Qwen3_5ForConditionalGeneration`` (hybrid linear/full attention text model, M-RoPE, a
  one-block vision tower) with a ``Qwen3VLProcessor`` saved beside it, so that verl loads the
  processor and builds (4, L) M-RoPE position ids, the multimodal fields and the Qwen-VL chat
  path exactly as for the real checkpoint. ``model_arch="qwen2"`` gives a text-only
  ``Qwen2ForCausalLM`` (no processor). Randomly initialised, then warm-started with a short,
  seeded supervised pass on the training answers in the format the rewards accept, so that
  sampled answers are right some of the time: GRPO needs groups whose answers disagree (a random
  model scores 0 everywhere and every advantage is 0). Each is saved with the tokenizer in one
  directory that ``AutoTokenizer`` / ``AutoProcessor`` / ``AutoModelForImageTextToText`` load;
- ``tiny_math`` and ``tiny_sql`` RL parquet files (train/val) and the SQLite databases.

Layout under the root::

    model/            config.json, model.safetensors, generation_config.json, tokenizer files,
                      chat_template.jinja, preprocessor_config.json, video_preprocessor_config.json,
                      processor_config.json (warm-started on tiny_math)
    model_sql/        the same files, warm-started on tiny_sql
    math/{train,val}.parquet
    sql/{train,val}.parquet
    sql/databases/<db_id>/<db_id>.sqlite
    MANIFEST.json     written last: format version, seed, arch, sha256 of every file, stats

Loading the processor needs torchvision (transformers' Qwen3-VL video processor); on a CPU host
without it, ``verl_replay.integrations.verl.vl_processor`` makes it loadable for text and image
rows (verl's CPU support installs it in every process).

Packing on CPU (Qwen3.5): without flash-linear-attention transformers' torch fallback of the
gated-delta-net recurrence ignores packed-sequence boundaries (it takes ``cu_seqlens`` and drops
it; a packed row then differs from separate rows by ~5e-3 in the logits). verl's CPU support
(``verl_replay.integrations.verl.cpu_linear_attention``) fills the layer's kernel slots with torch
kernels that restart at every sequence, so verl's padding-free path (``use_remove_padding``, with
``cu_seqlens``) is exact on CPU. transformers' own forward given only packed ``position_ids`` still
leaks (it passes the recurrence no boundaries). The ``qwen2`` model has no such layer and packs
exactly (sdpa, ``use_cache=False``).

Caching and concurrency: a root whose manifest matches (version, seed, arch) and whose files
match their hashes is returned as is. Otherwise the build runs under an exclusive file lock
(``fcntl``) into a sibling temporary directory that is renamed into place, so concurrent
builders (pytest workers, Ray processes) never see or leave a half-written tree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import statistics
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from verl_replay.data.math_benchmarks import MathExample
from verl_replay.data.prepare import MATH_RL_SCHEMA, SQL_RL_SCHEMA, math_rows, sql_rows, write_rl_parquet
from verl_replay.data.prompts import SQL_INSTRUCTION, TINY_MATH_INSTRUCTION
from verl_replay.data.schema import SQLExample
from verl_replay.data.tiny_math import TINY_MATH_SOURCE, tiny_math_examples
from verl_replay.data.tiny_sql import TINY_SQL_SOURCE, build_tiny_sql

# Bump when the layout, the generators or the model/tokenizer recipe change: old caches are
# then ignored because the default directory name and the manifest both carry the version.
ASSET_FORMAT_VERSION = 4
MODEL_ARCHS = ("qwen3_5", "qwen2")
DEFAULT_MODEL_ARCH = "qwen3_5"
MANIFEST_NAME = "MANIFEST.json"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen3.5's vision placeholders: its processor and config name them, even for text-only rows.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
TARGET_VOCAB_SIZE = 1024
MAX_POSITIONS = 1024
# Qwen-style template; generation prompt opens the assistant turn. Content is a string or, as
# processors pass it, a list of parts; image / video parts render Qwen's vision placeholders.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_SQL_KEYWORDS = (
    "SELECT DISTINCT FROM WHERE JOIN LEFT INNER OUTER CROSS ON AS AND OR NOT IN EXISTS IS NULL LIKE "
    "BETWEEN GROUP BY HAVING ORDER ASC DESC LIMIT OFFSET UNION ALL INTERSECT EXCEPT WITH CASE WHEN "
    "THEN ELSE END COUNT SUM AVG MIN MAX CAST OVER PARTITION ROW_NUMBER RANK"
)
_FILLER = (
    "Let me think step by step. First, we add the numbers. Then we multiply. "
    "The answer is \\boxed{0}. We need the table and the join. The query is:"
)


@dataclass(frozen=True)
class TinyAssets:
    """Paths of a complete tiny-asset build (``tokenizer`` is the model directory)."""

    root: Path
    model_dir: Path  # warm-started on tiny_math answers
    sql_model_dir: Path  # same architecture and tokenizer, warm-started on tiny_sql answers
    tokenizer: Path
    math_train: Path
    math_val: Path
    sql_train: Path
    sql_val: Path
    sql_db_root: Path
    seed: int
    model_arch: str
    # True when this call built the files (False: an existing build was reused).
    built_now: bool = field(default=False, compare=False)

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST_NAME

    def manifest(self) -> dict[str, Any]:
        return json.loads(self.manifest_path.read_text(encoding="utf-8"))


def default_root(seed: int = 0, model_arch: str = DEFAULT_MODEL_ARCH) -> Path:
    """``$VERL_REPLAY_CACHE`` (default ``~/.cache/verl_replay``) / ``tiny-v<version>[-arch-seed]``."""
    base = Path(os.environ.get("VERL_REPLAY_CACHE", "~/.cache/verl_replay")).expanduser()
    name = f"tiny-v{ASSET_FORMAT_VERSION}"
    if seed != 0 or model_arch != DEFAULT_MODEL_ARCH:
        name += f"-{model_arch}-seed{seed}"
    return base / name


def _assets_at(root: Path, seed: int, model_arch: str) -> TinyAssets:
    return TinyAssets(
        root=root,
        model_dir=root / "model",
        sql_model_dir=root / "model_sql",
        tokenizer=root / "model",
        math_train=root / "math" / "train.parquet",
        math_val=root / "math" / "val.parquet",
        sql_train=root / "sql" / "train.parquet",
        sql_val=root / "sql" / "val.parquet",
        sql_db_root=root / "sql" / "databases",
        seed=seed,
        model_arch=model_arch,
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _file_hashes(root: Path) -> dict[str, str]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    return {p.relative_to(root).as_posix(): _sha256(p) for p in files}


def _resolve_warm_start(warm_start_steps: Mapping[str, int] | None) -> dict[str, int]:
    steps = dict(WARM_START_STEPS if warm_start_steps is None else warm_start_steps)
    if set(steps) != set(WARM_START_STEPS) or any(not isinstance(v, int) or v < 0 for v in steps.values()):
        raise ValueError(f"warm_start_steps must map {sorted(WARM_START_STEPS)} to step counts >= 0, got {steps}")
    return steps


def is_complete(root: Path, *, seed: int, model_arch: str, warm_start_steps: Mapping[str, int] | None = None) -> bool:
    """True iff ``root`` holds a finished build for this version/seed/arch/warm start with intact files."""
    try:
        manifest = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    identity = (manifest.get("format_version"), manifest.get("seed"), manifest.get("model_arch"))
    if identity != (ASSET_FORMAT_VERSION, seed, model_arch):
        return False
    if manifest.get("warm_start_steps") != _resolve_warm_start(warm_start_steps):
        return False
    files = manifest.get("files", {})
    try:
        return bool(files) and all(_sha256(root / rel) == digest for rel, digest in files.items())
    except OSError:
        return False


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    import fcntl  # POSIX only, like verl's CPU/GPU stacks

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------- tokenizer


def _tokenizer_corpus(
    math: list[MathExample], sql: list[SQLExample], sql_prompts: list[str], math_prompts: list[str]
) -> list[str]:
    corpus = list(sql_prompts) + list(math_prompts)
    corpus += [f"The answer is \\boxed{{{ex.answer}}}." for ex in math]
    corpus += [f"```sql\n{q}\n```" for ex in sql for q in ex.gold_sqls]
    corpus += [_SQL_KEYWORDS, _SQL_KEYWORDS.lower(), " ".join("0123456789"), _FILLER, "system user assistant"]
    return corpus


def _train_tokenizer(corpus: list[str], vocab_size: int) -> Any:
    """Byte-level BPE; digits are isolated before byte-level splitting (Qwen does the same)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _fast_tokenizer(tok: Any) -> Any:
    """The transformers tokenizer saved into each model directory (by ``_save_model``)."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        extra_special_tokens=[IM_START, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD],
    )
    return hf_tok


# --------------------------------------------------------------------------- model


TEXT_HIDDEN_SIZE = 64
# Qwen3.5-4B's processor geometry (16-pixel patches, 2 frames per temporal patch, 2x2 merge);
# small pixel bounds keep any image test cheap on the one-block vision tower.
PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE = 16, 2, 2
IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS = 32 * 32, 128 * 128


def tiny_model_config(
    model_arch: str,
    vocab_size: int,
    *,
    eos_id: int,
    pad_id: int,
    vision_token_ids: Mapping[str, int] | None = None,
    hidden_size: int = TEXT_HIDDEN_SIZE,
    intermediate_size: int = 128,
    layer_types: Sequence[str] = ("linear_attention", "full_attention"),
    rope_theta: float = 10_000_000.0,
) -> Any:
    """Config of the tiny random model: text model hidden 64, 2 layers, 4 heads, intermediate 128
    (``hidden_size``, ``intermediate_size``, ``layer_types`` and ``rope_theta`` shape it for a task
    that needs more capacity or finer positions; ``layer_types`` applies to ``qwen3_5``).

    ``qwen3_5``: a ``Qwen3_5Config`` (what Qwen3.5-4B's ``config.json`` holds) whose text model
    has one gated-delta-net (linear attention) layer and one full-attention layer, interleaved
    M-RoPE over (t, h, w) sections like the real model, and a one-block vision tower.
    ``vision_token_ids`` maps the vision special tokens to their ids (required for ``qwen3_5``).
    """
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=len(layer_types) if model_arch == "qwen3_5" else 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,  # like Qwen: no BOS token is prepended
        dtype="float32",
    )
    if model_arch == "qwen3_5":
        from transformers import Qwen3_5Config

        if vision_token_ids is None or set(vision_token_ids) != {VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD}:
            raise ValueError(f"qwen3_5 needs the ids of {VISION_START}, {VISION_END}, {IMAGE_PAD}, {VIDEO_PAD}")
        text_config = dict(
            **common,
            head_dim=32,
            layer_types=list(layer_types),
            linear_conv_kernel_dim=4,
            # vLLM's CPU kernels for Gated DeltaNet take head dims that are multiples of 32 only
            # ("expect qk_head_size to be multiples of 32"): the tiny model runs in vLLM as is.
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            # Qwen3.5 rotates a quarter of each head (here 8 of 32 dims = 4 frequencies), split
            # over the temporal / height / width position rows (real model: [11, 11, 10]).
            rope_parameters={
                "rope_type": "default",
                "rope_theta": rope_theta,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        )
        vision_config = dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            in_channels=3,
            patch_size=PATCH_SIZE,
            temporal_patch_size=TEMPORAL_PATCH_SIZE,
            spatial_merge_size=MERGE_SIZE,
            out_hidden_size=hidden_size,
            num_position_embeddings=64,  # an 8 x 8 grid of learned position embeddings
        )
        return Qwen3_5Config(
            text_config=text_config,
            vision_config=vision_config,
            image_token_id=vision_token_ids[IMAGE_PAD],
            video_token_id=vision_token_ids[VIDEO_PAD],
            vision_start_token_id=vision_token_ids[VISION_START],
            vision_end_token_id=vision_token_ids[VISION_END],
            tie_word_embeddings=True,
            dtype="float32",
        )
    if model_arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    raise ValueError(f"model_arch must be one of {MODEL_ARCHS}, got {model_arch!r}")


def _model_class(model_arch: str) -> Any:
    """The class of the checkpoint (``architectures[0]``), i.e. what verl's actor instantiates."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # AutoModelForCausalLM maps qwen3_5 to the text-only Qwen3_5ForCausalLM.
    return AutoModelForImageTextToText if model_arch == "qwen3_5" else AutoModelForCausalLM


def _save_processor(model_dir: Path, hf_tok: Any) -> str:
    """Qwen3.5's processor files next to the tokenizer's: image and video preprocessor configs and
    ``processor_config.json`` naming ``Qwen3VLProcessor`` (the class ``AutoProcessor`` builds).

    Written piece by piece: building the ``Qwen3VLProcessor`` object itself needs torchvision,
    which loading does not need on the paths we use (see ``integrations.verl.vl_processor``)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    geometry = dict(patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE)
    normalise = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    # The PIL backend: its saved config is the same with or without torchvision installed.
    Qwen2VLImageProcessorPil(
        **geometry, **normalise, size={"shortest_edge": IMAGE_MIN_PIXELS, "longest_edge": IMAGE_MAX_PIXELS}
    ).save_pretrained(model_dir)
    Qwen3VLVideoProcessor(
        **geometry, **normalise, size={"shortest_edge": IMAGE_MIN_PIXELS, "longest_edge": 4 * IMAGE_MAX_PIXELS}
    ).save_pretrained(model_dir)
    processor_class = "Qwen3VLProcessor"
    (model_dir / "processor_config.json").write_text(
        json.dumps({"processor_class": processor_class}, indent=2) + "\n", encoding="utf-8"
    )
    return processor_class


_REPORTED_CONFIG_KEYS = {
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "layer_types",
    "max_position_embeddings",
    "tie_word_embeddings",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
    "rope_parameters",
}
_REPORTED_VISION_KEYS = {"depth", "hidden_size", "num_heads", "patch_size", "spatial_merge_size", "out_hidden_size"}


def _reported_config(config: Any) -> dict[str, Any]:
    text = config.get_text_config().to_dict()
    report = {k: v for k, v in text.items() if k in _REPORTED_CONFIG_KEYS}
    report["model_type"] = config.model_type
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        report["vision"] = {k: v for k, v in vision.to_dict().items() if k in _REPORTED_VISION_KEYS}
    return report


@contextlib.contextmanager
def _single_thread() -> Iterator[None]:
    """One intra-op thread for the warm start: a hidden size of 64 gains nothing from more, and on
    a busy 2-core machine extra threads made each step 6-20x slower. A fixed thread count also
    keeps the float reductions, hence the weights, the same on every machine."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Hide transformers' shard-writing bar for a 0.5 MB file, then restore the user's setting."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


# Warm start: enough supervised steps that sampled answers are sometimes right, few enough that
# they are often wrong (checked by tests/data/test_tiny_assets.py on sampled accuracy).
# One model per task: a 143K-parameter model cannot hold both answer formats after a few
# hundred steps. SQL sequences (~170 tokens) cost ~3x a math step.
WARM_START_STEPS = {"math": 240, "sql": 160}
WARM_START_BATCH = 16
WARM_START_LR = 3e-3


def _warm_start_batches(
    hf_tok: Any, pairs: list[tuple[list[dict], str]], seed: int, steps: int
) -> Iterator[tuple[Any, Any, Any]]:
    """Right-padded (input_ids, attention_mask, labels) batches of prompt + answer + eos; loss only on the answer."""
    import torch

    eos_id = hf_tok.convert_tokens_to_ids(IM_END)
    pad_id = hf_tok.convert_tokens_to_ids(ENDOFTEXT)
    encoded = []
    for messages, answer in pairs:
        prompt = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        target = hf_tok.encode(answer, add_special_tokens=False) + [eos_id]
        encoded.append((list(prompt), target))
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        picks = torch.randint(len(encoded), (WARM_START_BATCH,), generator=generator).tolist()
        rows = [encoded[i] for i in picks]
        width = max(len(p) + len(t) for p, t in rows)
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, W]
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, W]
        labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [B, W]
        for row, (prompt, target) in enumerate(rows):
            sequence = prompt + target
            input_ids[row, : len(sequence)] = torch.tensor(sequence)
            attention_mask[row, : len(sequence)] = 1
            labels[row, len(prompt) : len(sequence)] = torch.tensor(target)
        yield input_ids, attention_mask, labels


def _warm_start(model: Any, hf_tok: Any, pairs: list[tuple[list[dict], str]], seed: int, steps: int) -> float:
    """A short seeded SFT pass; returns the last batch's loss."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_START_LR)
    model.train()
    loss_value = float("nan")
    for input_ids, attention_mask, labels in _warm_start_batches(hf_tok, pairs, seed, steps):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    model.eval()
    return round(loss_value, 4)


def _save_model(
    model_dir: Path,
    model_arch: str,
    seed: int,
    hf_tok: Any,
    warm_start_pairs: list[tuple[list[dict], str]],
    warm_start_steps: int,
) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig

    eos_id = hf_tok.convert_tokens_to_ids(IM_END)
    pad_id = hf_tok.convert_tokens_to_ids(ENDOFTEXT)
    vision_ids = {t: hf_tok.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)}
    config = tiny_model_config(model_arch, len(hf_tok), eos_id=eos_id, pad_id=pad_id, vision_token_ids=vision_ids)
    # Private RNG stream: the same seed gives the same weights whatever the caller did before.
    with torch.random.fork_rng(devices=[]), _single_thread():
        torch.manual_seed(seed)
        model = _model_class(model_arch).from_config(config, dtype=torch.float32)
        warm_start_loss = _warm_start(model, hf_tok, warm_start_pairs, seed, warm_start_steps)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)
    with _quiet_progress_bars():
        model.save_pretrained(model_dir, safe_serialization=True)
    hf_tok.save_pretrained(model_dir)
    info = {
        "class": type(model).__name__,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "warm_start": {"steps": warm_start_steps, "batch": WARM_START_BATCH, "final_loss": warm_start_loss},
        "config": _reported_config(config),
    }
    if model_arch == "qwen3_5":
        info["processor"] = _save_processor(model_dir, hf_tok)
        info["vision_parameters"] = sum(p.numel() for p in model.model.visual.parameters())
    return info


# A spawned process costs ~5 s (importing torch and transformers), ~20 warm-start steps: short
# warm starts (the build-mechanics tests) stay in the calling process.
SIDE_BY_SIDE_MIN_STEPS = 50


def _save_models_side_by_side(jobs: list[tuple]) -> list[dict[str, Any]]:
    """``_save_model`` of each job, in processes of their own where there are cores for them: the
    warm starts are single-threaded and independent (each seeds a private RNG stream, so a model's
    bytes do not depend on where it was trained); side by side the build takes ~80 s, not ~140 s,
    on 2 cores. Spawned, not forked: the parent may hold torch's threads (or be a pytest worker)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    workers = min(len(jobs), os.cpu_count() or 1)
    if workers < 2 or min(job[-1] for job in jobs) < SIDE_BY_SIDE_MIN_STEPS:
        return [_save_model(*job) for job in jobs]
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_save_model, *job) for job in jobs]
        return [future.result() for future in futures]


# --------------------------------------------------------------------------- build


def _length_stats(lengths: list[int]) -> dict[str, float]:
    return {"min": min(lengths), "mean": round(statistics.fmean(lengths), 1), "max": max(lengths)}


def _build_into(tmp: Path, final_root: Path, seed: int, model_arch: str, warm_start_steps: dict[str, int]) -> None:
    final = _assets_at(final_root, seed, model_arch)
    staged = _assets_at(tmp, seed, model_arch)
    math = tiny_math_examples(seed)
    sql = build_tiny_sql(staged.sql_db_root, seed=seed, final_db_root=final.sql_db_root)
    rows: dict[str, list[dict[str, Any]]] = {}
    for split in ("train", "val"):
        rows[f"math_{split}"] = math_rows(
            math[split], split=split, data_source=TINY_MATH_SOURCE, instruction=TINY_MATH_INSTRUCTION
        )
        # Schema text is read from the staged copy; db_path must name the final location.
        staged_examples = [
            SQLExample(
                question_id=e.question_id,
                db_id=e.db_id,
                question=e.question,
                gold_sqls=e.gold_sqls,
                db_path=staged.sql_db_root / e.db_id / f"{e.db_id}.sqlite",
            )
            for e in sql[split]
        ]
        split_rows = sql_rows(
            staged_examples, data_source=TINY_SQL_SOURCE, split=split, semantics="bird", instruction=SQL_INSTRUCTION
        )
        for row, ex in zip(split_rows, sql[split], strict=True):
            row["extra_info"]["db_path"] = str(ex.db_path)
        rows[f"sql_{split}"] = split_rows

    prompt_texts = {k: [r["prompt"][-1]["content"] for r in v] for k, v in rows.items()}
    corpus = _tokenizer_corpus(
        math["train"] + math["val"],
        sql["train"] + sql["val"],
        prompt_texts["sql_train"] + prompt_texts["sql_val"],
        prompt_texts["math_train"] + prompt_texts["math_val"],
    )
    hf_tok = _fast_tokenizer(_train_tokenizer(corpus, TARGET_VOCAB_SIZE))
    warm_start_pairs = {
        "math": [(r["prompt"], f"\\boxed{{{r['reward_model']['ground_truth']}}}") for r in rows["math_train"]],
        "sql": [(r["prompt"], f"```sql\n{r['reward_model']['ground_truth']}\n```") for r in rows["sql_train"]],
    }
    math_info, sql_info = _save_models_side_by_side(
        [
            (staged.model_dir, model_arch, seed, hf_tok, warm_start_pairs["math"], warm_start_steps["math"]),
            (staged.sql_model_dir, model_arch, seed, hf_tok, warm_start_pairs["sql"], warm_start_steps["sql"]),
        ]
    )
    model_info = {**math_info, "sql_model": sql_info["warm_start"]}

    write_rl_parquet(rows["math_train"], staged.math_train, MATH_RL_SCHEMA)
    write_rl_parquet(rows["math_val"], staged.math_val, MATH_RL_SCHEMA)
    write_rl_parquet(rows["sql_train"], staged.sql_train, SQL_RL_SCHEMA)
    write_rl_parquet(rows["sql_val"], staged.sql_val, SQL_RL_SCHEMA)

    prompt_tokens = {
        key: _length_stats(
            [
                len(hf_tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"])
                for r in value
            ]
        )
        for key, value in rows.items()
    }
    manifest = {
        "format_version": ASSET_FORMAT_VERSION,
        "seed": seed,
        "model_arch": model_arch,
        "warm_start_steps": warm_start_steps,
        "vocab_size": len(hf_tok),
        "model": model_info,
        "counts": {key: len(value) for key, value in rows.items()},
        "prompt_tokens": prompt_tokens,
        "files": _file_hashes(tmp),
    }
    # The manifest is the completeness marker: written last, atomically.
    partial = tmp / f".{MANIFEST_NAME}.partial"
    partial.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(partial, tmp / MANIFEST_NAME)


_BUILD_ENTRIES = {"model", "model_sql", "math", "sql", MANIFEST_NAME}


def _check_replaceable(root: Path) -> None:
    """Only an earlier (possibly partial) tiny-asset build or an empty folder may be replaced:
    ``--output data/`` must never wipe a user's unrelated files."""
    if root.exists() and not (root.is_dir() and {p.name for p in root.iterdir()} <= _BUILD_ENTRIES):
        raise FileExistsError(
            f"refusing to replace {root}: it holds files that are not tiny assets; choose an empty or new directory"
        )


def _replace_dir(tmp: Path, root: Path, token: str) -> None:
    """Rename the finished build ``tmp`` to ``root``. Directories cannot be replaced atomically when
    the target is non-empty: the old tree is moved aside first, then removed."""
    if root.exists():
        trash = root.parent / f".{root.name}.old-{token}"
        os.replace(root, trash)
        os.replace(tmp, root)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, root)


def build_tiny_assets(
    root: Path | str | None = None,
    *,
    seed: int = 0,
    force: bool = False,
    model_arch: str = DEFAULT_MODEL_ARCH,
    warm_start_steps: Mapping[str, int] | None = None,
) -> TinyAssets:
    """Build (or return the cached) tiny assets under ``root`` (default: ``default_root``).

    ``force=True`` rebuilds even if a complete build exists. ``warm_start_steps`` (default
    ``WARM_START_STEPS``) sets the supervised warm-start steps per task; tests of the build
    mechanics pass a few steps to stay fast. Same seed and arch give the same
    bytes for every file except the SQL parquet files, which embed the absolute database path.
    """
    if model_arch not in MODEL_ARCHS:
        raise ValueError(f"model_arch must be one of {MODEL_ARCHS}, got {model_arch!r}")
    steps = _resolve_warm_start(warm_start_steps)
    root = Path(root).expanduser().absolute() if root is not None else default_root(seed, model_arch).absolute()
    assets = _assets_at(root, seed, model_arch)
    if not force and is_complete(root, seed=seed, model_arch=model_arch, warm_start_steps=steps):
        return assets
    _check_replaceable(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root.parent / f".{root.name}.lock"):
        # Another process may have finished the same build while we waited for the lock.
        if not force and is_complete(root, seed=seed, model_arch=model_arch, warm_start_steps=steps):
            return assets
        token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp = root.parent / f".{root.name}.tmp-{token}"
        try:
            tmp.mkdir()
            _build_into(tmp, root, seed, model_arch, steps)
            _replace_dir(tmp, root, token)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return replace(assets, built_now=True)
