"""Differences between arms paired by seed, with a 95% interval over seeds.

Every arm of a seed trains from the same warm start on the same data order, so what varies
between two arms of one seed is the arm; what varies between seeds is the noise both arms share.
The per-seed difference ``arm - reference`` removes that shared part, and its mean over seeds
gets a Student-t interval with ``n - 1`` degrees of freedom (``n`` seeds present in both arms).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

__all__ = ["t_quantile_975", "paired_difference", "curve_auc", "value_at_fresh_responses"]

# Two-sided 95% quantiles of Student's t, df = 1..30 (the 0.975 quantile).
_T_975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
_Z_975 = 1.959964


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (table to 30, then the
    first two terms of the Cornish-Fisher expansion around the normal quantile)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T_975):
        return _T_975[df - 1]
    z = _Z_975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def paired_difference(arm: Mapping[int, Optional[float]], reference: Mapping[int, Optional[float]]) -> dict[str, Any]:
    """``arm - reference`` over the seeds both have a finite value for: mean, standard error,
    95% interval (``None`` bounds with fewer than two seeds) and the seeds used."""
    seeds = sorted(
        s
        for s in arm
        if s in reference
        and arm[s] is not None
        and reference[s] is not None
        and math.isfinite(float(arm[s]))
        and math.isfinite(float(reference[s]))
    )
    diffs = [float(arm[s]) - float(reference[s]) for s in seeds]  # type: ignore[arg-type]
    out: dict[str, Any] = {"seeds": seeds, "n": len(diffs), "mean": None, "se": None, "low": None, "high": None}
    if not diffs:
        return out
    mean = sum(diffs) / len(diffs)
    out["mean"] = mean
    if len(diffs) < 2:
        return out
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    se = sd / math.sqrt(len(diffs))
    half = t_quantile_975(len(diffs) - 1) * se
    out.update(se=se, low=mean - half, high=mean + half)
    return out


def curve_auc(curve: Sequence[Mapping[str, float]], field: str = "mean") -> Optional[float]:
    """The mean of ``field`` over all evaluations of a run (the one before training included):
    the area under the learning curve per evaluation, less noisy than the final value alone."""
    values = [float(p[field]) for p in curve if p.get(field) is not None]
    return sum(values) / len(values) if values else None


def value_at_fresh_responses(
    curve: Sequence[Mapping[str, float]], budget: float, field: str = "mean"
) -> Optional[float]:
    """``field`` at the last evaluation taken after at most ``budget`` fresh responses (points
    carry ``fresh_responses``): how far an arm got on the reference's rollout budget."""
    within = [p for p in curve if p.get("fresh_responses") is not None and float(p["fresh_responses"]) <= budget]
    return float(within[-1][field]) if within else None
