"""Headroom, Policy Drift and replay KL.

Two layouts are supported:

* padded: ``[G, n, T]`` token tensors with a ``[G, n, T]`` response mask and ``[G, n]``
  response-level advantages (a verl batch regrouped by uid);
* ragged ("flat"): the responses of one group concatenated without padding, ``[L]`` with
  ``L = sum(response_lengths)``, the layout of :class:`~verl_replay.headroom_drift.buffer.
  ReplayGroup`. The ``*_flat`` functions score one group; the ``*_segments`` functions score a
  chunk of concatenated groups with segment sums (``torch.segment_reduce``), no padding.

Every function masks *before* any arithmetic (``torch.where`` on the inputs), so padded or
masked positions may hold anything (inf, nan, garbage) without changing a result. Arithmetic
runs in float64; results are float32 (tensors on the input device, or Python floats holding a
float32 value for :func:`group_scores_flat`).

Per token, with l clamped to <= 0 (log-probs a hair above 0 are numerical noise): 1 - p is
computed as ``-expm1(l)`` and k3 as ``expm1(r) - r``, which stay accurate where the values
that matter live (p close to 1, r close to 0) instead of cancelling two O(1) terms.

Degenerate cases (documented choices):

* a response with no valid token carries no direction and is left out of Headroom, like a
  response with ``A_i == 0`` (or NaN);
* a group with no directional response has Headroom 0;
* a group with no valid token has drift 0 and replay KL 0.

Determinism: the ``*_flat`` functions and :func:`group_scores_flat` compute a group from its
own tensors only, so a group's numbers never depend on which other groups were scored with it
(vectorised ``exp`` takes a different code path for a tensor's tail elements, so scoring
concatenated groups could change the last bits). The buffer therefore scores group by group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "WEIGHTINGS",
    "DRIFT_NORMS",
    "GroupScores",
    "headroom",
    "policy_drift",
    "replay_kl",
    "headroom_flat",
    "policy_drift_flat",
    "replay_kl_flat",
    "headroom_segments",
    "policy_drift_segments",
    "replay_kl_segments",
    "group_scores_flat",
]

WEIGHTINGS: tuple[str, ...] = ("sign", "advantage")
# l2: root mean square of the token log-ratios; mean_sq: its square (the paper's units, tau_sq =
# tau_rms**2: the same decisions); l1: mean absolute log-ratio (ablation)
DRIFT_NORMS: tuple[str, ...] = ("l2", "l1", "mean_sq")
_SQUARED_NORMS = ("l2", "mean_sq")  # norms aggregating r^2

_WORK = torch.float64  # internal accumulation dtype
_OUT = torch.float32  # public result dtype


# --------------------------------------------------------------------------- validation


def _check_weighting(weighting: str) -> None:
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")


def _check_norm(norm: str) -> None:
    if norm not in DRIFT_NORMS:
        raise ValueError(f"norm must be one of {DRIFT_NORMS}, got {norm!r}")


def _check_tensor(name: str, x: object, ndim: int) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def _check_float(name: str, x: Tensor) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def _check_same_shape(name: str, x: Tensor, ref_name: str, ref: Tensor) -> None:
    if x.shape != ref.shape:
        raise ValueError(f"{name} must have the same shape as {ref_name} {tuple(ref.shape)}, got {tuple(x.shape)}")


def _check_lengths(name: str, lengths: object, total: int, total_name: str) -> None:
    lengths = _check_tensor(name, lengths, 1)
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {lengths.dtype}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"{name} must be non-negative")
    if int(lengths.sum()) != total:
        raise ValueError(f"{name} must sum to the length of {total_name} ({total}), got {int(lengths.sum())}")


def _check_flat_tokens(log_probs: Tensor, response_mask: Tensor, gen_log_probs: Tensor | None = None) -> None:
    _check_tensor("log_probs", log_probs, 1)
    _check_float("log_probs", log_probs)
    _check_tensor("response_mask", response_mask, 1)
    _check_same_shape("response_mask", response_mask, "log_probs", log_probs)
    if gen_log_probs is not None:
        _check_tensor("gen_log_probs", gen_log_probs, 1)
        _check_float("gen_log_probs", gen_log_probs)
        _check_same_shape("gen_log_probs", gen_log_probs, "log_probs", log_probs)


def _check_advantages_1d(advantages: object, n: int) -> None:
    adv = _check_tensor("advantages", advantages, 1)
    if adv.numel() != n:
        raise ValueError(f"advantages must have one entry per response ({n}), got {adv.numel()}")


# --------------------------------------------------------------------------- token kernels


def _valid(mask: Tensor) -> Tensor:
    """Boolean validity of a mask given as bool / int / float (non-zero = valid)."""
    return mask if mask.dtype == torch.bool else mask != 0


def _masked_log_probs(log_probs: Tensor, valid: Tensor) -> Tensor:
    """float64 l, 0 at invalid positions (before any arithmetic), clamped to <= 0."""
    return torch.where(valid, log_probs.to(_WORK), 0.0).clamp_(max=0.0)


def _token_p_q(log_probs: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """(p, 1 - p) per token in float64, both 0 at invalid positions."""
    lp = _masked_log_probs(log_probs, valid)
    p = torch.exp(lp).mul_(valid)  # exp(0) = 1 at invalid positions -> zeroed
    q = torch.expm1(lp).neg_()  # expm1(0) = 0 at invalid positions already
    return p, q


def _log_ratio(log_probs: Tensor, gen_log_probs: Tensor, valid: Tensor) -> Tensor:
    """r = l_theta - l_gen in float64, 0 at invalid positions (garbage never propagates)."""
    lt = torch.where(valid, log_probs.to(_WORK), 0.0)
    lg = torch.where(valid, gen_log_probs.to(_WORK), 0.0)
    return lt.sub_(lg)


def _k3(r: Tensor) -> Tensor:
    return torch.expm1(r).sub_(r)


# --------------------------------------------------------------------------- response combine


def _combine_responses(
    sum_p: Tensor, sum_q: Tensor, count: Tensor, adv: Tensor, weighting: str
) -> tuple[Tensor, Tensor]:
    """Per-response (w_i * mean_t h_i, w_i) in float64, vectorised over any shape.

    h = 1 - p for A > 0 and p for A < 0; responses with A == 0 / NaN or no valid token get 0.
    """
    adv = adv.to(_WORK)
    pos, neg = adv > 0, adv < 0
    directional = (pos | neg) & (count > 0)
    w = directional.to(_WORK) if weighting == "sign" else torch.where(directional, adv.abs(), 0.0)
    mean_h = torch.where(pos, sum_q, sum_p) / count.to(_WORK).clamp(min=1.0)
    return w * mean_h, w


def _ratio_or_zero(num: Tensor, den: Tensor) -> Tensor:
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, num / safe, torch.zeros_like(num))


def _drift_from_sums(sq_sum: Tensor, abs_sum: Tensor, count: Tensor, norm: str) -> Tensor:
    count = count.to(_WORK)
    if norm == "l2":
        return torch.sqrt(_ratio_or_zero(sq_sum, count))
    if norm == "mean_sq":
        return _ratio_or_zero(sq_sum, count)
    return _ratio_or_zero(abs_sum, count)


# --------------------------------------------------------------------------- padded API


def headroom(
    log_probs: Tensor,  # [G, n, T] log-probs of the stored tokens under some policy
    response_mask: Tensor,  # [G, n, T] non-zero = valid response token
    advantages: Tensor,  # [G, n] response-level advantages A_i
    weighting: str = "sign",
) -> Tensor:  # [G] float32, in [0, 1]
    """Headroom H(g; l) of each group.

    Per token p = exp(l): h = 1 - p if A_i > 0, h = p if A_i < 0. Per response: mean of h over
    valid tokens. Per group: mean over responses with A_i != 0 weighted by w_i = 1 ("sign") or
    |A_i| ("advantage"); 0 for a group with no such response.
    """
    _check_weighting(weighting)
    _check_tensor("log_probs", log_probs, 3)
    _check_float("log_probs", log_probs)
    _check_tensor("response_mask", response_mask, 3)
    _check_same_shape("response_mask", response_mask, "log_probs", log_probs)
    _check_tensor("advantages", advantages, 2)
    if advantages.shape != log_probs.shape[:2]:
        raise ValueError(
            f"advantages must have shape [G, n] = {tuple(log_probs.shape[:2])}, got {tuple(advantages.shape)}"
        )
    valid = _valid(response_mask)
    p, q = _token_p_q(log_probs, valid)  # [G, n, T]
    num, w = _combine_responses(  # [G, n]
        p.sum(-1), q.sum(-1), valid.sum(-1), advantages.to(log_probs.device), weighting
    )
    return _ratio_or_zero(num.sum(-1), w.sum(-1)).to(_OUT)


def _padded_log_ratio(log_probs: Tensor, gen_log_probs: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(r [G, n*T] float64 with 0 at invalid positions, valid count [G])."""
    _check_tensor("log_probs", log_probs, 3)
    _check_float("log_probs", log_probs)
    _check_tensor("gen_log_probs", gen_log_probs, 3)
    _check_float("gen_log_probs", gen_log_probs)
    _check_same_shape("gen_log_probs", gen_log_probs, "log_probs", log_probs)
    _check_tensor("response_mask", response_mask, 3)
    _check_same_shape("response_mask", response_mask, "log_probs", log_probs)
    valid = _valid(response_mask).flatten(1)  # [G, n*T]
    r = _log_ratio(log_probs.flatten(1), gen_log_probs.flatten(1), valid)
    return r, valid.sum(-1)


