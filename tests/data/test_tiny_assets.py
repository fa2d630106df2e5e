from __future__ import annotations

import ast
import hashlib
import json
import operator
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from verl_replay.data.prepare import MATH_RL_SCHEMA, SQL_RL_SCHEMA
from verl_replay.data.schema import execute_readonly, schema_text
from verl_replay.data.tiny_assets import (
    ASSET_FORMAT_VERSION,
    CHAT_TEMPLATE,
    MANIFEST_NAME,
    build_tiny_assets,
    default_root,
    is_complete,
)

REPO = Path(__file__).resolve().parents[2]
# Build-mechanics tests use a two-step warm start; the trained default is tested separately.
FAST = {"math": 2, "sql": 2}


def _hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _sql_rows_relative(path: Path, root: Path) -> list[dict]:
    rows = pq.read_table(path).to_pylist()
    for row in rows:
        row["extra_info"]["db_path"] = Path(row["extra_info"]["db_path"]).relative_to(root).as_posix()
    return rows


def test_same_seed_gives_same_bytes_in_two_roots(tiny, tmp_path):
    other = build_tiny_assets(tmp_path / "second", seed=0, warm_start_steps=FAST)
    first, second = _hashes(tiny.root), _hashes(other.root)
    assert sorted(first) == sorted(second)
    # SQL parquet embeds the absolute database path, the manifest hashes that parquet.
    path_dependent = {"sql/train.parquet", "sql/val.parquet", MANIFEST_NAME}
    for rel in sorted(set(first) - path_dependent):
        assert first[rel] == second[rel], rel
    for split in ("train", "val"):
        rel = f"sql/{split}.parquet"
        assert _sql_rows_relative(tiny.root / rel, tiny.root) == _sql_rows_relative(other.root / rel, other.root)


def test_warm_starts_side_by_side_give_the_same_weights(tiny, tmp_path, monkeypatch):
    """The default build trains its two models in spawned processes at once: the same bytes as
    training them one after the other in the calling process (``tiny`` was built that way)."""
    from verl_replay.data import tiny_assets

    monkeypatch.setattr(tiny_assets, "SIDE_BY_SIDE_MIN_STEPS", 1)
    spawned = build_tiny_assets(tmp_path / "spawned", seed=0, warm_start_steps=FAST)
    for model in ("model/model.safetensors", "model_sql/model.safetensors"):
        assert spawned.manifest()["files"][model] == tiny.manifest()["files"][model], model
    assert spawned.manifest()["model"] == tiny.manifest()["model"]


def test_other_seed_changes_data_and_weights(tiny, tmp_path):
    other = build_tiny_assets(tmp_path / "seed1", seed=1, warm_start_steps=FAST)
    assert other.manifest()["seed"] == 1
    ours, theirs = tiny.manifest()["files"], other.manifest()["files"]
    assert ours["math/train.parquet"] != theirs["math/train.parquet"]
    assert ours["model/model.safetensors"] != theirs["model/model.safetensors"]
    # Asking for seed 0 at a seed-1 root rebuilds it rather than returning the wrong assets.
    rebuilt = build_tiny_assets(other.root, seed=0, warm_start_steps=FAST)
    assert rebuilt.manifest()["seed"] == 0
    assert rebuilt.manifest()["files"]["math/train.parquet"] == ours["math/train.parquet"]


def test_complete_build_is_returned_without_rebuilding(tiny):
    watched = [tiny.manifest_path, tiny.model_dir / "model.safetensors", tiny.sql_train]
    before = [p.stat().st_mtime_ns for p in watched]
    again = build_tiny_assets(tiny.root, seed=0, warm_start_steps=FAST)
    # nothing was rebuilt or rewritten (a rebuild trains two warm starts and rewrites every file)
    assert again == tiny and not again.built_now
    assert [p.stat().st_mtime_ns for p in watched] == before


