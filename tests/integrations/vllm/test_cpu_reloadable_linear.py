"""Linear layers on vLLM's CPU build compute from their live weight once verl-replay's plugin is in."""

from __future__ import annotations

import pytest
import torch

from verl_replay.integrations.vllm import cpu_reloadable_linear

pytest.importorskip("vllm", reason="vLLM's CPU build is part of the CPU stack")


class _Layer(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


@pytest.fixture
def patched(monkeypatch):
    import vllm.model_executor.layers.utils as layer_utils

    monkeypatch.setattr(layer_utils, "dispatch_cpu_unquantized_gemm", layer_utils.dispatch_cpu_unquantized_gemm)
    monkeypatch.delattr(layer_utils, cpu_reloadable_linear.PATCHED_FLAG, raising=False)
    cpu_reloadable_linear.install()
    cpu_reloadable_linear.install()  # idempotent: vLLM may load a plugin more than once
    return layer_utils


def test_vllms_own_dispatch_frees_the_weight_a_push_loads_into():
    """Canary and reason: vLLM's dispatch (oneDNN where it loads) empties layer.weight, so a later
    load_weights has nowhere to go. If a vLLM upgrade keeps the weight, this fails: re-check the plugin."""
    import vllm.model_executor.layers.utils as layer_utils
    from vllm import _custom_ops

    if not _custom_ops._supports_onednn:
        pytest.skip("this vLLM build has no oneDNN linear")
    original = cpu_reloadable_linear._ORIGINAL_DISPATCH.get("dispatch", layer_utils.dispatch_cpu_unquantized_gemm)
    layer = _Layer(torch.randn(64, 32, dtype=torch.bfloat16))
    original(layer, remove_weight=True)
    assert layer.weight.numel() == 0


def test_the_patched_dispatch_keeps_the_weight_and_reads_it_live(patched):
    layer = _Layer(torch.ones(3, 2))
    patched.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert layer.weight.shape == (3, 2) and cpu_reloadable_linear.uses_live_weights(layer)
    x = torch.tensor([[1.0, 2.0]])
    assert layer.cpu_linear(x, layer.weight, None).tolist() == [[3.0, 3.0, 3.0]]
    layer.weight.data.copy_(torch.full((3, 2), 2.0))  # what load_weights does
    assert layer.cpu_linear(x, layer.weight, None).tolist() == [[6.0, 6.0, 6.0]]
    bias = torch.tensor([1.0, 0.0, -1.0])
    assert layer.cpu_linear(x, layer.weight, bias).tolist() == [[7.0, 6.0, 5.0]]


def test_non_matrix_weights_go_to_vllms_dispatch(patched, monkeypatch):
    seen = []
    monkeypatch.setitem(cpu_reloadable_linear._ORIGINAL_DISPATCH, "dispatch", lambda layer, rw: seen.append(rw))
    conv = _Layer(torch.ones(4, 1, 3))
    patched.dispatch_cpu_unquantized_gemm(conv, remove_weight=False)
    assert seen == [False] and not cpu_reloadable_linear.uses_live_weights(conv)


def test_vllm_still_dispatches_through_the_patched_name():
    """Canary: linear.py and vocab_parallel_embedding.py import the dispatcher at call time, by this
    name; a module-level import in a later vLLM would bypass the patch."""
    import inspect

    from vllm.model_executor.layers import linear, vocab_parallel_embedding

    for module in (linear, vocab_parallel_embedding):
        source = inspect.getsource(module)
        assert "from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm" in source
        assert not hasattr(module, "dispatch_cpu_unquantized_gemm"), module.__name__


def test_a_packed_weight_takes_a_push_through_its_repacking_loader():
    """vLLM's mamba loader writes slices of an unpacked [dim, 1, kernel] weight; the wrapped loader
    gives it an unpacked staging tensor and packs the result into the packed parameter."""

    def vllm_loader(param, loaded):  # writes row blocks, as mamba_v2_sharded_weight_loader does
        param.data[:2] = loaded[:2]
        param.data[2:] = loaded[2:]

    def pack(weight):  # [dim, 1, kernel] -> a "packed" [kernel, dim]
        return weight.view(weight.size(0), weight.size(2)).t().contiguous() * 10

    packed = torch.nn.Parameter(torch.zeros(3, 4), requires_grad=False)  # [kernel, dim]
    load = cpu_reloadable_linear.repacking_loader(vllm_loader, (4, 1, 3), pack)
    pushed = torch.arange(12.0).view(4, 1, 3)
    load(packed, pushed)
    assert torch.equal(packed.data, pack(pushed))
    load(packed, pushed + 1)  # the next push replaces the packed weight whole
    assert torch.equal(packed.data, pack(pushed + 1))