def policy_drift(
    log_probs: Tensor,  # [G, n, T] current-policy log-probs l_theta
    gen_log_probs: Tensor,  # [G, n, T] generation-time log-probs l_gen
    response_mask: Tensor,  # [G, n, T]
    norm: str = "l2",
) -> Tensor:  # [G] float32, >= 0
    """Policy Drift of each group over all its valid tokens.

    ``l2``: sqrt(mean r^2); ``mean_sq``: mean r^2 (the paper's units); ``l1``: mean |r|;
    r = l_theta - l_gen. 0 for a group without tokens.
    """
    _check_norm(norm)
    r, count = _padded_log_ratio(log_probs, gen_log_probs, response_mask)
    return _drift_from_sums((r * r).sum(-1), r.abs().sum(-1), count, norm).to(_OUT)


def replay_kl(
    log_probs: Tensor,  # [G, n, T] current-policy log-probs l_theta
    gen_log_probs: Tensor,  # [G, n, T] generation-time log-probs l_gen
    response_mask: Tensor,  # [G, n, T]
) -> Tensor:  # [G] float32, >= 0
    """k3 = exp(r) - 1 - r averaged over each group's valid tokens (estimates KL(gen || theta))."""
    r, count = _padded_log_ratio(log_probs, gen_log_probs, response_mask)
    return _ratio_or_zero(_k3(r).sum(-1), count.to(_WORK)).to(_OUT)


