"""The comparisons' contrasts: hand-computed differences, verdicts from the paired interval, the
seeds a target effect needs, and the primary metric's choice."""

from __future__ import annotations

import pytest

from verl_replay.compare.contrasts import CONTRASTS, collapsed, contrast_result, primary_measure, verdict
from verl_replay.compare.report import aggregate

HD_VS_GRPO = next(c for c in CONTRASTS if (c.arm, c.reference) == ("headroom_drift", "grpo_matched"))


def _runs(values, key="post_exact"):
    return {seed: {key: value, "post_mean": value} for seed, value in values.items()}


def test_a_contrast_hand_computed():
    """Differences 0.02, 0.05, 0.01: mean 0.026667, sd 0.020817, se 0.012019, half width
    4.303 x se = 0.051717; MDE (4.3027 + 1.0607) x 0.020817 / sqrt(3) = 0.064462; a 3-point
    target needs 6 seeds: (2.5706 + 0.9195) x 0.020817 / sqrt(6) = 0.02966 (5: 0.03461)."""
    arm = _runs({1: 0.50, 2: 0.55, 3: 0.52})
    ref = _runs({1: 0.48, 2: 0.50, 3: 0.51, 4: 0.9})
    result = contrast_result(HD_VS_GRPO, arm, ref, "post_exact", 0.03)
    assert result["seeds"] == [1, 2, 3] and result["main"] is True
    assert result["mean"] == pytest.approx(0.026667, abs=1e-6)
    assert result["sd"] == pytest.approx(0.020817, abs=1e-6)
    assert result["low"] == pytest.approx(0.026667 - 0.051717, abs=2e-5)
    assert result["mde"] == pytest.approx(0.064462, abs=2e-5)
    assert result["verdict"] == "no difference detected" and result["seeds_for_target"] == 6


@pytest.mark.parametrize(
    "diff, expected",
    [
        ({"low": 0.01, "high": 0.05}, "arm higher"),
        ({"low": -0.05, "high": -0.01}, "arm lower"),
        ({"low": -0.01, "high": 0.05}, "no difference detected"),
        ({"low": None, "high": None}, "too few paired seeds for an interval"),
    ],
)
def test_verdicts_come_from_the_paired_interval_only(diff, expected):
    assert verdict(diff) == expected


def test_the_primary_metric_is_exact_only_when_every_run_has_it():
    assert primary_measure([{"post_exact": 0.4}, {"post_exact": 0.5}])[0] == "post_exact"
    assert primary_measure([{"post_exact": 0.4}, {"post_exact": None, "post_mean": 0.5}])[0] == "post_mean"
    assert primary_measure([])[0] == "post_mean"


def _result(value):
    curve = [{"step": 0, "mean": 0.3, "best": 0.3, "n": 2}, {"step": 2, "mean": value, "best": value, "n": 2}]
    return {
        "val_curve": curve,
        "final_mean": value,
        "final_best": value,
        "post_mean": value,
        "post_exact": value,
        "val_n": 2,
    }


def test_aggregate_reports_every_contrast_whose_arms_ran_on_the_primary_metric():
    arms = [{"name": n, "label": n} for n in ("grpo_matched", "naive", "headroom_drift")]
    runs = {
        "grpo_matched": {s: _result(0.40 + 0.01 * s) for s in (1, 2, 3)},
        "naive": {s: _result(0.41 + 0.01 * s) for s in (1, 2, 3)},
        "headroom_drift": {s: _result(0.45 + 0.01 * s + 0.001 * s * s) for s in (1, 2, 3)},
    }
    comp = aggregate("headroom_drift", arms, runs, target_effect=0.03)
    assert comp["primary_metric"]["key"] == "post_exact" and comp["target_effect"] == 0.03
    # the ablations' arms did not run: only the two main contrasts
    assert [(c["arm"], c["reference"]) for c in comp["contrasts"]] == [
        ("headroom_drift", "grpo_matched"),
        ("headroom_drift", "naive"),
    ]
    first = comp["contrasts"][0]
    assert first["mean"] == pytest.approx(0.05 + 0.014 / 3) and first["verdict"] == "arm higher"


