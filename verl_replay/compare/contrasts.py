"""The questions a comparison answers, each as one paired contrast between two arms.

A contrast is ``arm - reference`` on one measure, paired by seed (:func:`paired_difference`),
reported with its 95% interval, the smallest effect its seeds could detect (80% power, two-sided
5%, from the observed SD of the per-seed differences) and the seeds that SD says a target effect
needs. Verdicts come from the paired interval alone: it excludes 0 (the arm is higher or lower) or
it does not (no difference detected, and the minimum detectable effect says how small a difference
could have gone unseen). An arm whose seeds split into collapsed and learning runs is bimodal: a
mean and a t interval describe neither kind of run, so such a contrast is reported as counts of
collapsed seeds instead (:func:`collapsed`).

The main contrasts are the papers' claims (Headroom-Drift against on-policy GRPO at the same fresh
budget and against naive replay; EliteReplay against GRPO and against IID archive replay); the
others read the ablations and controls. Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from verl_replay.compare.paired import paired_difference, seeds_for_effect

__all__ = [
    "Contrast",
    "CONTRASTS",
    "PRIMARY_MEASURES",
    "ELITE_PRIMARY_MEASURES",
    "collapsed",
    "contrast_result",
    "measure_value",
    "primary_measure",
    "verdict",
]


@dataclass(frozen=True)
class Contrast:
    comparison: str
    arm: str
    reference: str
    main: bool  # a paper's claim (sized for); else an ablation or control (fewer seeds)
    question: str


CONTRASTS: tuple[Contrast, ...] = (
    Contrast("headroom_drift", "headroom_drift", "grpo_matched", True, "replay vs on-policy GRPO, same fresh rollouts"),
    Contrast("headroom_drift", "headroom_drift", "naive", True, "ranking and gate vs replaying the newest groups"),
    Contrast("headroom_drift", "headroom_drift", "headroom_only", False, "what does the Drift gate add?"),
    Contrast("headroom_drift", "headroom_drift", "drift_only", False, "what does the Headroom ranking add?"),
    Contrast("headroom_drift", "grpo_larger", "grpo_matched", False, "what do 1.5x fresh rollouts buy?"),
    Contrast("headroom_drift", "grpo_control", "grpo_matched", False, "control: random rewards must lose"),
    Contrast("elite", "elite", "grpo", True, "does archive replay beat GRPO?"),
    Contrast("elite", "elite", "elite_iid", True, "does balanced sampling beat IID sampling of the archive?"),
    Contrast("elite", "elite", "elite_mu0", False, "control: the recipe with its replay term off"),
    Contrast("elite", "elite_iid", "elite_mu0", False, "IID replay against the replay-off recipe"),
)

# (result key, title, kind): the least noisy measure a run has, first match wins ("eval:" keys
# read the last checkpoint's evaluation). The elite comparison's question is diversity: its
# measure is the distinct right query shapes per question, where every run was evaluated.
PRIMARY_MEASURES: tuple[tuple[str, str, str], ...] = (
    ("post_exact", "exact expected accuracy, mean over post-training evaluations", "pct"),
    ("post_mean", "sampled Mean@n, mean over post-training evaluations", "pct"),
)
ELITE_PRIMARY_MEASURES: tuple[tuple[str, str, str], ...] = (
    ("eval:distinct_strategies", "distinct right query shapes per question, last checkpoint", "num"),
    *PRIMARY_MEASURES,
)


def collapsed(result: Mapping[str, Any]) -> Optional[bool]:
    """Whether a run ended below where it started: its final sampled accuracy under its accuracy
    before training. On the learnable profiles every healthy run gains 20 points or more, so a
    run that ends below its start has diverged (GRPO that lost a part of the questions for good,
    or a random-reward control), whatever its exact final value (None: no evaluation before
    training in its curve)."""
    curve = [p for p in result.get("val_curve") or [] if p.get("mean") is not None]  # sampled points
    if len(curve) < 2 or int(curve[0]["step"]) != 0:
        return None
    start, final = curve[0]["mean"], curve[-1]["mean"]
    if not (_finite(start) and _finite(final)):
        return None
    return float(final) < float(start)


def collapse_counts(runs: Mapping[int, Mapping[str, Any]], seeds: Sequence[int]) -> int:
    return sum(1 for seed in seeds if collapsed(runs[seed]))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(float(value))


def measure_value(result: Mapping[str, Any], key: str) -> Optional[float]:
    """A run's value of ``key`` (``eval:NAME``: its last checkpoint's evaluation); None if absent."""
    value = (result.get("eval") or {}).get(key[5:]) if key.startswith("eval:") else result.get(key)
    return float(value) if _finite(value) else None


def primary_measure(results: Sequence[Mapping[str, Any]], comparison: str = "headroom_drift") -> tuple[str, str, str]:
    """The first of the comparison's primary measures that every run carries."""
    measures = ELITE_PRIMARY_MEASURES if comparison == "elite" else PRIMARY_MEASURES
    for measure in measures:
        if results and all(measure_value(r, measure[0]) is not None for r in results):
            return measure
    return measures[-1]


def verdict(diff: Mapping[str, Any]) -> str:
    """From the paired interval only."""
    if diff.get("low") is None:
        return "too few paired seeds for an interval"
    if diff["low"] > 0:
        return "arm higher"
    if diff["high"] < 0:
        return "arm lower"
    return "no difference detected"


def contrast_result(
    contrast: Contrast,
    arm_runs: Mapping[int, Mapping[str, Any]],
    ref_runs: Mapping[int, Mapping[str, Any]],
    measure: str,
    target_effect: Optional[float],
) -> dict[str, Any]:
    """One contrast on ``measure``: the paired difference (mean, sd, se, interval, mde, seeds),
    the collapsed seeds of each arm among them, its verdict (from counts when an arm is bimodal),
    and the seeds its observed SD needs to detect ``target_effect``."""
    diff = paired_difference(
        {s: measure_value(r, measure) for s, r in arm_runs.items()},
        {s: measure_value(r, measure) for s, r in ref_runs.items()},
    )
    n = diff["n"]
    arm_collapsed = collapse_counts(arm_runs, diff["seeds"])
    ref_collapsed = collapse_counts(ref_runs, diff["seeds"])
    bimodal = 0 < arm_collapsed < n or 0 < ref_collapsed < n
    ruling = verdict(diff)
    if bimodal:
        ruling = f"bimodal: {arm_collapsed} of {n} seeds collapsed in the arm, {ref_collapsed} of {n} in the reference"
    needed = None
    if target_effect is not None and diff.get("sd") is not None:
        needed = seeds_for_effect(diff["sd"], target_effect) if diff["sd"] > 0 else 2
    return {
        "arm": contrast.arm,
        "reference": contrast.reference,
        "main": contrast.main,
        "question": contrast.question,
        "measure": measure,
        **diff,
        "collapsed_arm": arm_collapsed,
        "collapsed_reference": ref_collapsed,
        "bimodal": bimodal,
        "verdict": ruling,
        "target_effect": target_effect,
        "seeds_for_target": needed,
    }