# --------------------------------------------------------------------------- segments API


def _seg_sum(values: Tensor, lengths: Tensor) -> Tensor:
    """Sum of consecutive segments of ``values`` (empty segments give 0)."""
    return torch.segment_reduce(values, "sum", lengths=lengths.to(device=values.device, dtype=torch.long))


def headroom_segments(
    log_probs: Tensor,  # [L] concatenated responses of all groups
    response_mask: Tensor,  # [L]
    response_lengths: Tensor,  # [R] tokens per response (incl. masked ones), sum = L
    advantages: Tensor,  # [R] response-level advantages
    group_sizes: Tensor,  # [G] responses per group, sum = R
    weighting: str = "sign",
) -> Tensor:  # [G] float32
    """Headroom of a chunk of ragged groups via segment sums (no padding)."""
    _check_weighting(weighting)
    _check_flat_tokens(log_probs, response_mask)
    _check_lengths("response_lengths", response_lengths, log_probs.numel(), "log_probs")
    _check_advantages_1d(advantages, response_lengths.numel())
    _check_lengths("group_sizes", group_sizes, response_lengths.numel(), "response_lengths")
    valid = _valid(response_mask)
    p, q = _token_p_q(log_probs, valid)  # [L]
    count = _seg_sum(valid.to(_WORK), response_lengths)  # [R]
    num, w = _combine_responses(  # [R]
        _seg_sum(p, response_lengths),
        _seg_sum(q, response_lengths),
        count,
        advantages.to(log_probs.device),
        weighting,
    )
    return _ratio_or_zero(_seg_sum(num, group_sizes), _seg_sum(w, group_sizes)).to(_OUT)