def test_force_rebuilds_same_content(tmp_path):
    assets = build_tiny_assets(tmp_path / "a", seed=0, warm_start_steps=FAST)
    mtime = assets.manifest_path.stat().st_mtime_ns
    hashes = assets.manifest()["files"]
    time.sleep(0.01)
    forced = build_tiny_assets(tmp_path / "a", seed=0, force=True, warm_start_steps=FAST)
    assert forced.built_now
    assert forced.manifest_path.stat().st_mtime_ns != mtime
    assert forced.manifest()["files"] == hashes
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_damaged_build_is_detected_and_repaired(tmp_path):
    assets = build_tiny_assets(tmp_path / "a", seed=0, warm_start_steps=FAST)
    good = assets.math_val.read_bytes()
    assets.math_val.write_bytes(good[:10])
    assert not is_complete(assets.root, seed=0, model_arch="qwen3_5", warm_start_steps=FAST)
    repaired = build_tiny_assets(tmp_path / "a", seed=0, warm_start_steps=FAST)
    assert repaired.math_val.read_bytes() == good
    (repaired.root / MANIFEST_NAME).unlink()  # a build without its marker is incomplete
    assert not is_complete(repaired.root, seed=0, model_arch="qwen3_5", warm_start_steps=FAST)


def test_concurrent_builders_produce_one_complete_build(tiny, tmp_path):
    root = tmp_path / "shared"
    code = (
        "import sys, json; from verl_replay.data.tiny_assets import build_tiny_assets; "
        "a = build_tiny_assets(sys.argv[1], warm_start_steps={'math': 2, 'sql': 2}); "
        "print(json.dumps([a.built_now, a.manifest()['files']]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=240) for p in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err.decode()
    reports = [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outputs]
    assert sorted(built for built, _ in reports) == [False, True]  # the lock let exactly one build
    assert reports[0][1] == reports[1][1]
    # Built in another process (other hash seeds) yet byte-identical to this session's build.
    ours = tiny.manifest()["files"]
    for rel, digest in reports[0][1].items():
        if not rel.endswith(".parquet") or rel.startswith("math/"):
            assert ours[rel] == digest, rel
    assert is_complete(root, seed=0, model_arch="qwen3_5", warm_start_steps=FAST)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "shared" and not p.name.endswith(".lock")]
    assert leftovers == []


def test_default_root_is_versioned_and_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VERL_REPLAY_CACHE", str(tmp_path))
    assert default_root() == tmp_path / f"tiny-v{ASSET_FORMAT_VERSION}"
    assert default_root(seed=3) != default_root()
    assert default_root(model_arch="qwen2") != default_root()


def test_refuses_to_replace_a_folder_with_other_files(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "bird_dev.parquet").write_bytes(b"user file")
    with pytest.raises(FileExistsError, match="refusing to replace .*data: it holds files that are not tiny assets"):
        build_tiny_assets(tmp_path / "data", warm_start_steps=FAST)
    assert (tmp_path / "data" / "bird_dev.parquet").read_bytes() == b"user file"
    (tmp_path / "empty").mkdir()
    assert build_tiny_assets(tmp_path / "empty", warm_start_steps=FAST).built_now


def test_unknown_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="model_arch must be one of"):
        build_tiny_assets(tmp_path / "x", model_arch="llama", warm_start_steps=FAST)


def test_tokenizer_loads_with_autotokenizer_and_round_trips(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    assert len(tok) == tiny.manifest()["vocab_size"]
    assert 512 <= len(tok) <= 1024
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.model_max_length == 1024
    text = "SELECT name FROM customers WHERE city = 'Zürich'; -- ünïcode ∑ 😀\n\tWhat is 12 + 30?"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # Digits are single tokens, like Qwen's tokenizer.
    assert len(tok.encode("2026", add_special_tokens=False)) == 4
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[0] == im_start
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[-1] == tok.eos_token_id


def test_chat_template_renders_qwen_format(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(messages, tokenize=False).endswith("assistant\n")
    encoded = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    assert tok.decode(ids) == text
    # Processors hand content over as a list of parts; text parts render like a string, image and
    # video parts as Qwen's placeholders (which the processor expands to one pad token per patch).
    parts = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is 2 + 3?"}, {"type": "video"}]}
    ]
    assert tok.apply_chat_template(parts, tokenize=False) == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is 2 + 3?"
        "<|vision_start|><|video_pad|><|vision_end|><|im_end|>\n"
    )
    for token in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"):
        assert tok.encode(token, add_special_tokens=False) == [tok.convert_tokens_to_ids(token)]
        assert tok.decode([tok.convert_tokens_to_ids(token)], skip_special_tokens=True) == ""


