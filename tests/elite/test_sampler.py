"""BalancedSampler / IIDSampler: balance at every draw, determinism, resume."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_replay.elite.archive import FrozenArchive, FrozenEntry
from verl_replay.elite.sampler import BalancedSampler, IIDSampler


def make_frozen(cells_per_question: list[int]) -> FrozenArchive:
    entries = []
    for qi, n_cells in enumerate(cells_per_question):
        for ci in range(n_cells):
            entries.append(
                FrozenEntry(
                    question_id=f"q{qi:03d}",
                    approach=f"a{ci % 3}",
                    descriptor=f"d{ci:02d}",
                    text=f"solution {qi}/{ci}",
                    num_tokens=3 + ci,
                    requested_approach=None,
                    parent=None,
                    insertion_round=0,
                    verification_reason="ok",
                    prompt=[{"role": "user", "content": f"question {qi}"}],
                    ground_truth=qi,
                    question_metadata={},
                    generation_metadata={},
                )
            )
    return FrozenArchive(entries)


def check_call(archive: FrozenArchive, idx: np.ndarray, q_counts: np.ndarray, c_counts: np.ndarray) -> None:
    """Replay one call's draws one by one against independent counters and check every step."""
    entry_q = np.repeat(np.arange(archive.num_questions), np.diff(archive.offsets))
    starts = archive.offsets[:-1]
    in_call_q = np.zeros_like(q_counts)
    in_call_c = np.zeros_like(c_counts)
    for i in idx:
        qi = entry_q[i]
        q_counts[qi] += 1
        c_counts[i] += 1
        in_call_q[qi] += 1
        in_call_c[i] += 1
        # the balance guarantee, after every single draw
        assert q_counts.max() - q_counts.min() <= 1
        spread = np.maximum.reduceat(c_counts, starts) - np.minimum.reduceat(c_counts, starts)
        assert spread.max() <= 1
        # in-call tie-break: questions (and a question's cells) are used evenly within a call
        assert in_call_q.max() - in_call_q.min() <= 1
        lo, hi = archive.offsets[qi], archive.offsets[qi + 1]
        assert in_call_c[lo:hi].max() - in_call_c[lo:hi].min() <= 1
    k, n_q = len(idx), archive.num_questions
    if k:
        per_q = np.bincount(entry_q[idx], minlength=n_q)
        assert per_q.max() <= math.ceil(k / n_q) and per_q.min() >= k // n_q


shapes = st.lists(st.integers(1, 6), min_size=1, max_size=12)
calls = st.lists(st.integers(0, 30), min_size=1, max_size=15)


@settings(max_examples=80, deadline=None)
@given(shape=shapes, ks=calls, seed=st.integers(0, 2**32 - 1))
def test_balanced_at_every_step(shape, ks, seed):
    archive = make_frozen(shape)
    sampler = BalancedSampler(archive, seed=seed)
    q_counts = np.zeros(archive.num_questions, dtype=np.int64)
    c_counts = np.zeros(len(archive), dtype=np.int64)
    for k in ks:
        idx = sampler.sample_indices(k)
        assert idx.shape == (k,)
        check_call(archive, idx, q_counts, c_counts)
        np.testing.assert_array_equal(sampler.question_counts(), q_counts)
        np.testing.assert_array_equal(sampler.cell_counts(), c_counts)
        stats = sampler.stats()
        assert stats["draws"] == k and stats["total_draws"] == q_counts.sum()
        assert stats["distinct_cells"] == len(set(idx.tolist()))
        assert stats["distinct_questions"] == len({archive.entries[i].question_id for i in idx})
        assert stats["question_spread"] == q_counts.max() - q_counts.min() <= 1
        assert stats["cell_spread"] <= 1


@settings(max_examples=40, deadline=None)
@given(shape=shapes, ks=calls, cut=st.integers(0, 15), seed=st.integers(0, 2**32 - 1))
def test_resume_gives_identical_continuation(shape, ks, cut, seed):
    archive = make_frozen(shape)
    for cls in (BalancedSampler, IIDSampler):
        original = cls(archive, seed=seed)
        cut_at = min(cut, len(ks))
        for k in ks[:cut_at]:
            original.sample_indices(k)
        state = json.loads(json.dumps(original.state_dict()))
        resumed = cls(archive, seed=seed + 1)
        resumed.load_state_dict(state)
        assert resumed.stats() == original.stats()
        for k in ks[cut_at:] + [7, 13]:
            np.testing.assert_array_equal(original.sample_indices(k), resumed.sample_indices(k))
            assert original.stats() == resumed.stats()
        assert json.dumps(original.state_dict()) == json.dumps(resumed.state_dict())