def _segment_log_ratio(
    log_probs: Tensor, gen_log_probs: Tensor, response_mask: Tensor, group_token_counts: Tensor
) -> tuple[Tensor, Tensor]:
    """(r [L] float64, valid count per group [G] float64)."""
    _check_flat_tokens(log_probs, response_mask, gen_log_probs)
    _check_lengths("group_token_counts", group_token_counts, log_probs.numel(), "log_probs")
    valid = _valid(response_mask)
    r = _log_ratio(log_probs, gen_log_probs, valid)
    return r, _seg_sum(valid.to(_WORK), group_token_counts)


def policy_drift_segments(
    log_probs: Tensor,  # [L] current-policy log-probs, concatenated groups
    gen_log_probs: Tensor,  # [L]
    response_mask: Tensor,  # [L]
    group_token_counts: Tensor,  # [G] tokens per group (incl. masked ones), sum = L
    norm: str = "l2",
) -> Tensor:  # [G] float32
    """Policy Drift of a chunk of ragged groups via segment sums."""
    _check_norm(norm)
    r, count = _segment_log_ratio(log_probs, gen_log_probs, response_mask, group_token_counts)
    sq = _seg_sum(r * r, group_token_counts)
    ab = _seg_sum(r.abs(), group_token_counts)
    return _drift_from_sums(sq, ab, count, norm).to(_OUT)


def replay_kl_segments(
    log_probs: Tensor,  # [L]
    gen_log_probs: Tensor,  # [L]
    response_mask: Tensor,  # [L]
    group_token_counts: Tensor,  # [G], sum = L
) -> Tensor:  # [G] float32
    """Replay KL (k3 token mean) of a chunk of ragged groups via segment sums."""
    r, count = _segment_log_ratio(log_probs, gen_log_probs, response_mask, group_token_counts)
    return _ratio_or_zero(_seg_sum(_k3(r), group_token_counts), count).to(_OUT)


