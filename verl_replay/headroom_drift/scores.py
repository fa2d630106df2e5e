"""Headroom, Policy Drift and replay KL (SPEC section 1.1 and 1.2).

Two layouts are supported:

* padded: ``[G, n, T]`` token tensors with a ``[G, n, T]`` response mask and ``[G, n]``
  response-level advantages (what a verl batch looks like after grouping by uid);
* ragged ("flat"): the responses of one group concatenated without padding, ``[L]`` with
  ``L = sum(response_lengths)``, which is how :class:`~verl_replay.headroom_drift.buffer.
  ReplayGroup` stores them. The ``*_segments`` functions score a chunk of such groups in one
  call with segment sums; the ``*_flat`` functions score one group.

Every function masks *before* any arithmetic (``torch.where`` on the inputs), so padded or
masked positions may hold anything (inf, nan, garbage) without changing a result. Arithmetic
runs in float64 and results are returned as float32 on the input device.

Degenerate cases (documented choices):

* a response with no valid token carries no direction and is left out of Headroom, like a
  response with ``A_i == 0``;
* a group with no directional response has Headroom 0 (SPEC 1.1);
* a group with no valid token has drift 0 and replay KL 0 (nothing to be incompatible with).

Determinism: each result is a pure function of its own group's values. The buffer scores
one group at a time through :func:`group_scores_flat`, so a group's numbers do not depend on
which other groups shared a scan chunk (vectorised ``exp`` takes different code paths for a
tensor's tail elements, so concatenating groups could change the last bits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
DRIFT_NORMS: tuple[str, ...] = ("l2", "l1")

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
        raise ValueError(
            f"{name} must have the same shape as {ref_name} {tuple(ref.shape)}, "
            f"got {tuple(x.shape)}"
        )


def _check_lengths(name: str, lengths: Tensor, total: int, total_name: str) -> None:
    _check_tensor(name, lengths, 1)
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {lengths.dtype}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"{name} must be non-negative")
    if int(lengths.sum()) != total:
        raise ValueError(
            f"{name} must sum to the length of {total_name} ({total}), got {int(lengths.sum())}"
        )


# --------------------------------------------------------------------------- core kernels


def _valid(mask: Tensor) -> Tensor:
    """Boolean validity of a mask given as bool / int / float (non-zero = valid)."""
    return mask if mask.dtype == torch.bool else mask != 0


def _token_headroom(log_probs: Tensor, valid: Tensor, token_adv: Tensor) -> Tensor:
    """Per-token h in float64, 0 where invalid or where the response has no direction.

    ``log_probs`` values at invalid positions never reach ``exp`` (masked first). p is
    clamped to [0, 1] so that numerically positive log-probs cannot push h out of [0, 1].
    """
    lp = torch.where(valid, log_probs.to(_WORK), torch.zeros((), dtype=_WORK, device=valid.device))
    p = torch.exp(lp).clamp_(0.0, 1.0)
    h = torch.where(token_adv > 0, 1.0 - p, torch.where(token_adv < 0, p, torch.zeros_like(p)))
    return torch.where(valid, h, torch.zeros_like(h))


def _combine_headroom(
    h_sum: Tensor, count: Tensor, adv: Tensor, weighting: str
) -> tuple[Tensor, Tensor]:
    """Per-response weighted numerators/weights: (w_i * mean_t h_i, w_i), both float64 [R].

    Responses with A_i == 0 (or NaN) or without valid tokens get weight 0.
    """
    adv = adv.to(_WORK)
    directional = ((adv > 0) | (adv < 0)) & (count > 0)
    if weighting == "sign":
        w = directional.to(_WORK)
    else:
        w = torch.where(directional, adv.abs(), torch.zeros_like(adv))
    mean_h = h_sum / count.clamp(min=1).to(_WORK)
    return w * mean_h, w


def _ratio_or_zero(num: Tensor, den: Tensor) -> Tensor:
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, num / safe, torch.zeros_like(num))


def _log_ratio(log_probs: Tensor, gen_log_probs: Tensor, valid: Tensor) -> Tensor:
    """r = l_theta - l_gen in float64 with 0 at invalid positions (masked before subtracting)."""
    zero = torch.zeros((), dtype=_WORK, device=valid.device)
    lt = torch.where(valid, log_probs.to(_WORK), zero)
    lg = torch.where(valid, gen_log_probs.to(_WORK), zero)
    return lt - lg


def _drift_from_sums(sq_sum: Tensor, abs_sum: Tensor, count: Tensor, norm: str) -> Tensor:
    if norm == "l2":
        return torch.sqrt(_ratio_or_zero(sq_sum, count.to(_WORK)))
    return _ratio_or_zero(abs_sum, count.to(_WORK))


def _k3(r: Tensor) -> Tensor:
    # exp(r) - 1 - r computed as expm1(r) - r: exact near r = 0 where the replay KL of a
    # "moderate" gate lives (~1e-3), instead of cancelling two O(1) terms.
    return torch.expm1(r) - r


def _segment_sum(values: Tensor, seg_ids: Tensor, num_segments: int) -> Tensor:
    out = torch.zeros(num_segments, dtype=values.dtype, device=values.device)
    return out.index_add_(0, seg_ids, values)


def _segment_ids(lengths: Tensor, device: torch.device) -> Tensor:
    lengths = lengths.to(device=device, dtype=torch.long)
    total = int(lengths.sum())  # known size: no second pass inside repeat_interleave
    return torch.repeat_interleave(
        torch.arange(lengths.numel(), device=device), lengths, output_size=total
    )


# --------------------------------------------------------------------------- padded API


def headroom(
    log_probs: Tensor,  # [G, n, T] log-probs of the stored tokens under some policy
    response_mask: Tensor,  # [G, n, T] 1 = valid response token
    advantages: Tensor,  # [G, n] response-level advantages A_i
    weighting: str = "sign",
) -> Tensor:  # [G] float32, in [0, 1]
    """Headroom H(g; l) of each group (SPEC 1.1).

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
            f"advantages must have shape [G, n] = {tuple(log_probs.shape[:2])}, "
            f"got {tuple(advantages.shape)}"
        )
    valid = _valid(response_mask)
    adv = advantages.to(device=log_probs.device, dtype=_WORK)
    h = _token_headroom(log_probs, valid, adv.unsqueeze(-1))  # [G, n, T]
    h_sum = h.sum(dim=-1)  # [G, n]
    count = valid.sum(dim=-1)  # [G, n]
    num, w = _combine_headroom(h_sum, count, adv, weighting)  # [G, n]
    return _ratio_or_zero(num.sum(dim=-1), w.sum(dim=-1)).to(_OUT)


