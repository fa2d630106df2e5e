"""Aggregation over seeds, verdicts from paired intervals, collapsed seeds, the table and the files
written."""

from __future__ import annotations

import json
import math

import pytest

from verl_replay.compare.report import (
    aggregate,
    format_cost,
    format_table,
    mean_std,
    run_cost,
    write_outputs,
)


def test_mean_std_hand_computed():
    mean, std, n = mean_std([1.0, 2.0, 6.0])
    assert mean == pytest.approx(3.0) and std == pytest.approx(math.sqrt(7.0)) and n == 3
    assert mean_std([5.0]) == (5.0, None, 1)
    assert mean_std([]) == (None, None, 0)
    assert mean_std([1.0, float("nan"), 3.0])[:2] == (2.0, pytest.approx(math.sqrt(2.0)))


def _result(final, best, curve_vals, t=2.0, acc=None, ev=None):
    curve = [{"step": 2 * i, "mean": v, "best": v + 0.1, "n": 2} for i, v in enumerate(curve_vals)]
    return {
        "final_mean": final,
        "final_best": best,
        "fresh_responses": 96,
        "step_time_s": t,
        "replay_acceptance": acc,
        "replay_token_share": None,
        "replay_kl_accepted": None,
        "elite_token_share": None,
        "val_curve": curve,
        "auc_mean": sum(curve_vals) / len(curve_vals),
        "post_mean": sum(curve_vals[1:]) / len(curve_vals[1:]) if curve_vals[1:] else None,
        "val_n": 2,
        "eval": ev,
    }


ARMS = [{"name": "grpo_matched", "label": "GRPO b16"}, {"name": "headroom_drift", "label": "HD"}]


def test_aggregate_table_and_files(tmp_path):
    runs = {
        "grpo_matched": {1: _result(0.2, 0.3, [0.1, 0.2]), 2: _result(0.4, 0.5, [0.1, 0.4])},
        "headroom_drift": {1: _result(0.5, 0.6, [0.1, 0.5], acc=0.5), 2: _result(0.7, 0.8, [0.1, 0.7], acc=1.0)},
    }
    comp = aggregate("headroom_drift", ARMS, runs)
    hd = comp["arms"][1]
    assert hd["summary"]["final_mean"]["mean"] == pytest.approx(0.6)
    assert hd["summary"]["final_mean"]["std"] == pytest.approx(math.sqrt(0.02))
    assert hd["summary"]["replay_acceptance"]["mean"] == pytest.approx(0.75)
    assert [p["mean"] for p in hd["curve_mean"]] == [pytest.approx(0.1), pytest.approx(0.6)]
    # per seed +0.3, +0.3: sd 0 -> a zero-width interval above 0; no unpaired screen is reported
    assert hd["paired"]["final_mean"]["mean"] == pytest.approx(0.3)
    assert hd["paired"]["final_mean"]["verdict"] == "arm higher"
    assert "vs_reference" not in hd and hd["collapsed_seeds"] == []
    table = format_table(comp)
    assert "| HD | 2 | 60.0 ± 14.1 | 60.0 ± 14.1 |" in table and "Mean@2 (final)" in table
    assert "2 standard errors" not in table and "exact accuracy" not in table  # no run has the exact metric
    doc = {"profile": "tiny", "steps": {"headroom_drift": 2}, "comparisons": [comp]}
    paths = write_outputs(tmp_path, doc)
    assert json.loads(paths["json"].read_text())["comparisons"][0]["arms"][1]["name"] == "headroom_drift"
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## headroom_drift" in paths["table"].read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["comparison.json", "curves.png", "table.md"]
    assert "Starting model" not in paths["table"].read_text()  # an older document without models
    doc["models"] = [{"path": "/cache/tiny-task/model", "sha256": "0123456789abcdef" * 4}]
    header = write_outputs(tmp_path, doc)["table"].read_text().split("## headroom_drift")[0]
    assert "Starting model: `/cache/tiny-task/model` (weights sha256 0123456789ab)." in header


