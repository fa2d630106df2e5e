"""Run a plan's recipe commands as subprocesses, one or a few at a time, resumably.

A finished run leaves ``<run_dir>/compare_run.json`` (its command, exit status and wall time);
a rerun of the same comparison skips those runs, and a run that was interrupted is started
again with the same ``RUN_DIR``, which the recipe resumes from its last checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from verl_replay._files import atomic_write_text
from verl_replay.compare.plan import Plan, RunSpec

__all__ = ["DONE_FILE", "read_done", "run_order", "run_spec", "run_plan", "run_plans"]

DONE_FILE = "compare_run.json"


def read_done(run_dir: Path) -> Optional[dict[str, Any]]:
    """The record of a finished run, or None if the run has not finished successfully."""
    path = Path(run_dir) / DONE_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("returncode") == 0 else None


def run_spec(spec: RunSpec, *, done_path: Optional[Path] = None) -> dict[str, Any]:
    """Run one recipe command with its environment, output to its log file; write the record."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **spec.env}
    start = time.monotonic()
    with open(spec.log_path, "a", encoding="utf-8") as log:
        log.write(f"[compare] {spec.shell()}\n")
        log.flush()
        proc = subprocess.run(spec.argv, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.monotonic() - start
    record = {
        "key": spec.key,
        "command": spec.shell(),
        "returncode": proc.returncode,
        "wall_s": wall,
        "log": str(spec.log_path),
    }
    if proc.returncode == 0:
        atomic_write_text(done_path or spec.run_dir / DONE_FILE, json.dumps(record, indent=2) + "\n")
    return record


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_plan(
    plan: Plan,
    *,
    say: Callable[[str], None] = _print,
    time_budget_s: Optional[float] = None,
    jobs: int = 1,
) -> dict[str, dict[str, Any]]:
    """Every run of the plan (the archive search first), skipping finished ones, up to ``jobs``
    at a time. Returns the records by run key, in plan order; failed runs are recorded and the
    rest still run. With a time budget, a run is not started when the time spent plus the mean
    wall time of this session's finished runs would exceed it (the runs left are recorded as not
    started; repeat the command to add them)."""
    return run_plans([plan], say=say, time_budget_s=time_budget_s, jobs=jobs)[0]


def run_order(plans: Sequence[Plan]) -> list[tuple[int, RunSpec]]:
    """(plan index, run) of every run: seed by seed (a partial comparison holds whole seeds of
    every arm), and within a seed the longest runs first (``Arm.relative_cost``), so that side by
    side the command does not end waiting on one long run; ties keep plan order."""
    seeds = sorted({run.seed for plan in plans for run in plan.runs}, key=_first_seen(plans))
    order = []
    for seed in seeds:
        runs = [(i, run) for i, plan in enumerate(plans) for run in plan.runs if run.seed == seed]
        order += sorted(runs, key=lambda item: -item[1].arm.relative_cost)  # stable
    return order


def _first_seen(plans: Sequence[Plan]) -> Callable[[int], int]:
    first: dict[int, int] = {}
    for run in (run for plan in plans for run in plan.runs):
        first.setdefault(run.seed, len(first))
    return first.__getitem__


def run_plans(
    plans: Sequence[Plan],
    *,
    say: Callable[[str], None] = _print,
    time_budget_s: Optional[float] = None,
    jobs: int = 1,
) -> list[dict[str, dict[str, Any]]]:
    """The runs of several plans (profiles) in one queue, as :func:`run_plan` runs one: every
    archive search first, then :func:`run_order`. Returns each plan's records, in its own order."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    records: list[dict[str, dict[str, Any]]] = [{} for _ in plans]
    named = len(plans) > 1  # several profiles: lines name the profile, run keys may repeat across them
    start = time.monotonic()
    walls: list[float] = []
    for plan, plan_records in zip(plans, records, strict=True):
        if plan.search is not None:
            plan_records["elite/search"] = _archive(plan, say, f"{plan.profile.name} " if named else "")
    order = run_order(plans)
    total = len(order)

    def label(index: int, spec: RunSpec, plan_index: int) -> str:
        return f"{index}/{total} {plans[plan_index].profile.name + '/' if named else ''}{spec.key}"

    queue: deque[tuple[int, int, RunSpec]] = deque()
    for index, (plan_index, spec) in enumerate(order, 1):
        plan_records = records[plan_index]
        done = read_done(spec.run_dir)
        if done is not None:
            say(f"[compare] {label(index, spec, plan_index)}: done earlier ({done['wall_s']:.0f}s)")
            plan_records[spec.key] = done
        elif spec.arm.comparison == "elite" and spec.arm.name != "grpo" and _failed(plan_records.get("elite/search")):
            plan_records[spec.key] = _not_started(spec, "no archive")
            say(f"[compare] {label(index, spec, plan_index)}: skipped (no archive)")
        else:
            queue.append((index, plan_index, spec))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        running: dict[Future[dict[str, Any]], tuple[int, int, RunSpec]] = {}
        while queue or running:
            while queue and len(running) < jobs:
                index, plan_index, spec = queue.popleft()
                name = label(index, spec, plan_index)
                done = read_done(spec.run_dir)
                if done is not None:  # finished meanwhile by another command on the same folder
                    say(f"[compare] {name}: done meanwhile ({done['wall_s']:.0f}s)")
                    records[plan_index][spec.key] = done
                    continue
                if time_budget_s is not None and walls:
                    expected = time.monotonic() - start + sum(walls) / len(walls)
                    if expected > time_budget_s:
                        records[plan_index][spec.key] = _not_started(spec, "time budget")
                        say(f"[compare] {name}: not started (time budget {time_budget_s:.0f}s)")
                        continue
                say(f"[compare] {name} ... (log {spec.log_path})")
                running[pool.submit(run_spec, spec)] = (index, plan_index, spec)
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                index, plan_index, spec = running.pop(future)
                record = future.result()
                walls.append(record["wall_s"])
                records[plan_index][spec.key] = record
                status = "ok" if record["returncode"] == 0 else f"FAILED (exit {record['returncode']}, see the log)"
                say(f"[compare] {label(index, spec, plan_index)}: {status} in {record['wall_s']:.0f}s")
    ordered = []
    for plan, plan_records in zip(plans, records, strict=True):
        keys = ["elite/search"] + [spec.key for spec in plan.runs]
        ordered.append({key: plan_records[key] for key in keys if key in plan_records})
    return ordered


def _archive(plan: Plan, say: Callable[[str], None], profile: str) -> dict[str, Any]:
    """The archive the plan's elite arms share: built earlier, or searched now."""
    assert plan.search is not None and plan.archive is not None
    manifest = plan.archive.with_name(plan.archive.name + ".manifest.json")
    done = read_done(plan.archive.parent)
    if done is not None and plan.archive.is_file() and manifest.is_file():
        say(f"[compare] {profile}archive: {plan.archive} (built earlier, {done['wall_s']:.0f}s)")
        return done
    say(f"[compare] {profile}archive search -> {plan.archive} (log {plan.search.log_path})")
    record = run_spec(plan.search, done_path=plan.archive.parent / DONE_FILE)
    if record["returncode"] != 0:
        say(f"[compare] {profile}archive search FAILED (exit {record['returncode']}): see {record['log']}")
    return record


def _failed(record: Optional[dict[str, Any]]) -> bool:
    return record is None or record["returncode"] != 0


def _not_started(spec: RunSpec, why: str) -> dict[str, Any]:
    return {"key": spec.key, "command": spec.shell(), "returncode": None, "wall_s": 0.0, "log": None, "skipped": why}
