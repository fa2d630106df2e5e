"""Causal attention over packed sequences on CPU, each sequence attending only within itself.

verl's padding-free path (``use_remove_padding=True``, what the recipes run) packs a micro-batch
into one row. On GPUs flash-attention's varlen kernel attends within each packed sequence. On the
CPU stack transformers' ``sdpa`` path gets the same exclusion from a dense ``[T, T]`` mask of the
whole pack (causal and same-sequence) and scores every query of the pack against every key: work
and memory quadratic in the pack's tokens. A scan pass of 128 answers of 12 tokens scores 1,536^2
pairs per head, 99% of them masked out; at 384 answers the attention is half the forward.

:func:`packed_sdpa_attention_forward` takes transformers' ``"sdpa"`` slot and computes a packed
row the way the varlen kernel does: the packed sequences (read from the position ids, exactly as
transformers reads them to build its mask) are grouped by length, and each group runs as the rows
of one causal ``scaled_dot_product_attention`` call: the same scores, softmax and sum per
sequence as the masked call, without the masked-out pairs. Anything else (a batch of several
rows, a KV cache, one sequence, a sliding window, a non-causal module) goes to transformers' own
``sdpa_attention_forward`` unchanged, so generation and padded training are untouched. For
Qwen3.5 models the packed row's dense mask, which this never reads, is not built either
(:func:`skip_mask_of_packed_rows`).

Imports torch and transformers only (and the CPU kernels' API-change error); verl's CPU support installs
it in every process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from verl_replay.integrations.verl.cpu_linear_attention import TransformersApiChanged

# The model modules whose causal mask is skipped for packed rows (their full-attention layers
# have no sliding window and no mask overlays: a packed row's mask is causal-within-sequence).
QWEN3_5_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)
# (module, attribute) of the transformers names this module reads or rebinds.
PRIVATE_API_PATCHES: tuple[tuple[str, str], ...] = (
    ("transformers.integrations.sdpa_attention", "sdpa_attention_forward"),
    ("transformers.integrations.sdpa_attention", "repeat_kv"),
    ("transformers.masking_utils", "find_packed_sequence_indices"),
    ("transformers.modeling_utils", "AttentionInterface"),
    *((module, "create_causal_mask") for module in QWEN3_5_MODULES),
)

ATTENTION_SLOT = "sdpa"

_installed: list[str] = []


def packed_segments(position_ids: torch.Tensor) -> list[tuple[int, int]] | None:
    """``[(start, end), ...]`` of the sequences packed in one row (``position_ids`` [1, T]), split where
    transformers' own mask splits them; None when the row holds one sequence."""
    from transformers.masking_utils import find_packed_sequence_indices

    sequence_ids = find_packed_sequence_indices(position_ids)  # [1, T] or None
    if sequence_ids is None:
        return None
    row = sequence_ids[0]
    starts = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
    bounds = [0, *starts, int(row.shape[0])]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _packed_row(query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor | None) -> bool:
    """One row, no cached keys (prefill or training, not decoding), position ids to split it by."""
    return query.shape[0] == 1 and query.shape[2] == key.shape[2] and position_ids is not None


def _causal_within_sequences(module: Any, is_causal: bool | None, kwargs: dict) -> bool:
    return (
        is_causal is not False
        and getattr(module, "is_causal", True)
        and getattr(module, "sliding_window", None) is None
        and not kwargs.get("output_attentions", False)
    )


def attend_within_segments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: list[tuple[int, int]],
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
) -> torch.Tensor:
    """Causal attention of each segment on its own: ``query`` [1, H, T, d], ``key`` / ``value``
    [1, H, T, d] (heads already repeated) -> [1, H, T, d]. Segments of one length run together as
    the rows of one call."""
    heads, dim = query.shape[1], query.shape[3]
    by_length: dict[int, list[int]] = {}
    for start, end in segments:
        by_length.setdefault(end - start, []).append(start)
    order, outputs = [], []
    for length, starts in by_length.items():
        index = (torch.tensor(starts)[:, None] + torch.arange(length)[None, :]).flatten()  # [b * L]

        def rows(t: torch.Tensor, index: torch.Tensor = index, b: int = len(starts), length: int = length):
            return t[0].index_select(1, index).view(heads, b, length, -1).transpose(0, 1)  # [b, H, L, d]

        out = F.scaled_dot_product_attention(
            rows(query), rows(key), rows(value), dropout_p=dropout, scale=scaling, is_causal=True
        )  # [b, H, L, d]
        outputs.append(out.transpose(0, 1).reshape(heads, -1, dim))  # [H, b * L, d]
        order.append(index)
    inverse = torch.argsort(torch.cat(order))  # packed position -> position in the grouped order
    return torch.cat(outputs, dim=1).index_select(1, inverse)[None]  # [1, H, T, d]


