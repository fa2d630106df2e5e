"""Running a plan's commands: records, skipping finished runs, failures, the time budget."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from verl_replay.compare.plan import Arm, Plan, RunSpec, tiny_profile
from verl_replay.compare.runner import DONE_FILE, read_done, run_plan


def _spec(tmp_path: Path, name: str, code: str) -> RunSpec:
    arm = Arm("headroom_drift", name, name, "unused.sh")
    return RunSpec(
        arm,
        1,
        tmp_path / "runs" / name,
        tmp_path / "logs" / f"{name}.log",
        {"COMPARE_TEST": name},
        [sys.executable, "-c", code],
    )


def _plan(tmp_path: Path, runs: list[RunSpec]) -> Plan:
    return Plan(profile=tiny_profile(), tau=0.06, out_dir=tmp_path, archive=None, search=None, runs=runs)


def test_records_failures_and_skips_finished_runs(tmp_path):
    ok = _spec(tmp_path, "ok", "import os; print('env', os.environ['COMPARE_TEST'])")
    bad = _spec(tmp_path, "bad", "import sys; print('boom'); sys.exit(3)")
    lines: list[str] = []
    records = run_plan(_plan(tmp_path, [ok, bad]), say=lines.append)
    assert records[ok.key]["returncode"] == 0 and read_done(ok.run_dir)["wall_s"] >= 0
    assert records[bad.key]["returncode"] == 3 and read_done(bad.run_dir) is None
    assert "boom" in bad.log_path.read_text() and "FAILED (exit 3" in lines[-1]
    assert "env ok" in ok.log_path.read_text()  # the spec's environment reached the command
    assert (ok.run_dir / DONE_FILE).is_file() and not (bad.run_dir / DONE_FILE).exists()
    lines.clear()
    again = run_plan(_plan(tmp_path, [ok, bad]), say=lines.append)
    assert "done earlier" in lines[0] and again[bad.key]["returncode"] == 3  # only the failed one re-ran


def test_a_run_another_command_finished_meanwhile_is_not_run_again(tmp_path):
    # two commands on one output folder: the first planned this run before the second finished it
    first = _spec(tmp_path, "first", "print('first ran')")
    taken = _spec(tmp_path, "taken", "print('ran again')")
    finisher = f"import json, pathlib; p = pathlib.Path({str(taken.run_dir)!r}); p.mkdir(parents=True); "
    finisher += f"(p / {DONE_FILE!r}).write_text(json.dumps({{'returncode': 0, 'wall_s': 7.0}}))"
    first = RunSpec(first.arm, 1, first.run_dir, first.log_path, first.env, [sys.executable, "-c", finisher])
    lines: list[str] = []
    records = run_plan(_plan(tmp_path, [first, taken]), say=lines.append)
    assert records[taken.key]["wall_s"] == 7.0 and not taken.log_path.exists()
    assert any(f"{taken.key}: done meanwhile (7s)" in line for line in lines)


def test_time_budget_stops_starting_runs(tmp_path):
    runs = [_spec(tmp_path, f"r{i}", "import time; time.sleep(0.4)") for i in range(3)]
    lines: list[str] = []
    records = run_plan(_plan(tmp_path, runs), say=lines.append, time_budget_s=0.6)
    # after the first (~0.4 s): 0.4 spent + 0.4 expected > 0.6 -> the others are not started
    assert records[runs[0].key]["returncode"] == 0
    assert [records[r.key].get("skipped") for r in runs[1:]] == ["time budget", "time budget"]
    assert sum("not started" in line for line in lines) == 2


def test_jobs_run_side_by_side_and_records_keep_plan_order(tmp_path):
    # each run waits for the other's marker: they can only both finish if they run at once
    def meet(me: str, other: str) -> str:
        return (
            "import pathlib, sys, time\n"
            f"pathlib.Path({str(tmp_path / me)!r}).touch()\n"
            "deadline = time.monotonic() + 300\n"
            f"while not pathlib.Path({str(tmp_path / other)!r}).exists():\n"
            "    if time.monotonic() > deadline: sys.exit(9)\n"
            "    time.sleep(0.05)\n"
        )

    runs = [_spec(tmp_path, "a", meet("a.here", "b.here")), _spec(tmp_path, "b", meet("b.here", "a.here"))]
    runs.append(_spec(tmp_path, "c", "print('third')"))
    lines: list[str] = []
    records = run_plan(_plan(tmp_path, runs), say=lines.append, jobs=2)
    assert [records[r.key]["returncode"] for r in runs] == [0, 0, 0]
    assert list(records) == [r.key for r in runs]
    # the third starts only when a slot is free: after one of the first two finished
    started_c = next(i for i, line in enumerate(lines) if "headroom_drift/c/seed1 ..." in line)
    assert any(": ok in" in line for line in lines[:started_c])
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        run_plan(_plan(tmp_path, runs), say=lines.append, jobs=0)
