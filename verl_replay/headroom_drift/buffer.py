"""Replay buffers for GRPO groups: Headroom-Drift (SPEC 1.3-1.5) and a naive recency baseline.

Data layout
-----------
A :class:`ReplayGroup` stores one whole GRPO group without padding: the responses are
concatenated into flat ``[L]`` tensors (``L = sum(response_lengths)``) and all per-token data
(ids, mask, generation-time log-probs) share that layout.

Scorer contract (:meth:`HeadroomDriftBuffer.select`)
-----------------------------------------------------
``scorer(groups: list[ReplayGroup]) -> list[Tensor]`` returns, for each group in order, the
*current* policy's teacher-forced log-probs of ``group.response_ids`` as a 1-D floating tensor
of length ``group.num_tokens`` in the same flat layout as ``group.gen_log_probs`` (any device;
values at masked positions are ignored). It is called once per scan chunk with at most
``scan_chunk_groups`` groups and must not modify them. A chunked scan equals a one-by-one scan
provided that a group's log-probs do not depend on which groups share its chunk.

Complexity
----------
Ranking lives in a binary heap of entries ``(-cached_H, -birth_step, insert_seq, group_id)``
with lazy invalidation: ``self._live[group_id]`` is the group's one valid entry; refreshed or
evicted groups leave stale entries that are dropped when popped, and the heap is rebuilt from
the live entries when stale ones outnumber live ones (O(N) after at least N stale entries were
created, i.e. amortised O(1) per refresh/eviction). A selection pops the scanned groups
(plus the unused tail of the last chunk) and pushes them back: O((scanned + chunk) log N)
amortised. FIFO order is an ``OrderedDict`` (O(1) append and evict-oldest). Nothing per step
touches all N groups.

Statistics (``SelectionResult.stats``; keys without the ``replay/`` prefix, all floats)
-------------------------------------------------------------------------------------
``buffer_size``, ``candidates`` (groups in the buffer when the step starts; equal at select
time), ``scanned``, ``accepted``, ``rejected_drift`` (scanned - accepted), ``fill_ratio``
(accepted / K_rep), ``acceptance_rate`` (accepted / scanned), ``scan_depth`` (1-based rank, in
the cached-Headroom order at the start of the step, of the last scanned group; since the scan
walks that order without skipping it equals ``scanned``), ``scan_depth_frac`` (scan_depth /
candidates), ``drift_scanned/{mean,p50,p90}``, ``drift_accepted/{mean,p50,p90}``,
``headroom_cached_accepted/mean`` (ranking key before the scan), ``headroom_refreshed_accepted/
mean`` (H under the current policy), ``replay_kl_accepted/mean`` (k3 averaged over all valid
tokens of the accepted groups, token-weighted), ``age_accepted/{mean,max}`` (steps since
birth), ``replay_tokens`` (valid tokens of the accepted groups, for the replay token share),
``select_seconds`` (whole call) and ``scan_forward_seconds`` (inside scorer calls).
Percentiles interpolate linearly (numpy default). Ingress/eviction counts come from ``admit``.
The naive buffer reports the same keys minus the drift/KL/refreshed-Headroom ones.

Empty sets: aggregates over an empty set (e.g. ``drift_accepted/mean`` when nothing was
accepted) are 0.0, and ratios with a zero denominator are 0.0; read them with the count
(``scanned``, ``accepted``). Values are NaN-free; drift can be ``inf`` when the scorer gives a
stored token log-prob -inf.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from verl_replay.headroom_drift.events import evict_record, ingress_record, scan_record
from verl_replay.headroom_drift.scores import (
    DRIFT_NORMS,
    WEIGHTINGS,
    group_scores_flat,
    headroom_flat,
)

__all__ = [
    "INGRESS_CRITERIA",
    "HeadroomDriftBuffer",
    "NaiveReplayBuffer",
    "ReplayGroup",
    "ScanRecord",
    "Scorer",
    "SelectionResult",
]

INGRESS_CRITERIA: tuple[str, ...] = ("answer_disagree", "nonzero_advantage")

Scorer = Callable[[list["ReplayGroup"]], Sequence[Tensor]]

_FILE_MAGIC = b"VERL-REPLAY-BUFFER v1\n"
_STATE_FORMAT = 1


# ============================================================================ ReplayGroup


def _as_1d(name: str, x: Any, dtype: torch.dtype) -> Tensor:
    """1-D contiguous CPU tensor of ``dtype``; no copy when ``x`` already is one."""
    t = x if isinstance(x, Tensor) else torch.as_tensor(x)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype != dtype or t.device.type != "cpu":
        t = t.to(device="cpu", dtype=dtype)
    if t.requires_grad:
        t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def _response_level(token_adv: Tensor, valid: Tensor) -> Tensor:
    """[n, T] token advantages -> [n]: the value at each response's first valid token (0 if none).

    GRPO broadcasts A_i over a response's tokens, so any valid token carries it.
    """
    n, T = token_adv.shape
    out = torch.zeros(n, dtype=token_adv.dtype)
    has = valid.any(dim=1)  # [n]
    if bool(has.any()):
        first = valid.to(torch.int8).argmax(dim=1)  # [n] first True (0 when none)
        out = torch.where(has, token_adv.gather(1, first[:, None])[:, 0], out)
    return out


_PLAIN = (type(None), bool, int, float, str)


def _check_meta(value: Any, where: str) -> None:
    """meta must survive ``torch.load(weights_only=True)``: plain Python types and tensors."""
    if isinstance(value, _PLAIN) or isinstance(value, Tensor):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_meta(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"meta keys must be str, got {k!r} at {where}")
            _check_meta(v, f"{where}[{k!r}]")
        return
    raise ValueError(
        f"meta values must be None/bool/int/float/str/list/tuple/dict/Tensor, got "
        f"{type(value).__name__} at {where} (convert numpy scalars with .item())"
    )


@dataclass(eq=False)
class ReplayGroup:
    """One whole GRPO group (prompt + n responses), stored compactly without padding.

    The constructor takes ownership of the tensors it is given (converting dtypes/devices when
    needed, without copying otherwise); :meth:`from_padded` copies. ``gen_log_probs`` and
    ``advantages`` are the immutable replay anchor: the buffer never writes to them, and callers
    must not either. The bookkeeping fields below ``meta`` are owned by the buffer.
    """

    prompt_ids: Tensor  # [P] int32, prompt without padding
    response_ids: Tensor  # [L] int32, responses concatenated, L = sum(response_lengths)
    response_lengths: Tensor  # [n] int64, tokens of each response (incl. masked tool tokens)
    response_mask: Tensor  # [L] bool, True = token trained on / scored
    gen_log_probs: Tensor  # [L] float32, generation-time log-probs l_gen (anchor)
    advantages: Tensor  # [n] float32, stored response-level GRPO advantages A_i
    correct: Tensor  # [n] bool, answer-correctness bits c_i
    scores: Tensor  # [n] float32, rewards as scored at generation time
    meta: dict[str, Any] = field(default_factory=dict)  # opaque per-group data (plain types)
    group_id: int = -1  # assigned by the buffer at ingress (monotonic)
    birth_step: int = -1  # training step of ingress
    insert_seq: int = -1  # insertion sequence number (tie-break: earlier first)
    headroom_ref: float = 0.0  # H_ref = H(g; l_gen), computed at ingress
    headroom_cached: float = 0.0  # ranking key; H_ref, then H(g; l_theta) at each scan
    replay_count: int = 0  # times accepted for replay

    def __post_init__(self) -> None:
        self.prompt_ids = _as_1d("prompt_ids", self.prompt_ids, torch.int32)
        self.response_ids = _as_1d("response_ids", self.response_ids, torch.int32)
        self.response_lengths = _as_1d("response_lengths", self.response_lengths, torch.int64)
        self.response_mask = _as_1d("response_mask", self.response_mask, torch.bool)
        if not torch.as_tensor(self.gen_log_probs).is_floating_point():
            raise ValueError("gen_log_probs must be a floating-point tensor")
        self.gen_log_probs = _as_1d("gen_log_probs", self.gen_log_probs, torch.float32)
        self.advantages = _as_1d("advantages", self.advantages, torch.float32)
        self.correct = _as_1d("correct", self.correct, torch.bool)
        self.scores = _as_1d("scores", self.scores, torch.float32)
        lengths = self.response_lengths.tolist()
        n = len(lengths)
        if n == 0:
            raise ValueError("a group needs at least one response (response_lengths is empty)")
        if min(lengths) < 0:
            raise ValueError("response_lengths must be non-negative")
        total = sum(lengths)
        for name in ("response_ids", "response_mask", "gen_log_probs"):
            if getattr(self, name).numel() != total:
                raise ValueError(
                    f"{name} must have sum(response_lengths) = {total} entries, "
                    f"got {getattr(self, name).numel()}"
                )
        for name in ("advantages", "correct", "scores"):
            if getattr(self, name).numel() != n:
                got = getattr(self, name).numel()
                raise ValueError(f"{name} must have one entry per response ({n}), got {got}")
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a dict, got {type(self.meta).__name__}")
        _check_meta(self.meta, "meta")

    # -- sizes -----------------------------------------------------------------------------

    @property
    def n(self) -> int:
        return self.response_lengths.numel()

    @property
    def num_tokens(self) -> int:
        """L: response tokens including masked ones (length of the scorer's output)."""
        return self.response_ids.numel()

    @property
    def num_valid_tokens(self) -> int:
        return int(self.response_mask.sum())

    @property
    def num_correct(self) -> int:
        return int(self.correct.sum())

    @property
    def nbytes(self) -> int:
        tensors = (self.prompt_ids, self.response_ids, self.response_lengths, self.response_mask,
                   self.gen_log_probs, self.advantages, self.correct, self.scores)
        return sum(t.numel() * t.element_size() for t in tensors)

    def response_offsets(self) -> Tensor:  # [n + 1] int64: response i is [off[i], off[i+1])
        return torch.cat([torch.zeros(1, dtype=torch.int64), self.response_lengths.cumsum(0)])

    # -- padded conversion -------------------------------------------------------------------

    @classmethod
    def from_padded(
        cls,
        *,
        prompt_ids: Tensor,  # [P] or [P_pad] with prompt_mask
        response_ids: Tensor,  # [n, T] right-padded responses
        response_mask: Tensor,  # [n, T] 1 = valid (tool tokens inside a response may be 0)
        gen_log_probs: Tensor,  # [n, T]
        advantages: Tensor,  # [n] response-level, or [n, T] token-level (value of 1st valid token)
        correct: Tensor,  # [n]
        scores: Tensor | None = None,  # [n]; defaults to correct as float
        response_lengths: Tensor | None = None,  # [n]; default: last valid position + 1
        prompt_mask: Tensor | None = None,  # [P_pad] 1 = real prompt token (drops padding)
        meta: dict[str, Any] | None = None,
    ) -> ReplayGroup:
        """Build a group from padded per-response tensors (copies everything).

        Without ``response_lengths`` a response ends at its last valid token; trailing masked
        tokens carry no loss and, being last, cannot influence earlier tokens' log-probs, so
        dropping them changes nothing the buffer computes. Pass the attention-mask lengths to
        keep them anyway.
        """
        if response_ids.dim() != 2:
            raise ValueError(f"response_ids must be [n, T], got shape {tuple(response_ids.shape)}")
        n, T = response_ids.shape
        for name, t in (("response_mask", response_mask), ("gen_log_probs", gen_log_probs)):
            if tuple(t.shape) != (n, T):
                raise ValueError(f"{name} must have shape [n, T] = {(n, T)}, got {tuple(t.shape)}")
        valid = (response_mask != 0).cpu()  # [n, T]
        if response_lengths is None:
            pos = torch.arange(1, T + 1).expand(n, T)  # [n, T] 1-based positions
            lengths = torch.where(valid, pos, torch.zeros_like(pos)).amax(dim=1)  # [n]
        else:
            lengths = torch.as_tensor(response_lengths).cpu().to(torch.int64).reshape(-1)
            bad_range = lengths.numel() > 0 and (lengths.min() < 0 or lengths.max() > T)
            if lengths.numel() != n or bad_range:
                raise ValueError(f"response_lengths must be [n] = [{n}] values in [0, {T}]")
            beyond = valid & (torch.arange(T).expand(n, T) >= lengths[:, None])
            if bool(beyond.any()):
                raise ValueError("response_mask has valid tokens beyond response_lengths")
        keep = torch.arange(T).expand(n, T) < lengths[:, None]  # [n, T] row-major = concat order
        adv = torch.as_tensor(advantages).detach().cpu()
        if adv.dim() == 2:
            if tuple(adv.shape) != (n, T):
                raise ValueError(f"token-level advantages must be [n, T] = {(n, T)}")
            adv = _response_level(adv, valid)
        elif adv.dim() != 1 or adv.numel() != n:
            raise ValueError(f"advantages must be [n] or [n, T], got shape {tuple(adv.shape)}")
        p_ids = torch.as_tensor(prompt_ids).detach().cpu().reshape(-1)
        if prompt_mask is not None:
            pm = torch.as_tensor(prompt_mask).cpu().reshape(-1)
            if pm.numel() != p_ids.numel():
                raise ValueError("prompt_mask must have the same length as prompt_ids")
            p_ids = p_ids[pm != 0]
        corr = torch.as_tensor(correct).detach().cpu().reshape(-1)
        return cls(
            prompt_ids=p_ids.clone(),
            response_ids=response_ids.detach().cpu()[keep].clone(),
            response_lengths=lengths.clone(),
            response_mask=valid[keep].clone(),
            gen_log_probs=gen_log_probs.detach().cpu().float()[keep].clone(),
            advantages=adv.float().clone(),
            correct=(corr != 0).clone(),
            scores=(corr.float() if scores is None
                    else torch.as_tensor(scores).detach().cpu().float().reshape(-1)).clone(),
            meta=dict(meta or {}),
        )

    def to_padded(self, pad_to: int | None = None, pad_token_id: int = 0) -> dict[str, Tensor]:
        """Right-padded per-response tensors (new tensors; padding is 0 / ``pad_token_id``).

        Returns ``prompt_ids [P] int64``, ``response_ids [n, T] int64``, ``response_mask
        [n, T] bool``, ``attention_mask [n, T] int64`` (positions < length),
        ``gen_log_probs [n, T] float32``, ``token_advantages [n, T] float32`` (A_i on valid
        tokens), ``advantages [n]``, ``correct [n]``, ``scores [n]``, ``response_lengths [n]``;
        T = ``pad_to`` or the longest response.
        """
        n = self.n
        longest = int(self.response_lengths.max()) if n else 0
        T = longest if pad_to is None else int(pad_to)
        if T < longest:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest response ({longest})")
        keep = torch.arange(T).expand(n, T) < self.response_lengths[:, None]  # [n, T]

        def scatter(values: Tensor, fill: Any, dtype: torch.dtype) -> Tensor:
            out = torch.full((n, T), fill, dtype=dtype)
            out[keep] = values.to(dtype)
            return out

        mask = scatter(self.response_mask, False, torch.bool)
        return {
            "prompt_ids": self.prompt_ids.to(torch.int64),
            "response_ids": scatter(self.response_ids, pad_token_id, torch.int64),
            "response_mask": mask,
            "attention_mask": keep.to(torch.int64),
            "gen_log_probs": scatter(self.gen_log_probs, 0.0, torch.float32),
            "token_advantages": torch.where(mask, self.advantages[:, None], 0.0).float(),
            "advantages": self.advantages.clone(),
            "correct": self.correct.clone(),
            "scores": self.scores.clone(),
            "response_lengths": self.response_lengths.clone(),
        }


# ============================================================================ results


@dataclass(frozen=True)
class ScanRecord:
    """What one scan step learned about one group."""

    group_id: int
    rank: int  # 1-based position in the cached-Headroom order at the start of the step
    birth_step: int
    age: int  # step - birth_step
    headroom_before: float  # cached Headroom used for ranking
    headroom_after: float | None  # refreshed H(g; l_theta); None = not refreshed (naive buffer)
    drift: float | None  # D(g); None = not measured (naive buffer)
    replay_kl: float | None  # k3 token mean; None = not measured (naive buffer)
    num_valid_tokens: int
    accepted: bool


@dataclass
class SelectionResult:
    """Outcome of one ``select`` call."""

    step: int
    groups: list[ReplayGroup]  # accepted groups, acceptance order (= rank order)
    records: list[ScanRecord]  # every scanned group, rank order
    stats: dict[str, float]  # SPEC 1.5 metrics without the "replay/" prefix
    scorer_calls: int = 0  # forward chunks used (depends on the chunk size)
    scored_groups: int = 0  # groups given to the scorer (>= scanned: unused last-chunk tail)

    @property
    def accepted_ids(self) -> list[int]:
        return [g.group_id for g in self.groups]

    def events(self) -> list[dict[str, Any]]:
        """``scan`` event records for :class:`~verl_replay.headroom_drift.events.ReplayEventLog`."""
        return [
            scan_record(
                step=self.step, group_id=r.group_id, rank=r.rank, drift=r.drift,
                replay_kl=r.replay_kl, headroom_before=r.headroom_before,
                headroom_after=r.headroom_after, accepted=r.accepted, age=r.age,
                birth_step=r.birth_step,
            )
            for r in self.records
        ]


def _num(x: float | None) -> float:
    if x is None:
        raise AssertionError("a scored record lacks a measured value")
    return x


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else 0.0


def _pct(xs: Sequence[float], q: float) -> float:
    """Percentile with linear interpolation between order statistics (numpy's default method),
    0.0 for an empty set. Written out because numpy returns NaN as soon as an inf is involved,
    and drift is legitimately inf for a token the current policy gives probability 0."""
    if not len(xs):
        return 0.0
    v = sorted(xs)
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    frac = pos - lo
    if frac == 0.0 or v[lo] == v[hi]:
        return float(v[lo])
    return float(v[lo] + (v[hi] - v[lo]) * frac)


def _accepted_stats(records: Sequence[ScanRecord], k_rep: int) -> dict[str, float]:
    acc = [r for r in records if r.accepted]
    tokens = sum(r.num_valid_tokens for r in acc)
    ages = [float(r.age) for r in acc]
    return {
        "accepted": float(len(acc)),
        "fill_ratio": len(acc) / k_rep,
        "headroom_cached_accepted/mean": _mean([r.headroom_before for r in acc]),
        "age_accepted/mean": _mean(ages),
        "age_accepted/max": max(ages) if ages else 0.0,
        "replay_tokens": float(tokens),
    }


# ============================================================================ shared store


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return str(value)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _FifoReplayStore:
    """Ingress, FIFO eviction, lookup and persistence shared by both buffers."""

    _KIND = "base"

    def __init__(self, *, capacity: int, k_rep: int, ingress: str, weighting: str) -> None:
        self.capacity = _check_int("capacity", capacity, 1)
        self.k_rep = _check_int("k_rep", k_rep, 1)
        self.ingress = _check_choice("ingress", ingress, INGRESS_CRITERIA)
        self.weighting = _check_choice("weighting", weighting, WEIGHTINGS)
        self._groups: OrderedDict[int, ReplayGroup] = OrderedDict()  # FIFO: oldest first
        self._next_group_id = 0
        self._next_insert_seq = 0

    # -- container protocol ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[ReplayGroup]:
        """Groups in FIFO order, oldest first."""
        return iter(list(self._groups.values()))

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._groups

    @property
    def groups_by_id(self) -> Mapping[int, ReplayGroup]:
        """Read-only live view ``group_id -> ReplayGroup`` (FIFO order)."""
        return MappingProxyType(self._groups)

    def config(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "k_rep": self.k_rep, "ingress": self.ingress,
                "weighting": self.weighting}

    # -- ingress -------------------------------------------------------------------------------

    def passes_ingress(self, group: ReplayGroup) -> bool:
        """SPEC 1.4: answers disagree (0 < sum c_i < n), or some A_i != 0."""
        if self.ingress == "answer_disagree":
            return 0 < group.num_correct < group.n
        adv = group.advantages
        return bool(((adv > 0) | (adv < 0)).any())

    def admit(self, groups: Sequence[ReplayGroup], step: int) -> dict[str, Any]:
        """Ingress after the update (SPEC 1.4); evicts the oldest groups beyond capacity.

        Returns ``{"ingress", "rejected_ingress", "evicted", "buffer_size"}`` (ints) and
        ``"events"``: ingress/evict records for the event log. All groups are validated and
        scored before the buffer changes, so an error leaves it untouched.
        """
        step = _check_int("step", step, -(2**62))
        seen: set[int] = set()
        admitted: list[tuple[ReplayGroup, float]] = []
        for g in groups:
            if not isinstance(g, ReplayGroup):
                raise ValueError(f"admit expects ReplayGroup objects, got {type(g).__name__}")
            if g.group_id != -1 or id(g) in seen:
                raise ValueError(
                    f"group already admitted (group_id={g.group_id}); build a new ReplayGroup"
                )
            seen.add(id(g))
            if not self.passes_ingress(g):
                continue
            # the group validated its own layout at construction
            h_ref = float(headroom_flat(g.gen_log_probs, g.response_mask, g.response_lengths,
                                        g.advantages, self.weighting, validate=False))
            if math.isnan(h_ref):
                raise ValueError("gen_log_probs contain NaN at valid positions; group refused")
            admitted.append((g, h_ref))
        events: list[dict[str, Any]] = []
        for g, h_ref in admitted:
            g.group_id = self._next_group_id
            g.insert_seq = self._next_insert_seq
            self._next_group_id += 1
            self._next_insert_seq += 1
            g.birth_step = step
            g.headroom_ref = g.headroom_cached = h_ref
            g.replay_count = 0
            self._groups[g.group_id] = g
            self._on_insert(g)
            events.append(ingress_record(step=step, group_id=g.group_id, birth_step=step,
                                         initial_headroom=h_ref, n=g.n, num_correct=g.num_correct))
        evicted = 0
        while len(self._groups) > self.capacity:
            _, old = self._groups.popitem(last=False)
            self._on_evict(old)
            evicted += 1
            events.append(evict_record(step=step, group_id=old.group_id, birth_step=old.birth_step,
                                       lifetime_replay_count=old.replay_count))
        self._after_mutation()
        return {"ingress": len(admitted), "rejected_ingress": len(groups) - len(admitted),
                "evicted": evicted, "buffer_size": len(self._groups), "events": events}

    # hooks for the ranking structure
    def _on_insert(self, group: ReplayGroup) -> None:
        pass

    def _on_evict(self, group: ReplayGroup) -> None:
        pass

    def _after_mutation(self) -> None:
        pass

    def _rebuild_index(self) -> None:
        pass

    # -- persistence ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors/Python values (``torch.save``-able, ``weights_only`` loadable).

        Groups are packed into concatenated tensors (FIFO order) instead of one dict per group,
        so saving 1e5 groups costs a few large tensors rather than ~1e6 small ones.
        """
        gs = list(self._groups.values())

        def cat(name: str, dtype: torch.dtype) -> Tensor:
            parts = [getattr(g, name) for g in gs]
            return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)

        def scal(name: str, dtype: torch.dtype) -> Tensor:
            return torch.tensor([getattr(g, name) for g in gs], dtype=dtype)

        return {
            "format": _STATE_FORMAT,
            "kind": self._KIND,
            "config": self.config(),
            "next_group_id": self._next_group_id,
            "next_insert_seq": self._next_insert_seq,
            "groups": {
                "prompt_lengths": torch.tensor([g.prompt_ids.numel() for g in gs],
                                               dtype=torch.int64),
                "group_sizes": torch.tensor([g.n for g in gs], dtype=torch.int64),
                "prompt_ids": cat("prompt_ids", torch.int32),
                "response_ids": cat("response_ids", torch.int32),
                "response_lengths": cat("response_lengths", torch.int64),
                "response_mask": cat("response_mask", torch.bool),
                "gen_log_probs": cat("gen_log_probs", torch.float32),
                "advantages": cat("advantages", torch.float32),
                "correct": cat("correct", torch.bool),
                "scores": cat("scores", torch.float32),
                "group_id": scal("group_id", torch.int64),
                "birth_step": scal("birth_step", torch.int64),
                "insert_seq": scal("insert_seq", torch.int64),
                # float64 holds the Python floats exactly, so caches round-trip bit for bit
                "headroom_ref": scal("headroom_ref", torch.float64),
                "headroom_cached": scal("headroom_cached", torch.float64),
                "replay_count": scal("replay_count", torch.int64),
                "meta": [dict(g.meta) for g in gs],
            },
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Replace the contents with ``state``.

        ``strict``: the saved configuration must equal this buffer's (otherwise future
        selections would differ); with ``strict=False`` this buffer's configuration wins and
        the oldest groups beyond ``capacity`` are dropped.
        """
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise ValueError(f"not a replay buffer state (format {_STATE_FORMAT} expected)")
        if state.get("kind") != self._KIND:
            raise ValueError(f"state was saved by {state.get('kind')!r}, "
                             f"cannot load into {self._KIND!r}")
        saved_cfg = dict(state["config"])
        mine = self.config()
        diff = sorted(k for k in set(saved_cfg) | set(mine) if saved_cfg.get(k) != mine.get(k))
        if diff and strict:
            detail = ", ".join(f"{k}: saved {saved_cfg.get(k)!r} vs {mine.get(k)!r}" for k in diff)
            raise ValueError(f"buffer configuration differs from the saved one ({detail}); "
                             "construct the buffer with the saved settings or pass strict=False")
        p = state["groups"]
        sizes = p["group_sizes"].tolist()
        plen = p["prompt_lengths"].tolist()
        rlen = p["response_lengths"]
        prompt_parts = torch.split(p["prompt_ids"], plen)
        resp_parts = torch.split(rlen, sizes)
        per_resp = rlen.tolist()
        tok_counts, off = [], 0
        for n in sizes:  # tokens per group = sum of its response lengths
            tok_counts.append(sum(per_resp[off:off + n]))
            off += n
        ids_parts = torch.split(p["response_ids"], tok_counts)
        mask_parts = torch.split(p["response_mask"], tok_counts)
        lp_parts = torch.split(p["gen_log_probs"], tok_counts)
        adv_parts = torch.split(p["advantages"], sizes)
        cor_parts = torch.split(p["correct"], sizes)
        sc_parts = torch.split(p["scores"], sizes)
        scal = {k: p[k].tolist() for k in ("group_id", "birth_step", "insert_seq", "headroom_ref",
                                           "headroom_cached", "replay_count")}
        groups: OrderedDict[int, ReplayGroup] = OrderedDict()
        for i in range(len(sizes)):
            g = ReplayGroup(
                prompt_ids=prompt_parts[i].clone(), response_ids=ids_parts[i].clone(),
                response_lengths=resp_parts[i].clone(), response_mask=mask_parts[i].clone(),
                gen_log_probs=lp_parts[i].clone(), advantages=adv_parts[i].clone(),
                correct=cor_parts[i].clone(), scores=sc_parts[i].clone(), meta=dict(p["meta"][i]),
                group_id=scal["group_id"][i], birth_step=scal["birth_step"][i],
                insert_seq=scal["insert_seq"][i], headroom_ref=scal["headroom_ref"][i],
                headroom_cached=scal["headroom_cached"][i], replay_count=scal["replay_count"][i],
            )
            groups[g.group_id] = g
        while len(groups) > self.capacity:
            groups.popitem(last=False)
        self._groups = groups
        self._next_group_id = int(state["next_group_id"])
        self._next_insert_seq = int(state["next_insert_seq"])
        self._rebuild_index()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the state atomically (tmp file + fsync + os.replace) with a sha256 header."""
        buf = io.BytesIO()
        torch.save(self.state_dict(), buf)
        payload = buf.getvalue()
        header = _FILE_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + \
            str(len(payload)).encode() + b"\n"
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(header)
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                tmp.unlink()
        _fsync_dir(target.parent)

    @staticmethod
    def _read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
        p = Path(path)
        data = p.read_bytes()
        if not data.startswith(_FILE_MAGIC):
            raise ValueError(f"{p} is not a replay buffer file (bad header)")
        rest = data[len(_FILE_MAGIC):]
        parts = rest.split(b"\n", 2)
        if len(parts) < 3:
            raise ValueError(f"replay buffer file {p} is truncated (incomplete header)")
        digest, size_txt, payload = parts
        try:
            size = int(size_txt)
        except ValueError:
            raise ValueError(f"replay buffer file {p} is corrupted (bad length field)") from None
        if len(payload) < size:
            raise ValueError(f"replay buffer file {p} is truncated: {len(payload)} of {size} "
                             "payload bytes present")
        if len(payload) > size:
            raise ValueError(f"replay buffer file {p} is corrupted: {len(payload) - size} "
                             "unexpected trailing bytes")
        if hashlib.sha256(payload).hexdigest().encode() != digest:
            raise ValueError(f"replay buffer file {p} is corrupted: sha256 content hash mismatch")
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)

    def load(self, path: str | os.PathLike[str], strict: bool = True) -> None:
        """Load a file written by :meth:`save` (hash verified) into this buffer."""
        self.load_state_dict(self._read_state(path), strict=strict)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> _FifoReplayStore:
        """A new buffer with the saved configuration and contents."""
        state = cls._read_state(path)
        if state.get("kind") != cls._KIND:
            raise ValueError(f"{path} holds a {state.get('kind')!r} buffer, not {cls._KIND!r}")
        buf = cls(**state["config"])
        buf.load_state_dict(state)
        return buf


# ============================================================================ Headroom-Drift


class HeadroomDriftBuffer(_FifoReplayStore):
    """Headroom-ranked, Policy-Drift-gated replay of whole GRPO groups (SPEC 1.3-1.5).

    Args (keyword-only):
        capacity: maximum number of groups (FIFO eviction of the oldest).
        k_rep: K_rep, maximum number of groups accepted per step.
        tau: drift gate, accept iff D <= tau (``math.inf`` disables the gate).
        weighting: Headroom weighting, "sign" (default) or "advantage".
        drift_norm: "l2" (default) or "l1".
        scan_chunk_groups: groups per scorer call.
        max_scan_groups: optional cap on groups scanned per step (None = no cap).
        ingress: "answer_disagree" (default) or "nonzero_advantage".
    """

    _KIND = "HeadroomDriftBuffer"

    def __init__(
        self,
        *,
        capacity: int,
        k_rep: int,
        tau: float,
        weighting: str = "sign",
        drift_norm: str = "l2",
        scan_chunk_groups: int,
        max_scan_groups: int | None = None,
        ingress: str = "answer_disagree",
    ) -> None:
        super().__init__(capacity=capacity, k_rep=k_rep, ingress=ingress, weighting=weighting)
        if isinstance(tau, bool) or not isinstance(tau, (int, float, np.floating, np.integer)):
            raise ValueError(f"tau must be a number, got {tau!r}")
        if math.isnan(float(tau)) or float(tau) < 0:
            raise ValueError(f"tau must be >= 0 (math.inf disables the gate), got {tau!r}")
        self.tau = float(tau)
        self.drift_norm = _check_choice("drift_norm", drift_norm, DRIFT_NORMS)
        self.scan_chunk_groups = _check_int("scan_chunk_groups", scan_chunk_groups, 1)
        self.max_scan_groups = (None if max_scan_groups is None
                                else _check_int("max_scan_groups", max_scan_groups, 1))
        # ranking heap with lazy invalidation (see module docstring)
        self._heap: list[tuple[float, int, int, int]] = []
        self._live: dict[int, tuple[float, int, int, int]] = {}

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(tau=self.tau, drift_norm=self.drift_norm,
                   scan_chunk_groups=self.scan_chunk_groups, max_scan_groups=self.max_scan_groups)
        return cfg

    # -- ranking structure --------------------------------------------------------------------

    @staticmethod
    def _entry(g: ReplayGroup) -> tuple[float, int, int, int]:
        # min-heap key: higher cached H first, then newer birth step, then earlier insertion
        return (-g.headroom_cached, -g.birth_step, g.insert_seq, g.group_id)

    def _push(self, g: ReplayGroup) -> None:
        entry = self._entry(g)
        self._live[g.group_id] = entry
        heapq.heappush(self._heap, entry)

    def _on_insert(self, group: ReplayGroup) -> None:
        self._push(group)

    def _on_evict(self, group: ReplayGroup) -> None:
        del self._live[group.group_id]  # its heap entry is now stale

    def _after_mutation(self) -> None:
        # compact once stale entries outnumber live ones (+ slack so tiny buffers don't thrash)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._rebuild_index()

    def _rebuild_index(self) -> None:
        self._live = {gid: self._entry(g) for gid, g in self._groups.items()}
        self._heap = list(self._live.values())
        heapq.heapify(self._heap)

    def _pop_live(self, want: int) -> list[tuple[float, int, int, int]]:
        """Pop up to ``want`` live entries in rank order, discarding stale ones."""
        out: list[tuple[float, int, int, int]] = []
        while len(out) < want and self._heap:
            entry = heapq.heappop(self._heap)
            if self._live.get(entry[3]) is entry:
                out.append(entry)
        return out

    # -- selection ------------------------------------------------------------------------------

    def _score(self, group: ReplayGroup, log_probs: Any) -> Any:
        if not isinstance(log_probs, Tensor) or log_probs.dim() != 1 \
                or log_probs.numel() != group.num_tokens or not log_probs.is_floating_point():
            shape = (tuple(log_probs.shape) if isinstance(log_probs, Tensor)
                     else type(log_probs).__name__)
            raise ValueError(
                f"scorer must return a 1-D float tensor of length num_tokens={group.num_tokens} "
                f"for group {group.group_id}, got {shape}"
            )
        try:
            return group_scores_flat(log_probs.detach().to("cpu"), group.gen_log_probs,
                                     group.response_mask, group.response_lengths, group.advantages,
                                     self.weighting, self.drift_norm, validate=False)
        except ValueError as exc:
            raise ValueError(f"scorer output for group {group.group_id}: {exc}") from None

    def select(self, step: int, scorer: Scorer) -> SelectionResult:
        """Pick up to K_rep replay groups for ``step`` (SPEC 1.3); call before ``admit``.

        Scans candidates by cached Headroom (desc; ties newer birth step, then earlier
        insertion) in chunks of ``scan_chunk_groups``, one scorer call per chunk; refreshes the
        cached Headroom of every scanned group; accepts while D <= tau; stops at K_rep accepted,
        no candidates left, or ``max_scan_groups`` scanned. Groups of the last chunk beyond the
        stopping point are not scanned: no record, no refresh. If the scorer raises, the
        buffer is left exactly as before.
        """
        t0 = time.perf_counter()
        step = _check_int("step", step, -(2**62))
        if not callable(scorer):
            raise ValueError("scorer must be callable: scorer(list[ReplayGroup]) -> list[Tensor]")
        candidates = len(self._groups)
        budget = (candidates if self.max_scan_groups is None
                  else min(candidates, self.max_scan_groups))
        popped: list[tuple[float, int, int, int]] = []
        records: list[ScanRecord] = []
        refreshed: dict[int, float] = {}
        accepted: list[ReplayGroup] = []
        forward_s = 0.0
        calls = 0
        done = False
        try:
            while not done and len(records) < budget:
                chunk = self._pop_live(min(self.scan_chunk_groups, budget - len(records)))
                popped.extend(chunk)
                if not chunk:
                    break
                groups = [self._groups[e[3]] for e in chunk]
                tf = time.perf_counter()
                outputs = scorer(groups)
                forward_s += time.perf_counter() - tf
                calls += 1
                if len(outputs) != len(groups):
                    raise ValueError(f"scorer returned {len(outputs)} tensors "
                                     f"for {len(groups)} groups")
                for g, lp in zip(groups, outputs):
                    sc = self._score(g, lp)
                    ok = sc.drift <= self.tau
                    records.append(ScanRecord(
                        group_id=g.group_id, rank=len(records) + 1, birth_step=g.birth_step,
                        age=step - g.birth_step, headroom_before=g.headroom_cached,
                        headroom_after=sc.headroom, drift=sc.drift, replay_kl=sc.replay_kl,
                        num_valid_tokens=sc.num_valid_tokens, accepted=ok,
                    ))
                    refreshed[g.group_id] = sc.headroom
                    if ok:
                        accepted.append(g)
                        if len(accepted) >= self.k_rep:
                            done = True
                            break
        except BaseException:
            for e in popped:  # untouched entries are still the live ones: just put them back
                heapq.heappush(self._heap, e)
            raise
        # commit: refreshed groups get new entries (old ones are the popped, now dropped,
        # entries); the unscanned tail of the last chunk goes back unchanged
        for e in popped:
            gid = e[3]
            if gid in refreshed:
                g = self._groups[gid]
                g.headroom_cached = refreshed[gid]
                self._push(g)
            else:
                heapq.heappush(self._heap, e)
        for g in accepted:
            g.replay_count += 1
        self._after_mutation()
        stats = self._stats(records, candidates)
        stats["scan_forward_seconds"] = forward_s
        stats["select_seconds"] = time.perf_counter() - t0
        return SelectionResult(step=step, groups=accepted, records=records, stats=stats,
                               scorer_calls=calls, scored_groups=len(popped))

    def _stats(self, records: list[ScanRecord], candidates: int) -> dict[str, float]:
        # every record of this buffer was scored: drift/replay_kl/headroom_after are floats
        acc = [r for r in records if r.accepted]
        drift_s = [_num(r.drift) for r in records]
        drift_a = [_num(r.drift) for r in acc]
        tokens = sum(r.num_valid_tokens for r in acc)
        kl_sum = sum(_num(r.replay_kl) * r.num_valid_tokens for r in acc)
        stats: dict[str, float] = {
            "buffer_size": float(len(self._groups)),
            "candidates": float(candidates),
            "scanned": float(len(records)),
            "rejected_drift": float(len(records) - len(acc)),
            "acceptance_rate": len(acc) / len(records) if records else 0.0,
            "scan_depth": float(records[-1].rank) if records else 0.0,
            "scan_depth_frac": records[-1].rank / candidates if records else 0.0,
            "drift_scanned/mean": _mean(drift_s),
            "drift_scanned/p50": _pct(drift_s, 50),
            "drift_scanned/p90": _pct(drift_s, 90),
            "drift_accepted/mean": _mean(drift_a),
            "drift_accepted/p50": _pct(drift_a, 50),
            "drift_accepted/p90": _pct(drift_a, 90),
            "headroom_refreshed_accepted/mean": _mean([_num(r.headroom_after) for r in acc]),
            "replay_kl_accepted/mean": kl_sum / tokens if tokens else 0.0,  # token-weighted
        }
        stats.update(_accepted_stats(records, self.k_rep))
        return stats


# ============================================================================ naive baseline


class NaiveReplayBuffer(_FifoReplayStore):
    """Recency baseline: replay the latest K_rep buffered groups, newest first.

    No ranking, no gate, no scorer call. Same ingress, eviction, persistence and (where
    meaningful) statistics as :class:`HeadroomDriftBuffer`. "Scanned" groups are the ones it
    looked at, i.e. exactly the accepted ones; drift is never measured, so drift/KL keys are
    absent and records carry ``drift=None``; cached Headroom stays H_ref.
    """

    _KIND = "NaiveReplayBuffer"

    def __init__(self, *, capacity: int, k_rep: int, ingress: str = "answer_disagree",
                 weighting: str = "sign") -> None:
        super().__init__(capacity=capacity, k_rep=k_rep, ingress=ingress, weighting=weighting)

    def select(self, step: int, scorer: Scorer | None = None) -> SelectionResult:
        t0 = time.perf_counter()
        step = _check_int("step", step, -(2**62))
        candidates = len(self._groups)
        accepted: list[ReplayGroup] = []
        records: list[ScanRecord] = []
        for gid in reversed(self._groups):  # newest first; stops after k_rep: O(k_rep)
            if len(accepted) >= self.k_rep:
                break
            g = self._groups[gid]
            accepted.append(g)
            records.append(ScanRecord(
                group_id=g.group_id, rank=len(records) + 1, birth_step=g.birth_step,
                age=step - g.birth_step, headroom_before=g.headroom_cached, headroom_after=None,
                drift=None, replay_kl=None, num_valid_tokens=g.num_valid_tokens, accepted=True,
            ))
        for g in accepted:
            g.replay_count += 1
        stats: dict[str, float] = {
            "buffer_size": float(candidates),
            "candidates": float(candidates),
            "scanned": float(len(records)),
            "rejected_drift": 0.0,
            "acceptance_rate": 1.0 if records else 0.0,
            "scan_depth": float(len(records)),
            "scan_depth_frac": len(records) / candidates if candidates else 0.0,
        }
        stats.update(_accepted_stats(records, self.k_rep))
        stats["scan_forward_seconds"] = 0.0
        stats["select_seconds"] = time.perf_counter() - t0
        return SelectionResult(step=step, groups=accepted, records=records, stats=stats)
