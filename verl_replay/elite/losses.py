"""EliteReplay loss.

    L        = (1 - mu) * L_GRPO + mu * L_replay
    L_replay = -(1/|E|) * sum_{(x,y) in E} (1/|y|) * sum_t log pi_theta(y_t | x, y_<t)

Two-level normalisation: each replay response by its own number of valid tokens first, then
the mean over replay responses. Averaging whole-sequence log-probs (or one token-mean over the
whole batch) weights long responses more and is a different, wrong, quantity.

For a result that does not depend on micro-batching, dynamic batch size or the data-parallel
split, the verl integration sums :func:`replay_nll_sum` over its micro-batches and divides by
the GLOBAL number of replay rows of the update (summed over micro-batches and ranks); each
row's term only depends on that row, so the split cannot change the sum.

Masking: positions outside the mask are replaced by 0 with ``torch.where`` before any
arithmetic, so padding may hold anything (``-inf``, ``nan``, garbage) without reaching the value
or the gradient. No ``exp`` is taken here; callers that exponentiate must mask first too.
Half-precision inputs are accumulated in float32 (the result keeps that dtype); float32 and
float64 inputs keep their dtype.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

__all__ = ["per_row_mean_nll", "length_normalized_nll", "replay_nll_sum", "mixed_loss"]


def _as_bool_mask(mask: Tensor, shape: torch.Size, name: str) -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(shape)}")
    if mask.dtype == torch.bool:
        return mask
    # A 0/1 mask in another dtype is fine; fractional weights are not a mask.
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name} must hold only 0/1 (or bool) values")
    return mask != 0


def _valid_token_counts(log_probs: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(masked log-probs [R, T] in the working dtype, bool mask [R, T], valid counts [R])."""
    if not isinstance(log_probs, Tensor):
        raise TypeError(f"log_probs must be a torch.Tensor, got {type(log_probs).__name__}")
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be [R, T], got shape {tuple(log_probs.shape)}")
    if not log_probs.is_floating_point():
        raise TypeError(f"log_probs must be floating point, got {log_probs.dtype}")
    mask = _as_bool_mask(response_mask, log_probs.shape, "response_mask")  # [R, T]
    lp = log_probs.float() if log_probs.dtype in (torch.float16, torch.bfloat16) else log_probs
    lp = torch.where(mask, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))  # [R, T]
    counts = mask.sum(dim=-1)  # [R]
    return lp, mask, counts


def per_row_mean_nll(log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """``[R, T], [R, T] -> [R]``: each row's mean negative log-prob over its valid tokens.

    Raises ``ValueError`` naming the rows that have no valid token.
    """
    lp, _, counts = _valid_token_counts(log_probs, response_mask)
    empty = (counts == 0).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"rows {empty.tolist()[:10]} have no valid token; a replay response needs >= 1")
    return -lp.sum(dim=-1) / counts.to(lp.dtype)  # [R]


def length_normalized_nll(log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """``L_replay``: ``[R, T], [R, T] -> []``, mean over rows of each row's mean NLL."""
    if isinstance(log_probs, Tensor) and log_probs.dim() >= 1 and log_probs.shape[0] == 0:
        raise ValueError("length_normalized_nll: no rows (R == 0); the mean over replay responses is undefined")
    return per_row_mean_nll(log_probs, response_mask).mean()


def replay_nll_sum(log_probs: Tensor, response_mask: Tensor, row_is_replay: Tensor) -> Tensor:
    """``[R, T], [R, T], [R] -> []``: sum over replay rows of their per-row mean NLL.

    Divide the sum over all micro-batches / ranks by the global number of replay rows to get
    ``L_replay`` exactly. Non-replay rows contribute exactly 0 (value and gradient) and may have
    no valid token; a replay row without a valid token raises ``ValueError``. With no replay
    row the result is a graph-connected 0.
    """
    lp, _, counts = _valid_token_counts(log_probs, response_mask)
    replay = _as_bool_mask(row_is_replay, lp.shape[:1], "row_is_replay")  # [R]
    empty = (replay & (counts == 0)).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"replay rows {empty.tolist()[:10]} have no valid token; a replay response needs >= 1")
    per_row = -lp.sum(dim=-1) / counts.clamp(min=1).to(lp.dtype)  # [R]; clamp only affects non-replay rows
    return torch.where(replay, per_row, torch.zeros((), dtype=per_row.dtype, device=per_row.device)).sum()


def mixed_loss(grpo_loss: Tensor, replay_loss: Tensor, mu: float) -> Tensor:
    """``(1 - mu) * grpo_loss + mu * replay_loss`` with ``mu`` a real number in [0, 1]."""
    if isinstance(mu, bool) or not isinstance(mu, numbers.Real):
        raise TypeError(f"mu must be a real number in [0, 1], got {mu!r}")
    mu = float(mu)
    if not (math.isfinite(mu) and 0.0 <= mu <= 1.0):
        raise ValueError(f"mu must be in [0, 1], got {mu}")
    return (1.0 - mu) * grpo_loss + mu * replay_loss
