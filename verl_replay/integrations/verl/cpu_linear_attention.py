"""CPU kernels for Qwen3.5's Gated DeltaNet layers that keep packed sequences apart.

verl's padding-free path (``use_remove_padding=True``, what the recipes run on GPUs) packs a
micro-batch into one row and hands the boundaries to its patched Qwen3.5 forward
(``verl/models/transformers/qwen3_5.py``) as ``cu_seqlens``. That forward calls the two kernels
the Gated DeltaNet layer holds:

- ``self.causal_conv1d_fn(x=..., seq_idx=...)``: on GPUs causal-conv1d's kernel, which restarts
  the short convolution where ``seq_idx`` changes. Without it (``None``) verl runs a torch
  convolution per packed sequence, which is exact.
- ``self.chunk_gated_delta_rule(..., cu_seqlens=...)``: on GPUs flash-linear-attention's kernel,
  which restarts the recurrence at every sequence start. Without it transformers' torch fallback
  (``torch_chunk_gated_delta_rule``) takes ``**kwargs`` and so silently *ignores* ``cu_seqlens``:
  the recurrent state runs on from one packed sequence into the next (a packed row then differs
  from separate rows by ~5e-3 in the logits on the tiny model).

The layer takes both kernels from its module's globals when it is built
(``causal_conv1d_fn``, ``chunk_gated_delta_rule``, ``None`` where the GPU packages are missing).
:func:`install_packed_linear_attention_kernels` fills those ``None`` slots with the torch
implementations below, the same extension point the GPU packages fill, so verl's packed forward
takes its GPU branches (``seq_idx`` for the convolution, ``cu_seqlens`` for the recurrence) and is
exact on CPU. Each kernel without boundaries runs exactly transformers' own torch fallback, so
unpacked forwards (padded training, generation with a cache) are unchanged bit for bit. With
flash-linear-attention or causal-conv1d installed the corresponding slot is not ``None`` and is
left alone.

Imports torch and transformers only; verl's CPU support installs it in every process (before
any model is built: a layer reads the globals once, in ``__init__``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

QWEN3_5_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)
# (module, attribute) of the transformers private names this module reads or rebinds.
PRIVATE_API_PATCHES: tuple[tuple[str, str], ...] = tuple(
    (module, attribute)
    for module in QWEN3_5_MODULES
    for attribute in ("causal_conv1d_fn", "chunk_gated_delta_rule", "torch_chunk_gated_delta_rule")
)

_installed: list[str] = []


class TransformersApiChanged(RuntimeError):
    """A transformers name this module relies on has moved: the pinned transformers changed."""


def _segments(boundaries: list[int]) -> list[tuple[int, int]]:
    return [(start, end) for start, end in zip(boundaries[:-1], boundaries[1:], strict=True)]


def _seq_idx_boundaries(seq_idx: torch.Tensor) -> list[int]:
    """[0, ..., T]: where the sequence index of one row changes (``seq_idx`` [T])."""
    changes = (torch.nonzero(seq_idx[1:] != seq_idx[:-1]).flatten() + 1).tolist()
    return [0, *changes, int(seq_idx.shape[0])]


def packed_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """causal-conv1d's ``causal_conv1d_fn`` in torch: a depthwise causal convolution per sequence.

    ``x`` [B, C, T], ``weight`` [C, K], ``seq_idx`` [B, T] (int; a new value starts a new
    sequence, which sees no input of the one before). Without ``seq_idx`` this is exactly the
    layer's torch fallback, ``silu(conv1d(x, padding=K-1)[..., :T])``. With it, each row is laid
    out with K-1 zeros before every sequence and convolved once: every output is the same window
    sum as the sequence's own padded convolution, in one call instead of one per sequence.
    """
    if initial_states is not None or return_final_states or final_states_out is not None:
        raise NotImplementedError("the CPU causal_conv1d_fn keeps no convolution state (training forward only)")
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"causal_conv1d_fn activation {activation!r} (causal-conv1d knows silu/swish)")
    channels, width = weight.shape
    kernel = weight.unsqueeze(1)  # [C, 1, K], what nn.Conv1d(groups=C) holds

    def conv(segment: torch.Tensor) -> torch.Tensor:  # [b, C, t] -> [b, C, t]
        out = F.conv1d(segment, kernel, bias, padding=width - 1, groups=channels)[..., : segment.shape[-1]]
        return F.silu(out) if activation is not None else out

    if seq_idx is None:
        return conv(x)
    if seq_idx.shape != (x.shape[0], x.shape[-1]):
        raise ValueError(f"seq_idx {tuple(seq_idx.shape)} does not match x {tuple(x.shape)} ([B, C, T] / [B, T])")
    rows = []
    for row, row_seq_idx in zip(x, seq_idx, strict=True):  # [C, T], [T]
        spaced, outputs = _zeros_between_sequences(_seq_idx_boundaries(row_seq_idx), width - 1)
        with_zero = torch.cat([row.new_zeros(channels, 1), row], dim=1)  # column 0: the zero a gap reads
        out = F.conv1d(
            with_zero.index_select(1, spaced)[None], kernel, bias, groups=channels
        )  # [1, C, T + gaps - K + 1]
        out = out.index_select(2, outputs)  # [1, C, T]
        rows.append(F.silu(out) if activation is not None else out)
    return torch.cat(rows, dim=0)


def _zeros_between_sequences(boundaries: list[int], gap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices that lay one packed row out with ``gap`` zeros before each sequence, and where each
    token's output lands in an unpadded convolution over that layout.

    ``spaced`` picks, for every slot of the spaced row, column 0 (a zero) or column 1 + t (token t);
    ``outputs`` [T] is, for token t, the start of its window (its slot - ``gap``): the window then
    holds exactly the ``gap`` tokens before it in its own sequence, zeros where the sequence has
    none, as a convolution of that sequence alone with ``padding=gap`` sees them.
    """
    spaced, outputs = [], []
    for start, end in _segments(boundaries):
        spaced.extend([0] * gap)
        first_slot = len(spaced)
        spaced.extend(range(start + 1, end + 1))
        outputs.extend(range(first_slot - gap, first_slot - gap + end - start))
    return torch.tensor(spaced, dtype=torch.long), torch.tensor(outputs, dtype=torch.long)


