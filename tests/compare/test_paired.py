"""Paired-by-seed differences: hand-computed values, the t quantiles, and why pairing matters."""

from __future__ import annotations

import math

import pytest

from verl_replay.compare.paired import (
    curve_auc,
    minimum_detectable_effect,
    paired_difference,
    post_training_mean,
    seeds_for_effect,
    t_quantile,
    t_quantile_975,
    value_at_fresh_responses,
)
from verl_replay.compare.report import aggregate, format_table


def _t_cdf_above_zero(q: float, df: int, steps: int = 20000) -> float:
    """P(0 < T < q) for Student's t, by Simpson's rule over its density (independent of the table)."""
    const = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    h = q / steps
    total = 0.0
    for i in range(steps + 1):
        x = i * h
        weight = 1 if i in (0, steps) else (4 if i % 2 else 2)
        total += weight * const * (1 + x * x / df) ** (-(df + 1) / 2)
    return total * h / 3


@pytest.mark.parametrize("df", [1, 2, 3, 4, 9, 29, 30, 31, 60, 200])
def test_t_quantile_puts_2_5_percent_in_each_tail(df):
    assert _t_cdf_above_zero(t_quantile_975(df), df) == pytest.approx(0.475, abs=2e-4)


def test_t_quantile_refuses_no_degrees_of_freedom():
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile_975(0)


@pytest.mark.parametrize("df, table", [(1, 1.376), (2, 1.061), (5, 0.920), (10, 0.879), (30, 0.854)])
def test_t_quantile_at_80_percent(df, table):
    q = t_quantile(0.8, df)
    assert q == pytest.approx(table, abs=1e-3)
    assert _t_cdf_above_zero(q, df) == pytest.approx(0.3, abs=1e-5)
    assert t_quantile(0.975, df) == pytest.approx(t_quantile_975(df), abs=1e-3)


def test_minimum_detectable_effect_hand_computed():
    # (t[.975, 2] + t[.8, 2]) * 3 / sqrt(3) = (4.3027 + 1.0607) * 1.7321 = 9.2897
    assert minimum_detectable_effect(3.0, 3) == pytest.approx(9.2897, abs=1e-3)
    # 9 seeds: (2.3060 + 0.8889) * 3 / 3 = 3.195 > 3; 10 seeds: (2.2622 + 0.8834) * 3 / 3.1623 = 2.984
    assert seeds_for_effect(3.0, 3.0) == 10
    assert minimum_detectable_effect(3.0, 1) is None
    assert seeds_for_effect(3.0, 0.01, max_seeds=20) is None
    with pytest.raises(ValueError, match="effect must be > 0"):
        seeds_for_effect(3.0, 0.0)


def test_a_true_effect_of_the_minimum_detectable_size_is_found_four_times_in_five():
    """Simulated paired designs (normal per-seed differences, sd 1, 10 seeds) with the true mean at
    the computed MDE: the two-sided t-test rejects in ~80% of them."""
    import numpy as np

    rng = np.random.default_rng(0)
    n, reps = 10, 20000
    mde = minimum_detectable_effect(1.0, n)
    diffs = rng.normal(mde, 1.0, size=(reps, n))
    t = diffs.mean(axis=1) / (diffs.std(axis=1, ddof=1) / math.sqrt(n))
    power = float((np.abs(t) > t_quantile_975(n - 1)).mean())
    assert 0.77 < power < 0.83, power


def test_paired_difference_hand_computed():
    """Differences 0.05, 0.10, 0.02: mean 0.17/3; sample variance 0.0016333 (deviations -0.00667,
    0.04333, -0.03667), se = sqrt(0.0016333 / 3) = 0.023333; t(2) = 4.303 -> half width 0.100403."""
    reference = {1: 0.20, 2: 0.40, 3: 0.30}
    arm = {1: 0.25, 2: 0.50, 3: 0.32, 4: 0.9}  # seed 4 has no reference run: not used
    diff = paired_difference(arm, reference)
    assert diff["seeds"] == [1, 2, 3] and diff["n"] == 3
    assert diff["mean"] == pytest.approx(0.17 / 3)
    assert diff["se"] == pytest.approx(0.023333, abs=1e-6)
    assert diff["low"] == pytest.approx(0.17 / 3 - 0.100403, abs=1e-5)
    assert diff["high"] == pytest.approx(0.17 / 3 + 0.100403, abs=1e-5)
    assert diff["sd"] == pytest.approx(math.sqrt(0.0016333), abs=1e-6)
    assert diff["mde"] == pytest.approx(minimum_detectable_effect(diff["sd"], 3))


