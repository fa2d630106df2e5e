"""Tiny tasks beyond the tiny assets' math and SQL, built on their tokenizer: agentic search, image
math and two-digit addition. Deterministic, local, cached like the tiny assets (own folder, own
manifest).

- ``search``: questions about invented things ("What is the code of the zib?") whose answers
  (two-digit codes) are in a small local corpus; the model calls verl's tool agent loop's
  ``search`` tool (``verl_replay.integrations.verl.search_tool.LocalSearchTool``, BM25 over
  ``corpus.jsonl``) in Qwen's hermes format (``<tool_call>{json}</tool_call>``), reads the
  retrieved ``Doc 1(Title: ...) ...`` lines and answers ``\\boxed{code}``. The warm start is a
  supervised pass on whole trajectories (both assistant turns, the tool output masked out), so
  sampled rollouts call the tool and are right some of the time.
- ``image``: pictures of 1-4 coloured squares (64 x 64 PNGs drawn with PIL, 4 x 4 patches of
  Qwen3.5's 16-pixel geometry, 4 image tokens after the 2 x 2 merge) and the question "How many
  squares?", answered ``\\boxed{N}``; verl's dataset turns the prompt's ``<image>`` into an image
  part and the row's ``images`` column into the picture. The model is the tiny math model (it
  answers ``\\boxed{N}`` already) after a short warm start that runs its vision tower.
- ``arith``: ``aaa+bbb=`` answered by the sum (:mod:`verl_replay.data.tiny_arith`), the task on
  which GRPO is meant to learn within minutes: a larger model (hidden 128, intermediate 384, three
  layers) warm-started on a noisy teacher, so that sampled answers are right far less often than
  greedy ones; 256 held-out problems are the validation set.
- ``shapes``: text-to-SQL questions over one real SQLite table, each answerable by three query
  shapes that the archive's descriptor tells apart (:mod:`verl_replay.data.tiny_shapes`); the
  arith model's size, warm-started on a teacher that writes the shapes at unequal rates and copies
  the question's threshold less reliably in the rare ones; 128 held-out questions.

Layout of a task folder (``<tiny root>-<task>-t<version>``)::

    model/           a Qwen3.5-architecture model warm-started on the task (tokenizer, processor)
    train.parquet    verl RL rows (search rows name agent_name=tool_agent)
    val.parquet
    corpus.jsonl     search: the documents (Search-R1's {"id", "contents"} lines)
    databases/       shapes: <db_id>/<db_id>.sqlite, the database the rows' db_path names
    tools.yaml       search: verl's tool config for LocalSearchTool over corpus.jsonl
    MANIFEST.json    written last: version, task, base tokenizer hash, sha256 of every file
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from verl_replay.data import tiny_shapes
from verl_replay.data.tiny_arith import OPERANDS, TEACHER_NOISE, Problem, arith_problems, arith_rows, warm_start_batches
from verl_replay.data.tiny_assets import (
    IM_END,
    IM_START,
    IMAGE_PAD,
    MANIFEST_NAME,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    TinyAssets,
    _exclusive_lock,
    _file_hashes,
    _model_class,
    _quiet_progress_bars,
    _replace_dir,
    _save_processor,
    _sha256,
    _single_thread,
    build_tiny_assets,
    tiny_model_config,
)

TASK_FORMAT_VERSION = 1
TASKS = ("search", "image", "arith", "shapes")
TINY_SEARCH_SOURCE = "tiny_search"
TINY_IMAGE_SOURCE = "tiny_image_math"  # "math" in the name: verl_replay.rewards scores it as math
# search starts from a random model (the hermes tool call is new to every tiny model); image from the
# tiny math model, which answers \boxed{N} already: a few steps put its vision tower in the loop.
WARM_START_STEPS = {"search": 200, "image": 40, "arith": 1000, "shapes": 600}
WARM_START_BATCH = {"search": 16, "image": 16, "arith": 64, "shapes": 64}
WARM_START_LR = {"search": 3e-3, "image": 3e-3, "arith": 1e-3, "shapes": 1e-3}
# Addition with carries needs more than the hidden-64 model of the other tasks: aligned digits are
# found by position (rope base 1e4 for a 20-token sequence, not the real model's 1e7) and, measured
# on 1,500 noisy-teacher steps of three-digit sums, a third layer (two full-attention layers after
# the linear one) learns it fastest of the shapes tried (loss 1.21 vs 1.45-1.48 for two layers).
# On two-digit sums this shape reaches held-out pass@1 0.33 at T=1 and 0.89 greedy in 1,000 steps.
MODEL_SIZE = {
    "arith": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "layer_types": ("linear_attention", "full_attention", "full_attention"),
        "rope_theta": 10_000.0,
    }
}
# shapes copies a threshold from the question into one of three query shapes: the arith shape
MODEL_SIZE["shapes"] = MODEL_SIZE["arith"]
SEARCH_TOOL_NAME = "search"
SEARCH_INSTRUCTION = "Use the search tool to look it up, then answer as \\boxed{N}."
IMAGE_SIZE = 64
IMAGE_QUESTION = "<image>How many squares are in the picture? Answer as \\boxed{N}."
_THINGS = ("zib", "mop", "kel", "dax", "rup", "fen", "tov", "wix", "gal", "nim", "sor", "bek")
_COLOURS = ((220, 40, 40), (40, 160, 60), (40, 80, 220), (230, 180, 20))


@dataclass(frozen=True)
class TinyTask:
    root: Path
    task: str
    model_dir: Path
    train: Path
    val: Path
    corpus: Path | None = None  # search
    tool_config: Path | None = None  # search
    database: Path | None = None  # shapes
    built_now: bool = False

    def manifest(self) -> dict[str, Any]:
        return json.loads((self.root / MANIFEST_NAME).read_text(encoding="utf-8"))


def task_root(base: TinyAssets, task: str) -> Path:
    return base.root.parent / f"{base.root.name}-{task}-t{TASK_FORMAT_VERSION}"


def _task_at(root: Path, task: str) -> TinyTask:
    search = task == "search"
    return TinyTask(
        root=root,
        task=task,
        model_dir=root / "model",
        train=root / "train.parquet",
        val=root / "val.parquet",
        corpus=root / "corpus.jsonl" if search else None,
        tool_config=root / "tools.yaml" if search else None,
        database=root / "databases" / tiny_shapes.DB_ID / f"{tiny_shapes.DB_ID}.sqlite" if task == "shapes" else None,
    )


# --------------------------------------------------------------------------- search


def search_facts(seed: int = 0) -> list[tuple[str, int]]:
    """(thing, two-digit code) pairs: what the corpus knows and the questions ask."""
    rng = random.Random(f"tiny-search-{seed}")
    codes = rng.sample(range(10, 100), len(_THINGS))
    return list(zip(_THINGS, codes, strict=True))


def search_corpus(facts: Sequence[tuple[str, int]]):
    from verl_replay.search.index import Document

    docs = [Document(f"d{i}", f"{thing}\nThe code of the {thing} is {code}.") for i, (thing, code) in enumerate(facts)]
    return docs


def search_question(thing: str) -> str:
    return f"What is the code of the {thing}? {SEARCH_INSTRUCTION}"


def tool_call_text(query: str) -> str:
    """The assistant's hermes-format call (what verl's HermesToolParser extracts)."""
    call = {"name": SEARCH_TOOL_NAME, "arguments": {"query": query}}
    return "<tool_call>" + json.dumps(call, separators=(",", ":")) + "</tool_call>"


def search_rows(facts: Sequence[tuple[str, int]], split: str) -> list[dict[str, Any]]:
    return [
        {
            "data_source": TINY_SEARCH_SOURCE,
            "agent_name": "tool_agent",
            "prompt": [{"role": "user", "content": search_question(thing)}],
            "ability": "search",
            "reward_model": {"style": "rule", "ground_truth": str(code)},
            "extra_info": {"split": split, "index": index, "question": search_question(thing)},
        }
        for index, (thing, code) in enumerate(facts)
    ]


def tool_config_yaml(corpus: Path, topk: int = 1) -> str:
    from verl_replay.search.index import SEARCH_TOOL_CLASS, SEARCH_TOOL_SCHEMA

    config = {
        "tools": [
            {
                "class_name": SEARCH_TOOL_CLASS,
                "config": {"type": "native", "corpus_path": str(corpus), "topk": topk},
                "tool_schema": SEARCH_TOOL_SCHEMA,
            }
        ]
    }
    return json.dumps(config, indent=2) + "\n"  # JSON is YAML


def _piece(hf_tok: Any, role: str, content: str) -> list[int]:
    return hf_tok.encode(f"{IM_START}{role}\n{content}{IM_END}\n", add_special_tokens=False)


def search_trajectories(hf_tok: Any, facts: Sequence[tuple[str, int]]) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of whole tool trajectories: user, assistant call, tool output,
    assistant answer; the loss covers the two assistant turns (content + ``<|im_end|>``)."""
    from verl_replay.search.index import BM25Index, format_results

    index = BM25Index(search_corpus(facts))
    gen_prompt = hf_tok.encode(f"{IM_START}assistant\n", add_special_tokens=False)
    out = []
    for thing, code in facts:
        ids: list[int] = []
        mask: list[int] = []

        def add(tokens: list[int], trained: bool, ids: list[int] = ids, mask: list[int] = mask) -> None:
            ids.extend(tokens)
            mask.extend([int(trained)] * len(tokens))

        add(_piece(hf_tok, "user", search_question(thing)), False)
        for turn, text in enumerate((tool_call_text(thing), f"\\boxed{{{code}}}")):
            add(gen_prompt, False)
            add(hf_tok.encode(text, add_special_tokens=False) + [hf_tok.convert_tokens_to_ids(IM_END)], True)
            add(hf_tok.encode("\n", add_special_tokens=False), False)
            if turn == 0:
                hits = [doc for doc, _ in index.search([thing], 1)[0]]
                add(_piece(hf_tok, "tool", format_results(hits)), False)
        out.append((ids, mask))
    return out


