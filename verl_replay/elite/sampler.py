"""Replay samplers over a :class:`~verl_replay.elite.archive.FrozenArchive`.

:class:`BalancedSampler` -- each draw takes a question with the fewest cumulative draws, then,
within it, a cell with the fewest cumulative draws. Ties are broken, in this order, by fewer
draws *in the current* ``sample(k)`` *call*, then uniformly at random with the sampler's own
seeded generator. Consequences (all tested, after every single draw):

* cumulative draw counts differ by at most one across questions, and across the cells of each
  question (the balance guarantee; it only needs "least cumulative draws first");
* within one call, a question appears ``floor(k/Q)`` or ``ceil(k/Q)`` times, so a call with
  ``k <= Q`` returns ``k`` distinct questions, and a call with ``k > Q`` repeats questions
  (each at most ``ceil(k/Q)`` times) rather than refusing; likewise the repeats of a question
  within a call go to distinct cells while it has unused ones. (Why the in-call tie-break holds
  these: when an item with ``c`` in-call draws is chosen, any item with fewer in-call draws would
  have to have one more cumulative draw now and therefore two more at the call's start -- which
  the cumulative guarantee rules out.)

Returned lists are in draw order.

Complexity. Cumulative counts of a set of siblings (all questions, or the cells of one question)
take only two values ``m`` and ``m+1``, and in-call counts only two values ``c`` and ``c+1``,
so each set is a bucket queue with at most four buckets keyed ``(cumulative, in_call)``. A
bucket is a list with swap-remove (an index map), so a draw finds the least non-empty bucket
(<= 4 keys), picks a uniform position, and moves the item to the next bucket: O(1). At the end
of a call the items drawn in it move back to their ``(cumulative, 0)`` bucket: O(k). A call is
therefore O(k) -- better than the O(k log Q) a heap would give, and never O(Q) per draw. The
random numbers of a call are drawn in one vectorised ``rng.random(2k)``. The cells of a
question get their bucket queue at its first draw (O(its cells), once). ``stats()``,
``state_dict()`` and ``load_state_dict()`` are O(entries), vectorised.

:class:`IIDSampler` -- uniform over entries with replacement (the IID archive-replay baseline), same API.

Both checkpoint their complete state (counts, bucket order, generator state) in a JSON-ready
``state_dict()``; loading it into a sampler over the same archive continues with identical draws.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Iterable, Mapping

import numpy as np

from verl_replay.elite.archive import FrozenArchive, FrozenEntry

__all__ = ["BalancedSampler", "IIDSampler"]

_STATE_VERSION = 1


def _check_k(k: Any) -> int:
    if isinstance(k, (bool, np.bool_)):
        raise TypeError("sample(k): k must be an int, got a bool")
    k = operator.index(k)
    if k < 0:
        raise ValueError(f"sample(k): k must be >= 0, got {k}")
    return k


def _check_seed(seed: Any, who: str) -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"{who}(seed=...) must be a non-negative int, got {seed!r}")
    return int(seed)


class _LeastDrawnBag:
    """Seeded uniform choice among the items with the least ``(cumulative, in_call)`` draws.

    ``counts`` is the sampler's array of cumulative counts (shared, indexed by item); the bag
    increments it. Buckets are plain lists with swap-remove; ``_pos`` maps item -> index.
    """

    __slots__ = ("_counts", "_buckets", "_key", "_pos", "_touched")

    def __init__(self, order: Iterable[int], counts: np.ndarray) -> None:
        self._counts = counts
        self._buckets: dict[tuple[int, int], list[int]] = {}
        self._key: dict[int, tuple[int, int]] = {}
        self._pos: dict[int, int] = {}
        self._touched: list[int] = []  # items drawn in the current call, in first-draw order
        for item in order:
            self._push(int(item), (int(counts[item]), 0))

    def _push(self, item: int, key: tuple[int, int]) -> None:
        bucket = self._buckets.setdefault(key, [])
        self._key[item] = key
        self._pos[item] = len(bucket)
        bucket.append(item)

    def _remove(self, item: int) -> None:
        key = self._key[item]
        bucket = self._buckets[key]
        j = self._pos[item]
        last = bucket.pop()
        if last != item:  # swap-remove: the last element takes the freed slot
            bucket[j] = last
            self._pos[last] = j
        if not bucket:
            del self._buckets[key]

    @property
    def in_call(self) -> bool:
        return bool(self._touched)

    def draw(self, u: float) -> int:
        """Take an item with the least key; ``u`` in [0, 1) picks the position in the bucket."""
        key = min(self._buckets)  # <= 4 keys
        bucket = self._buckets[key]
        item = bucket[min(int(u * len(bucket)), len(bucket) - 1)]
        self._remove(item)
        self._counts[item] += 1
        if key[1] == 0:
            self._touched.append(item)
        self._push(item, (key[0] + 1, key[1] + 1))
        return item

    def end_call(self) -> None:
        for item in self._touched:  # deterministic order, so a checkpoint reproduces the buckets
            self._remove(item)
            self._push(item, (int(self._counts[item]), 0))
        self._touched.clear()

    def order(self) -> list[int]:
        """Items bucket by bucket (least key first); rebuilding from it gives identical buckets.
        Only meaningful between calls."""
        return [item for key in sorted(self._buckets) for item in self._buckets[key]]


class _SamplerBase:
    """Archive bookkeeping, counts, stats and the common parts of checkpointing."""

    _kind = "base"

    def __init__(self, archive: FrozenArchive, *, seed: int) -> None:
        if not isinstance(archive, FrozenArchive):
            raise TypeError(f"{type(self).__name__} samples a FrozenArchive, got {type(archive).__name__}")
        if len(archive) == 0:
            raise ValueError(f"{type(self).__name__}: the archive is empty; nothing to replay")
        self._archive = archive
        self._entries = archive.entries
        self._offsets = archive.offsets  # [Q + 1]
        sizes = np.diff(self._offsets)  # [Q] cells per question
        self._entry_question = np.repeat(np.arange(archive.num_questions, dtype=np.int64), sizes)  # [N]
        self._rng = np.random.default_rng(_check_seed(seed, type(self).__name__))
        self._q_counts = np.zeros(archive.num_questions, dtype=np.int64)  # [Q] cumulative draws
        self._cell_counts = np.zeros(len(archive), dtype=np.int64)  # [N] cumulative draws
        self._last = np.zeros(0, dtype=np.int64)  # entry indices of the last call
        self._total = 0

    @property
    def archive(self) -> FrozenArchive:
        return self._archive

    def sample(self, k: int) -> list[FrozenEntry]:
        """``k`` entries in draw order (``sample_indices`` is each subclass's draw rule)."""
        return [self._entries[i] for i in self.sample_indices(k)]  # type: ignore[attr-defined]

    def question_counts(self) -> np.ndarray:
        """Cumulative draws per question (copy), in ``archive.question_ids`` order."""
        return self._q_counts.copy()

    def cell_counts(self) -> np.ndarray:
        """Cumulative draws per entry (copy), in ``archive.entries`` order."""
        return self._cell_counts.copy()

    def stats(self) -> dict[str, int]:
        """Last call: ``draws``, ``distinct_questions``, ``distinct_cells``. Cumulative:
        ``total_draws``, ``question_spread`` (max - min draws over questions) and ``cell_spread``
        (max over questions of max - min draws over its cells)."""
        starts = self._offsets[:-1]
        within = np.maximum.reduceat(self._cell_counts, starts) - np.minimum.reduceat(self._cell_counts, starts)
        return {
            "draws": int(self._last.size),
            "distinct_questions": int(np.unique(self._entry_question[self._last]).size),
            "distinct_cells": int(np.unique(self._last).size),
            "total_draws": int(self._total),
            "question_spread": int(self._q_counts.max() - self._q_counts.min()),
            "cell_spread": int(within.max()),
        }

    def _base_state(self) -> dict[str, Any]:
        return {
            "kind": self._kind,
            "version": _STATE_VERSION,
            "archive_fingerprint": self._archive.fingerprint,
            "num_questions": self._archive.num_questions,
            "num_entries": len(self._archive),
            "question_counts": self._q_counts.tolist(),
            "cell_counts": self._cell_counts.tolist(),
            "total_draws": int(self._total),
            "last": self._last.tolist(),
            "rng": copy.deepcopy(self._rng.bit_generator.state),
        }

    def _check_base_state(
        self, state: Mapping[str, Any]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.random.Generator]:
        name = type(self).__name__
        if state.get("kind") != self._kind or state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"{name}.load_state_dict: state is kind {state.get('kind')!r} version {state.get('version')!r}, "
                f"expected {self._kind!r} version {_STATE_VERSION}"
            )
        if state["archive_fingerprint"] != self._archive.fingerprint:
            raise ValueError(
                f"{name}.load_state_dict: state was saved for archive {state['archive_fingerprint']}, "
                f"this sampler's archive is {self._archive.fingerprint}"
            )
        q_counts = np.asarray(state["question_counts"], dtype=np.int64)
        cell_counts = np.asarray(state["cell_counts"], dtype=np.int64)
        if q_counts.shape != self._q_counts.shape or cell_counts.shape != self._cell_counts.shape:
            raise ValueError(f"{name}.load_state_dict: count arrays do not match the archive's shape")
        if (q_counts < 0).any() or (cell_counts < 0).any():
            raise ValueError(f"{name}.load_state_dict: negative counts")
        if not np.array_equal(np.add.reduceat(cell_counts, self._offsets[:-1]), q_counts):
            raise ValueError(f"{name}.load_state_dict: cell counts do not add up to question counts")
        if int(q_counts.sum()) != int(state["total_draws"]):
            raise ValueError(f"{name}.load_state_dict: counts do not add up to total_draws")
        last = np.asarray(state["last"], dtype=np.int64)
        if last.size and (last.min() < 0 or last.max() >= len(self._archive)):
            raise ValueError(f"{name}.load_state_dict: 'last' indexes outside the archive")
        rng = np.random.default_rng()
        rng.bit_generator.state = copy.deepcopy(state["rng"])
        return q_counts, cell_counts, last, rng


