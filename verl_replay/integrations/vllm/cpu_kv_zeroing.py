"""vLLM plugin: zero freshly allocated KV-cache blocks on vLLM's CPU build, as its GPU runner does.

vLLM 0.24's GPU model runner zeroes every KV-cache block the scheduler hands out anew
(``_zero_block_ids``) "to prevent stale NaN/data from corrupting attention or SSM computation". Its
CPU runner skips that on the grounds that CPU attention gives masked positions a -inf logit. A -inf
logit gives a zero weight, but a zero weight times a NaN value in a stale block is still NaN: once
one generation leaves NaN in the cache (a sequence cut at a weight push, a model mid-update), every
later sequence that is given that block reads it back, and its log-probs turn NaN and its tokens
garbage. That is what verl's rollout showed from the second weight push on.

``install`` (run by verl-replay's vLLM plugin, ``cpu_plugin``, on vLLM's CPU platform only) replaces
the CPU runner's no-op with a torch ``index_fill_`` over the full-attention caches, the same blocks
the GPU runner's Triton kernel zeroes. Mamba / Gated DeltaNet state is not touched, as on GPUs
(vLLM resets that state per request itself).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Set on CPUModelRunner once patched (idempotent: vLLM may load plugins more than once a process).
PATCHED_FLAG = "_verl_replay_zeroes_kv_blocks"
_TABLE_ATTR = "_verl_replay_kv_zero_table"


@dataclass(frozen=True)
class ZeroTarget:
    """One KV-cache tensor and where its block index sits."""

    cache: torch.Tensor  # CPU attention layout: [num_kernel_blocks, kv_heads, block_size, 2*head_size]
    block_dim: int
    # Scheduler blocks are split into kernel blocks when the backend wants smaller ones.
    kernel_blocks_per_block: int


def zero_kv_blocks(targets: Iterable[ZeroTarget], block_ids: Sequence[int]) -> None:
    """Zero scheduler blocks ``block_ids`` (every kernel block they span) in each target cache."""
    if not block_ids:
        return
    ids = torch.as_tensor(list(block_ids), dtype=torch.long)  # [B]
    for target in targets:
        ratio = target.kernel_blocks_per_block
        kernel_ids = (ids[:, None] * ratio + torch.arange(ratio)).reshape(-1)  # [B*ratio]
        target.cache.index_fill_(target.block_dim, kernel_ids, 0)


def full_attention_targets(runner: Any) -> list[ZeroTarget]:
    """The runner's full-attention KV caches, read as vLLM's own ``KVBlockZeroer`` reads them."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    context = runner.compilation_config.static_forward_context
    skipped = set(getattr(runner, "runner_only_attn_layers", None) or ())
    kernel_block_sizes = runner._kernel_block_sizes
    seen: set[int] = set()
    targets: list[ZeroTarget] = []
    for group in runner._kv_cache_spec_attn_group_iterator():
        spec = group.kv_cache_spec
        if not isinstance(spec, FullAttentionSpec) or group.kv_cache_group_id >= len(kernel_block_sizes):
            continue
        kernel_block_size = kernel_block_sizes[group.kv_cache_group_id]
        block_dim = group.backend.get_kv_cache_block_dim(
            kernel_block_size, spec.num_kv_heads, spec.head_size, cache_dtype_str=runner.cache_config.cache_dtype
        )
        for layer_name in group.layer_names:
            cache = context[layer_name].kv_cache if layer_name not in skipped else None
            if not isinstance(cache, torch.Tensor) or cache.data_ptr() in seen:
                continue
            seen.add(cache.data_ptr())
            targets.append(ZeroTarget(cache, block_dim, spec.block_size // kernel_block_size))
    return targets


def _zero_block_ids(runner: Any, block_ids: list[int]) -> None:
    """Replacement for ``CPUModelRunner._zero_block_ids``; the target table is built once per KV cache."""
    key = id(getattr(runner, "kv_cache_config", None))
    table = getattr(runner, _TABLE_ATTR, None)
    if table is None or table[0] != key:
        table = (key, full_attention_targets(runner))
        setattr(runner, _TABLE_ATTR, table)
    zero_kv_blocks(table[1], block_ids)


def install() -> None:
    """Patch vLLM's CPU runner (idempotent)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, PATCHED_FLAG, False):
        return
    CPUModelRunner._zero_block_ids = _zero_block_ids
    setattr(CPUModelRunner, PATCHED_FLAG, True)
    logger.debug("verl_replay: CPUModelRunner zeroes new KV-cache blocks")
