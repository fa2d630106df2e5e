"""The SQL process sandbox: hard deadlines, bounded memory, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from load_tolerant import STARVED_SCHEDULER_S, PeakSampler, cpu_seconds, within_deadline
from verifier_fixtures import fingerprint

from verl_replay.verifiers import sandbox as sandbox_mod
from verl_replay.verifiers.sandbox import SandboxError, SQLSandbox, get_sql_sandbox, shutdown_sql_sandbox
from verl_replay.verifiers.sql import KILL_GRACE_S, execute_readonly

MB = 1024 * 1024
TIMEOUT = 0.5
# Single SQLite steps that ignore the progress handler for tens of seconds (measured in-process
# on a 1 s deadline: instr 49 s, replace 25 s).
LONG_STEPS = {
    "instr": (
        "SELECT instr(x || 'b', substr(x, 1, 200000) || 'b') "
        "FROM (SELECT replace(hex(zeroblob(2000000)), '0', 'a') AS x)"
    ),
    "replace": (
        "SELECT length(replace(x, substr(x, 1, 100000) || 'b', 'c')) "
        "FROM (SELECT replace(hex(zeroblob(2000000)), '0', 'a') AS x)"
    ),
}
ROWS_150_X_16MB = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 150) "
    "SELECT x, randomblob(16000000) FROM c"
)


def run(sb: SQLSandbox, db: Path, sql: str, timeout_s: float = TIMEOUT, max_bytes: int = 64 * MB):  # type: ignore[no-untyped-def]
    return sb.execute(str(db), sql, timeout_s=timeout_s, max_rows=100_000, max_bytes=max_bytes)


def process_state(pid: int) -> str | None:
    """'R', 'S', 'Z', ... from /proc, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split()[1]
    except OSError:
        return None
    return None


def wait_gone(pids: list[int], timeout_s: float = STARVED_SCHEDULER_S, allow_zombies: bool = False) -> list[int]:
    """Pids still present (as zombies too, unless allowed) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in pids if process_state(p) not in (None, *(("Z",) if allow_zombies else ()))]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def own_children() -> set[int]:
    me = os.getpid()
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                kids.add(int(entry))
    return kids


@pytest.fixture
def sb():  # type: ignore[no-untyped-def]
    sandbox = SQLSandbox(max_workers=4, min_workers=2)
    assert sandbox.wait_ready(STARVED_SCHEDULER_S)
    yield sandbox
    sandbox.close()
    assert not wait_gone(sandbox.started_pids), "sandbox workers left behind"


@pytest.mark.parametrize("name", sorted(LONG_STEPS))
def test_a_long_sqlite_step_is_killed_at_the_deadline(sb: SQLSandbox, db: Path, name: str) -> None:
    before = fingerprint(db)
    # in process, SQLite's own deadline cannot stop it (shown with a short budget)
    start = time.monotonic()
    result = run(sb, db, LONG_STEPS[name])
    elapsed = time.monotonic() - start
    assert (result.rows, result.reason) == (None, "timeout")
    assert "killed" in result.detail and sb.kills == 1  # stopped by the kill, not by finishing
    assert TIMEOUT <= elapsed, elapsed  # never before the deadline (load only makes it later)
    assert within_deadline(elapsed, TIMEOUT + KILL_GRACE_S)  # inline the step runs 25-49 s
    assert fingerprint(db) == before
    # the replacement is started at once, at the kill: the next query starts no worker
    started = sb.stats()["started"]
    assert run(sb, db, "SELECT count(*) FROM t").rows == [(2000,)]
    assert sb.stats()["started"] == started
    assert len(sb.worker_pids()) >= 2


def test_the_same_step_overruns_without_the_sandbox(db: Path) -> None:
    """Why the sandbox exists: inline, the deadline only fires after the step ends. Measured in
    this process's CPU time (the work done), which load on the machine does not change."""
    small = (
        "SELECT instr(x || 'b', substr(x, 1, 20000) || 'b') FROM (SELECT replace(hex(zeroblob(200000)), '0', 'a') AS x)"
    )
    # Grow the step until it takes several deadlines of CPU uninterrupted, whatever this CPU's speed.
    for size in (200_000, 400_000, 800_000, 1_600_000):
        step = small.replace("200000", str(size))
        _, uninterrupted = cpu_seconds(execute_readonly, db, step, timeout_s=60.0, isolation="inline")
        if uninterrupted > 8 * 0.05:
            break
    result, cut_short = cpu_seconds(execute_readonly, db, step, timeout_s=0.05, isolation="inline")
    assert cut_short > 0.5 * uninterrupted > 4 * 0.05  # the deadline did not cut the step: all its work was done
    assert result.reason in ("timeout", "ok")