def packed_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention interface; a packed row attends within each sequence
    (``query`` [1, H, T, d], ``key`` / ``value`` [1, H_kv, T, d] -> ([1, T, H, d], None))."""
    from transformers.integrations import sdpa_attention

    position_ids = kwargs.get("position_ids")
    segments = packed_segments(position_ids) if _packed_row(query, key, position_ids) else None
    if segments is not None and not _causal_within_sequences(module, is_causal, kwargs):
        if attention_mask is None:  # the mask was skipped for a packed row (see skip_mask_of_packed_rows)
            raise NotImplementedError(
                f"{type(module).__name__}: packed sequences without a mask need causal attention with no sliding "
                "window; verl_replay's CPU packed attention skips the mask for Qwen3.5 models only"
            )
        segments = None
    if segments is None:
        return sdpa_attention.sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = sdpa_attention.repeat_kv(key, groups), sdpa_attention.repeat_kv(value, groups)
    out = attend_within_segments(query, key, value, segments, dropout=dropout, scaling=scaling)
    return out.transpose(1, 2).contiguous(), None


def skip_mask_of_packed_rows(create_causal_mask: Callable[..., Any]) -> Callable[..., Any]:
    """A model module's ``create_causal_mask`` that builds nothing for a packed sdpa row.

    transformers builds a packed row's ``[T, T]`` mask from the position ids; the packed attention
    reads the same sequences from the same position ids and never uses it (a tenth of a scan
    pass's forward on the tiny model). Any other call (padding, a cache, overlays, another
    attention implementation, one sequence) builds the mask as before."""

    @functools.wraps(create_causal_mask)
    def create(
        config: Any,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Any,
        position_ids: torch.Tensor | None = None,
        **overlays: Any,
    ) -> Any:
        packed = (
            getattr(config, "_attn_implementation", None) == ATTENTION_SLOT
            and attention_mask is None
            and past_key_values is None
            and not any(value is not None for value in overlays.values())
            and inputs_embeds.shape[0] == 1
            and position_ids is not None
            and packed_segments(position_ids) is not None
        )
        if packed:
            return None
        return create_causal_mask(config, inputs_embeds, attention_mask, past_key_values, position_ids, **overlays)

    create._verl_replay_packed = True  # type: ignore[attr-defined]
    return create


def install_packed_attention() -> list[str]:
    """Put :func:`packed_sdpa_attention_forward` in transformers' ``"sdpa"`` attention slot and skip
    the Qwen3.5 models' mask of packed rows; idempotent. Models look both up at every forward, so
    models built earlier use them too."""
    import importlib

    from transformers.modeling_utils import AttentionInterface

    if _installed:
        return list(_installed)
    AttentionInterface.register(ATTENTION_SLOT, packed_sdpa_attention_forward)
    _installed.append(f"transformers AttentionInterface[{ATTENTION_SLOT!r}]")
    for name in QWEN3_5_MODULES:
        module = importlib.import_module(name)
        if not hasattr(module, "create_causal_mask"):
            raise TransformersApiChanged(
                f"verl_replay's CPU packed attention wraps {name}.create_causal_mask, which this transformers "
                "version does not have; verl_replay pins transformers==5.9.0"
            )
        if not getattr(module.create_causal_mask, "_verl_replay_packed", False):
            module.create_causal_mask = skip_mask_of_packed_rows(module.create_causal_mask)
        _installed.append(f"{name}.create_causal_mask")
    return list(_installed)
