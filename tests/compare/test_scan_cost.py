"""The scan-cost side-by-side report: per-step means and ratios from hand-made runs."""

from __future__ import annotations

import json

import pytest

from verl_replay.compare.scan_cost import main, scan_cost, side_by_side


def _run(tmp_path, name, steps, exact_values):
    run = tmp_path / name
    run.mkdir()
    events = [{"event": "step", "step": 1, "stats": {"candidates": 0.0, "scanned": 0.0}}]  # empty buffer: left out
    events += [{"event": "step", "step": i + 2, "stats": {"candidates": 5.0, **s}} for i, s in enumerate(steps)]
    (run / "replay_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    lines = [
        {
            "step": step,
            "data": {
                "val-core/tiny_arith/acc/mean@2": v,
                "val-exact/tiny_arith/acc/expected": v,
                **({"timing_s/step": 1.0} if step else {}),
            },
        }
        for step, v in exact_values
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run / "config.yaml").write_text("data:\n  train_batch_size: 8\nactor_rollout_ref:\n  rollout:\n    n: 8\n")
    return run


def _step(scanned, skipped, accepted, rows, calls, wall, cpu):
    return {
        "scanned": scanned,
        "scan_skipped": skipped,
        "accepted": accepted,
        "scan_forward_rows": rows,
        "scan_forward_calls": calls,
        "scan_forward_seconds": wall,
        "scan_forward_cpu_seconds": cpu,
    }


def test_per_step_means_ratios_and_the_paired_metric(tmp_path, capsys):
    exact = _run(
        tmp_path,
        "exact",
        [_step(100, 0, 2, 800, 2, 4.0, 2.0), _step(200, 0, 4, 1600, 4, 8.0, 4.0)],
        [(0, 0.3), (1, 0.5), (2, 0.6)],
    )
    skip = _run(
        tmp_path,
        "skip",
        [_step(10, 90, 2, 80, 1, 1.0, 0.2), _step(30, 170, 2, 240, 1, 2.0, 0.6)],
        [(0, 0.3), (1, 0.5), (2, 0.7)],
    )
    cost = scan_cost(exact)
    assert cost["steps"] == 2 and cost["scanned"] == 150 and cost["cpu_s"] == 3.0 and cost["calls"] == 3
    report = side_by_side([exact], [skip])
    ratios = report["pairs"][0]["ratios"]
    assert ratios["rows"] == pytest.approx(160 / 1200) and ratios["wall_s"] == pytest.approx(1.5 / 6.0)
    assert ratios["cpu_s"] == pytest.approx(0.4 / 3.0) and ratios["calls"] == pytest.approx(1 / 3)
    # the held-out metric: the exact one, mean over post-training evaluations (0.55 vs 0.60)
    assert report["metric"]["measure"] == "post_exact" and report["metric"]["mean"] == pytest.approx(0.05)
    assert report["metric"]["verdict"] == "too few paired seeds for an interval"
    assert main(["--exact", str(exact), "--skip", str(skip)]) == 0
    out = capsys.readouterr().out
    assert "cpu_s         3.00 ->      0.40   (0.13x)" in out and "skip - exact: +5.0 points (1 seeds)" in out


def test_unpaired_or_unscanned_runs_are_refused(tmp_path, capsys):
    empty = _run(tmp_path, "empty", [], [(0, 0.3), (1, 0.4)])
    assert main(["--exact", str(empty), "--skip", str(empty)]) == 2
    assert "no step with a buffer to scan" in capsys.readouterr().err
    with pytest.raises(ValueError, match="one --skip run for each --exact run"):
        side_by_side([empty, empty], [empty])
