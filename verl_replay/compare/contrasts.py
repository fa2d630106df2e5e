"""The questions a comparison answers, each as one paired contrast between two arms.

A contrast is ``arm - reference`` on one measure, paired by seed (:func:`paired_difference`),
reported with its 95% interval, the smallest effect its seeds could detect (80% power, two-sided
5%, from the observed SD of the per-seed differences) and the seeds that SD says a target effect
needs. Verdicts come from the paired interval alone: it excludes 0 (the arm is higher or lower) or
it does not (no difference detected, and the minimum detectable effect says how small a difference
could have gone unseen).

The main contrasts are the papers' claims (Headroom-Drift against on-policy GRPO at the same fresh
budget and against naive replay; EliteReplay against GRPO and against IID archive replay); the
others read the ablations and controls. Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from verl_replay.compare.paired import paired_difference, seeds_for_effect

__all__ = ["Contrast", "CONTRASTS", "PRIMARY_MEASURES", "primary_measure", "contrast_result", "verdict"]


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

# (result key, title, kind): the least noisy measure a run has, first match wins
PRIMARY_MEASURES: tuple[tuple[str, str, str], ...] = (
    ("post_exact", "exact expected accuracy, mean over post-training evaluations", "pct"),
    ("post_mean", "sampled Mean@n, mean over post-training evaluations", "pct"),
)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(float(value))


def primary_measure(results: Sequence[Mapping[str, Any]]) -> tuple[str, str, str]:
    """The first of :data:`PRIMARY_MEASURES` that every run carries."""
    for measure in PRIMARY_MEASURES:
        if results and all(_finite(r.get(measure[0])) for r in results):
            return measure
    return PRIMARY_MEASURES[-1]


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
    its verdict, and the seeds its observed SD needs to detect ``target_effect``."""
    diff = paired_difference(
        {s: r.get(measure) for s, r in arm_runs.items()}, {s: r.get(measure) for s, r in ref_runs.items()}
    )
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
        "verdict": verdict(diff),
        "target_effect": target_effect,
        "seeds_for_target": needed,
    }
