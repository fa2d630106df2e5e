"""Differences between arms paired by seed, with a 95% interval over seeds.

Every arm of a seed trains from the same warm start on the same data order, so what varies
between two arms of one seed is the arm; what varies between seeds is the noise both arms share.
The per-seed difference ``arm - reference`` removes that shared part, and its mean over seeds
gets a Student-t interval with ``n - 1`` degrees of freedom (``n`` seeds present in both arms).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

__all__ = [
    "t_quantile_975",
    "t_quantile",
    "minimum_detectable_effect",
    "seeds_for_effect",
    "paired_difference",
    "curve_auc",
    "post_training_mean",
    "value_at_fresh_responses",
]

# The design the comparisons are sized for: a two-sided paired t-test at 5% with 80% power.
ALPHA = 0.05
POWER = 0.80

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


def _t_cdf(x: float, df: int) -> float:
    """Student's t CDF by Simpson's rule on the density over [0, |x|] (2,000 panels: error far
    below the 1e-6 the quantiles need)."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(t: float) -> float:
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(t * t / df))

    a, panels = abs(x), 2000
    h = a / panels
    area = density(0.0) + density(a)
    area += sum((4 if i % 2 else 2) * density(i * h) for i in range(1, panels))
    half = area * h / 3
    return 0.5 + half if x >= 0 else 0.5 - half


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on the CDF)."""
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:
        low, high = high, high * 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def minimum_detectable_effect(sd: float, n: int, *, alpha: float = ALPHA, power: float = POWER) -> Optional[float]:
    """The smallest true mean difference a paired t-test over ``n`` seeds detects with probability
    ``power`` at two-sided level ``alpha``, given the SD of the per-seed differences:
    ``(t[1 - alpha/2, n-1] + t[power, n-1]) * sd / sqrt(n)``. None below two seeds."""
    if n < 2 or not math.isfinite(sd) or sd < 0:
        return None
    return (t_quantile(1 - alpha / 2, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)


def seeds_for_effect(
    sd: float, effect: float, *, alpha: float = ALPHA, power: float = POWER, max_seeds: int = 200
) -> Optional[int]:
    """The fewest seeds whose minimum detectable effect is at most ``effect`` (None: more than
    ``max_seeds``)."""
    if not effect > 0:
        raise ValueError(f"effect must be > 0, got {effect}")
    for n in range(2, max_seeds + 1):
        mde = minimum_detectable_effect(sd, n, alpha=alpha, power=power)
        if mde is not None and mde <= effect:
            return n
    return None


def paired_difference(arm: Mapping[int, Optional[float]], reference: Mapping[int, Optional[float]]) -> dict[str, Any]:
    """``arm - reference`` over the seeds both have a finite value for: mean, SD of the per-seed
    differences, standard error, 95% interval, the minimum detectable effect of this many seeds
    (``None`` with fewer than two seeds) and the seeds used."""
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
    out: dict[str, Any] = {
        "seeds": seeds,
        "n": len(diffs),
        "mean": None,
        "sd": None,
        "se": None,
        "low": None,
        "high": None,
        "mde": None,
    }
    if not diffs:
        return out
    mean = sum(diffs) / len(diffs)
    out["mean"] = mean
    if len(diffs) < 2:
        return out
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    se = sd / math.sqrt(len(diffs))
    half = t_quantile_975(len(diffs) - 1) * se
    out.update(sd=sd, se=se, low=mean - half, high=mean + half, mde=minimum_detectable_effect(sd, len(diffs)))
    return out


def curve_auc(curve: Sequence[Mapping[str, float]], field: str = "mean") -> Optional[float]:
    """The mean of ``field`` over all evaluations of a run (the one before training included):
    the area under the learning curve per evaluation, less noisy than the final value alone."""
    values = [float(p[field]) for p in curve if p.get(field) is not None]
    return sum(values) / len(values) if values else None


def post_training_mean(curve: Sequence[Mapping[str, float]], field: str = "mean") -> Optional[float]:
    """The mean of ``field`` over the evaluations after training began (step > 0): the evaluation
    before training is the same draw in every arm of a seed, so it only dilutes a paired difference."""
    values = [float(p[field]) for p in curve if int(p["step"]) > 0 and p.get(field) is not None]
    return sum(values) / len(values) if values else None


def value_at_fresh_responses(
    curve: Sequence[Mapping[str, float]], budget: float, field: str = "mean"
) -> Optional[float]:
    """``field`` at the last evaluation taken after at most ``budget`` fresh responses (points
    carry ``fresh_responses``): how far an arm got on the reference's rollout budget."""
    within = [
        p
        for p in curve
        if p.get("fresh_responses") is not None and float(p["fresh_responses"]) <= budget and p.get(field) is not None
    ]
    return float(within[-1][field]) if within else None