def test_the_table_lists_every_contrast_with_its_mde_and_the_seeds_it_needs():
    from verl_replay.compare.report import format_table

    arms = [{"name": n, "label": n.replace("_", " ")} for n in ("grpo_matched", "headroom_drift")]
    runs = {
        "grpo_matched": {s: _result(0.40 + 0.01 * s) for s in (1, 2, 3)},
        "headroom_drift": {s: _result(0.40 + 0.01 * s + 0.01 * (s % 2)) for s in (1, 2, 3)},
    }
    comp = aggregate("headroom_drift", arms, runs, target_effect=0.03)
    table = format_table(comp)
    c = comp["contrasts"][0]
    mde = f"{100 * c['mde']:.1f}"
    assert "MDE of 3 points" in table
    difference = f"{100 * c['mean']:+.1f} [{100 * c['low']:+.1f}, {100 * c['high']:+.1f}]"
    assert (
        f"| headroom drift - grpo matched | yes | {difference} | no difference detected | {mde} | "
        f"3 (needs {c['seeds_for_target']}) |" in table
    )


@pytest.mark.parametrize(
    "start, final, expected",
    [(0.40, 0.41, False), (0.40, 0.39, True), (0.40, 0.80, False), (0.40, 0.40, False), (None, 0.5, None)],
)
def test_a_run_collapsed_when_it_ends_below_its_start(start, final, expected):
    curve = [{"step": 0, "mean": start}, {"step": 10, "mean": final}]
    assert collapsed({"val_curve": curve}) is expected
    assert collapsed({"val_curve": curve[1:]}) is None  # no evaluation before training: unknown


def test_an_arm_split_into_collapsed_and_learning_seeds_is_reported_as_counts():
    """GRPO collapses in one seed of three (0.3 -> 0.05); a replay arm learns in all three. A t
    interval over (+0.1, +0.1, +0.55) would describe neither kind of run: the verdict counts."""
    arms = [{"name": n, "label": n} for n in ("grpo_matched", "headroom_drift", "grpo_control")]
    runs = {
        "grpo_matched": {1: _result(0.50), 2: _result(0.05), 3: _result(0.50)},
        "headroom_drift": {s: _result(0.60) for s in (1, 2, 3)},
        "grpo_control": {s: _result(0.02) for s in (1, 2, 3)},  # every seed collapsed: one mode
    }
    comp = aggregate("headroom_drift", arms, runs, target_effect=0.03)
    by_arm = {c["arm"]: c for c in comp["contrasts"]}
    hd = by_arm["headroom_drift"]
    assert hd["bimodal"] and (hd["collapsed_arm"], hd["collapsed_reference"]) == (0, 1)
    assert hd["verdict"] == "bimodal: 0 of 3 seeds collapsed in the arm, 1 of 3 in the reference"
    control = by_arm["grpo_control"]  # one mode in the arm, but its reference is split
    assert control["bimodal"] and (control["collapsed_arm"], control["collapsed_reference"]) == (3, 1)
    assert [a["collapsed_seeds"] for a in comp["arms"]] == [[2], [], [1, 2, 3]]
    from verl_replay.compare.report import format_table

    table = format_table(comp)
    assert "| grpo_matched | 3 |" in table and "| 1 of 3 |" in table
    assert "- grpo_matched: bimodal, 1 of 3 seeds collapsed (seeds 2); no interval" in table
    assert "| see counts | bimodal: 0 of 3" in table
    assert "- grpo_control: bimodal" not in table and "- grpo_control: -28.0 [" in table  # all collapsed: one mode


def test_seeds_sized_from_two_seeds_say_the_sd_is_unreliable():
    from verl_replay.compare.report import format_table

    arms = [{"name": n, "label": n} for n in ("grpo_matched", "headroom_drift")]
    runs = {
        "grpo_matched": {s: _result(0.40 + 0.01 * s) for s in (1, 2)},
        "headroom_drift": {s: _result(0.43 + 0.011 * s) for s in (1, 2)},
    }
    table = format_table(aggregate("headroom_drift", arms, runs, target_effect=0.03))
    assert "from an SD of 2 seeds: unreliable)" in table