def test_paired_difference_with_one_seed_has_no_interval():
    diff = paired_difference({1: 0.5, 2: None}, {1: 0.25, 2: 0.3})
    assert (diff["n"], diff["mean"], diff["low"], diff["high"]) == (1, 0.25, None, None)
    assert paired_difference({}, {1: 0.3})["mean"] is None


def test_curve_auc_and_value_at_a_fresh_budget():
    curve = [
        {"step": 0, "fresh_responses": 0, "mean": 0.1},
        {"step": 2, "fresh_responses": 96, "mean": 0.3},
        {"step": 4, "fresh_responses": 192, "mean": 0.5},
    ]
    assert curve_auc(curve) == pytest.approx(0.3)
    assert value_at_fresh_responses(curve, 128) == 0.3  # step 4's 192 responses exceed the budget
    assert value_at_fresh_responses(curve, 192) == 0.5
    assert value_at_fresh_responses(curve[1:], 50) is None


def _run(final: float, curve: list[float], fresh_per_step: int) -> dict:
    points = [
        {"step": 2 * i, "fresh_responses": 2 * i * fresh_per_step, "mean": v, "best": v, "n": 2}
        for i, v in enumerate(curve)
    ]
    return {
        "final_mean": final,
        "auc_mean": curve_auc(points),
        "post_mean": post_training_mean(points),
        "val_curve": points,
        "val_n": 2,
        "final_best": final,
    }


def test_pairing_sees_a_small_effect_that_seed_noise_hides():
    """Seeds differ by 20 points (a shared warm start effect); the arm is 2 points better in every
    seed. Unpaired, that is within noise; paired, the interval excludes zero. A control arm equal
    to the reference in every seed gets a zero difference and a zero-width interval."""
    seeds = {1: 0.2, 2: 0.4, 3: 0.6}
    runs = {
        "ref": {s: _run(v, [0.1, v], 48) for s, v in seeds.items()},
        "better": {s: _run(v + 0.02 + 0.001 * s, [0.1, v + 0.02 + 0.001 * s], 48) for s, v in seeds.items()},
        "same": {s: _run(v, [0.1, v], 48) for s, v in seeds.items()},
        # 1.5x the fresh responses per step: at the reference's budget (96 after step 2) it is at step 0
        "larger": {s: _run(v + 0.05, [0.1, 0.15, v + 0.05], 72) for s, v in seeds.items()},
    }
    arms = [{"name": n, "label": n} for n in runs]
    comp = aggregate("headroom_drift", arms, runs)
    better, same, larger = comp["arms"][1], comp["arms"][2], comp["arms"][3]
    paired = better["paired"]["final_mean"]
    # unpaired, the 2.2 points hide in a 20-point spread between seeds
    assert better["summary"]["final_mean"]["std"] > 5 * paired["mean"]
    assert paired["mean"] == pytest.approx(0.022) and paired["low"] > 0 and paired["verdict"] == "arm higher"
    assert same["paired"]["final_mean"]["mean"] == 0.0 and same["paired"]["final_mean"]["high"] == 0.0
    # one post-training evaluation: the final one
    assert better["paired"]["post_mean"]["mean"] == pytest.approx(0.022)
    # larger arm at 96 fresh responses: its step-2 value (0.15 after 144 > 96) is past the budget,
    # so its step-0 value 0.1 against the reference's finals 0.2 / 0.4 / 0.6
    at_budget = larger["paired"]["mean_at_reference_fresh"]
    assert at_budget["mean"] == pytest.approx(0.1 - 0.4)
    assert larger["paired"]["final_mean"]["mean"] == pytest.approx(0.05)
    table = format_table(comp)
    assert "Paired by seed (ref as reference)" in table
    assert "- better: final +2.2 [" in table and "(3 seeds)" in table
