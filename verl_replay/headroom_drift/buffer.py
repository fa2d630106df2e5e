"""Replay buffers for GRPO groups: Headroom-Drift (SPEC 1.3-1.5) and a naive recency baseline.

Data layout
-----------
A :class:`ReplayGroup` stores one whole GRPO group without padding: the responses are
concatenated into flat ``[L]`` tensors (``L = sum(response_lengths)``) and all per-token data
(ids, mask, generation-time log-probs) share that layout. A group keeps all of it, metadata
included, in one ``bytes`` object (token ids in 2-4 bytes, bits packed, metadata in a compact
binary encoding: :mod:`~verl_replay.headroom_drift.packing`), because a buffer holds ~1e5
groups for a whole run and per-object overheads (a torch tensor, a Python dict) would cost more
than the tokens.

Scorer contract (:meth:`HeadroomDriftBuffer.select`)
-----------------------------------------------------
``scorer(groups: list[ReplayGroup]) -> list[Tensor]`` returns, for each group in order, the
*current* policy's teacher-forced log-probs of ``group.response_ids`` as a 1-D floating tensor
of length ``group.num_tokens`` in the same flat layout as ``group.gen_log_probs`` (any device;
values at masked positions are ignored). It is called once per scan chunk and must not modify
the groups. A chunk holds no more groups than the scan can still use: the smaller of
``scan_chunk_groups`` and K_rep minus the groups accepted so far, rounded up to the caller's
``chunk_multiple`` (groups that fill what the data-parallel dispatch would pad anyway) and
capped by the scan budget and the candidates left. A chunked scan equals a one-by-one scan
provided that a group's log-probs do not depend on which groups share its chunk.

Complexity
----------
Ranking lives in a binary heap of entries ``(-cached_H, -birth_step, insert_seq, group_id)``
with lazy invalidation: ``group._rank`` is the group's one valid entry; refreshed or evicted
groups leave stale entries that are dropped when popped, and the heap is compacted when stale
entries exceed a quarter of the live ones (O(N) after at least N/4 stale entries were created,
i.e. amortised O(1) per refresh/eviction). A selection pops the scanned groups (plus the
unused tail of the last chunk) and pushes them back: O((scanned + chunk) log N) amortised.
FIFO order is a dict (insertion order) plus a deque of ids (O(1) append and evict-oldest).
Nothing per step touches all N groups.

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
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from verl_replay.headroom_drift.events import evict_record, ingress_record, scan_record
from verl_replay.headroom_drift.packing import (
    decode_meta,
    encode_meta,
    id_width,
    pack_bits,
    pack_ids,
    unpack_bits,
    unpack_ids,
)
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
    "scan_chunk_multiple",
]

INGRESS_CRITERIA: tuple[str, ...] = ("answer_disagree", "nonzero_advantage")

Scorer = Callable[[list["ReplayGroup"]], Sequence[Tensor]]

_FILE_MAGIC = b"VERL-REPLAY-BUFFER v1\n"  # the container (hash header), not the state format
_STATE_FORMAT = 2  # 2: packed groups; 1: one tensor per field + meta dicts (read, not written)
_READABLE_FORMATS = (1, 2)


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


# Packed group layout (little-endian; all offsets follow from the 16-byte header):
#   header  u8 version, u8 flags, u8 id widths (prompt << 4 | response), u8 0, u32 n, u32 L, u32 P
#   f32[L] gen_log_probs | f32[n] advantages | f32[n] scores
#   u32[n] response_lengths | prompt ids (P x width) | response ids (L x width)
#   correct bits ceil(n/8) | response_mask bits ceil(L/8) (absent when every token is valid)
#   metadata (packing.encode_meta) up to the end
_HEADER = struct.Struct("<BBBBIII")
_GROUP_VERSION = 1
_MASK_ALL_VALID = 1  # flag: no mask bits stored
_U32_MAX = 2**32 - 1


class _Layout:
    """Section offsets of one packed group (computed on demand, never stored)."""

    __slots__ = ("flags", "n", "L", "P", "wp", "wr", "adv", "sc", "len", "pid", "rid", "cor", "mask", "meta")

    def __init__(self, buf: bytes) -> None:
        if len(buf) < _HEADER.size:
            raise ValueError("packed replay group is truncated (no header)")
        version, flags, widths, _, n, L, P = _HEADER.unpack_from(buf)
        if version != _GROUP_VERSION:
            raise ValueError(f"packed replay group has version {version}, expected {_GROUP_VERSION}")
        self.flags, self.n, self.L, self.P = flags, n, L, P
        self.wp, self.wr = widths >> 4, widths & 0xF
        if self.wp not in (2, 3, 4) or self.wr not in (2, 3, 4) or flags & ~_MASK_ALL_VALID:
            raise ValueError("packed replay group has an invalid header")
        self.adv = _HEADER.size + 4 * L
        self.sc = self.adv + 4 * n
        self.len = self.sc + 4 * n
        self.pid = self.len + 4 * n
        self.rid = self.pid + self.wp * P
        self.cor = self.rid + self.wr * L
        self.mask = self.cor + (n + 7) // 8
        self.meta = self.mask + (0 if flags & _MASK_ALL_VALID else (L + 7) // 8)
        if self.meta >= len(buf):  # the metadata encoding is never empty
            raise ValueError("packed replay group is truncated")


def _f32(buf: bytes, offset: int, count: int) -> Tensor:
    """``count`` stored float32 values as a new tensor (a copy costs ~1 us per 1e4 values)."""
    return torch.from_numpy(np.frombuffer(buf, "<f4", count, offset).astype(np.float32))


def _pack_group(
    prompt_ids: Tensor,
    response_ids: Tensor,
    response_lengths: Tensor,
    response_mask: Tensor,
    gen_log_probs: Tensor,
    advantages: Tensor,
    correct: Tensor,
    scores: Tensor,
    meta_blob: bytes,
) -> bytes:
    n, L, P = response_lengths.numel(), response_ids.numel(), prompt_ids.numel()
    wp, wr = id_width(prompt_ids), id_width(response_ids)
    all_valid = bool(response_mask.all())
    flags = _MASK_ALL_VALID if all_valid else 0
    parts = [
        _HEADER.pack(_GROUP_VERSION, flags, wp << 4 | wr, 0, n, L, P),
        gen_log_probs.numpy().astype("<f4", copy=False).tobytes(),
        advantages.numpy().astype("<f4", copy=False).tobytes(),
        scores.numpy().astype("<f4", copy=False).tobytes(),
        response_lengths.numpy().astype("<u4").tobytes(),
        pack_ids(prompt_ids, wp),
        pack_ids(response_ids, wr),
        pack_bits(correct),
        b"" if all_valid else pack_bits(response_mask),
        meta_blob,
    ]
    return b"".join(parts)  # one allocation; bytes: the stored anchor cannot be written to


_BOOKKEEPING = ("group_id", "birth_step", "insert_seq", "headroom_ref", "headroom_cached", "replay_count")


class ReplayGroup:
    """One whole GRPO group (prompt + n responses), stored compactly without padding.

    Everything the group holds lives in one immutable ``bytes`` object (layout above): token
    ids in the narrowest of 2/3/4 bytes, the response mask and correctness bits packed 8 per
    byte (no mask at all when every token is valid), log-probs/advantages/scores as float32,
    and ``meta`` in a compact binary encoding (~5x smaller than pickle for verl rows). The
    tensor attributes are read-only properties that decode into new tensors on every access
    (dtypes as documented below), so the replay anchor (``gen_log_probs``, ``advantages``)
    cannot be changed through them. ``meta`` returns a new dict on every access: assign
    ``group.meta = {...}`` to change it.

    The constructor copies what it is given into that storage; :meth:`from_padded` also drops
    padding. The bookkeeping attributes after ``meta`` are owned by the buffer.
    """

    __slots__ = ("_buf", *_BOOKKEEPING, "_rank")

    def __init__(
        self,
        prompt_ids: Tensor,  # [P] int32, prompt without padding
        response_ids: Tensor,  # [L] int32, responses concatenated, L = sum(response_lengths)
        response_lengths: Tensor,  # [n] int64, tokens of each response (incl. masked tool tokens)
        response_mask: Tensor,  # [L] bool, True = token trained on / scored
        gen_log_probs: Tensor,  # [L] float32, generation-time log-probs l_gen (anchor)
        advantages: Tensor,  # [n] float32, stored response-level GRPO advantages A_i
        correct: Tensor,  # [n] bool, answer-correctness bits c_i
        scores: Tensor,  # [n] float32, rewards as scored at generation time
        meta: dict[str, Any] | None = None,  # opaque per-group data (plain types)
        group_id: int = -1,  # assigned by the buffer at ingress (monotonic)
        birth_step: int = -1,  # training step of ingress
        insert_seq: int = -1,  # insertion sequence number (tie-break: earlier first)
        headroom_ref: float = 0.0,  # H_ref = H(g; l_gen), computed at ingress
        headroom_cached: float = 0.0,  # ranking key; H_ref, then H(g; l_theta) at each scan
        replay_count: int = 0,  # times accepted for replay
    ) -> None:
        prompt_ids = _as_1d("prompt_ids", prompt_ids, torch.int32)
        response_ids = _as_1d("response_ids", response_ids, torch.int32)
        response_lengths = _as_1d("response_lengths", response_lengths, torch.int64)
        response_mask = _as_1d("response_mask", response_mask, torch.bool)
        if not torch.as_tensor(gen_log_probs).is_floating_point():
            raise ValueError("gen_log_probs must be a floating-point tensor")
        gen_log_probs = _as_1d("gen_log_probs", gen_log_probs, torch.float32)
        advantages = _as_1d("advantages", advantages, torch.float32)
        correct = _as_1d("correct", correct, torch.bool)
        scores = _as_1d("scores", scores, torch.float32)
        lengths = response_lengths.tolist()
        n = len(lengths)
        if n == 0:
            raise ValueError("a group needs at least one response (response_lengths is empty)")
        if min(lengths) < 0:
            raise ValueError("response_lengths must be non-negative")
        total = sum(lengths)
        if total > _U32_MAX or prompt_ids.numel() > _U32_MAX:
            raise ValueError(f"a group holds at most {_U32_MAX} prompt or response tokens")
        tokens = {"response_ids": response_ids, "response_mask": response_mask, "gen_log_probs": gen_log_probs}
        for name, t in tokens.items():
            if t.numel() != total:
                raise ValueError(f"{name} must have sum(response_lengths) = {total} entries, got {t.numel()}")
        for name, t in (("advantages", advantages), ("correct", correct), ("scores", scores)):
            if t.numel() != n:
                raise ValueError(f"{name} must have one entry per response ({n}), got {t.numel()}")
        meta = {} if meta is None else meta
        if not isinstance(meta, dict):
            raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
        self._buf = _pack_group(
            prompt_ids,
            response_ids,
            response_lengths,
            response_mask,
            gen_log_probs,
            advantages,
            correct,
            scores,
            encode_meta(meta),
        )
        self.group_id = group_id
        self.birth_step = birth_step
        self.insert_seq = insert_seq
        self.headroom_ref = headroom_ref
        self.headroom_cached = headroom_cached
        self.replay_count = replay_count
        self._rank: tuple[float, int, int, int] | None = None  # the buffer's live heap entry

    @classmethod
    def _from_packed(cls, buf: bytes, **bookkeeping: Any) -> ReplayGroup:
        """A group over stored bytes (a saved buffer, hash-checked by the caller). The layout is
        checked here; metadata is decoded when read (MetaDecodeError if it does not decode)."""
        lay = _Layout(buf)
        lengths = np.frombuffer(buf, "<u4", lay.n, lay.len)
        if int(lengths.sum(dtype=np.int64)) != lay.L:
            raise ValueError("packed replay group is inconsistent (lengths do not sum to L)")
        self = cls.__new__(cls)
        self._buf = buf
        for name in _BOOKKEEPING:
            setattr(self, name, bookkeeping[name])
        self._rank = None
        return self

    # -- stored fields ----------------------------------------------------------------------

    @property
    def prompt_ids(self) -> Tensor:  # [P] int32 (new tensor)
        lay = _Layout(self._buf)
        return unpack_ids(self._buf, lay.pid, lay.P, lay.wp)

    @property
    def response_ids(self) -> Tensor:  # [L] int32 (new tensor)
        lay = _Layout(self._buf)
        return unpack_ids(self._buf, lay.rid, lay.L, lay.wr)

    @property
    def response_lengths(self) -> Tensor:  # [n] int64 (new tensor)
        lay = _Layout(self._buf)
        return torch.from_numpy(np.frombuffer(self._buf, "<u4", lay.n, lay.len).astype(np.int64))

    @property
    def response_mask(self) -> Tensor:  # [L] bool (new tensor)
        lay = _Layout(self._buf)
        if lay.flags & _MASK_ALL_VALID:
            return torch.ones(lay.L, dtype=torch.bool)
        return unpack_bits(self._buf, lay.mask, lay.L)

    @property
    def gen_log_probs(self) -> Tensor:  # [L] float32 (new tensor)
        return _f32(self._buf, _HEADER.size, _Layout(self._buf).L)

    @property
    def advantages(self) -> Tensor:  # [n] float32 (new tensor)
        lay = _Layout(self._buf)
        return _f32(self._buf, lay.adv, lay.n)

    @property
    def scores(self) -> Tensor:  # [n] float32 (new tensor)
        lay = _Layout(self._buf)
        return _f32(self._buf, lay.sc, lay.n)

    @property
    def correct(self) -> Tensor:  # [n] bool (new tensor)
        lay = _Layout(self._buf)
        return unpack_bits(self._buf, lay.cor, lay.n)

    @property
    def meta(self) -> dict[str, Any]:
        """The group's metadata, decoded into a new dict (changes need ``group.meta = ...``)."""
        lay = _Layout(self._buf)
        return decode_meta(memoryview(self._buf)[lay.meta :])

    @meta.setter
    def meta(self, value: dict[str, Any]) -> None:
        blob = encode_meta(value)
        self._buf = self._buf[: _Layout(self._buf).meta] + blob

    def _scoring_fields(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(gen_log_probs, response_mask, response_lengths, advantages) from one layout parse:
        what Headroom/Drift need, for the buffer's per-group hot paths."""
        lay = _Layout(self._buf)
        mask = (
            torch.ones(lay.L, dtype=torch.bool)
            if lay.flags & _MASK_ALL_VALID
            else unpack_bits(self._buf, lay.mask, lay.L)
        )
        lengths = torch.from_numpy(np.frombuffer(self._buf, "<u4", lay.n, lay.len).astype(np.int64))
        return (_f32(self._buf, _HEADER.size, lay.L), mask, lengths, _f32(self._buf, lay.adv, lay.n))

    # -- sizes -----------------------------------------------------------------------------

    @property
    def n(self) -> int:
        return _HEADER.unpack_from(self._buf)[4]

    @property
    def num_tokens(self) -> int:
        """L: response tokens including masked ones (length of the scorer's output)."""
        return _HEADER.unpack_from(self._buf)[5]

    @property
    def num_valid_tokens(self) -> int:
        lay = _Layout(self._buf)
        if lay.flags & _MASK_ALL_VALID:
            return lay.L
        return int(unpack_bits(self._buf, lay.mask, lay.L).sum())

    @property
    def num_correct(self) -> int:
        return int(self.correct.sum())

    @property
    def nbytes(self) -> int:
        """Bytes of the packed storage: tokens, log-probs, per-response values and metadata."""
        return len(self._buf)

    def response_offsets(self) -> Tensor:  # [n + 1] int64: response i is [off[i], off[i+1])
        return torch.cat([torch.zeros(1, dtype=torch.int64), self.response_lengths.cumsum(0)])

    def __repr__(self) -> str:
        return (
            f"ReplayGroup(group_id={self.group_id}, n={self.n}, num_tokens={self.num_tokens}, "
            f"birth_step={self.birth_step}, headroom_cached={self.headroom_cached!r}, "
            f"replay_count={self.replay_count})"
        )

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
        return cls(  # the constructor copies into the group's own storage
            prompt_ids=p_ids,
            response_ids=response_ids.detach().cpu()[keep],
            response_lengths=lengths,
            response_mask=valid[keep],
            gen_log_probs=gen_log_probs.detach().cpu().float()[keep],
            advantages=adv.float(),
            correct=corr != 0,
            scores=(corr.float() if scores is None else torch.as_tensor(scores).detach().cpu().float().reshape(-1)),
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
    chunk_groups: tuple[int, ...] = ()  # groups given to the scorer, per call
    chunk_rows: tuple[int, ...] = ()  # responses (rows) given to the scorer, per call

    @property
    def accepted_ids(self) -> list[int]:
        return [g.group_id for g in self.groups]

    def forward_rows(self, row_multiple: int = 1) -> int:
        """Rows through the scan forward when each scorer call pads its rows up to a multiple
        of ``row_multiple`` (the data-parallel dispatch): ``replay/scan_forward_rows``."""
        r = _check_int("row_multiple", row_multiple, 1)
        return sum(-(-rows // r) * r for rows in self.chunk_rows)

    def events(self) -> list[dict[str, Any]]:
        """``scan`` event records for :class:`~verl_replay.headroom_drift.events.ReplayEventLog`."""
        return [
            scan_record(
                step=self.step,
                group_id=r.group_id,
                rank=r.rank,
                drift=r.drift,
                replay_kl=r.replay_kl,
                headroom_before=r.headroom_before,
                headroom_after=r.headroom_after,
                accepted=r.accepted,
                age=r.age,
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
        # group_id -> group; a plain dict keeps insertion (= FIFO) order because only the
        # oldest group is ever removed, and costs ~half an OrderedDict per entry
        self._groups: dict[int, ReplayGroup] = {}
        self._fifo: deque[int] = deque()  # group ids, oldest first: O(1) evict-oldest
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
        return {"capacity": self.capacity, "k_rep": self.k_rep, "ingress": self.ingress, "weighting": self.weighting}

    # -- ingress -------------------------------------------------------------------------------

    def passes_ingress(self, group: ReplayGroup) -> bool:
        """SPEC 1.4: answers disagree (0 < sum c_i < n), or some A_i != 0."""
        return self._passes(group.num_correct, group.n, group.advantages)

    def _passes(self, num_correct: int, n: int, advantages: Tensor) -> bool:
        if self.ingress == "answer_disagree":
            return 0 < num_correct < n
        return bool(((advantages > 0) | (advantages < 0)).any())

    def admit(self, groups: Sequence[ReplayGroup], step: int) -> dict[str, Any]:
        """Ingress after the update (SPEC 1.4); evicts the oldest groups beyond capacity.

        Returns ``{"ingress", "rejected_ingress", "evicted", "buffer_size"}`` (ints) and
        ``"events"``: ingress/evict records for the event log. All groups are validated and
        scored before the buffer changes, so an error leaves it untouched.
        """
        step = _check_int("step", step, -(2**62))
        seen: set[int] = set()
        admitted: list[tuple[ReplayGroup, float, int, int]] = []
        for g in groups:
            if not isinstance(g, ReplayGroup):
                raise ValueError(f"admit expects ReplayGroup objects, got {type(g).__name__}")
            if g.group_id != -1 or id(g) in seen:
                raise ValueError(f"group already admitted (group_id={g.group_id}); build a new ReplayGroup")
            seen.add(id(g))
            gen, mask, lengths, adv = g._scoring_fields()  # decoded once per group
            n, num_correct = lengths.numel(), g.num_correct
            if not self._passes(num_correct, n, adv):
                continue
            # the group validated its own layout at construction
            h_ref = float(headroom_flat(gen, mask, lengths, adv, self.weighting, validate=False))
            if math.isnan(h_ref):
                raise ValueError("gen_log_probs contain NaN at valid positions; group refused")
            admitted.append((g, h_ref, n, num_correct))
        events: list[dict[str, Any]] = []
        for g, h_ref, n, num_correct in admitted:
            g.group_id = self._next_group_id
            # one int object for both when equal (always, unless a state file says otherwise)
            g.insert_seq = g.group_id if self._next_insert_seq == g.group_id else self._next_insert_seq
            self._next_group_id += 1
            self._next_insert_seq += 1
            g.birth_step = step
            g.headroom_ref = g.headroom_cached = h_ref
            g.replay_count = 0
            self._groups[g.group_id] = g
            self._fifo.append(g.group_id)
            self._on_insert(g)
            events.append(
                ingress_record(
                    step=step,
                    group_id=g.group_id,
                    birth_step=step,
                    initial_headroom=h_ref,
                    n=n,
                    num_correct=num_correct,
                )
            )
        evicted = 0
        while len(self._groups) > self.capacity:
            old = self._groups.pop(self._fifo.popleft())
            self._on_evict(old)
            evicted += 1
            events.append(
                evict_record(
                    step=step, group_id=old.group_id, birth_step=old.birth_step, lifetime_replay_count=old.replay_count
                )
            )
        self._after_mutation()
        return {
            "ingress": len(admitted),
            "rejected_ingress": len(groups) - len(admitted),
            "evicted": evicted,
            "buffer_size": len(self._groups),
            "events": events,
        }

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

        Format 2: the groups' packed bytes concatenated into one uint8 tensor (FIFO order) with
        their sizes, plus the buffer-owned bookkeeping as tensors; a few large tensors rather
        than ~1e6 small ones, and no Python object per group.
        """
        gs = list(self._groups.values())
        sizes = [len(g._buf) for g in gs]
        packed = bytearray(sum(sizes))
        view, off = memoryview(packed), 0
        for g, size in zip(gs, sizes, strict=True):
            view[off : off + size] = g._buf
            off += size
        view.release()

        def scal(name: str, dtype: torch.dtype) -> Tensor:
            return torch.tensor([getattr(g, name) for g in gs], dtype=dtype)

        return {
            "format": _STATE_FORMAT,
            "kind": self._KIND,
            "config": self.config(),
            "next_group_id": self._next_group_id,
            "next_insert_seq": self._next_insert_seq,
            "groups": {
                "packed": (
                    torch.frombuffer(packed, dtype=torch.uint8) if packed else torch.zeros(0, dtype=torch.uint8)
                ),
                "packed_sizes": torch.tensor(sizes, dtype=torch.int64),
                "group_id": scal("group_id", torch.int64),
                "birth_step": scal("birth_step", torch.int64),
                "insert_seq": scal("insert_seq", torch.int64),
                # float64 holds the Python floats exactly, so caches round-trip bit for bit
                "headroom_ref": scal("headroom_ref", torch.float64),
                "headroom_cached": scal("headroom_cached", torch.float64),
                "replay_count": scal("replay_count", torch.int64),
            },
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Replace the contents with ``state`` (format 2, or format 1 from earlier versions).

        ``strict``: the saved configuration must equal this buffer's (otherwise future
        selections would differ); with ``strict=False`` this buffer's configuration wins and
        the oldest groups beyond ``capacity`` are dropped.
        """
        fmt = state.get("format") if isinstance(state, Mapping) else None
        if fmt not in _READABLE_FORMATS:
            raise ValueError(
                f"not a replay buffer state this version can read (format "
                f"{fmt!r}; readable formats: {_READABLE_FORMATS})"
            )
        if state.get("kind") != self._KIND:
            raise ValueError(f"state was saved by {state.get('kind')!r}, cannot load into {self._KIND!r}")
        saved_cfg = dict(state["config"])
        mine = self.config()
        diff = sorted(k for k in set(saved_cfg) | set(mine) if saved_cfg.get(k) != mine.get(k))
        if diff and strict:
            detail = ", ".join(f"{k}: saved {saved_cfg.get(k)!r} vs {mine.get(k)!r}" for k in diff)
            raise ValueError(
                f"buffer configuration differs from the saved one ({detail}); "
                "construct the buffer with the saved settings or pass strict=False"
            )
        p = state["groups"]
        bookkeeping = {k: p[k].tolist() for k in _BOOKKEEPING}
        count = len(bookkeeping["group_id"])
        if any(len(v) != count for v in bookkeeping.values()):
            raise ValueError("replay buffer state is inconsistent: bookkeeping lengths differ")
        make = _groups_v1 if fmt == 1 else _groups_v2
        groups = make(p, count, bookkeeping)
        gids = [g.group_id for g in groups]
        if len(set(gids)) != len(gids):
            raise ValueError("replay buffer state is inconsistent: duplicate group ids")
        groups = groups[max(0, len(groups) - self.capacity) :]  # drop the oldest beyond capacity
        _share_equal_numbers(groups)
        self._groups = {g.group_id: g for g in groups}
        self._fifo = deque(g.group_id for g in groups)
        self._next_group_id = int(state["next_group_id"])
        self._next_insert_seq = int(state["next_insert_seq"])
        self._rebuild_index()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the state atomically (tmp file + fsync + os.replace) with a sha256 header."""
        buf = io.BytesIO()
        torch.save(self.state_dict(), buf)
        payload = buf.getbuffer()  # no copy of a payload that can be hundreds of MB
        header = _FILE_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + str(len(payload)).encode() + b"\n"
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
            payload.release()
            if tmp.exists():
                tmp.unlink()
        _fsync_dir(target.parent)

    @staticmethod
    def _read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
        p = Path(path)
        data = p.read_bytes()
        if not data.startswith(_FILE_MAGIC):
            raise ValueError(f"{p} is not a replay buffer file (bad header)")
        start = len(_FILE_MAGIC)
        end_digest = data.find(b"\n", start)
        end_size = data.find(b"\n", end_digest + 1) if end_digest >= 0 else -1
        if end_size < 0:
            raise ValueError(f"replay buffer file {p} is truncated (incomplete header)")
        digest = data[start:end_digest]
        try:
            size = int(data[end_digest + 1 : end_size])
        except ValueError:
            raise ValueError(f"replay buffer file {p} is corrupted (bad length field)") from None
        payload = memoryview(data)[end_size + 1 :]
        if len(payload) < size:
            raise ValueError(f"replay buffer file {p} is truncated: {len(payload)} of {size} payload bytes present")
        if len(payload) > size:
            raise ValueError(f"replay buffer file {p} is corrupted: {len(payload) - size} unexpected trailing bytes")
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


def _share_equal_numbers(groups: Sequence[ReplayGroup]) -> None:
    """One Python object per distinct number, as live admission leaves them (``tolist`` makes
    one per entry): the same int for group_id and insert_seq, one birth-step int per step, the
    same float for an unrefreshed cache. ~80 bytes per group at 1e5 groups."""
    births: dict[int, int] = {}
    for g in groups:
        if g.insert_seq == g.group_id:
            g.insert_seq = g.group_id
        g.birth_step = births.setdefault(g.birth_step, g.birth_step)
        a, b = g.headroom_cached, g.headroom_ref
        if a == b and math.copysign(1.0, a) == math.copysign(1.0, b):  # bit-equal (signed 0)
            g.headroom_cached = g.headroom_ref


def _groups_v2(p: Mapping[str, Any], count: int, bookkeeping: dict[str, list[Any]]) -> list[ReplayGroup]:
    sizes = p["packed_sizes"].tolist()
    packed = p["packed"].numpy()
    if len(sizes) != count or sum(sizes) != packed.size or min(sizes, default=1) < 1:
        raise ValueError("replay buffer state is inconsistent: packed sizes do not match")
    groups, off = [], 0
    for i, size in enumerate(sizes):
        buf = packed[off : off + size].tobytes()
        off += size
        try:
            groups.append(ReplayGroup._from_packed(buf, **{k: v[i] for k, v in bookkeeping.items()}))
        except ValueError as exc:
            raise ValueError(f"replay buffer state, group {i}: {exc}") from None
    return groups


def _groups_v1(p: Mapping[str, Any], count: int, bookkeeping: dict[str, list[Any]]) -> list[ReplayGroup]:
    """Format 1 (one concatenated tensor per field, meta as a list of dicts): repacked."""
    sizes = p["group_sizes"].tolist()
    if len(sizes) != count or len(p["meta"]) != count:
        raise ValueError("replay buffer state is inconsistent: group counts differ")
    plen = p["prompt_lengths"].tolist()
    rlen = p["response_lengths"]
    per_resp = rlen.tolist()
    tok_counts, off = [], 0
    for n in sizes:  # tokens per group = sum of its response lengths
        tok_counts.append(sum(per_resp[off : off + n]))
        off += n
    parts = {
        "prompt_ids": torch.split(p["prompt_ids"], plen),
        "response_lengths": torch.split(rlen, sizes),
        "response_ids": torch.split(p["response_ids"], tok_counts),
        "response_mask": torch.split(p["response_mask"], tok_counts),
        "gen_log_probs": torch.split(p["gen_log_probs"], tok_counts),
        "advantages": torch.split(p["advantages"], sizes),
        "correct": torch.split(p["correct"], sizes),
        "scores": torch.split(p["scores"], sizes),
    }
    return [
        ReplayGroup(
            **{k: v[i] for k, v in parts.items()}, meta=dict(p["meta"][i]), **{k: v[i] for k, v in bookkeeping.items()}
        )
        for i in range(count)
    ]


def scan_chunk_multiple(rows_per_group: int, row_multiple: int) -> int:
    """``chunk_multiple`` for :meth:`HeadroomDriftBuffer.select` under a row-padded dispatch.

    The scorer's forward takes rows in multiples of ``row_multiple`` (data-parallel size x
    micro-batch size), padding the rest. When ``rows_per_group`` divides it, chunks of a multiple
    of ``row_multiple // rows_per_group`` groups fill the padding with real candidates at no
    extra forward rows; otherwise 1, because no group multiple avoids adding rows for every
    chunk size.
    """
    n = _check_int("rows_per_group", rows_per_group, 1)
    r = _check_int("row_multiple", row_multiple, 1)
    return r // n if r % n == 0 else 1


# ============================================================================ Headroom-Drift


class HeadroomDriftBuffer(_FifoReplayStore):
    """Headroom-ranked, Policy-Drift-gated replay of whole GRPO groups (SPEC 1.3-1.5).

    Args (keyword-only):
        capacity: maximum number of groups (FIFO eviction of the oldest).
        k_rep: K_rep, maximum number of groups accepted per step.
        tau: drift gate, accept iff D <= tau (``math.inf`` disables the gate).
        weighting: Headroom weighting, "sign" (default) or "advantage".
        drift_norm: "l2" (default) or "l1".
        scan_chunk_groups: most groups per scorer call (before rounding to ``chunk_multiple``).
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
        self.max_scan_groups = None if max_scan_groups is None else _check_int("max_scan_groups", max_scan_groups, 1)
        # ranking heap with lazy invalidation (see module docstring)
        self._heap: list[tuple[float, int, int, int]] = []
        # -birth_step objects shared by all entries of one birth step (an int per entry otherwise)
        self._neg_birth: dict[int, int] = {}

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(
            tau=self.tau,
            drift_norm=self.drift_norm,
            scan_chunk_groups=self.scan_chunk_groups,
            max_scan_groups=self.max_scan_groups,
        )
        return cfg

    # -- ranking structure --------------------------------------------------------------------

    def _entry(self, g: ReplayGroup) -> tuple[float, int, int, int]:
        # min-heap key: higher cached H first, then newer birth step, then earlier insertion
        neg_birth = self._neg_birth.get(g.birth_step)
        if neg_birth is None:
            neg_birth = self._neg_birth[g.birth_step] = -g.birth_step
        return (-g.headroom_cached, neg_birth, g.insert_seq, g.group_id)

    def _is_live(self, entry: tuple[float, int, int, int]) -> bool:
        g = self._groups.get(entry[3])
        return g is not None and g._rank is entry

    def _push(self, g: ReplayGroup) -> None:
        g._rank = entry = self._entry(g)
        heapq.heappush(self._heap, entry)

    def _on_insert(self, group: ReplayGroup) -> None:
        self._push(group)

    def _on_evict(self, group: ReplayGroup) -> None:
        group._rank = None  # its heap entry is now stale

    def _after_mutation(self) -> None:
        # compact once stale entries exceed a quarter of the live ones (+ slack so tiny buffers
        # don't thrash): O(heap) after >= N/4 stale entries were made, amortised O(1) each,
        # and the heap holds at most 1.25 N + 64 entries
        if len(self._heap) - len(self._groups) > len(self._groups) // 4 + 64:
            self._heap = [e for e in self._heap if self._is_live(e)]
            heapq.heapify(self._heap)
            self._neg_birth = {-e[1]: e[1] for e in self._heap}

    def _rebuild_index(self) -> None:
        self._neg_birth = {}
        self._heap = []
        for g in self._groups.values():
            g._rank = self._entry(g)
            self._heap.append(g._rank)
        heapq.heapify(self._heap)

    def _pop_live(self, want: int) -> list[tuple[float, int, int, int]]:
        """Pop up to ``want`` live entries in rank order, discarding stale ones."""
        out: list[tuple[float, int, int, int]] = []
        while len(out) < want and self._heap:
            entry = heapq.heappop(self._heap)
            if self._is_live(entry):
                out.append(entry)
        return out

    # -- selection ------------------------------------------------------------------------------

    def _score(self, group: ReplayGroup, log_probs: Any) -> Any:
        if (
            not isinstance(log_probs, Tensor)
            or log_probs.dim() != 1
            or log_probs.numel() != group.num_tokens
            or not log_probs.is_floating_point()
        ):
            shape = tuple(log_probs.shape) if isinstance(log_probs, Tensor) else type(log_probs).__name__
            raise ValueError(
                f"scorer must return a 1-D float tensor of length num_tokens={group.num_tokens} "
                f"for group {group.group_id}, got {shape}"
            )
        gen, mask, lengths, adv = group._scoring_fields()
        try:
            return group_scores_flat(
                log_probs.detach().to("cpu"), gen, mask, lengths, adv, self.weighting, self.drift_norm, validate=False
            )
        except ValueError as exc:
            raise ValueError(f"scorer output for group {group.group_id}: {exc}") from None

    def _chunk_size(self, accepted: int, scanned: int, budget: int, multiple: int) -> int:
        """Groups to give the scorer next: no more than the scan can still use, except that
        the count is rounded up to ``multiple`` (those extra groups take the place of dispatch
        padding, so they cost no forward rows) and never past the scan budget."""
        left = budget - scanned
        want = min(self.scan_chunk_groups, self.k_rep - accepted, left)
        return min(-(-want // multiple) * multiple, left)

    def select(self, step: int, scorer: Scorer, *, chunk_multiple: int = 1) -> SelectionResult:
        """Pick up to K_rep replay groups for ``step`` (SPEC 1.3); call before ``admit``.

        Scans candidates by cached Headroom (desc; ties newer birth step, then earlier
        insertion), one scorer call per chunk; refreshes the cached Headroom of every scanned
        group; accepts while D <= tau; stops at K_rep accepted, no candidates left, or
        ``max_scan_groups`` scanned. Each chunk holds the smaller of ``scan_chunk_groups`` and
        the acceptances still needed (K_rep - accepted), rounded up to a multiple of
        ``chunk_multiple`` (in groups: what the caller's data-parallel dispatch needs, see
        :func:`scan_chunk_multiple`), and at most the scan budget left and the candidates left.
        Groups of the last chunk beyond the stopping point are not scanned: no record, no
        refresh. The decisions do not depend on the chunk sizes (given a scorer whose output
        for a group does not depend on its chunk). If the scorer raises, the buffer is left
        exactly as before.
        """
        t0 = time.perf_counter()
        step = _check_int("step", step, -(2**62))
        multiple = _check_int("chunk_multiple", chunk_multiple, 1)
        if not callable(scorer):
            raise ValueError("scorer must be callable: scorer(list[ReplayGroup]) -> list[Tensor]")
        candidates = len(self._groups)
        budget = candidates if self.max_scan_groups is None else min(candidates, self.max_scan_groups)
        popped: list[tuple[float, int, int, int]] = []
        records: list[ScanRecord] = []
        refreshed: dict[int, float] = {}
        accepted: list[ReplayGroup] = []
        chunk_groups: list[int] = []
        chunk_rows: list[int] = []
        forward_s = 0.0
        done = False
        try:
            while not done and len(records) < budget:
                chunk = self._pop_live(self._chunk_size(len(accepted), len(records), budget, multiple))
                popped.extend(chunk)
                if not chunk:
                    break
                groups = [self._groups[e[3]] for e in chunk]
                tf = time.perf_counter()
                outputs = scorer(groups)
                forward_s += time.perf_counter() - tf
                chunk_groups.append(len(groups))
                chunk_rows.append(sum(g.n for g in groups))
                if len(outputs) != len(groups):
                    raise ValueError(f"scorer returned {len(outputs)} tensors for {len(groups)} groups")
                for g, lp in zip(groups, outputs, strict=True):
                    sc = self._score(g, lp)
                    ok = sc.drift <= self.tau
                    records.append(
                        ScanRecord(
                            group_id=g.group_id,
                            rank=len(records) + 1,
                            birth_step=g.birth_step,
                            age=step - g.birth_step,
                            headroom_before=g.headroom_cached,
                            headroom_after=sc.headroom,
                            drift=sc.drift,
                            replay_kl=sc.replay_kl,
                            num_valid_tokens=sc.num_valid_tokens,
                            accepted=ok,
                        )
                    )
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
        return SelectionResult(
            step=step,
            groups=accepted,
            records=records,
            stats=stats,
            scorer_calls=len(chunk_groups),
            scored_groups=len(popped),
            chunk_groups=tuple(chunk_groups),
            chunk_rows=tuple(chunk_rows),
        )

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

    def __init__(self, *, capacity: int, k_rep: int, ingress: str = "answer_disagree", weighting: str = "sign") -> None:
        super().__init__(capacity=capacity, k_rep=k_rep, ingress=ingress, weighting=weighting)

    def select(self, step: int, scorer: Scorer | None = None, *, chunk_multiple: int = 1) -> SelectionResult:
        """The latest K_rep groups, newest first. ``scorer`` and ``chunk_multiple`` are accepted
        for the same call as :meth:`HeadroomDriftBuffer.select` and unused: nothing is scanned,
        so nothing goes through a forward (``forward_rows() == 0``)."""
        t0 = time.perf_counter()
        step = _check_int("step", step, -(2**62))
        _check_int("chunk_multiple", chunk_multiple, 1)
        candidates = len(self._groups)
        accepted: list[ReplayGroup] = []
        records: list[ScanRecord] = []
        for gid in reversed(self._groups):  # newest first; stops after k_rep: O(k_rep)
            if len(accepted) >= self.k_rep:
                break
            g = self._groups[gid]
            accepted.append(g)
            records.append(
                ScanRecord(
                    group_id=g.group_id,
                    rank=len(records) + 1,
                    birth_step=g.birth_step,
                    age=step - g.birth_step,
                    headroom_before=g.headroom_cached,
                    headroom_after=None,
                    drift=None,
                    replay_kl=None,
                    num_valid_tokens=g.num_valid_tokens,
                    accepted=True,
                )
            )
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