def test_150_rows_of_16_mb_stop_at_the_first_row_past_the_cap(db: Path) -> None:
    with SQLSandbox(min_workers=1) as fresh:  # a fresh worker: its peak is this query's
        assert fresh.wait_ready(STARVED_SCHEDULER_S)
        result = run(fresh, db, ROWS_150_X_16MB, timeout_s=10.0)
        assert result.reason == "byte_cap"
        assert "at row 5" in result.detail  # 4 x 16 MB fit in 64 MB; the 5th row trips the cap
        assert fresh.peak_rss_kb * 1024 < 512 * MB, fresh.peak_rss_kb  # ~130 MB measured; not 150 x 16 MB = 2.4 GB


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT " + ", ".join(["zeroblob(16000000)"] * 100),  # one row of 1.6 GB
        "SELECT " + ", ".join(["CAST(zeroblob(16000000) AS TEXT)"] * 100),
    ],
    ids=["blob-row", "text-row"],
)
def test_a_huge_row_fails_within_the_memory_limit(db: Path, sql: str) -> None:
    with SQLSandbox(min_workers=1, memory_limit_mb=1024) as fresh:
        assert fresh.wait_ready(STARVED_SCHEDULER_S)
        result = run(fresh, db, sql, timeout_s=10.0)
        assert result.reason == "out_of_memory", result
        assert 0 < fresh.peak_rss_kb * 1024 < 1024 * MB
        assert fresh.recycled == 1  # a worker that ran out of memory is not reused
        assert run(fresh, db, "SELECT 1").rows == [(1,)]


def test_concurrent_callers_run_side_by_side(sb: SQLSandbox, db: Path) -> None:
    for _ in range(2):  # four callers at once make the sandbox start four workers
        threads = [threading.Thread(target=run, args=(sb, db, "SELECT 1")) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(run(sb, db, LONG_STEPS["instr"]).reason)) for _ in range(4)
    ]
    with PeakSampler(sb.busy_count) as busy:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == ["timeout"] * 4 and sb.kills == 4
    # side by side: four workers each held a long step at the same time (seen from inside the
    # sandbox; the total wall time would say as much about the machine's load as about this)
    assert busy.peak == 4, busy.peak


def test_nothing_is_left_behind(db: Path) -> None:
    threads_before = threading.active_count()
    children_before = own_children()
    sandbox = SQLSandbox(max_workers=3, min_workers=2)
    for sql in (LONG_STEPS["instr"], "SELECT 1", LONG_STEPS["replace"], "DELETE FROM t", "SELECT 2"):
        run(sandbox, db, sql)
    assert sandbox.kills == 2
    assert threading.active_count() == threads_before  # the caller waits; no watchdog thread
    # children: the live workers only -- a killed worker finishes dying on its own (under load
    # that takes a moment) and the next call reaps it: no zombies accumulate
    extra = own_children() - children_before - set(sandbox.worker_pids())
    assert not wait_gone(list(extra), allow_zombies=True)
    # each call reaps the killed workers that have finished dying by then (under load a
    # replacement can still be starting): a few calls leave exactly the live workers
    deadline = time.monotonic() + STARVED_SCHEDULER_S  # a poll: ends as soon as it holds
    while True:
        run(sandbox, db, "SELECT 3")
        live = set(sandbox.worker_pids())
        if own_children() - children_before == live or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert own_children() - children_before == live
    assert all(process_state(pid) in ("R", "S") for pid in live)
    sandbox.close()
    assert not wait_gone(sandbox.started_pids)
    assert own_children() - children_before == set()
    assert threading.active_count() == threads_before


