"""Evaluation metrics: pass@k, Mean@n / Best@n, averages over benchmarks, distinct
correct strategies, AmbiQT coverage. Pure functions over numbers, booleans and strings.

Correctness inputs are "per question, per sample" booleans: a 2-D array ``[Q, n]`` or a ragged
sequence of sequences (questions may have different sample counts); every question needs at
least one sample, and values must be bool or 0/1.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = [
    "pass_at_k",
    "mean_pass_at_k",
    "mean_at_n_per_question",
    "best_at_n_per_question",
    "mean_at_n",
    "best_at_n",
    "macro_average",
    "weighted_average",
    "distinct_correct_strategies",
    "ambiqt_coverage",
]


def _count(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got a bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct: ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (no huge binomials, no cancellation for
    large n). Requires ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    n, c, k = _count(n, "n"), _count(c, "c"), _count(k, "k")
    if k < 1:
        raise ValueError(f"pass_at_k: k must be >= 1, got {k}")
    if k > n:
        raise ValueError(f"pass_at_k: k={k} exceeds the number of samples n={n}")
    if c > n:
        raise ValueError(f"pass_at_k: c={c} correct exceeds the number of samples n={n}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def _rows(correct: Any, name: str) -> list[np.ndarray]:
    if isinstance(correct, np.ndarray):
        if correct.ndim != 2:
            raise ValueError(f"{name} must be [Q, n], got shape {correct.shape}")
        rows = list(correct)
    else:
        rows = [np.asarray(r) for r in correct]
    if not rows:
        raise ValueError(f"{name} has no questions")
    out = []
    for i, r in enumerate(rows):
        r = np.asarray(r)
        if r.ndim != 1 or r.size == 0:
            raise ValueError(f"{name}: question {i} needs a non-empty 1-D list of samples, got shape {r.shape}")
        if r.dtype != np.bool_:
            if not np.issubdtype(r.dtype, np.number) or not np.isin(r, (0, 1)).all():
                raise ValueError(f"{name}: question {i} has values other than bool / 0 / 1")
            r = r != 0
        out.append(r)
    return out


def mean_at_n_per_question(correct: Any) -> np.ndarray:
    """``[Q]``: fraction of each question's samples that are correct."""
    return np.array([r.mean() for r in _rows(correct, "correct")], dtype=np.float64)


def best_at_n_per_question(correct: Any) -> np.ndarray:
    """``[Q]`` bool: whether any of each question's samples is correct."""
    return np.array([bool(r.any()) for r in _rows(correct, "correct")], dtype=np.bool_)


def mean_at_n(correct: Any) -> float:
    """Mean@n of a benchmark: mean over questions of the per-question fraction correct."""
    return float(mean_at_n_per_question(correct).mean())


def best_at_n(correct: Any) -> float:
    """Best@n of a benchmark: fraction of questions with at least one correct sample."""
    return float(best_at_n_per_question(correct).mean())


def mean_pass_at_k(correct: Any, k: int) -> float:
    """pass@k of a benchmark: mean over questions of :func:`pass_at_k` (each question's own n)."""
    rows = _rows(correct, "correct")
    return float(np.mean([pass_at_k(r.size, int(r.sum()), k) for r in rows]))


def _finite_scores(per_benchmark: Mapping[str, float], name: str) -> dict[str, float]:
    if not per_benchmark:
        raise ValueError(f"{name}: no benchmarks")
    out = {}
    for b, v in per_benchmark.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
            raise ValueError(f"{name}: benchmark {b!r} has a non-finite or non-numeric score {v!r}")
        out[b] = float(v)
    return out


def macro_average(per_benchmark: Mapping[str, float]) -> float:
    """Unweighted mean over benchmarks (the papers' "Avg")."""
    scores = _finite_scores(per_benchmark, "macro_average")
    return sum(scores.values()) / len(scores)


def weighted_average(per_benchmark: Mapping[str, float], sizes: Mapping[str, int]) -> float:
    """Mean over benchmarks weighted by their number of questions (``sizes``, same keys)."""
    scores = _finite_scores(per_benchmark, "weighted_average")
    if set(sizes) != set(scores):
        raise ValueError(f"weighted_average: sizes keys {sorted(sizes)} differ from benchmark keys {sorted(scores)}")
    weights = {b: _count(sizes[b], f"sizes[{b!r}]") for b in scores}
    if any(w == 0 for w in weights.values()):
        raise ValueError(f"weighted_average: every benchmark size must be >= 1, got {weights}")
    total = sum(weights.values())
    return sum(scores[b] * weights[b] for b in scores) / total


def distinct_correct_strategies(
    samples: Sequence[Any],
    correct: Sequence[bool],
    *,
    skeleton: Callable[[Any], str | None] | None = None,
) -> int:
    """Number of distinct strategy skeletons among one question's correct samples.

    ``samples`` are skeleton strings, or raw samples when ``skeleton`` (e.g.
    ``verl_replay.sql_skeleton``) is given; it is then applied to correct samples only. A
    correct sample whose skeleton is ``None`` (could not be parsed) is not counted as a strategy.
    """
    if len(samples) != len(correct):
        raise ValueError(f"distinct_correct_strategies: {len(samples)} samples but {len(correct)} correctness flags")
    flags = _rows([list(correct)], "correct")[0] if len(correct) else np.zeros(0, dtype=np.bool_)
    found: set[str] = set()
    for s, ok in zip(samples, flags, strict=True):
        if not ok:
            continue
        key = skeleton(s) if skeleton is not None else s
        if key is None:
            continue
        if not isinstance(key, str):
            raise TypeError(f"distinct_correct_strategies: a skeleton must be a str or None, got {type(key).__name__}")
        found.add(key)
    return len(found)


def ambiqt_coverage(matches_interp1: Any, matches_interp2: Any) -> float:
    """Fraction of questions where both gold interpretations are matched by at least one sample.

    Both inputs are ``[Q, k]`` (or ragged, same lengths per question): whether sample j of
    question q matches interpretation 1 (resp. 2). Different samples may cover the two.
    """
    r1 = _rows(matches_interp1, "matches_interp1")
    r2 = _rows(matches_interp2, "matches_interp2")
    if len(r1) != len(r2):
        raise ValueError(f"ambiqt_coverage: {len(r1)} vs {len(r2)} questions")
    for i, (a, b) in enumerate(zip(r1, r2, strict=True)):
        if a.size != b.size:
            raise ValueError(f"ambiqt_coverage: question {i} has {a.size} vs {b.size} samples")
    return float(np.mean([bool(a.any() and b.any()) for a, b in zip(r1, r2, strict=True)]))
