"""Memory budget: parameter counts against transformers' own models (meta device, no memory),
byte counts against hand-computed values, and the scaling rules (sharding, offload)."""

from __future__ import annotations

import copy
import json

import pytest

from verl_replay.memory_budget import (
    GIB,
    QWEN3_5_4B_CONFIG,
    ModelShape,
    RunSizes,
    estimate,
    format_markdown,
    main,
)

SMALL_QWEN3_5 = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 12,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "model_type": "qwen3_5",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 4,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [],
    },
}


def _transformers_count(hf_config: dict) -> tuple[int, int]:
    """(all parameters, vision parameters) of transformers' Qwen3.5 built on the meta device."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3_5Config(**copy.deepcopy(hf_config))
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    total = sum(p.numel() for p in model.parameters())  # tied weights are listed once
    vision = sum(p.numel() for p in model.model.visual.parameters())
    return total, vision


@pytest.mark.parametrize("hf_config", [SMALL_QWEN3_5, QWEN3_5_4B_CONFIG], ids=["small", "qwen3.5-4b"])
def test_parameter_count_equals_transformers(hf_config):
    shape = ModelShape.from_hf_config(hf_config)
    total, vision = _transformers_count(hf_config)
    assert shape.vision_params == vision
    assert shape.total_params == total


def test_small_counts_by_hand():
    s = ModelShape.from_hf_config(SMALL_QWEN3_5)
    assert (s.full_attention_layers, s.linear_attention_layers) == (1, 3)
    # full attention: q (with output gate) 64 x 4*16*2, k, v 64 x 2*16, o 64 x 64, q/k norms 16 each
    assert s.full_attention_layer_params == 64 * 128 + 2 * 64 * 32 + 64 * 64 + 2 * 16
    # Gated DeltaNet: key_dim 16, value_dim 48, conv_dim 80
    assert s.linear_attention_layer_params == (64 * 80 + 64 * 48 + 2 * 64 * 4 + 80 * 4 + 2 * 4 + 12 + 48 * 64)
    assert s.mlp_params == 3 * 64 * 160
    # per-token KV of the one full-attention layer: K and V, 2 heads x 16, bf16
    assert s.kv_bytes_per_token() == 2 * 2 * 16 * 2 * 1
    # recurrent state 4 heads x 8 x 12 + conv state 80 x 3, bf16, three layers
    assert s.linear_state_bytes_per_sequence() == (4 * 8 * 12 + 80 * 3) * 2 * 3


def test_flat_decoder_config():
    qwen2 = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    }
    s = ModelShape.from_hf_config(qwen2)
    assert (s.full_attention_layers, s.linear_attention_layers, s.head_dim) == (2, 0, 8)
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**qwen2))
    assert s.total_params == sum(p.numel() for p in model.parameters())
    assert s.linear_state_bytes_per_sequence() == 0


def _sizes(**changes) -> RunSizes:
    base = dict(
        train_gpus=2,
        ppo_max_token_len_per_gpu=20480,
        log_prob_max_token_len_per_gpu=40960,
        max_model_len=20480,
        max_num_batched_tokens=20480,
        max_num_seqs=256,
    )
    base.update(changes)
    return RunSizes(**base)


def test_budget_rows_by_hand():
    shape = ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)
    budget = estimate(shape, _sizes())
    rows = {r.what: r.bytes for r in budget.resident + budget.update_pass}
    p, pt, v = shape.total_params, shape.text_params, 248320
    assert rows["fp32 parameters (FSDP shard)"] == 4 * p // 2
    assert rows["fp32 gradients (FSDP shard)"] == 4 * pt // 2
    assert rows["AdamW moments (fp32, shard)"] == 8 * pt // 2
    assert rows["logits (bf16)"] == 2 * 20480 * v
    assert rows["logits gradient"] == 0  # flash-attn's cross-entropy works in place
    assert rows["entropy (fp32 upcast)"] == 8 * 2048 * v
    logprob = {r.what: r.bytes for r in budget.logprob_pass}
    assert logprob["logits (bf16)"] == 2 * 40960 * v  # the ~19 GiB of one log-prob micro-batch
    assert logprob["logits (bf16)"] / GIB == pytest.approx(18.95, abs=0.01)
    assert budget.training_total == max(budget.update_total, budget.logprob_total)
    assert budget.update_total == sum(r.bytes for r in budget.resident + budget.update_pass)
    # rollout: weights + profiling peak + KV fill gpu_memory_utilization x 80 GiB exactly
    assert budget.rollout_total == int(0.85 * 80 * GIB)
    per_sequence = 20480 * 32 * 1024 + shape.linear_state_bytes_per_sequence()
    assert budget.kv_sequences == budget.rollout[-1].bytes // per_sequence
    assert shape.kv_bytes_per_token() == 2 * 4 * 256 * 2 * 8  # 32 KiB: only the 8 full-attention layers


def test_sharding_offload_and_flash_attn_rules():
    shape = ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)
    two, four = estimate(shape, _sizes()), estimate(shape, _sizes(train_gpus=4))
    for a, b in zip(two.resident[:3], four.resident[:3], strict=True):
        assert b.bytes == pytest.approx(a.bytes / 2, abs=1)
    off = estimate(shape, _sizes(param_offload=True, optimizer_offload=True))
    assert [r.bytes for r in off.resident[:3]] == [0, 0, 0]
    assert {r.what for r in off.host} >= {"offloaded parameters + gradients", "offloaded AdamW moments"}
    no_flash = estimate(shape, _sizes(fused_cross_entropy=False))
    grad = {r.what: r.bytes for r in no_flash.update_pass}["logits gradient"]
    assert grad == 4 * 20480 * 248320
    assert no_flash.update_total - two.update_total == grad
    hot = estimate(shape, _sizes(temperature=0.7))
    assert {r.what: r.bytes for r in hot.logprob_pass}["logits (bf16)"] == 2 * 2 * 40960 * 248320
    rounds = estimate(shape, _sizes(parameter_sync_step=4))
    assert rounds.host[0].bytes == 2 * two.host[0].bytes  # pi_old and the current weights


def test_markdown_and_cli(tmp_path, capsys):
    shape = ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)
    table = format_markdown(estimate(shape, _sizes()))
    assert "| training | log-prob pass | **total** (resident + log-prob pass) |" in table
    assert "248320" in table and table.count("\n| ") >= 15
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL_QWEN3_5))
    assert main(["--model", str(model), "--train-gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "vocabulary 1000" in out
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelShape.from_model_dir(tmp_path)


def test_sizes_are_validated():
    with pytest.raises(ValueError, match="train_gpus"):
        _sizes(train_gpus=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        _sizes(gpu_memory_utilization=1.5)