def _padded_drift_sums(
    log_probs: Tensor, gen_log_probs: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """(r [G, n*T] with zeros at invalid positions, valid count [G])."""
    _check_tensor("log_probs", log_probs, 3)
    _check_float("log_probs", log_probs)
    _check_tensor("gen_log_probs", gen_log_probs, 3)
    _check_float("gen_log_probs", gen_log_probs)
    _check_same_shape("gen_log_probs", gen_log_probs, "log_probs", log_probs)
    _check_tensor("response_mask", response_mask, 3)
    _check_same_shape("response_mask", response_mask, "log_probs", log_probs)
    valid = _valid(response_mask).flatten(1)  # [G, n*T]
    r = _log_ratio(log_probs.flatten(1), gen_log_probs.flatten(1), valid)
    return r, valid.sum(dim=-1)


def policy_drift(
    log_probs: Tensor,  # [G, n, T] current-policy log-probs l_theta
    gen_log_probs: Tensor,  # [G, n, T] generation-time log-probs l_gen
    response_mask: Tensor,  # [G, n, T]
    norm: str = "l2",
) -> Tensor:  # [G] float32, >= 0
    """Policy Drift of each group over all its valid tokens (SPEC 1.2).

    ``l2``: sqrt(mean r^2); ``l1``: mean |r|; r = l_theta - l_gen. 0 for a group without tokens.
    """
    _check_norm(norm)
    r, count = _padded_drift_sums(log_probs, gen_log_probs, response_mask)
    return _drift_from_sums((r * r).sum(-1), r.abs().sum(-1), count, norm).to(_OUT)


def replay_kl(
    log_probs: Tensor,  # [G, n, T] current-policy log-probs l_theta
    gen_log_probs: Tensor,  # [G, n, T] generation-time log-probs l_gen
    response_mask: Tensor,  # [G, n, T]
) -> Tensor:  # [G] float32, >= 0
    """k3 = exp(r) - 1 - r averaged over each group's valid tokens (estimates KL(gen || theta))."""
    r, count = _padded_drift_sums(log_probs, gen_log_probs, response_mask)
    k3 = _k3(r)  # 0 at invalid positions since r = 0 there
    return _ratio_or_zero(k3.sum(-1), count.to(_WORK)).to(_OUT)


# --------------------------------------------------------------------------- ragged API


def _check_flat_tokens(
    log_probs: Tensor, response_mask: Tensor, gen_log_probs: Tensor | None = None
) -> None:
    _check_tensor("log_probs", log_probs, 1)
    _check_float("log_probs", log_probs)
    _check_tensor("response_mask", response_mask, 1)
    _check_same_shape("response_mask", response_mask, "log_probs", log_probs)
    if gen_log_probs is not None:
        _check_tensor("gen_log_probs", gen_log_probs, 1)
        _check_float("gen_log_probs", gen_log_probs)
        _check_same_shape("gen_log_probs", gen_log_probs, "log_probs", log_probs)


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
    _check_tensor("advantages", advantages, 1)
    if advantages.numel() != response_lengths.numel():
        raise ValueError(
            f"advantages must have one entry per response ({response_lengths.numel()}), "
            f"got {advantages.numel()}"
        )
    _check_lengths("group_sizes", group_sizes, response_lengths.numel(), "response_lengths")
    device = log_probs.device
    num_resp = response_lengths.numel()
    tok_resp = _segment_ids(response_lengths, device)  # [L] response index of each token
    valid = _valid(response_mask)
    adv = advantages.to(device=device, dtype=_WORK)  # [R]
    h = _token_headroom(log_probs, valid, adv[tok_resp])  # [L]
    h_sum = _segment_sum(h, tok_resp, num_resp)  # [R]
    count = _segment_sum(valid.to(_WORK), tok_resp, num_resp)  # [R]
    num, w = _combine_headroom(h_sum, count, adv, weighting)  # [R]
    resp_group = _segment_ids(group_sizes, device)  # [R]
    num_groups = group_sizes.numel()
    g_num = _segment_sum(num, resp_group, num_groups)
    g_w = _segment_sum(w, resp_group, num_groups)
    return _ratio_or_zero(g_num, g_w).to(_OUT)


def _segment_drift_sums(
    log_probs: Tensor, gen_log_probs: Tensor, response_mask: Tensor, group_token_counts: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per group float64 sums (r^2, |r|, k3, valid count) and the token->group ids."""
    _check_flat_tokens(log_probs, response_mask, gen_log_probs)
    _check_lengths("group_token_counts", group_token_counts, log_probs.numel(), "log_probs")
    device = log_probs.device
    num_groups = group_token_counts.numel()
    tok_group = _segment_ids(group_token_counts, device)  # [L]
    valid = _valid(response_mask)
    r = _log_ratio(log_probs, gen_log_probs, valid)  # [L], 0 where invalid
    sq = _segment_sum(r * r, tok_group, num_groups)
    ab = _segment_sum(r.abs(), tok_group, num_groups)
    k3 = _segment_sum(_k3(r), tok_group, num_groups)
    count = _segment_sum(valid.to(_WORK), tok_group, num_groups)
    return sq, ab, k3, count, tok_group


def policy_drift_segments(
    log_probs: Tensor,  # [L] current-policy log-probs, concatenated groups
    gen_log_probs: Tensor,  # [L]
    response_mask: Tensor,  # [L]
    group_token_counts: Tensor,  # [G] tokens per group (incl. masked ones), sum = L
    norm: str = "l2",
) -> Tensor:  # [G] float32
    """Policy Drift of a chunk of ragged groups via segment sums."""
    _check_norm(norm)
    sq, ab, _, count, _ = _segment_drift_sums(
        log_probs, gen_log_probs, response_mask, group_token_counts
    )
    return _drift_from_sums(sq, ab, count, norm).to(_OUT)


def replay_kl_segments(
    log_probs: Tensor,  # [L]
    gen_log_probs: Tensor,  # [L]
    response_mask: Tensor,  # [L]
    group_token_counts: Tensor,  # [G], sum = L
) -> Tensor:  # [G] float32
    """Replay KL (k3 token mean) of a chunk of ragged groups via segment sums."""
    _, _, k3, count, _ = _segment_drift_sums(
        log_probs, gen_log_probs, response_mask, group_token_counts
    )
    return _ratio_or_zero(k3, count).to(_OUT)


def _flat_response_headroom(
    log_probs: Tensor, response_mask: Tensor, response_lengths: Tensor, advantages: Tensor,
    weighting: str,
) -> Tensor:
    """Headroom of one ragged group as a float64 0-d tensor (shared by the flat functions)."""
    _check_weighting(weighting)
    _check_flat_tokens(log_probs, response_mask)
    _check_lengths("response_lengths", response_lengths, log_probs.numel(), "log_probs")
    _check_tensor("advantages", advantages, 1)
    if advantages.numel() != response_lengths.numel():
        raise ValueError(
            f"advantages must have one entry per response ({response_lengths.numel()}), "
            f"got {advantages.numel()}"
        )
    device = log_probs.device
    num_resp = response_lengths.numel()
    tok_resp = _segment_ids(response_lengths, device)  # [L]
    valid = _valid(response_mask)
    adv = advantages.to(device=device, dtype=_WORK)  # [n]
    h = _token_headroom(log_probs, valid, adv[tok_resp])  # [L]
    h_sum = _segment_sum(h, tok_resp, num_resp)  # [n]
    count = _segment_sum(valid.to(_WORK), tok_resp, num_resp)  # [n]
    num, w = _combine_headroom(h_sum, count, adv, weighting)  # [n]
    return _ratio_or_zero(num.sum(), w.sum())


def _flat_drift_sums(
    log_probs: Tensor, gen_log_probs: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """(r [L] float64 with 0 at invalid positions, valid token count as float64 0-d)."""
    _check_flat_tokens(log_probs, response_mask, gen_log_probs)
    valid = _valid(response_mask)
    r = _log_ratio(log_probs, gen_log_probs, valid)
    return r, valid.sum().to(_WORK)


def headroom_flat(
    log_probs: Tensor,  # [L] one group's concatenated responses
    response_mask: Tensor,  # [L]
    response_lengths: Tensor,  # [n], sum = L
    advantages: Tensor,  # [n]
    weighting: str = "sign",
) -> Tensor:  # [] float32
    """Headroom of one ragged group (0-d tensor)."""
    return _flat_response_headroom(
        log_probs, response_mask, response_lengths, advantages, weighting
    ).to(_OUT)


def policy_drift_flat(
    log_probs: Tensor,  # [L]
    gen_log_probs: Tensor,  # [L]
    response_mask: Tensor,  # [L]
    norm: str = "l2",
) -> Tensor:  # [] float32
    """Policy Drift of one ragged group (0-d tensor)."""
    _check_norm(norm)
    r, count = _flat_drift_sums(log_probs, gen_log_probs, response_mask)
    return _drift_from_sums((r * r).sum(), r.abs().sum(), count, norm).to(_OUT)


def replay_kl_flat(
    log_probs: Tensor,  # [L]
    gen_log_probs: Tensor,  # [L]
    response_mask: Tensor,  # [L]
) -> Tensor:  # [] float32
    """Replay KL of one ragged group (0-d tensor)."""
    r, count = _flat_drift_sums(log_probs, gen_log_probs, response_mask)
    return _ratio_or_zero(_k3(r).sum(), count).to(_OUT)


@dataclass(frozen=True)
class GroupScores:
    """Everything a scan needs about one group, as Python floats (float32-rounded)."""

    headroom: float  # H(g; l_theta)
    drift: float  # D(g) under the chosen norm
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
) -> GroupScores:
    """Headroom, drift and replay KL of one ragged group in one pass.

    Returns exactly the values of :func:`headroom_flat`, :func:`policy_drift_flat` and
    :func:`replay_kl_flat` (same kernels, same shapes), so callers may mix them.
    """
    _check_norm(norm)
    h = headroom_flat(log_probs, response_mask, response_lengths, advantages, weighting)
    r, count = _flat_drift_sums(log_probs, gen_log_probs, response_mask)
    drift = _drift_from_sums((r * r).sum(), r.abs().sum(), count, norm).to(_OUT)
    kl = _ratio_or_zero(_k3(r).sum(), count).to(_OUT)
    h_val = float(h)
    if math.isnan(h_val):
        raise ValueError("log_probs contain NaN at valid response positions")
    return GroupScores(
        headroom=h_val,
        drift=float(drift),
        replay_kl=float(kl),
        num_valid_tokens=int(count),
    )
