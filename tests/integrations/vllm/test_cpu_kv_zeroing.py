"""The KV-block zeroing that verl-replay's vLLM plugin adds to vLLM's CPU runner (no engine here:
tests/integrations/vllm/test_cpu_engine.py runs one)."""

from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import pytest
import torch

from verl_replay.integrations.vllm import cpu_kv_zeroing
from verl_replay.integrations.vllm.cpu_kv_zeroing import ZeroTarget, zero_kv_blocks

vllm = pytest.importorskip("vllm", reason="vLLM's CPU build is part of the CPU stack")


def _cache(num_kernel_blocks: int) -> torch.Tensor:
    # CPU attention layout: [blocks, kv_heads, block_size, 2*head_size], filled with block index + 1
    cache = torch.empty(num_kernel_blocks, 2, 4, 6)
    for block in range(num_kernel_blocks):
        cache[block] = block + 1
    return cache


def test_zeroes_exactly_the_given_blocks():
    cache = _cache(5)
    zero_kv_blocks([ZeroTarget(cache, block_dim=0, kernel_blocks_per_block=1)], [1, 3])
    assert [float(cache[b].abs().sum()) for b in range(5)] == [48.0, 0.0, 144.0, 0.0, 240.0]


def test_a_scheduler_block_spans_its_kernel_blocks():
    # scheduler blocks of 2 kernel blocks: block 1 is kernel blocks 2 and 3
    cache = _cache(6)
    zero_kv_blocks([ZeroTarget(cache, block_dim=0, kernel_blocks_per_block=2)], [1])
    assert [b for b in range(6) if cache[b].abs().sum() == 0] == [2, 3]


def test_block_dim_other_than_zero_and_every_target():
    first, second = _cache(3).permute(1, 0, 2, 3), _cache(3)  # first: blocks on dim 1
    zero_kv_blocks([ZeroTarget(first, 1, 1), ZeroTarget(second, 0, 1)], [2])
    assert float(first[:, 2].abs().sum()) == 0.0 and float(first[:, :2].abs().sum()) == 48.0 + 96.0
    assert float(second[2].abs().sum()) == 0.0 and float(second[:2].abs().sum()) == 48.0 + 96.0


def test_no_block_ids_touch_nothing():
    cache = _cache(2)
    zero_kv_blocks([ZeroTarget(cache, 0, 1)], [])
    assert torch.equal(cache, _cache(2))


def test_nan_in_a_stale_block_is_what_masking_cannot_hide():
    # Why the plugin exists: a -inf logit gives weight 0, and 0 * NaN is NaN.
    weights = torch.softmax(torch.tensor([0.0, float("-inf")]), dim=0)  # [2]
    values = torch.tensor([1.0, float("nan")])  # the second is a stale cache entry
    assert torch.isnan(weights @ values)
    values[1] = 0.0  # zeroed
    assert float(weights @ values) == 1.0


def test_the_plugin_is_registered_for_vllm():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert names.get("verl_replay_cpu") == "verl_replay.integrations.vllm.cpu_plugin:register"


def test_install_patches_the_cpu_runner_once(monkeypatch):
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    monkeypatch.setattr(CPUModelRunner, "_zero_block_ids", CPUModelRunner._zero_block_ids)
    monkeypatch.delattr(CPUModelRunner, cpu_kv_zeroing.PATCHED_FLAG, raising=False)
    cpu_kv_zeroing.install()
    cpu_kv_zeroing.install()
    assert CPUModelRunner._zero_block_ids is cpu_kv_zeroing._zero_block_ids
    assert getattr(CPUModelRunner, cpu_kv_zeroing.PATCHED_FLAG) is True


def test_the_replaced_method_is_still_vllms_no_op():
    """Canary: vLLM 0.24's CPU runner skips zeroing. If a vLLM upgrade zeroes blocks itself, the
    plugin is no longer needed: this fails so that someone removes it."""
    import ast
    import inspect

    from vllm.v1.worker import cpu_model_runner

    tree = ast.parse(inspect.getsource(cpu_model_runner))
    runner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CPUModelRunner")
    method = next(n for n in runner.body if isinstance(n, ast.FunctionDef) and n.name == "_zero_block_ids")
    assert [type(statement).__name__ for statement in method.body] == ["Pass"]


def test_targets_follow_the_runner_like_vllms_zeroer():
    """full_attention_targets reads the runner's private names the GPU runner's KVBlockZeroer reads;
    a fake runner with vLLM's own spec and backend classes pins how they are used."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=3, dtype=torch.float32)
    cache = torch.ones(4 * 2, 2, 4, 6)  # kernel block size 4: 2 kernel blocks per scheduler block
    other = torch.ones(3, 2, 4, 6)
    group = SimpleNamespace(
        kv_cache_spec=spec, kv_cache_group_id=0, backend=CPUAttentionBackend, layer_names=["a", "b"]
    )
    mamba_group = SimpleNamespace(kv_cache_spec=object(), kv_cache_group_id=1, backend=None, layer_names=["m"])
    runner = SimpleNamespace(
        compilation_config=SimpleNamespace(
            static_forward_context={"a": SimpleNamespace(kv_cache=cache), "b": SimpleNamespace(kv_cache=other)}
        ),
        runner_only_attn_layers={"b"},
        _kernel_block_sizes=[4, 8],
        cache_config=SimpleNamespace(cache_dtype="auto"),
        _kv_cache_spec_attn_group_iterator=lambda: iter([group, mamba_group]),
        kv_cache_config=object(),
    )
    cpu_kv_zeroing._zero_block_ids(runner, [3])
    assert [int(k) for k in range(8) if cache[k].sum() == 0] == [6, 7]
    assert bool((other == 1).all())  # a runner-only layer is skipped, as vLLM skips it