# --------------------------------------------------------------------------- one group


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32 value (the public result precision)."""
    return float(np.float32(x))


def _headroom_one(log_probs: Tensor, valid: Tensor, lengths: Tensor, adv: Tensor, weighting: str) -> float:
    """Headroom of one validated ragged group as a float32-valued Python float.

    The n-sized combine runs in Python (n is small): fewer tiny tensor ops on the hot path.
    """
    p, q = _token_p_q(log_probs, valid)  # [L]
    sums = torch.stack(
        [_seg_sum(p, lengths), _seg_sum(q, lengths), _seg_sum(valid.to(_WORK), lengths)]
    ).tolist()  # 3 x [n]
    num = den = 0.0
    for sp, sq, c, a in zip(*sums, adv.tolist(), strict=True):
        if c > 0 and (a > 0 or a < 0):  # directional response with valid tokens (NaN: no)
            w = 1.0 if weighting == "sign" else abs(a)
            num += w * ((sq if a > 0 else sp) / c)
            den += w
    return _f32(num / den) if den > 0 else 0.0


def _drift_kl_one(log_probs: Tensor, gen_log_probs: Tensor, valid: Tensor, norm: str) -> tuple[float, float, int]:
    """(drift, replay KL, valid tokens) of one validated ragged group."""
    r = _log_ratio(log_probs, gen_log_probs, valid)
    agg = (r * r) if norm in _SQUARED_NORMS else r.abs()
    s_agg, s_k3, count = torch.stack([agg.sum(), _k3(r).sum(), valid.sum().to(_WORK)]).tolist()
    if count == 0:
        return 0.0, 0.0, 0
    drift = math.sqrt(s_agg / count) if norm == "l2" else s_agg / count  # mean_sq, l1: the mean
    return _f32(drift), _f32(s_k3 / count), int(count)


def headroom_flat(
    log_probs: Tensor,  # [L] one group's concatenated responses
    response_mask: Tensor,  # [L]
    response_lengths: Tensor,  # [n], sum = L
    advantages: Tensor,  # [n]
    weighting: str = "sign",
    *,
    validate: bool = True,
) -> Tensor:  # [] float32
    """Headroom of one ragged group (0-d tensor); ``validate=False`` skips the shape checks."""
    _check_weighting(weighting)
    if validate:
        _check_flat_tokens(log_probs, response_mask)
        _check_lengths("response_lengths", response_lengths, log_probs.numel(), "log_probs")
        _check_advantages_1d(advantages, response_lengths.numel())
    h = _headroom_one(log_probs, _valid(response_mask), response_lengths, advantages, weighting)
    return torch.tensor(h, dtype=_OUT, device=log_probs.device)


def policy_drift_flat(
    log_probs: Tensor,  # [L]
    gen_log_probs: Tensor,  # [L]
    response_mask: Tensor,  # [L]
    norm: str = "l2",
) -> Tensor:  # [] float32
    """Policy Drift of one ragged group (0-d tensor)."""
    _check_norm(norm)
    _check_flat_tokens(log_probs, response_mask, gen_log_probs)
    d, _, _ = _drift_kl_one(log_probs, gen_log_probs, _valid(response_mask), norm)
    return torch.tensor(d, dtype=_OUT, device=log_probs.device)


def replay_kl_flat(
    log_probs: Tensor,  # [L]
    gen_log_probs: Tensor,  # [L]
    response_mask: Tensor,  # [L]
) -> Tensor:  # [] float32
    """Replay KL of one ragged group (0-d tensor)."""
    _check_flat_tokens(log_probs, response_mask, gen_log_probs)
    _, kl, _ = _drift_kl_one(log_probs, gen_log_probs, _valid(response_mask), "l2")
    return torch.tensor(kl, dtype=_OUT, device=log_probs.device)


@dataclass(frozen=True)
class GroupScores:
    """Everything a scan needs about one group, as Python floats holding float32 values."""

    headroom: float  # H(g; l_theta)
    drift: float  # D(g) under the chosen norm (may be inf for a -inf log-prob)
    replay_kl: float  # k3 mean over valid tokens
    num_valid_tokens: int  # N_g


def group_scores_flat(
    log_probs: Tensor,  # [L] current-policy log-probs of one group
    gen_log_probs: Tensor,  # [L]
    response_mask: Tensor,  # [L]
    response_lengths: Tensor,  # [n], sum = L
    advantages: Tensor,  # [n]
    weighting: str = "sign",
    norm: str = "l2",
    *,
    validate: bool = True,
) -> GroupScores:
    """Headroom, drift and replay KL of one ragged group in one pass.

    Bit-identical to :func:`headroom_flat`, :func:`policy_drift_flat` and
    :func:`replay_kl_flat` (same kernels). ``validate=False`` skips the shape checks for
    callers that already guarantee them (the buffer: ReplayGroup validates its own layout and
    the scorer output length is checked). NaN at a valid position raises ValueError.
    """
    _check_weighting(weighting)
    _check_norm(norm)
    if validate:
        _check_flat_tokens(log_probs, response_mask, gen_log_probs)
        _check_lengths("response_lengths", response_lengths, log_probs.numel(), "log_probs")
        _check_advantages_1d(advantages, response_lengths.numel())
    valid = _valid(response_mask)
    h = _headroom_one(log_probs, valid, response_lengths, advantages, weighting)
    drift, kl, count = _drift_kl_one(log_probs, gen_log_probs, valid, norm)
    if math.isnan(h) or math.isnan(drift):
        raise ValueError("log_probs contain NaN at valid response positions")
    return GroupScores(headroom=h, drift=drift, replay_kl=kl, num_valid_tokens=count)