# --------------------------------------------------------------------------- image


def square_image(count: int, rng: random.Random) -> bytes:
    """A 64 x 64 PNG with ``count`` non-overlapping coloured squares on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    cells = rng.sample(range(4), count)  # one square per quadrant: never overlapping
    for cell in cells:
        x0, y0 = (cell % 2) * 32 + rng.randint(2, 12), (cell // 2) * 32 + rng.randint(2, 12)
        draw.rectangle([x0, y0, x0 + 15, y0 + 15], fill=_COLOURS[rng.randrange(len(_COLOURS))])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_examples(seed: int = 0, count: int = 16) -> list[tuple[bytes, int]]:
    rng = random.Random(f"tiny-image-{seed}")
    return [(square_image(n, rng), n) for n in [1 + i % 4 for i in range(count)]]


def image_rows(examples: Sequence[tuple[bytes, int]], split: str) -> list[dict[str, Any]]:
    return [
        {
            "data_source": TINY_IMAGE_SOURCE,
            "prompt": [{"role": "user", "content": IMAGE_QUESTION}],
            "images": [{"bytes": png}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(n)},
            "extra_info": {"split": split, "index": index, "benchmark": TINY_IMAGE_SOURCE},
        }
        for index, (png, n) in enumerate(examples)
    ]


# --------------------------------------------------------------------------- warm start


def _text_batches(
    sequences: Sequence[tuple[list[int], list[int]]], pad_id: int, seed: int, steps: int
) -> Iterator[dict[str, Any]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        picks = torch.randint(len(sequences), (WARM_START_BATCH["search"],), generator=generator).tolist()
        width = max(len(sequences[i][0]) for i in picks)
        input_ids = torch.full((len(picks), width), pad_id, dtype=torch.long)  # [B, W]
        attention_mask = torch.zeros_like(input_ids)  # [B, W]
        labels = torch.full_like(input_ids, -100)  # [B, W]
        for row, i in enumerate(picks):
            ids, mask = sequences[i]
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
            trained = torch.tensor(mask, dtype=torch.bool)
            labels[row, : len(ids)] = torch.where(trained, torch.tensor(ids), torch.tensor(-100))
        yield {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _image_batches(hf_tok: Any, image_processor: Any, examples: Sequence[tuple[bytes, int]], seed: int, steps: int):
    """Batches of prompt (the image's placeholder expanded to its merged patch count, as Qwen's
    processor expands it) + answer, with the image's patches; loss on the answer."""
    import torch
    from PIL import Image

    merge = int(image_processor.merge_size) ** 2
    features = [image_processor(images=[Image.open(io.BytesIO(png)).convert("RGB")]) for png, _ in examples]
    encoded = []
    for (_, n), feature in zip(examples, features, strict=True):
        tokens = int(feature["image_grid_thw"].prod()) // merge
        vision = "<|vision_start|>" + "<|image_pad|>" * tokens + "<|vision_end|>"
        prompt = f"{IM_START}user\n" + IMAGE_QUESTION.replace("<image>", vision) + f"{IM_END}\n{IM_START}assistant\n"
        answer = hf_tok.encode(f"\\boxed{{{n}}}{IM_END}", add_special_tokens=False)
        encoded.append((hf_tok.encode(prompt, add_special_tokens=False) + answer, len(answer)))
    generator = torch.Generator().manual_seed(seed)
    pad_id = hf_tok.pad_token_id
    for _ in range(steps):
        picks = torch.randint(len(examples), (WARM_START_BATCH["image"],), generator=generator).tolist()
        width = max(len(encoded[i][0]) for i in picks)
        input_ids = torch.full((len(picks), width), pad_id, dtype=torch.long)  # [B, W]
        attention_mask = torch.zeros_like(input_ids)  # [B, W]
        labels = torch.full_like(input_ids, -100)  # [B, W]
        for row, i in enumerate(picks):
            ids, answer_len = encoded[i]
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
            labels[row, len(ids) - answer_len : len(ids)] = torch.tensor(ids[-answer_len:])
        image_token = hf_tok.convert_tokens_to_ids(IMAGE_PAD)
        yield {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "mm_token_type_ids": (input_ids == image_token).to(torch.int64),  # 1 = image token (M-RoPE)
            "labels": labels,
            "pixel_values": torch.cat([torch.as_tensor(features[i]["pixel_values"]) for i in picks]),
            "image_grid_thw": torch.cat([torch.as_tensor(features[i]["image_grid_thw"]) for i in picks]),
        }