def test_workers_die_with_their_owner(tmp_path: Path, db: Path) -> None:
    """SIGKILL the owning process while its worker is inside a long SQLite step: the worker's
    lifeline closes and it exits at once (no orphan keeps burning CPU)."""
    script = tmp_path / "owner.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys, threading, time
        sys.path[:0] = {sys.path!r}
        from verl_replay.verifiers.sandbox import SQLSandbox
        sb = SQLSandbox(min_workers=1)
        assert sb.wait_ready({STARVED_SCHEDULER_S})
        threading.Thread(target=sb.execute, args=({str(db)!r}, {LONG_STEPS["instr"]!r}),
                         kwargs=dict(timeout_s=600, max_rows=10, max_bytes=10**6), daemon=True).start()
        time.sleep(0.5)
        print(" ".join(map(str, sb.worker_pids())), flush=True)
        time.sleep(600)
    """)
    )
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]  # type: ignore[union-attr]
        assert pids and all(process_state(p) in ("R", "S") for p in pids)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert not wait_gone(pids, allow_zombies=True), "a worker outlived its owner"  # its step runs 600 s
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user + system), from /proc; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kill_all_once_one_runs(sb: SQLSandbox, busy_cpu_s: float = 0.2) -> threading.Thread:
    """A thread that SIGKILLs every worker once one of them has spent ``busy_cpu_s`` more CPU
    than at the start (it is inside the query), however long a loaded machine takes to get there."""
    pids = sb.worker_pids()
    start = {pid: cpu_s(pid) for pid in pids}

    def kill_when_running() -> None:
        deadline = time.monotonic() + STARVED_SCHEDULER_S
        while time.monotonic() < deadline and all(cpu_s(p) - start[p] < busy_cpu_s for p in pids):
            time.sleep(0.02)
        for pid in sb.worker_pids():
            os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=kill_when_running)
    thread.start()
    return thread


def test_a_crashing_worker_is_a_failed_verification(sb: SQLSandbox, db: Path) -> None:
    killer = kill_all_once_one_runs(sb)
    # the deadline is far off (the kill decides, even if a loaded machine delays it)
    result = run(sb, db, LONG_STEPS["instr"], timeout_s=STARVED_SCHEDULER_S)
    killer.join()
    assert result.reason == "worker_crashed" and "exit code -9" in result.detail
    # the idle worker died too: the next query is not blamed for it, whether the sandbox sees
    # the death before sending (reaped) or after (no receipt: sent again to a fresh worker)
    assert run(sb, db, "SELECT 3").rows == [(3,)]


def test_a_worker_dead_before_the_query_is_replaced(sb: SQLSandbox, db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that dies idle (the OOM killer, an operator) between the sandbox's liveness check
    and the query: it never sends its receipt, so the query runs on another worker."""
    for worker in list(sb._idle):
        os.kill(worker.pid, signal.SIGKILL)
        assert not wait_gone([worker.pid], allow_zombies=True)
        monkeypatch.setattr(worker.proc, "poll", lambda: None)  # the check ran a moment before the death
    assert run(sb, db, "SELECT 3").rows == [(3,)]
    assert sb.crashes == 2  # both dead workers were tried (the last ready one first), neither blamed


def test_workers_that_die_before_every_query_fail_it(monkeypatch: pytest.MonkeyPatch, db: Path) -> None:
    # ready, then gone at the first query, before its receipt
    dies_at_query = (
        "import sys; from multiprocessing.connection import Connection; c = Connection(int(sys.argv[1])); "
        f"c.send_bytes({sandbox_mod._READY!r}); c.recv_bytes()"
    )
    monkeypatch.setattr(sandbox_mod, "_BOOT", dies_at_query)
    with SQLSandbox(min_workers=1, max_workers=1) as doomed:
        result = run(doomed, db, "SELECT 1")
        assert (result.rows, result.reason) == (None, "worker_crashed")
        assert "3 sandbox workers in a row died before they could take the query" in result.detail
        assert doomed.crashes == 3
    assert not wait_gone(doomed.started_pids)


def test_workers_are_recycled(db: Path) -> None:
    with SQLSandbox(min_workers=1, max_workers=1, max_tasks_per_worker=3) as sandbox:
        pids = []
        for _ in range(7):
            assert run(sandbox, db, "SELECT 1").rows == [(1,)]
            pids.append(sandbox.worker_pids()[0])
        assert sandbox.recycled == 2
        assert len(set(pids)) == 3
    assert not wait_gone(sandbox.started_pids)


def test_workers_that_cannot_start_raise(monkeypatch: pytest.MonkeyPatch, db: Path) -> None:
    monkeypatch.setattr(sandbox_mod, "_BOOT", "import sys; sys.exit(3)")
    with SQLSandbox(min_workers=1) as broken, pytest.raises(SandboxError, match="do not start"):
        run(broken, db, "SELECT 1")
    assert not wait_gone(broken.started_pids)


def test_closed_sandbox_refuses(db: Path) -> None:
    sandbox = SQLSandbox(min_workers=0)
    sandbox.close()
    with pytest.raises(SandboxError, match="closed"):
        run(sandbox, db, "SELECT 1")


def test_process_wide_sandbox_and_its_configuration(monkeypatch: pytest.MonkeyPatch, db: Path) -> None:
    shutdown_sql_sandbox()
    monkeypatch.setenv("VERL_REPLAY_SQL_WORKERS", "3")
    monkeypatch.setenv("VERL_REPLAY_SQL_MIN_WORKERS", "1")
    sandbox = get_sql_sandbox()
    assert (sandbox.max_workers, sandbox.min_workers) == (3, 1)
    assert get_sql_sandbox() is sandbox
    assert execute_readonly(db, "SELECT 4", isolation="process").rows == [(4,)]
    shutdown_sql_sandbox()
    assert sandbox.closed and not wait_gone(sandbox.started_pids)
    monkeypatch.setenv("VERL_REPLAY_SQL_WORKERS", "lots")
    with pytest.raises(ValueError, match="VERL_REPLAY_SQL_WORKERS"):
        get_sql_sandbox()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_workers": 0},
        {"min_workers": 5, "max_workers": 2},
        {"memory_limit_mb": 10},
        {"kill_grace_s": 0},
        {"max_tasks_per_worker": 0},
    ],
)
def test_invalid_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SQLSandbox(**kwargs)