def test_elite_table_has_pass_at_k_and_strategies():
    ev = {"pass@1": 0.25, "pass@4": 0.5, "distinct_strategies": 1.0}
    runs = {"grpo": {1: _result(0.1, 0.2, [0.1], ev=ev)}}
    comp = aggregate("elite", [{"name": "grpo", "label": "GRPO"}], runs)
    assert comp["pass_k_max"] == 4
    table = format_table(comp)
    assert (
        "pass@4" in table
        and "distinct correct strategies" in table
        and "| GRPO | 1 | 10.0 | 25.0 | 50.0 | 1.00 |" in table  # no post-training evaluation: no column
    )


def test_gain_over_start_is_final_minus_the_evaluation_before_training():
    from verl_replay.compare.report import gain_over_start

    # gains 0.4 - 0.1 = 0.3, 0.5 - 0.1 = 0.4, 0.7 - 0.2 = 0.5: mean 0.4, sd 0.1, se 0.1 / sqrt(3)
    runs = {
        1: _result(0.4, 0.5, [0.1, 0.4]),
        2: _result(0.5, 0.6, [0.1, 0.5]),
        3: _result(0.7, 0.8, [0.2, 0.7]),
    }
    gain = gain_over_start(runs)
    se = 0.1 / math.sqrt(3)
    assert gain["mean"] == pytest.approx(0.4) and gain["se"] == pytest.approx(se) and gain["seeds"] == [1, 2, 3]
    assert gain["low"] == pytest.approx(0.4 - 4.303 * se) and gain["high"] == pytest.approx(0.4 + 4.303 * se)
    # a run without a validation before training has no start: left out, not guessed
    late = _result(0.9, 0.9, [0.3, 0.9])
    late["val_curve"] = late["val_curve"][1:]
    assert gain_over_start({**runs, 4: late})["seeds"] == [1, 2, 3]
    comp = aggregate("headroom_drift", ARMS[:1], {"grpo_matched": runs})
    assert comp["arms"][0]["gain"]["mean"] == pytest.approx(0.4)
    table = format_table(comp)
    low, high = 100 * (0.4 - 4.303 * se), 100 * (0.4 + 4.303 * se)
    assert f"- GRPO b16: +40.0 [{low:+.1f}, {high:+.1f}] (3 seeds), 6.9 SE" in table


def test_elite_arms_are_paired_with_grpo_on_the_evaluation_too():
    # per seed: pass@1 diffs 0.10, 0.20, 0.30 (mean 0.2, sd 0.1); strategies diffs 0.5, 0.7, 0.9 (sd 0.2)
    def ev(p1, p16, strategies):
        return {"pass@1": p1, "pass@16": p16, "distinct_strategies": strategies}

    grpo = {s: _result(0.5, 0.6, [0.4, 0.5], ev=ev(0.5, 0.9, 1.0)) for s in (1, 2, 3)}
    elite = {
        1: _result(0.5, 0.6, [0.4, 0.5], ev=ev(0.6, 0.9, 1.5)),
        2: _result(0.5, 0.6, [0.4, 0.5], ev=ev(0.7, 0.95, 1.7)),
        3: _result(0.5, 0.6, [0.4, 0.5], ev=ev(0.8, 1.0, 1.9)),
    }
    arms = [{"name": "grpo", "label": "GRPO"}, {"name": "elite", "label": "EliteReplay"}]
    comp = aggregate("elite", arms, {"grpo": grpo, "elite": elite})
    paired = comp["arms"][1]["paired"]
    half = 4.303 * 0.1 / math.sqrt(3)
    assert paired["eval:pass@1"]["mean"] == pytest.approx(0.2) and paired["eval:pass@1"]["high"] == pytest.approx(
        0.2 + half
    )
    assert paired["eval:pass@16"]["mean"] == pytest.approx(0.05)
    assert paired["eval:distinct_strategies"]["mean"] == pytest.approx(0.7)
    assert paired["eval:distinct_strategies"]["low"] == pytest.approx(0.7 - 2 * half)
    table = format_table(comp)
    assert (
        f"- EliteReplay: pass@1 +20.0 [{100 * (0.2 - half):+.1f}, {100 * (0.2 + half):+.1f}] (3 seeds); "
        f"pass@16 +5.0 " in table
    )
    assert f"distinct correct strategies +0.70 [{0.7 - 2 * half:+.2f}, {0.7 + 2 * half:+.2f}] (3 seeds)" in table
    # the Headroom-Drift comparison has no evaluation stage to pair on
    hd = aggregate("headroom_drift", ARMS, {"grpo_matched": grpo, "headroom_drift": elite})
    assert "eval:pass@1" not in hd["arms"][1]["paired"] and "last checkpoint" not in format_table(hd)


