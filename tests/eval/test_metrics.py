"""Evaluation metrics against hand-computed values and exact combinatorics."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from verl_replay.eval.metrics import (
    ambiqt_coverage,
    best_at_n,
    best_at_n_per_question,
    distinct_correct_strategies,
    macro_average,
    mean_at_n,
    mean_at_n_per_question,
    mean_pass_at_k,
    pass_at_k,
    weighted_average,
)


def test_pass_at_k_hand_values():
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # k = 1 -> c / n
    assert pass_at_k(7, 0, 3) == 0.0  # c = 0
    assert pass_at_k(7, 7, 3) == 1.0  # c = n
    assert pass_at_k(6, 1, 6) == 1.0 and pass_at_k(6, 0, 6) == 0.0  # n = k
    assert pass_at_k(5, 3, 3) == 1.0  # n - c < k: every 3-subset holds a correct sample
    assert pass_at_k(1000, 1, 128) == pytest.approx(0.128, rel=1e-12)  # c = 1 -> k / n
    assert pass_at_k(np.int64(4), np.int64(1), np.int64(2)) == pytest.approx(0.5)


def test_pass_at_k_equals_exact_combinatorics_on_a_grid():
    for n in range(1, 31):
        for c in range(0, n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-14), (n, c, k)
    for c in range(0, 11):  # k = 1 gives c / n for every c
        assert pass_at_k(10, c, 1) == pytest.approx(c / 10, abs=1e-15)


def test_pass_at_k_large_n_is_stable():
    n, c, k = 2000, 37, 128
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def test_pass_at_k_validation():
    with pytest.raises(ValueError, match="exceeds the number of samples"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c=5 correct exceeds"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match=">= 0"):
        pass_at_k(4, -1, 1)
    with pytest.raises(ValueError, match=">= 0"):
        pass_at_k(-4, 0, 1)
    with pytest.raises(ValueError, match="k must be >= 1"):
        pass_at_k(4, 1, 0)
    with pytest.raises(TypeError):
        pass_at_k(4.0, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pass_at_k(4, True, 1)


def test_mean_and_best_at_n():
    correct = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=bool)
    np.testing.assert_allclose(mean_at_n_per_question(correct), [0.5, 0.0, 1.0])
    np.testing.assert_array_equal(best_at_n_per_question(correct), [True, False, True])
    assert mean_at_n(correct) == pytest.approx(0.5)
    assert best_at_n(correct) == pytest.approx(2 / 3)
    # ragged (questions with different sample counts), 0/1 ints: per-question means first
    ragged = [[1, 0], [1, 1, 1, 0], [0]]
    assert mean_at_n(ragged) == pytest.approx((0.5 + 0.75 + 0.0) / 3)
    assert best_at_n(ragged) == pytest.approx(2 / 3)
    # pass@k of a benchmark: mean over questions
    assert mean_pass_at_k(correct, 1) == pytest.approx(0.5)
    assert mean_pass_at_k(correct, 2) == pytest.approx((1 - 1 / 6 + 0 + 1) / 3)
    with pytest.raises(ValueError, match="no questions"):
        mean_at_n([])
    with pytest.raises(ValueError, match="question 1 needs a non-empty"):
        mean_at_n([[1], []])
    with pytest.raises(ValueError, match="other than bool"):
        mean_at_n([[1, 2]])
    with pytest.raises(ValueError, match=r"\[Q, n\]"):
        mean_at_n(np.ones(3, dtype=bool))


def test_macro_and_weighted_average():
    scores = {"math500": 0.8, "aime24": 0.2, "amc23": 0.5}
    assert macro_average(scores) == pytest.approx(0.5)
    sizes = {"math500": 500, "aime24": 30, "amc23": 40}
    assert weighted_average(scores, sizes) == pytest.approx((0.8 * 500 + 0.2 * 30 + 0.5 * 40) / 570)
    with pytest.raises(ValueError, match="keys"):
        weighted_average(scores, {"math500": 500})
    with pytest.raises(ValueError, match=">= 1"):
        weighted_average(scores, {**sizes, "aime24": 0})
    with pytest.raises(ValueError, match="no benchmarks"):
        macro_average({})
    with pytest.raises(ValueError, match="non-finite"):
        macro_average({"a": float("nan")})


def test_distinct_correct_strategies():
    skeletons = ["S1", "S2", "S1", "S3", "S4", None]
    correct = [True, True, True, False, True, True]
    assert distinct_correct_strategies(skeletons, correct) == 3  # S1, S2, S4; S3 wrong; None unparsed
    assert distinct_correct_strategies(["S1", "S2"], [False, False]) == 0
    assert distinct_correct_strategies([], []) == 0

    def skeleton(sql: str) -> str:
        if "WRONG" in sql:
            raise AssertionError("skeleton must only run on correct samples")
        return sql.split(" FROM")[0]

    samples = ["SELECT a FROM t", "SELECT a FROM u", "SELECT b FROM t", "WRONG"]
    assert distinct_correct_strategies(samples, [1, 1, 1, 0], skeleton=skeleton) == 2
    with pytest.raises(ValueError, match="2 samples but 1"):
        distinct_correct_strategies(["a", "b"], [True])
    with pytest.raises(TypeError, match="str or None"):
        distinct_correct_strategies([1], [True])


def test_ambiqt_coverage():
    m1 = [[1, 0, 0], [0, 0, 0], [0, 1, 0], [1, 1, 1]]
    m2 = [[0, 0, 1], [1, 1, 1], [0, 1, 0], [0, 0, 0]]
    # q0: both (different samples), q1: only interp2, q2: both (same sample), q3: only interp1
    assert ambiqt_coverage(m1, m2) == pytest.approx(0.5)
    assert ambiqt_coverage(np.array(m1, dtype=bool), np.array(m1, dtype=bool)) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="questions"):
        ambiqt_coverage(m1, m2[:3])
    with pytest.raises(ValueError, match="question 0 has 3 vs 2 samples"):
        ambiqt_coverage(m1, [[0, 1], *m2[1:]])