def _arith_batches(hf_tok: Any, held_out: Sequence[Problem], seed: int, steps: int) -> Iterator[dict[str, Any]]:
    """The noisy teacher's batches, each prompt in the chat template the rollout applies."""
    return warm_start_batches(
        _encode_user_prompt(hf_tok),
        lambda text: hf_tok.encode(text, add_special_tokens=False),
        eos_id=hf_tok.eos_token_id,
        pad_id=hf_tok.pad_token_id,
        held_out=held_out,
        seed=seed,
        steps=steps,
        batch_size=WARM_START_BATCH["arith"],
    )


def _encode_user_prompt(hf_tok: Any) -> Any:
    def encode_prompt(question: str) -> list[int]:
        messages = [{"role": "user", "content": question}]
        return list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    return encode_prompt


def _shapes_batches(
    hf_tok: Any, questions: Sequence[tiny_shapes.ShapesQuestion], seed: int, steps: int
) -> Iterator[dict[str, Any]]:
    """The shapes teacher's batches over the training questions, prompts as the rollout sees them."""
    return tiny_shapes.warm_start_batches(
        questions,
        _encode_user_prompt(hf_tok),
        lambda text: hf_tok.encode(text, add_special_tokens=False),
        eos_id=hf_tok.eos_token_id,
        pad_id=hf_tok.pad_token_id,
        seed=seed,
        steps=steps,
        batch_size=WARM_START_BATCH["shapes"],
    )