def _load_model(model_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    # The checkpoint's own class, as verl's actor loads it (AutoModelForCausalLM would give the
    # text-only Qwen3_5ForCausalLM for a qwen3_5 config).
    auto = AutoModelForImageTextToText if config.model_type == "qwen3_5" else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, attn_implementation="sdpa")
    return config, model, AutoTokenizer.from_pretrained(model_dir)


def _check_model(model_dir: Path, expected_class: str, expected_type: str) -> None:
    config, model, tok = _load_model(model_dir)
    assert type(model).__name__ == expected_class and config.architectures == [expected_class]
    assert config.model_type == expected_type
    text = config.get_text_config()
    assert text.vocab_size == len(tok)
    assert text.eos_token_id == tok.eos_token_id and text.pad_token_id == tok.pad_token_id
    assert text.tie_word_embeddings and text.max_position_embeddings == 1024
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight

    # Right-padded batch of two prompts: padded logits equal the unpadded ones.
    first = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}], add_generation_prompt=True)[
        "input_ids"
    ]
    second = first[:-4]
    model.eval()
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([ids])).logits[0] for ids in (first, second)]
        batch = torch.full((2, len(first)), tok.pad_token_id)
        mask = torch.zeros_like(batch)
        for row, ids in enumerate((first, second)):
            batch[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        padded = model(input_ids=batch, attention_mask=mask).logits  # [2, T, V]
    torch.testing.assert_close(padded[0], alone[0])
    torch.testing.assert_close(padded[1, : len(second)], alone[1])

    model.train()
    inputs = torch.randint(3, len(tok), (8, 64), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=inputs, labels=inputs)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    # A text-only batch reaches every parameter except the vision tower's.
    grads = [p.grad for name, p in model.named_parameters() if p.requires_grad and not name.startswith("model.visual.")]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


def test_qwen3_5_model_loads_and_trains_on_cpu(tiny):
    manifest = tiny.manifest()["model"]
    assert manifest["class"] == "Qwen3_5ForConditionalGeneration" and manifest["processor"] == "Qwen3VLProcessor"
    assert set(manifest["config"]["layer_types"]) == {"linear_attention", "full_attention"}
    assert 0 < manifest["vision_parameters"] < manifest["num_parameters"] / 4  # the text model dominates
    for model_dir in (tiny.model_dir, tiny.sql_model_dir):
        _check_model(model_dir, "Qwen3_5ForConditionalGeneration", "qwen3_5")


def test_qwen3_5_config_names_the_vision_tokens_and_mrope(tiny):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny.model_dir)
    tok = AutoTokenizer.from_pretrained(tiny.model_dir)
    assert config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert config.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    rope = config.text_config.rope_parameters
    rotary_half = int(config.text_config.head_dim * rope["partial_rotary_factor"]) // 2
    assert rope["mrope_interleaved"] and sum(rope["mrope_section"]) == rotary_half  # every frequency is used
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size


def _processor(model_dir: Path):
    from transformers import AutoProcessor

    from verl_replay.integrations.verl.vl_processor import allow_vl_processor_without_torchvision

    allow_vl_processor_without_torchvision()
    return AutoProcessor.from_pretrained(model_dir)