class BalancedSampler(_SamplerBase):
    """Question-balanced, then cell-balanced replay sampler (see the module docstring).

    ``sample(k)`` -> ``k`` :class:`FrozenEntry` in draw order; ``sample_indices(k)`` -> their
    indices into ``archive.entries``.
    """

    _kind = "BalancedSampler"

    def __init__(self, archive: FrozenArchive, *, seed: int) -> None:
        super().__init__(archive, seed=seed)
        self._q_bag = _LeastDrawnBag(range(archive.num_questions), self._q_counts)
        # Initial bucket order of the cell bags not built yet (built at a question's first draw).
        self._cell_order = np.arange(len(archive), dtype=np.int64)
        self._cell_bags: dict[int, _LeastDrawnBag] = {}

    def _cell_bag(self, q: int) -> _LeastDrawnBag:
        bag = self._cell_bags.get(q)
        if bag is None:
            lo, hi = int(self._offsets[q]), int(self._offsets[q + 1])
            bag = self._cell_bags[q] = _LeastDrawnBag(self._cell_order[lo:hi].tolist(), self._cell_counts)
        return bag

    def sample_indices(self, k: int) -> np.ndarray:
        k = _check_k(k)
        u = self._rng.random(2 * k).tolist()  # [2k]: even -> question choice, odd -> cell choice
        out = np.empty(k, dtype=np.int64)  # [k] entry indices, draw order
        touched: list[_LeastDrawnBag] = []
        try:
            for i in range(k):
                q = self._q_bag.draw(u[2 * i])
                bag = self._cell_bag(q)
                if not bag.in_call:
                    touched.append(bag)
                out[i] = bag.draw(u[2 * i + 1])
        finally:  # keep the buckets consistent even if interrupted
            self._q_bag.end_call()
            for bag in touched:
                bag.end_call()
        self._last = out
        self._total += k
        return out

    def state_dict(self) -> dict[str, Any]:
        state = self._base_state()
        cell_order = self._cell_order.copy()
        for q, bag in self._cell_bags.items():
            cell_order[self._offsets[q] : self._offsets[q + 1]] = bag.order()
        state["question_order"] = self._q_bag.order()
        state["cell_order"] = cell_order.tolist()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        name = type(self).__name__
        q_counts, cell_counts, last, rng = self._check_base_state(state)
        q_order = np.asarray(state["question_order"], dtype=np.int64)
        cell_order = np.asarray(state["cell_order"], dtype=np.int64)
        n_q, n = len(q_counts), len(cell_counts)
        if q_order.shape != (n_q,) or not np.array_equal(np.sort(q_order), np.arange(n_q)):
            raise ValueError(f"{name}.load_state_dict: question_order is not a permutation of the questions")
        if cell_order.shape != (n,) or not np.array_equal(np.sort(cell_order), np.arange(n)):
            raise ValueError(f"{name}.load_state_dict: cell_order is not a permutation of the entries")
        if not np.array_equal(self._entry_question[cell_order], self._entry_question):
            raise ValueError(f"{name}.load_state_dict: cell_order moves a cell out of its question's segment")
        starts = self._offsets[:-1]
        within = np.maximum.reduceat(cell_counts, starts) - np.minimum.reduceat(cell_counts, starts)
        if q_counts.max() - q_counts.min() > 1 or within.max() > 1:
            raise ValueError(f"{name}.load_state_dict: counts violate the balance guarantee; not a valid state")
        self._q_counts[:] = q_counts
        self._cell_counts[:] = cell_counts
        self._total = int(state["total_draws"])
        self._last = last
        self._rng = rng
        self._q_bag = _LeastDrawnBag(q_order.tolist(), self._q_counts)
        self._cell_order = cell_order
        self._cell_bags = {}


class IIDSampler(_SamplerBase):
    """Uniform over archive entries, with replacement (the IID-replay baseline)."""

    _kind = "IIDSampler"

    def sample_indices(self, k: int) -> np.ndarray:
        k = _check_k(k)
        out = self._rng.integers(0, len(self._entries), size=k, dtype=np.int64)  # [k]
        np.add.at(self._cell_counts, out, 1)
        np.add.at(self._q_counts, self._entry_question[out], 1)
        self._last = out
        self._total += k
        return out

    def state_dict(self) -> dict[str, Any]:
        return self._base_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        q_counts, cell_counts, last, rng = self._check_base_state(state)
        self._q_counts[:] = q_counts
        self._cell_counts[:] = cell_counts
        self._total = int(state["total_draws"])
        self._last = last
        self._rng = rng