def _train(model: Any, batches: Iterator[dict[str, Any]], lr: float) -> float:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss_value = float("nan")
    for batch in batches:
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    model.eval()
    return round(loss_value, 4)


def _train_model(model_dir: Path, base: TinyAssets, task: str, payload: Any, seed: int, steps: int) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    hf_tok = AutoTokenizer.from_pretrained(base.model_dir)
    eos_id, pad_id = hf_tok.eos_token_id, hf_tok.pad_token_id
    vision_ids = {t: hf_tok.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)}
    config = tiny_model_config(
        "qwen3_5", len(hf_tok), eos_id=eos_id, pad_id=pad_id, vision_token_ids=vision_ids, **MODEL_SIZE.get(task, {})
    )
    with torch.random.fork_rng(devices=[]), _single_thread():
        torch.manual_seed(seed)
        if task == "image":  # from the math model: it answers \boxed{N} already, only the pictures are new
            model = _model_class("qwen3_5").from_pretrained(base.model_dir, dtype=torch.float32)
        else:
            model = _model_class("qwen3_5").from_config(config, dtype=torch.float32)
        if task == "search":
            batches = _text_batches(search_trajectories(hf_tok, payload), pad_id, seed, steps)
        elif task == "arith":
            batches = _arith_batches(hf_tok, payload, seed, steps)
        elif task == "shapes":
            batches = _shapes_batches(hf_tok, payload, seed, steps)
        else:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            image_processor = Qwen2VLImageProcessorPil.from_pretrained(base.model_dir)
            batches = _image_batches(hf_tok, image_processor, payload, seed, steps)
        loss = _train(model, batches, WARM_START_LR[task])
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)
    with _quiet_progress_bars():
        model.save_pretrained(model_dir, safe_serialization=True)
    hf_tok.save_pretrained(model_dir)
    _save_processor(model_dir, hf_tok)
    return {
        "warm_start": {"steps": steps, "final_loss": loss},
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


# --------------------------------------------------------------------------- build


def _write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def _build_into(tmp: Path, final: TinyTask, base: TinyAssets, task: str, seed: int, steps: int) -> dict[str, Any]:
    staged = _task_at(tmp, task)
    if task == "search":
        from verl_replay.search.index import write_corpus

        facts = search_facts(seed)
        write_corpus(search_corpus(facts), staged.corpus)
        staged.tool_config.write_text(tool_config_yaml(final.corpus), encoding="utf-8")
        train, val, payload = search_rows(facts, "train"), search_rows(facts[:4], "val"), facts
    elif task == "arith":
        problems, held_out = arith_problems(seed)
        train, val, payload = arith_rows(problems, "train"), arith_rows(held_out, "val"), held_out
    elif task == "shapes":
        tiny_shapes.write_database(staged.database, tiny_shapes.product_rows(seed))
        questions, held_out = tiny_shapes.shapes_questions(staged.database, seed)
        # the rows name the database where the build is moved to, as the tiny SQL rows do
        train = tiny_shapes.shapes_rows(questions, final.database, "train")
        val = tiny_shapes.shapes_rows(held_out, final.database, "val")
        payload = questions
    else:
        examples = image_examples(seed)
        train, val, payload = image_rows(examples, "train"), image_rows(examples[:4], "val"), examples
    _write_rows(train, staged.train)
    _write_rows(val, staged.val)
    info = _train_model(staged.model_dir, base, task, payload, seed, steps)
    return {"counts": {"train": len(train), "val": len(val)}, "model": info}


def _identity(base: TinyAssets, task: str, seed: int, steps: int) -> dict[str, Any]:
    identity = {
        "format_version": TASK_FORMAT_VERSION,
        "task": task,
        "seed": seed,
        "warm_start_steps": steps,
        "base_tokenizer": _sha256(base.model_dir / "tokenizer.json"),
    }
    if task == "image":  # warm-started from the math model's weights
        identity["base_model"] = _sha256(base.model_dir / "model.safetensors")
    if task in ("arith", "shapes"):  # the warm start makes them what they are: a change of any of it rebuilds
        warm_start: dict[str, Any] = {"batch": WARM_START_BATCH[task], "lr": WARM_START_LR[task]}
        if task == "arith":
            warm_start.update(teacher_noise=TEACHER_NOISE, operands=[OPERANDS.start, OPERANDS.stop])
        else:
            warm_start.update(
                products=tiny_shapes.PRODUCTS,
                shape_rates=list(tiny_shapes.SHAPE_RATES),
                shape_noise=list(tiny_shapes.SHAPE_NOISE),
            )
        # as the manifest stores it (JSON: tuples read back as lists), so a cached build compares equal
        identity["warm_start"] = json.loads(json.dumps({**warm_start, **MODEL_SIZE[task]}))
    return identity


def _is_complete(root: Path, identity: Mapping[str, Any]) -> bool:
    try:
        manifest = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if any(manifest.get(k) != v for k, v in identity.items()):
        return False
    files = manifest.get("files", {})
    try:
        return bool(files) and all(_sha256(root / rel) == digest for rel, digest in files.items())
    except OSError:
        return False


def build_tiny_task(
    task: str,
    base: TinyAssets | None = None,
    *,
    seed: int = 0,
    force: bool = False,
    warm_start_steps: int | None = None,
) -> TinyTask:
    """Build (or return the cached) tiny ``task`` next to the tiny assets ``base`` (built if needed)."""
    if task not in TASKS:
        raise ValueError(f"tiny task must be one of {TASKS}, got {task!r}")
    base = base if base is not None else build_tiny_assets()
    steps = WARM_START_STEPS[task] if warm_start_steps is None else int(warm_start_steps)
    root = task_root(base, task)
    final = _task_at(root, task)
    identity = _identity(base, task, seed, steps)
    if not force and _is_complete(root, identity):
        return final
    with _exclusive_lock(root.parent / f".{root.name}.lock"):
        if not force and _is_complete(root, identity):
            return final
        token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp = root.parent / f".{root.name}.tmp-{token}"
        try:
            tmp.mkdir(parents=True)
            manifest = {**identity, **_build_into(tmp, final, base, task, seed, steps), "files": _file_hashes(tmp)}
            partial = tmp / f".{MANIFEST_NAME}.partial"
            partial.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(partial, tmp / MANIFEST_NAME)
            _replace_dir(tmp, root, token)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return replace(final, built_now=True)