def test_processor_loads_and_matches_the_tokenizer(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.model_dir)
    for model_dir in (tiny.model_dir, tiny.sql_model_dir):
        processor = _processor(model_dir)
        assert type(processor).__name__ == "Qwen3VLProcessor"
        assert processor.image_processor.patch_size == 16 and processor.image_processor.merge_size == 2
        assert processor.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
        messages = [{"role": "user", "content": "What is 7 + 5?"}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        encoded = processor(text=[text], return_tensors="pt")
        expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert encoded["input_ids"][0].tolist() == expected
        assert not encoded["mm_token_type_ids"].any()  # text only: every token is of type text


def test_verl_builds_mrope_position_ids_through_the_processor(tiny):
    """verl's agent loop: processor loaded by verl's hf_processor, (1, 4, L) position ids from its
    _compute_position_ids; for text the temporal/height/width rows all equal the token index."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.utils import hf_processor

    _processor(tiny.model_dir)  # torchvision-free loading, as verl's CPU support installs it
    processor = hf_processor(str(tiny.model_dir))
    assert type(processor).__name__ == "Qwen3VLProcessor" and hasattr(processor, "get_rope_index")
    worker = AgentLoopWorker.__new__(AgentLoopWorker)  # only the processor is read
    worker.processor = processor
    text = processor.apply_chat_template(
        [{"role": "user", "content": "What is 7 + 5?"}], add_generation_prompt=True, tokenize=False
    )
    features = dict(processor(text=[text], return_tensors="pt"))
    input_ids, attention_mask = features.pop("input_ids"), features.pop("attention_mask")  # [1, L]
    position_ids = worker._compute_position_ids(input_ids, attention_mask, features)  # [1, 4, L]
    length = input_ids.shape[1]
    assert position_ids.shape == (1, 4, length) and position_ids.dtype == torch.long
    torch.testing.assert_close(position_ids[0], torch.arange(length).expand(4, length))


def test_model_runs_an_image_through_its_vision_tower(tiny):
    """The tiny model is a working vision-language model: an image becomes pad tokens whose
    embeddings come from the vision tower, with 3-D M-RoPE positions over the patch grid."""
    from PIL import Image

    processor = _processor(tiny.model_dir)
    _, model, _ = _load_model(tiny.model_dir)
    model.eval()
    image = Image.new("RGB", (64, 32), color=(200, 30, 90))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    grid = inputs["image_grid_thw"][0].tolist()  # [t, h, w] in 16-pixel patches
    assert grid == [1, 2, 4]
    n_image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_image_tokens == grid[0] * grid[1] * grid[2] // 4  # 2 x 2 patches merge into one token
    position_ids, _ = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )  # [3, 1, L]
    image_rows = position_ids[:, 0, inputs["input_ids"][0] == model.config.image_token_id]  # [3, tokens]
    assert image_rows[1].unique().numel() == 1 and image_rows[2].unique().numel() == 2  # 1 x 2 merged grid
    with torch.no_grad():
        with_image = model(**inputs).logits[0, -1]
        other = processor(text=[text], images=[Image.new("RGB", (64, 32), color=(0, 0, 0))], return_tensors="pt")
        other_image = model(**other).logits[0, -1]
    assert torch.isfinite(with_image).all() and not torch.allclose(with_image, other_image)


def test_qwen2_fallback_model_loads_and_trains_on_cpu(tmp_path):
    assets = build_tiny_assets(tmp_path / "q2", model_arch="qwen2", warm_start_steps=FAST)
    _check_model(assets.model_dir, "Qwen2ForCausalLM", "qwen2")


def test_parquet_schemas_and_rows(tiny):
    manifest = tiny.manifest()
    assert manifest["counts"] == {"math_train": 64, "math_val": 16, "sql_train": 48, "sql_val": 12}
    question_ids = set()
    for path, schema, source, ability in (
        (tiny.math_train, MATH_RL_SCHEMA, "tiny_math", "math"),
        (tiny.math_val, MATH_RL_SCHEMA, "tiny_math", "math"),
        (tiny.sql_train, SQL_RL_SCHEMA, "tiny_sql", "sql"),
        (tiny.sql_val, SQL_RL_SCHEMA, "tiny_sql", "sql"),
    ):
        table = pq.read_table(path)
        assert table.schema.equals(schema, check_metadata=False), path
        rows = table.to_pylist()
        split = path.stem
        assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
        for row in rows:
            assert row["data_source"] == source and row["ability"] == ability
            assert row["reward_model"]["style"] == "rule" and row["reward_model"]["ground_truth"]
            assert row["extra_info"]["split"] == split
            assert [m["role"] for m in row["prompt"]] == ["user"]
            question_ids.add(row["extra_info"]["question_id"])
    assert len(question_ids) == sum(manifest["counts"].values())


def _arithmetic(expression: str) -> int:
    """Evaluate integer +, -, * expressions (the only ones tiny_math generates)."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unexpected expression {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


def test_math_ground_truths_are_correct(tiny):
    rows = pq.read_table(tiny.math_train).to_pylist() + pq.read_table(tiny.math_val).to_pylist()
    assert len({r["extra_info"]["question"] for r in rows}) == len(rows)
    for row in rows:
        question = row["extra_info"]["question"]
        assert row["prompt"][0]["content"] == f"{question}\nPut the final answer in \\boxed{{}}."
        if question.startswith("What is "):
            expected = _arithmetic(question.removeprefix("What is ").removesuffix("?"))
        else:
            numbers = [int(w) for w in question.replace("?", "").split() if w.isdigit()]
            expected = sum(numbers)
        assert row["reward_model"]["ground_truth"] == str(expected), question


def test_every_gold_sql_executes_on_its_database(tiny):
    rows = pq.read_table(tiny.sql_train).to_pylist() + pq.read_table(tiny.sql_val).to_pylist()
    multi_strategy = 0
    for row in rows:
        info = row["extra_info"]
        db_path = Path(info["db_path"])
        assert db_path.is_absolute() and db_path.is_file()
        assert db_path.parent.parent == tiny.sql_db_root and info["db_id"] == db_path.stem
        assert info["semantics"] == "bird" and info["evidence"] == ""
        assert info["gold_sqls"][0] == row["reward_model"]["ground_truth"]
        results = [set(execute_readonly(db_path, sql)) for sql in info["gold_sqls"]]
        assert results[0], info["question"]
        assert all(r == results[0] for r in results), info["question"]
        multi_strategy += len(info["gold_sqls"]) > 1
        content = row["prompt"][0]["content"]
        assert schema_text(db_path) in content and f"Question: {info['question']}" in content
        assert "```sql" in content
    assert multi_strategy >= len(rows) // 2


def test_prompts_are_short_and_stats_match(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    stats = tiny.manifest()["prompt_tokens"]
    for key, path in (("sql_val", tiny.sql_val), ("math_val", tiny.math_val)):
        lengths = [
            len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True)["input_ids"])
            for r in pq.read_table(path).to_pylist()
        ]
        assert stats[key] == {"min": min(lengths), "mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)}
    assert max(s["max"] for s in stats.values()) < 200


def test_verl_rlhf_dataset_reads_the_parquet(tiny, tmp_path):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    config = OmegaConf.create(
        {
            "prompt_key": "prompt",
            "max_prompt_length": 256,
            "filter_overlong_prompts": True,
            "filter_overlong_prompts_workers": 1,
            "truncation": "error",
            "cache_dir": str(tmp_path / "verl_cache"),
        }
    )
    for path, n_rows in ((tiny.sql_val, 12), (tiny.math_val, 16)):
        dataset = RLHFDataset(str(path), tok, config)
        assert len(dataset) == n_rows  # nothing filtered as overlong
        item = dataset[3]
        assert item["raw_prompt"][0]["role"] == "user"
        assert item["reward_model"]["ground_truth"]
        assert item["index"] == 3 and item["extra_info"]["index"] == 3
    # Both SQL splits concatenate (same Arrow features).
    both = RLHFDataset([str(tiny.sql_train), str(tiny.sql_val)], tok, config)
    assert len(both) == 60


def test_build_script_prints_paths_of_cached_assets(tiny_assets):
    tiny = tiny_assets  # the script builds with the default warm start: reuse the cached build
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_tiny_assets.py"), "--root", str(tiny.root)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(None, 1) for line in result.stdout.splitlines() if line.strip())
    assert lines["model_dir"] == str(tiny.model_dir)
    assert lines["sql_train"] == str(tiny.sql_train)
    assert lines["sql_db_root"] == str(tiny.sql_db_root)
    assert "Qwen3_5ForConditionalGeneration" in lines["model"]


@pytest.mark.parametrize("arch, separated", [("qwen2", True), ("qwen3_5", False)])
def test_packed_sequences_on_cpu(tiny, tmp_path, arch, separated):
    """Padding-free packing through transformers' own forward (one row, position_ids restarting at
    0, no cu_seqlens). With sdpa, transformers separates packed sequences for the full-attention
    layers, but it hands Qwen3.5's gated delta net no boundaries, so that layer carries state across
    them: a packed Qwen3.5 row is NOT equal to separate rows this way. verl's packed path passes
    cu_seqlens, which the CPU kernels honour (tests/integrations/verl/test_verl_fixes.py checks it
    exact); if this starts passing for qwen3_5, transformers packs on its own."""
    model_dir = (
        tiny.model_dir
        if arch == "qwen3_5"
        else build_tiny_assets(tmp_path / "q2", model_arch="qwen2", warm_start_steps=FAST).model_dir
    )
    _, model, tok = _load_model(model_dir)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    first, second = (
        torch.randint(3, len(tok), (1, 12), generator=gen),
        torch.randint(3, len(tok), (1, 7), generator=gen),
    )
    with torch.no_grad():
        alone = model(input_ids=second, use_cache=False).logits[0]  # [7, V]
        packed = model(
            input_ids=torch.cat([first, second], dim=1),
            position_ids=torch.cat([torch.arange(12), torch.arange(7)])[None],
            use_cache=False,
        ).logits[0, 12:]  # [7, V]
    assert torch.allclose(packed, alone, atol=1e-5) is separated


def _cpu_tiny_response_lengths() -> dict[str, int]:
    import yaml

    profile = yaml.safe_load((REPO / "verl_replay" / "config" / "platform" / "cpu_tiny.yaml").read_text())
    assert profile["data"]["max_response_length"] == "${tiny_response_length.${tiny_task}}"
    return profile["tiny_response_length"]


def test_cpu_tiny_response_length_fits_every_gold_answer(tiny):
    """The tiny run's response cap leaves room for each training answer as the warm start and the
    reward spell it (fenced SQL / \\boxed{}) plus eos: no correct answer is ever cut off."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    caps = _cpu_tiny_response_lengths()
    for task, path, spell in (
        ("math", tiny.math_train, lambda gold: f"\\boxed{{{gold}}}"),
        ("sql", tiny.sql_train, lambda gold: f"```sql\n{gold}\n```"),
    ):
        golds = [r["reward_model"]["ground_truth"] for r in pq.read_table(path).to_pylist()]
        lengths = [len(tok.encode(spell(g), add_special_tokens=False)) + 1 for g in golds]
        assert max(lengths) <= caps[task], (task, max(lengths), caps[task])


def test_default_warm_start_gives_mixed_answers(tiny_assets):
    """GRPO needs groups whose answers disagree: the default models must be right only sometimes."""
    import pandas as pd
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from verl_replay.rewards import compute_score

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.model_dir)
    caps = _cpu_tiny_response_lengths()
    for task, model_dir, parquet in (
        ("math", tiny_assets.model_dir, tiny_assets.math_train),
        ("sql", tiny_assets.sql_model_dir, tiny_assets.sql_train),
    ):
        model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
        rows = pd.read_parquet(parquet).head(12)
        accs = []
        torch.manual_seed(0)
        for _, row in rows.iterrows():
            prompt = tokenizer.apply_chat_template(
                list(row["prompt"]), add_generation_prompt=True, tokenize=True, return_dict=False
            )
            outputs = model.generate(
                torch.tensor([prompt] * 4),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=caps[task],
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            for output in outputs:
                text = tokenizer.decode(output[len(prompt) :], skip_special_tokens=True)
                score = compute_score(
                    row["data_source"], text, row["reward_model"]["ground_truth"], dict(row["extra_info"])
                )
                accs.append(score["acc"])
        accuracy = sum(accs) / len(accs)
        assert 0.0 < accuracy < 0.9, (model_dir.name, accuracy)
