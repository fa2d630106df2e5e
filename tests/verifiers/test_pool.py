from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import pytest
import verifier_tasks as tasks
from load_tolerant import STARVED_SCHEDULER_S, within_deadline
from verifier_fixtures import fingerprint

from verl_replay.verifiers import pool as pool_module
from verl_replay.verifiers.pool import TaskFailure, VerifierPool
from verl_replay.verifiers.sandbox import warm_sql_sandbox
from verl_replay.verifiers.sql import SQLVerification, sql_failure, verify_sql


def assert_processes_gone(pids: list[int]) -> None:
    """No process (live or zombie) is left for any worker pid."""
    deadline = time.monotonic() + STARVED_SCHEDULER_S  # a poll: ends as soon as they are gone
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.05)
    left = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    assert not left, f"leftover worker processes: {left}"
    assert not {p.pid for p in multiprocessing.active_children()} & set(pids)


def own_children() -> list[int]:
    return [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _parent(int(pid)) == os.getpid()]


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


def still_running(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (not gone, not zombies) after a patient wait."""
    deadline = time.monotonic() + STARVED_SCHEDULER_S
    while True:
        left = {pid for pid in pids if _state(pid) not in (None, "Z")}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


SCENARIOS = [
    ("ok", 0),
    ("exit", 1),
    ("ok", 2),
    ("segfault", 3),
    ("ok", 4),
    ("sleep", 5),
    ("ok", 6),
    ("busy", 7),
    ("raise", 8),
    ("ok", 9),
]


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_crashes_and_hangs_cost_one_result_each(start_method: str) -> None:
    hang_deadline = 1.0
    # the hangs get a short deadline; the tasks that return get room for a starved scheduler
    with VerifierPool(num_workers=2, task_timeout_s=STARVED_SCHEDULER_S, start_method=start_method) as pool:
        assert pool.wait_ready(STARVED_SCHEDULER_S)
        start = time.monotonic()
        futures = [
            pool.submit(tasks.scenario, kind, value, timeout_s=hang_deadline if kind in ("sleep", "busy") else None)
            for kind, value in SCENARIOS
        ]
        results = [future.result() for future in futures]
        elapsed = time.monotonic() - start
        by_kind = dict(zip((k for k, _ in SCENARIOS), results, strict=True))
        assert [r for (k, _), r in zip(SCENARIOS, results, strict=True) if k == "ok"] == [0, 20, 40, 60, 90]
        assert by_kind["exit"] == TaskFailure("worker_crashed", "worker process died (exit code 7)")
        assert by_kind["segfault"].reason == "worker_crashed" and "-11" in by_kind["segfault"].detail
        assert by_kind["sleep"].reason == "worker_timeout"
        assert by_kind["busy"].reason == "worker_timeout"
        assert by_kind["raise"].reason == "task_error" and "failed on purpose" in by_kind["raise"].detail
        assert all(r.correct is False for r in results if isinstance(r, TaskFailure))
        # each hang cost one deadline, not the pool: both were killed (2 crashes + 2 kills = 4
        # respawns) and the map returned although the tasks run forever (how long it takes on a
        # quiet machine: bench_verifiers.py --sections deadlines)
        assert pool.replacements == 4
        assert within_deadline(elapsed, 2 * hang_deadline)
        # the pool keeps working after all that
        assert pool.map(tasks.scenario, [("ok", i) for i in range(6)]) == [0, 10, 20, 30, 40, 50]
        pids = list(pool.started_pids)
    assert pool.closed
    assert_processes_gone(pids)


def test_sql_through_pool_adversarial_within_deadline(db: Path) -> None:
    before = fingerprint(db)
    gold = "SELECT name FROM emp WHERE salary > 100"
    timeout = 1.0
    verify = functools.partial(verify_sql, timeout_s=timeout)
    # the pool's hard deadline far behind SQLite's own, so that the race between the two clocks
    # (in two processes) is never decided by how the machine schedules them
    with VerifierPool(num_workers=2, task_timeout_s=timeout + STARVED_SCHEDULER_S, on_failure=sql_failure) as pool:
        first = pool.map(verify, [(str(db), gold, gold)])
        assert first[0].correct
        assert pool.wait_ready(STARVED_SCHEDULER_S)  # both workers up
        jobs = [
            ("SELECT count(*) FROM t a, t b, t c, t d", "timeout"),
            ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c", "timeout"),
            ("DELETE FROM t", "write_attempt"),
            ("SELECT 1; DROP TABLE t", "multiple_statements"),
            (gold, "ok"),
        ]
        results = pool.map(verify, [(str(db), q, gold) for q, _ in jobs])
        pids = list(pool.started_pids)
    assert [r.reason for r in results] == [reason for _, reason in jobs]
    assert all(isinstance(r, SQLVerification) for r in results)
    assert all(within_deadline(r.elapsed_s, timeout) for r in results)  # measured inside the worker
    # SQLite's own deadline fired inside the worker: no worker had to be killed
    assert pool.replacements == 0
    assert fingerprint(db) == before
    assert_processes_gone(pids)


def test_pool_hard_deadline_returns_typed_failure(db: Path) -> None:
    verify = functools.partial(verify_sql, timeout_s=30.0)  # SQLite deadline far away
    # the initializer starts each worker's nested SQL sandbox outside the 0.5 s task deadline
    with VerifierPool(num_workers=1, task_timeout_s=0.5, on_failure=sql_failure, initializer=warm_sql_sandbox) as pool:
        assert pool.wait_ready(STARVED_SCHEDULER_S)
        start = time.monotonic()
        [hung] = pool.map(verify, [(str(db), "SELECT count(*) FROM t a, t b, t c, t d", "SELECT 1")])
        # the pool's deadline fired (SQLite's is 30 s away and the query runs for hours)
        assert hung == SQLVerification(False, "worker_timeout", "task exceeded its 0.5s deadline")
        assert within_deadline(time.monotonic() - start, 0.5)
        # ... and the pool serves on (this one with room for a starved scheduler)
        fine = pool.submit(verify, str(db), "SELECT 1", "SELECT 1", timeout_s=STARVED_SCHEDULER_S).result()
        assert fine.correct


def test_wait_ready() -> None:
    with VerifierPool(num_workers=2) as pool:
        assert pool.wait_ready(STARVED_SCHEDULER_S)
        assert len(pool.worker_pids()) == 2
        os.kill(pool.worker_pids()[0], 9)  # an idle worker dies: replaced, ready again
        deadline = time.monotonic() + STARVED_SCHEDULER_S
        while pool.replacements == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.replacements == 1
        assert pool.wait_ready(STARVED_SCHEDULER_S)
        assert pool.map(tasks.scenario, [("ok", 1), ("ok", 2)]) == [10, 20]


def test_workers_are_recycled_after_max_tasks() -> None:
    with VerifierPool(num_workers=1, max_tasks_per_child=2) as pool:
        pids = pool.map(tasks.worker_pid, [()] * 5)
        started = list(pool.started_pids)
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
    assert pool.replacements == 0  # recycling is not a crash
    assert_processes_gone(started)


def test_close_without_wait_fails_running_and_queued_tasks() -> None:
    pool = VerifierPool(num_workers=1, task_timeout_s=60)
    running = pool.submit(tasks.scenario, "sleep", 0)
    queued = [pool.submit(tasks.scenario, "ok", i) for i in range(3)]
    time.sleep(0.5)
    start = time.monotonic()
    pool.close(wait=False)
    # it did not wait for the running task (which sleeps until its 60 s deadline)
    assert within_deadline(time.monotonic() - start, 0.0)
    assert running.result(timeout=0).reason == "pool_closed"
    assert [f.result(timeout=0).reason for f in queued] == ["pool_closed"] * 3
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(tasks.scenario, "ok", 1)
    assert_processes_gone(pool.started_pids)


def test_context_exit_on_error_does_not_wait_for_hung_tasks() -> None:
    start = time.monotonic()
    with pytest.raises(KeyError), VerifierPool(num_workers=1, task_timeout_s=60) as pool:
        future = pool.submit(tasks.scenario, "busy", 0)
        raise KeyError("caller failed")
    assert within_deadline(time.monotonic() - start, 0.0)  # not the hung task's 60 s deadline
    assert future.result(timeout=0).reason == "pool_closed"
    assert_processes_gone(pool.started_pids)


def test_cancelled_queued_task_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with VerifierPool(num_workers=1, task_timeout_s=10 + STARVED_SCHEDULER_S) as pool:
        first = pool.submit(time.sleep, 5.0)  # holds the one worker while the next is cancelled
        cancelled = pool.submit(os.mkdir, str(marker))
        assert cancelled.cancel()
        after = pool.submit(tasks.scenario, "ok", 3)
        assert after.result(timeout=10 + STARVED_SCHEDULER_S) == 30
        assert first.result() is None
    assert not marker.exists()


def test_submit_from_many_threads() -> None:
    results: dict[int, int] = {}
    lock = threading.Lock()
    with VerifierPool(num_workers=2) as pool:

        def client(base: int) -> None:
            futures = {base + i: pool.submit(tasks.scenario, "ok", base + i) for i in range(10)}
            for key, future in futures.items():
                with lock:
                    results[key] = future.result()

        threads = [threading.Thread(target=client, args=(100 * t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == {key: key * 10 for key in results} and len(results) == 80


def test_unpicklable_task_raises_in_the_caller() -> None:
    with VerifierPool(num_workers=1) as pool:
        with pytest.raises((pickle.PicklingError, AttributeError), match="pickle|Can't|lambda"):
            pool.submit(lambda: 1)
        assert pool.map(tasks.scenario, [("ok", 1)]) == [10]


def test_memory_limit_turns_runaway_allocation_into_task_error() -> None:
    with VerifierPool(num_workers=1, memory_limit_mb=512) as pool:
        [huge, after] = pool.map(bytearray, [(2**31,), (3,)])
    assert huge.reason == "task_error" and "MemoryError" in huge.detail
    assert after == bytearray(3)
    assert pool.replacements == 0


def test_workers_that_cannot_start_fail_tasks_instead_of_looping() -> None:
    with VerifierPool(num_workers=1, preload=("no_such_module_for_verifier_pool_test",)) as pool:
        result = pool.submit(tasks.scenario, "ok", 1).result(timeout=30)
    assert result.reason == "worker_start_failed"
    assert_processes_gone(pool.started_pids)


@pytest.mark.parametrize(
    "kwargs",
    [{"num_workers": 0}, {"task_timeout_s": 0}, {"max_tasks_per_child": 0}, {"start_method": "fork"}],
)
def test_invalid_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        VerifierPool(**kwargs)


def test_supervisor_failure_resolves_every_future_and_closes_the_pool() -> None:
    pool = VerifierPool(num_workers=1, task_timeout_s=10)
    assert pool.wait_ready(STARVED_SCHEDULER_S)
    spawn_missing = pool._spawn_missing

    def broken_respawn() -> None:
        if len(pool._workers) < pool.num_workers:
            raise RuntimeError("simulated supervisor bug")
        spawn_missing()

    pool._spawn_missing = broken_respawn  # type: ignore[method-assign]  # fails once a worker must be replaced
    crashed = pool.submit(tasks.scenario, "exit", 0)
    queued = pool.submit(tasks.scenario, "ok", 1)
    assert crashed.result(timeout=10).reason == "worker_crashed"
    assert queued.result(timeout=10).reason == "pool_closed"
    assert pool._closed.wait(10)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(tasks.scenario, "ok", 2)
    pool.close()
    assert_processes_gone(pool.started_pids)


def failing_starts(pool: VerifierPool, failures: float) -> list[int]:
    """Make the pool's next ``failures`` worker starts raise as a killed forkserver's do; returns
    the list that counts them."""
    spawn, raised = pool._spawn, []

    def spawn_or_raise() -> None:
        if len(raised) < failures:
            raised.append(1)
            raise EOFError("unexpected EOF")  # what multiprocessing raises when its forkserver dies mid-start
        spawn()

    pool._spawn = spawn_or_raise  # type: ignore[method-assign]
    return raised


def test_a_worker_start_that_raises_is_retried(caplog: pytest.LogCaptureFixture) -> None:
    # the pool's own level: an import elsewhere in this process may have raised the root logger's
    # (importing vLLM's server module sets it to ERROR)
    caplog.set_level(logging.WARNING, logger="verl_replay.verifiers.pool")
    with VerifierPool(num_workers=1, task_timeout_s=10) as pool:
        assert pool.wait_ready(STARVED_SCHEDULER_S)
        raised = failing_starts(pool, 2)
        assert pool.submit(tasks.scenario, "exit", 0).result(timeout=10).reason == "worker_crashed"
        assert pool.submit(tasks.scenario, "ok", 1).result(timeout=STARVED_SCHEDULER_S) == 10  # the third start
        assert len(raised) == 2 and not pool.closed
    warnings = [r for r in caplog.records if r.name == "verl_replay.verifiers.pool"]
    assert [r.levelname for r in warnings] == ["WARNING", "WARNING"]  # no ERROR, no traceback
    assert "did not start (2 in a row): EOFError" in warnings[1].getMessage()
    assert_processes_gone(pool.started_pids)


def test_workers_that_never_start_fail_tasks_and_the_pool_stays_open() -> None:
    with VerifierPool(num_workers=1, task_timeout_s=10) as pool:
        assert pool.wait_ready(STARVED_SCHEDULER_S)
        raised = failing_starts(pool, float("inf"))
        assert pool.submit(tasks.scenario, "exit", 0).result(timeout=10).reason == "worker_crashed"
        failed = pool.submit(tasks.scenario, "ok", 1).result(timeout=STARVED_SCHEDULER_S)
        assert failed.reason == "worker_start_failed" and "5 workers in a row did not start" in failed.detail
        assert len(raised) == 5 and not pool.closed  # retried with pauses, then given up: no busy loop
        assert pool.submit(tasks.scenario, "ok", 2).result(timeout=10).reason == "worker_start_failed"
    assert_processes_gone(pool.started_pids)


def test_a_worker_that_dies_before_taking_its_task_does_not_fail_it(tmp_path: Path) -> None:
    with VerifierPool(num_workers=1, task_timeout_s=10) as pool:
        once = tasks.DiesWhenUnpickled(str(tmp_path / "died_once"))
        assert pool.submit(tasks.scenario, "ok", once).result(timeout=STARVED_SCHEDULER_S) == 50
        assert pool.replacements == 1
        always = pool.submit(tasks.scenario, "ok", tasks.DiesWhenUnpickled()).result(timeout=STARVED_SCHEDULER_S)
        assert always.reason == "worker_crashed"
        assert always.detail == "3 workers in a row died before they could take the task"
        assert pool.replacements == 4 and pool.submit(tasks.scenario, "ok", 1).result(timeout=10) == 10
    assert_processes_gone(pool.started_pids)


def test_a_killed_forkserver_is_replaced() -> None:
    """SIGKILL the forkserver (the workers, its children, die with it): the next task runs on
    workers of a new forkserver."""
    with VerifierPool(num_workers=2, task_timeout_s=10, start_method="forkserver") as pool:
        assert pool.wait_ready(STARVED_SCHEDULER_S)
        before = set(pool.worker_pids())
        forkservers = [pid for pid in own_children() if "multiprocessing.forkserver" in cmdline(pid)]
        assert len(forkservers) == 1
        os.kill(forkservers[0], signal.SIGKILL)
        assert not still_running(before)  # the workers died with it (their parent)
        # sent at once, maybe to a worker whose death the pool has not seen: never taken, not charged
        ran_on = pool.submit(tasks.worker_pid).result(timeout=STARVED_SCHEDULER_S)
        assert isinstance(ran_on, int) and ran_on not in before
    assert_processes_gone(pool.started_pids)


def test_preloading_the_sql_module_starts_each_workers_sandbox(db: Path) -> None:
    """A pool that preloads verl_replay.verifiers.sql starts its workers' SQL sandboxes before
    they report ready, so no task deadline pays for their start-up."""
    verify = functools.partial(verify_sql, timeout_s=5.0)
    with VerifierPool(
        num_workers=1, task_timeout_s=10, preload=("verl_replay.verifiers.sql",), on_failure=sql_failure
    ) as pool:
        assert pool.wait_ready(STARVED_SCHEDULER_S)
        [worker] = pool.worker_pids()
        sandbox_workers = tasks.children_of(worker)
        assert len(sandbox_workers) == 2  # min_workers, started and ready before any task
        [result] = pool.map(verify, [(str(db), "SELECT 1", "SELECT 1")])
        assert result.correct
        assert tasks.children_of(worker) == sandbox_workers  # the same, reused: no cold start
    assert_processes_gone(sandbox_workers)  # they die with their pool worker


def test_workers_that_all_die_idle_start_again_only_for_work() -> None:
    """A process being torn down (its process group killed) loses every worker at once while idle:
    the pool does not start new ones then (a start would meet a dead forkserver and print its
    traceback into the run's log), but a task submitted afterwards still runs."""
    with VerifierPool(num_workers=2) as pool:
        assert pool.wait_ready(STARVED_SCHEDULER_S)
        first = pool.worker_pids()
        for pid in first:  # one at a time, as a starved supervisor may see a process group die
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        deadline = time.monotonic() + STARVED_SCHEDULER_S
        while pool.replacements < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.replacements == 2
        # the supervisor may see the deaths one at a time (a starved scheduler): the first must not
        # be replaced before the second is seen, and neither after the grace
        time.sleep(pool_module._IDLE_DEATH_GRACE_S + 0.5)
        assert pool.worker_pids() == [] and pool.started_pids == first
        assert pool.map(tasks.scenario, [("ok", 3)]) == [30]
        assert pool.wait_ready(STARVED_SCHEDULER_S) and len(pool.worker_pids()) == 2