def _torch_fallback(module_name: str) -> Callable[..., Any]:
    import importlib

    module = importlib.import_module(module_name)
    fallback = getattr(module, "torch_chunk_gated_delta_rule", None)
    if fallback is None:
        raise TransformersApiChanged(
            f"verl_replay's CPU Gated DeltaNet kernel wraps {module_name}.torch_chunk_gated_delta_rule, which this "
            "transformers version does not have; verl_replay pins transformers==5.9.0"
        )
    return fallback


def _chunk_size(fallback: Callable[..., Any]) -> int:
    """The chunk length ``fallback`` pads every sequence to a multiple of (its ``chunk_size`` default)."""
    import inspect

    parameter = inspect.signature(fallback).parameters.get("chunk_size")
    if parameter is None or not isinstance(parameter.default, int):
        raise TransformersApiChanged(
            f"{getattr(fallback, '__qualname__', fallback)} has no integer chunk_size default; verl_replay pins "
            "transformers==5.9.0"
        )
    return parameter.default


def _pad_time(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [1, t, ...] zero-padded at the end of its time dimension to ``width``."""
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]))


# The chunk length packed sequences run in. The chunked delta rule is exact for any chunk length;
# the fallback's cost is a Python loop over the chunk's rows (triangular solve) plus one over the
# chunks, on [chunk, chunk] matrices: measured on 48 packed sequences (forward + backward, one
# thread), 16 is the fastest of 8 / 16 / 32 / 64 for 8-16 tokens (11 ms vs 177 ms at 64), 50-96
# (60 vs 333 ms) and 100-300 (319 vs 805 ms).
PACKED_CHUNK = 16


def block_size(length: int, chunk: int) -> int:
    """The chunk length a packed sequence of ``length`` tokens runs with: ``PACKED_CHUNK``, or the
    fallback's own ``chunk`` where that is smaller."""
    return min(chunk, PACKED_CHUNK)


def _run_segments_batched(
    fallback: Callable[..., Any],
    chunk: int,
    tensors: tuple[torch.Tensor, ...],
    offsets: list[int],
    initial_state: torch.Tensor | None,
    common: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The packed sequences of ``tensors`` (query, key, value [1, T, H, *]; g, beta [1, T, H]), those
    of one chunk size and count as the rows of one ``fallback`` call; outputs back in packed order."""
    query, value = tensors[0], tensors[2]
    segments = _segments(offsets)
    by_blocks: dict[tuple[int, int], list[int]] = {}  # (chunk size, chunk count) -> sequences
    for i, (start, end) in enumerate(segments):
        if end > start:
            size = block_size(end - start, chunk)
            by_blocks.setdefault((size, -(-(end - start) // size)), []).append(i)
    outputs: list[torch.Tensor | None] = [None] * len(segments)
    finals: list[torch.Tensor | None] = [None] * len(segments)
    for (size, n_chunks), members in by_blocks.items():
        width = n_chunks * size
        rows = [
            torch.cat([_pad_time(t[:, segments[i][0] : segments[i][1]], width) for i in members], dim=0)
            for t in tensors
        ]  # each [b, width, H, *]
        state = initial_state[members] if initial_state is not None else None  # [b, H, K, V]
        out, final = fallback(
            *rows[:3], g=rows[3], beta=rows[4], chunk_size=size, initial_state=state, **common
        )  # [b, width, H, V]
        for row, i in enumerate(members):
            outputs[i] = out[row : row + 1, : segments[i][1] - segments[i][0]]  # [1, t, H, V]
            if common["output_final_state"]:
                finals[i] = final[row : row + 1]  # [1, H, K, V]
    present = [out for out in outputs if out is not None]
    output = torch.cat(present, dim=1) if present else value.new_zeros(value.shape)
    if not common["output_final_state"]:
        return output, None
    for i, final in enumerate(finals):
        if final is None:  # an empty sequence: no output, its state passes through
            passed = initial_state[i : i + 1] if initial_state is not None else None
            zeros = query.new_zeros(1, value.shape[2], query.shape[-1], value.shape[-1], dtype=torch.float32)
            finals[i] = passed if passed is not None else zeros
    return output, torch.cat(finals, dim=0)


def make_packed_chunk_gated_delta_rule(fallback: Callable[..., Any]) -> Callable[..., Any]:
    """flash-linear-attention's ``chunk_gated_delta_rule`` on top of transformers' torch fallback.

    The fallback runs one sequence per batch row; with ``cu_seqlens`` (one packed row, as verl
    passes it) each packed sequence runs on its own, from its own ``initial_state`` row (or zeros).
    Shapes as in flash-linear-attention: ``query``/``key`` [B, T, H, K], ``value`` [B, T, H, V],
    ``g``/``beta`` [B, T, H]; with ``cu_seqlens`` (N+1 offsets) B is 1 and the states are [N, H, K, V].

    The fallback pads every sequence with zeros to a multiple of its chunk size and runs a Python
    loop per chunk; so the packed sequences that fill the same number of chunks are padded here the
    way the fallback pads each of them and run as the rows of one call (the rows never mix): each
    sequence gets the fallback's own algorithm on its own input, in one call per chunk count
    instead of one per sequence (a micro-batch of 32 short answers: one call, not 32). Packed
    sequences run in 16-token chunks (:func:`block_size`), not the fallback's default 64: the
    same recurrence blocked differently, equal to the default chunk's result up to float rounding,
    2.5-15x faster on CPU (a 12-token answer no longer pays for 64).
    """
    chunk = _chunk_size(fallback)

    def packed_chunk_gated_delta_rule(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        scale: float | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if scale is not None and abs(scale - query.shape[-1] ** -0.5) > 1e-12:
            raise NotImplementedError("the torch gated delta rule scales by 1/sqrt(head_dim) only")
        common = {"output_final_state": output_final_state, "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel}
        if cu_seqlens is None:
            return fallback(query, key, value, g=g, beta=beta, initial_state=initial_state, **common)
        if query.shape[0] != 1:
            raise ValueError(f"packed sequences (cu_seqlens) need batch size 1, got {query.shape[0]}")
        offsets = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
        if offsets[0] != 0 or offsets[-1] != query.shape[1]:
            raise ValueError(f"cu_seqlens {offsets[0]}..{offsets[-1]} does not cover the {query.shape[1]} tokens")
        return _run_segments_batched(fallback, chunk, (query, key, value, g, beta), offsets, initial_state, common)

    packed_chunk_gated_delta_rule._verl_replay_packed = True  # type: ignore[attr-defined]
    return packed_chunk_gated_delta_rule


def install_packed_linear_attention_kernels() -> list[str]:
    """Fill the empty Gated DeltaNet kernel slots of transformers' Qwen3.5 modules; idempotent.

    Returns the ``module.attribute`` slots now holding a CPU kernel (empty where the GPU packages
    are installed). Layers built before this call keep what they took in ``__init__``.
    """
    import importlib

    for name in QWEN3_5_MODULES:
        module = importlib.import_module(name)
        for attribute in ("causal_conv1d_fn", "chunk_gated_delta_rule"):
            if not hasattr(module, attribute):
                raise TransformersApiChanged(
                    f"verl_replay's CPU support fills {name}.{attribute}, which this transformers version does not "
                    "have; verl_replay pins transformers==5.9.0"
                )
        slot = f"{name}.causal_conv1d_fn"
        if module.causal_conv1d_fn is None:
            module.causal_conv1d_fn = packed_causal_conv1d
            _installed.append(slot)
        slot = f"{name}.chunk_gated_delta_rule"
        if module.chunk_gated_delta_rule is None:
            module.chunk_gated_delta_rule = make_packed_chunk_gated_delta_rule(_torch_fallback(name))
            _installed.append(slot)
    return list(_installed)
