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


def test_run_order_is_seed_by_seed_longest_first_across_profiles(tmp_path):
    from verl_replay.compare.plan import arith_profile, build_plan, shapes_profile
    from verl_replay.compare.runner import run_order

    recipes = Path(__file__).resolve().parents[2] / "recipes"

    def plan(profile, comparison):
        return build_plan(
            comparisons=[comparison],
            profile=profile,
            seeds=[2, 1],
            out_dir=tmp_path / profile.name,
            recipes_dir=recipes,
            python="python",
        )

    plans = [plan(arith_profile(), "headroom_drift"), plan(shapes_profile(), "elite")]
    order = [(plans[i].profile.name, run.seed, run.arm.name) for i, run in run_order(plans)]
    assert len(order) == 2 * (7 + 4) and [seed for _, seed, _ in order] == [2] * 11 + [1] * 11
    first_seed = order[:11]
    assert [arm for _, _, arm in first_seed[:2]] == ["headroom_drift", "drift_only"]  # the gated arms
    assert {arm for profile, _, arm in first_seed[2:6]} == {"grpo", "elite_iid", "elite", "elite_mu0"}
    assert [arm for _, _, arm in first_seed[6:]] == [
        "grpo_matched",
        "grpo_larger",
        "naive",
        "headroom_only",
        "grpo_control",
    ]


def test_several_plans_run_in_one_queue_and_report_apart(tmp_path):
    from verl_replay.compare.runner import run_plans

    plans = [_plan(tmp_path / "a", [_spec(tmp_path / "a", "x", "print(1)")]), _plan(tmp_path / "b", [])]
    plans[1] = Plan(
        profile=tiny_profile(), tau=0.06, out_dir=tmp_path / "b", archive=None, search=None,
        runs=[_spec(tmp_path / "b", "x", "import sys; sys.exit(4)")],
    )  # fmt: skip
    lines: list[str] = []
    first, second = run_plans(plans, say=lines.append, jobs=2)
    assert first["headroom_drift/x/seed1"]["returncode"] == 0 and second["headroom_drift/x/seed1"]["returncode"] == 4
    assert any("tiny/headroom_drift/x/seed1" in line for line in lines)  # the profile names each line
