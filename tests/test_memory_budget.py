"""Memory budget: parameter counts against transformers' own models (meta device, no memory),
byte counts against hand-computed values, and the scaling rules (sharding, offload)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from verl_replay.memory_budget import (
    GIB,
    QWEN3_5_4B_CONFIG,
    ModelShape,
    RunSizes,
    estimate,
    fit_token_limit,
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
        log_prob_max_token_len_per_gpu=32768,
        max_model_len=20480,
        max_num_batched_tokens=20480,
        max_num_seqs=256,
        weight_sync_bucket_bytes=2048 << 20,
    )
    base.update(changes)
    return RunSizes(**base)


V = 248320  # Qwen3.5's vocabulary


def test_budget_rows_by_hand():
    shape = ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)
    budget = estimate(shape, _sizes())
    rows = {r.what: r.bytes for r in budget.resident + budget.update_pass}
    p, pt, pv = shape.total_params, shape.text_params, shape.vision_params
    assert rows["fp32 parameters (FSDP shard)"] == 4 * p // 2
    assert rows["fp32 gradients, text model (FSDP shard)"] == 4 * pt // 2
    assert rows["AdamW moments, text model (fp32, shard)"] == 8 * pt // 2
    # verl runs the vision tower on a dummy image every forward: gradients + AdamW for it too (~1.8 GiB)
    assert rows["vision tower: gradients + AdamW moments (shard)"] == 12 * pv // 2
    assert rows["vision tower: gradients + AdamW moments (shard)"] / GIB == pytest.approx(1.87, abs=0.01)
    assert rows["weight-sync buffers (training rank 0)"] == 2 * 2048 * 2**20  # two 2 GiB cupy-pooled buckets
    assert rows["logits (bf16)"] == 2 * 20480 * V
    assert rows["log-prob backward"] == 0  # flash-attn's cross-entropy works in place
    assert "entropy (chunked, fp32)" not in rows  # entropy_coeff 0: the update computes none
    logprob = {r.what: r.bytes for r in budget.logprob_pass}
    assert logprob["logits (bf16)"] == 2 * 32768 * V  # the ~15 GiB of one log-prob micro-batch
    assert logprob["entropy (chunked, fp32)"] == 3 * 4 * 2048 * V  # upcast chunk, softmax, product
    assert budget.training_total == max(budget.update_total, budget.logprob_total)
    assert budget.update_total == sum(r.bytes for r in budget.resident + budget.update_pass)
    # rollout: weights + profiling peak + KV fill gpu_memory_utilization x 79.3 GiB; a push adds 2 buckets
    assert budget.rollout_total == int(0.85 * 79.3 * GIB) + 2 * 2048 * 2**20
    per_sequence = 20480 * 32 * 1024 + shape.linear_state_bytes_per_sequence()
    assert budget.kv_sequences == budget.rollout[2].bytes // per_sequence
    assert shape.kv_bytes_per_token() == 2 * 4 * 256 * 2 * 8  # 32 KiB: only the 8 full-attention layers


def test_padded_path_is_verls_unchunked_entropy_and_unpadded_copy():
    """verl's padded branch: entropy_from_logits on the whole micro-batch (softmax + a temporary,
    2 bf16 tensors of the logits' size), then the rows cut into a new tensor after those are freed;
    the larger of the two counts. Without flash-attn the update keeps log_softmax + its gradient."""
    shape = ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)
    packed, padded = estimate(shape, _sizes()), estimate(shape, _sizes(packed=False, fused_cross_entropy=False))
    t = 32768
    rows = {r.what: r for r in padded.logprob_pass}
    assert rows["entropy (whole micro-batch, bf16)"].bytes == 2 * 2 * t * V
    assert rows["unpadded copy of the logits (padded path)"].bytes == 2 * t * V
    assert (
        rows["entropy (whole micro-batch, bf16)"].transient
        and rows["unpadded copy of the logits (padded path)"].transient
    )
    # activations + logits + the larger transient (the entropy)
    assert padded.logprob_total == padded.resident_total + _layer(shape, t) + 2 * t * V + 2 * 2 * t * V
    assert padded.logprob_total - packed.logprob_total == 2 * 2 * t * V - 3 * 4 * 2048 * V
    # issue 19's estimate: ~91 GiB at 32K tokens (97 at 40K) on an A100 80GB that exposes 79.3
    assert padded.logprob_total / GIB == pytest.approx(91.1, abs=0.1)
    update = {r.what: r.bytes for r in padded.update_pass}
    assert update["log-prob backward"] == 2 * 2 * 20480 * V
    fused_padded = estimate(shape, _sizes(packed=False))  # sdpa with flash-attn installed
    assert {r.what: r.bytes for r in fused_padded.update_pass}["log-prob backward"] == 2 * 20480 * V
    scan = estimate(shape, _sizes(packed=False, scan=True)).passes["scan pass"]
    assert sum(r.bytes for r in scan) == _layer(shape, t) + 2 * t * V + 2 * t * V  # no entropy, the copy held


def _layer(shape, tokens):
    return (6 * shape.hidden_size + 4 * shape.intermediate_size) * 2 * tokens


def test_fit_token_limit_finds_the_largest_fitting_multiple():
    shape = ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)
    sizes = _sizes(packed=False, fused_cross_entropy=False, optimizer_offload=True)
    limit = int(0.9 * 79.3 * GIB)
    best = fit_token_limit(shape, sizes, "log_prob_max_token_len_per_gpu", limit)
    assert best % 1024 == 0
    assert estimate(shape, replace(sizes, log_prob_max_token_len_per_gpu=best)).logprob_total <= limit
    assert estimate(shape, replace(sizes, log_prob_max_token_len_per_gpu=best + 1024)).logprob_total > limit
    assert fit_token_limit(shape, sizes, "ppo_max_token_len_per_gpu", 10 * GIB, floor=20480) == 0


def test_sharding_offload_and_flash_attn_rules():
    shape = ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)
    two, four = estimate(shape, _sizes()), estimate(shape, _sizes(train_gpus=4))
    for a, b in zip(two.resident[:4], four.resident[:4], strict=True):
        assert b.bytes == pytest.approx(a.bytes / 2, abs=1)
    off = estimate(shape, _sizes(param_offload=True, optimizer_offload=True))
    assert [r.bytes for r in off.resident[:4]] == [0, 0, 0, 0]
    assert {r.what for r in off.host} >= {"offloaded parameters + gradients", "offloaded AdamW moments"}
    no_flash = estimate(shape, _sizes(fused_cross_entropy=False))
    grad = {r.what: r.bytes for r in no_flash.update_pass}["log-prob backward"]
    assert grad == 4 * 20480 * V
    assert no_flash.update_total - two.update_total == grad
    hot = estimate(shape, _sizes(temperature=0.7))
    assert {r.what: r.bytes for r in hot.logprob_pass}["logits (bf16)"] == 2 * 2 * 32768 * V
    entropy = estimate(shape, _sizes(update_entropy=True))
    assert {r.what: r.bytes for r in entropy.update_pass}["entropy (chunked, fp32)"] == 3 * 4 * 2048 * V
    rounds = estimate(shape, _sizes(parameter_sync_step=4))
    assert rounds.host[0].bytes == 2 * two.host[0].bytes  # pi_old and the current weights
    colocated = estimate(shape, _sizes(weight_sync_bucket_bytes=0))
    assert "weight-sync buffers (training rank 0)" not in {r.what for r in colocated.resident}


def test_markdown_and_cli(tmp_path, capsys):
    shape = ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)
    table = format_markdown(estimate(shape, _sizes()))
    assert "| training | log-prob pass | **total** (resident + log-prob pass) |" in table
    assert "248320" in table and table.count("\n| ") >= 15 and "79.3 GiB usable" in table
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