def test_k_at_most_questions_gives_distinct_questions_and_larger_k_repeats():
    archive = make_frozen([1, 2, 3, 4, 5])
    sampler = BalancedSampler(archive, seed=0)
    for k in (3, 5, 2, 4, 1, 5):
        got = [e.question_id for e in sampler.sample(k)]
        assert len(set(got)) == k
    got = Counter(e.question_id for e in sampler.sample(12))
    assert sorted(got.values()) == [2, 2, 2, 3, 3]
    # a question drawn several times in one call gets distinct cells while it has unused ones
    single = make_frozen([4])
    s = BalancedSampler(single, seed=1)
    s.sample(1)
    assert len(set(s.sample(4))) == 4  # entries are hashable


def test_seeded_determinism_and_uniform_tie_break():
    archive = make_frozen([2] * 50)
    a = BalancedSampler(archive, seed=7).sample_indices(40)
    b = BalancedSampler(archive, seed=7).sample_indices(40)
    c = BalancedSampler(archive, seed=8).sample_indices(40)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    small = make_frozen([1, 1, 1, 1])
    first = Counter(BalancedSampler(small, seed=s).sample(1)[0].question_id for s in range(400))
    assert set(first) == {"q000", "q001", "q002", "q003"}
    assert all(60 <= n <= 140 for n in first.values()), first
    cells = Counter(BalancedSampler(make_frozen([3]), seed=s).sample(1)[0].descriptor for s in range(300))
    assert all(60 <= n <= 140 for n in cells.values()), cells


def test_balanced_weights_questions_not_entries_and_iid_weights_entries():
    archive = make_frozen([1, 4, 1, 4])
    bal = BalancedSampler(archive, seed=0)
    bal.sample(4000)
    np.testing.assert_array_equal(bal.question_counts(), [1000, 1000, 1000, 1000])
    assert set(bal.cell_counts().tolist()) == {1000, 250}
    iid = IIDSampler(archive, seed=0)
    iid.sample(20000)
    qc = iid.question_counts()
    assert 3.5 <= qc[1] / qc[0] <= 4.5 and 3.5 <= qc[3] / qc[2] <= 4.5
    assert iid.stats()["question_spread"] > 1  # IID replay gives no balance guarantee
    assert iid.stats()["draws"] == 20000 and iid.stats()["total_draws"] == 20000


def test_sample_returns_entries_in_draw_order():
    archive = make_frozen([2, 3])
    s = BalancedSampler(archive, seed=3)
    idx = BalancedSampler(archive, seed=3).sample_indices(6)
    assert s.sample(6) == [archive.entries[i] for i in idx]
    assert s.sample(0) == [] and s.stats()["draws"] == 0


def test_invalid_use():
    archive = make_frozen([2, 1])
    with pytest.raises(ValueError, match="empty"):
        BalancedSampler(FrozenArchive([]), seed=0)
    with pytest.raises(ValueError, match="empty"):
        IIDSampler(FrozenArchive([]), seed=0)
    with pytest.raises(ValueError, match="k must be >= 0"):
        BalancedSampler(archive, seed=0).sample(-1)
    with pytest.raises(TypeError):
        BalancedSampler(archive, seed=0).sample(True)
    with pytest.raises(ValueError, match="seed"):
        BalancedSampler(archive, seed=-3)
    with pytest.raises(TypeError, match="FrozenArchive"):
        BalancedSampler(list(archive), seed=0)  # type: ignore[arg-type]


def test_load_state_refuses_foreign_or_inconsistent_states():
    archive = make_frozen([2, 2, 1])
    s = BalancedSampler(archive, seed=0)
    s.sample(4)
    state = s.state_dict()
    with pytest.raises(ValueError, match="saved for archive"):
        BalancedSampler(make_frozen([2, 2, 2]), seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="kind"):
        IIDSampler(archive, seed=0).load_state_dict(state)
    bad = json.loads(json.dumps(state))
    bad["question_counts"][0] += 2
    bad["cell_counts"][0] += 2
    bad["total_draws"] += 2
    with pytest.raises(ValueError, match="balance"):
        BalancedSampler(archive, seed=0).load_state_dict(bad)
    bad = json.loads(json.dumps(state))
    bad["cell_order"][0], bad["cell_order"][-1] = bad["cell_order"][-1], bad["cell_order"][0]
    with pytest.raises(ValueError, match="segment"):
        BalancedSampler(archive, seed=0).load_state_dict(bad)
    bad = json.loads(json.dumps(state))
    bad["cell_counts"][0] += 1
    with pytest.raises(ValueError, match="add up"):
        BalancedSampler(archive, seed=0).load_state_dict(bad)
