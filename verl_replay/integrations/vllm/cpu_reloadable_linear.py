"""Linear layers on vLLM's CPU build that read their live weights, so verl's weight push reaches them.

After loading, vLLM 0.24's CPU build hands each linear layer to a prepacked kernel (oneDNN, or
sgl's on AMX hosts) built from a copy of the weight, and frees ``layer.weight`` (an empty
parameter). That is fine for a server that loads once; verl pushes new weights into the running
engine every global step (``model.load_weights``), and then the first push fails ("Attempted to
load weight (torch.Size([48, 16])) into parameter (torch.Size([0]))"), and the layers that keep
their weight (embeddings, lm head) would go on computing with the prepacked copy of the first one.
vLLM's GPU build computes from ``layer.weight`` itself; so does vLLM's own CPU fallback
(``torch.nn.functional.linear``), which ``install`` selects for every 2-D weight. On AMX hosts vLLM
also packs Gated DeltaNet's conv weights in place (its AMX conv kernel reads that layout only); those
keep the packing, and their loader packs each pushed weight the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

PATCHED_FLAG = "_verl_replay_reloadable_linear"


_ORIGINAL_DISPATCH: dict[str, Any] = {}


def live_weight_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Replacement for ``dispatch_cpu_unquantized_gemm``: vLLM's fallback for every 2-D weight.

    ``remove_weight`` is ignored on purpose: the weight is what the next push loads into. A conv
    weight (Gated DeltaNet's ``[dim, 1, kernel]``) goes to vLLM's own dispatch, which on AMX hosts
    packs it in place into the layout its AMX kernel reads; its loader is then wrapped to load into
    the unpacked shape and pack again, so a push lands there too.
    """
    if layer.weight.ndim == 2:
        layer.cpu_linear = _linear
        return
    unpacked_shape = tuple(layer.weight.shape)
    loader = getattr(layer.weight, "weight_loader", None)
    _ORIGINAL_DISPATCH["dispatch"](layer, remove_weight)
    if tuple(layer.weight.shape) != unpacked_shape and loader is not None:
        layer.weight.weight_loader = repacking_loader(loader, unpacked_shape, _pack_conv_weight)


def repacking_loader(loader: Callable, unpacked_shape: tuple[int, ...], pack: Callable) -> Callable:
    """A weight loader for a packed parameter: ``loader`` fills an unpacked staging tensor, then the
    packed parameter is overwritten with ``pack(staging)``. Partial loads are not supported: a
    packed weight is loaded whole (vLLM loads each conv weight in one call)."""

    def load(param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        staging = torch.nn.Parameter(torch.zeros(unpacked_shape, dtype=param.dtype), requires_grad=False)
        loader(staging, loaded_weight, *args, **kwargs)
        param.data.copy_(pack(staging.data))

    load.unpacked_shape = unpacked_shape  # type: ignore[attr-defined]
    return load


def _pack_conv_weight(weight: torch.Tensor) -> torch.Tensor:
    from vllm import _custom_ops as ops

    # the packing vLLM's dispatch applies on AMX hosts: [dim, 1, kernel] viewed as [dim, kernel]
    return ops.causal_conv1d_weight_pack(weight.view(weight.size(0), weight.size(2)))


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def install() -> None:
    import vllm.model_executor.layers.utils as layer_utils

    if getattr(layer_utils, PATCHED_FLAG, False):
        return
    _ORIGINAL_DISPATCH["dispatch"] = layer_utils.dispatch_cpu_unquantized_gemm
    layer_utils.dispatch_cpu_unquantized_gemm = live_weight_linear
    setattr(layer_utils, PATCHED_FLAG, True)


def uses_live_weights(layer: Any) -> bool:
    return getattr(layer, "cpu_linear", None) is _linear