def _timed(result, wall, validation, steps, scan=None):
    return {**result, "wall_s": wall, "time": {"validation_s": validation, "steps_s": steps, "scan_s": scan}}


def test_run_cost_is_the_wall_time_less_validation_and_steps():
    result = _timed(_result(0.2, 0.3, [0.1, 0.2]), 100.0, 20.0, 50.0, 10.0)
    cost = run_cost(result)
    assert cost == {"wall_s": 100.0, "validation_s": 20.0, "steps_s": 50.0, "scan_s": 10.0, "rest_s": 30.0}
    assert run_cost(_result(0.2, 0.3, [0.1, 0.2])) is None  # stored before runs recorded time


def test_cost_table_means_per_arm_and_totals_over_every_run(tmp_path):
    runs = {
        "grpo_matched": {
            1: _timed(_result(0.2, 0.3, [0.1, 0.2]), 100.0, 20.0, 50.0),
            2: _timed(_result(0.4, 0.5, [0.1, 0.4]), 120.0, 30.0, 60.0),
        },
        "headroom_drift": {1: _timed(_result(0.5, 0.6, [0.1, 0.5]), 300.0, 40.0, 200.0, 120.0)},
    }
    comp = aggregate("headroom_drift", ARMS, runs)
    text = format_cost([comp])
    assert "| GRPO b16 | 2 | 110 | 25 | 55 | – | 30 |" in text
    assert "| HD | 1 | 300 | 40 | 200 | 120 | 60 |" in text
    assert "All 3 runs: 520 s of run wall time, 90 s of it validation; without validation 430 s." in text
    doc = {"profile": "tiny", "steps": {"headroom_drift": 2}, "comparisons": [comp]}
    assert "## Where the time went" in write_outputs(tmp_path, doc)["table"].read_text()
    untimed = aggregate("headroom_drift", ARMS, {"grpo_matched": {1: _result(0.2, 0.3, [0.1, 0.2])}})
    assert format_cost([untimed]) == ""


def test_a_comparison_sampled_only_at_the_ends_is_plotted_at_every_exact_evaluation(tmp_path):
    """sampled_val=ends: the exact metric at steps 0-4, verl's sampled one at 0 and 4; the plot's
    ticks and curves follow the exact points."""
    from verl_replay.compare.report import _eval_steps, plot_curves

    def run(exact):
        curve = [{"step": 0, "mean": 0.4, "best": 0.5, "n": 2, "exact": 0.42}]
        curve += [{"step": 2, "mean": None, "best": None, "n": None, "exact": exact[0]}]
        curve += [{"step": 4, "mean": 0.6, "best": 0.7, "n": 2, "exact": exact[1]}]
        return {**_result(0.6, 0.7, [0.4, 0.6]), "val_curve": curve, "post_exact": sum(exact) / 2}

    runs = {
        "grpo_matched": {1: run([0.5, 0.6]), 2: run([0.52, 0.61])},
        "headroom_drift": {1: run([0.55, 0.62]), 2: run([0.56, 0.64])},
    }
    comp = aggregate("headroom_drift", ARMS, runs)
    assert comp["primary_metric"]["key"] == "post_exact"
    assert [p["step"] for p in comp["arms"][0]["curve_exact"]] == [0, 2, 4] and _eval_steps(comp) == [0, 2, 4]
    png = plot_curves([comp], tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
