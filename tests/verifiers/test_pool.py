from __future__ import annotations

import functools
import multiprocessing
import os
import pickle
import threading
import time
from pathlib import Path

import pytest
import verifier_tasks as tasks
from verifier_fixtures import fingerprint

from verl_replay.verifiers.pool import TaskFailure, VerifierPool
from verl_replay.verifiers.sandbox import warm_sql_sandbox
from verl_replay.verifiers.sql import SQLVerification, sql_failure, verify_sql


def assert_processes_gone(pids: list[int]) -> None:
    """No process (live or zombie) is left for any worker pid."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.05)
    left = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    assert not left, f"leftover worker processes: {left}"
    assert not {p.pid for p in multiprocessing.active_children()} & set(pids)


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
    with VerifierPool(num_workers=2, task_timeout_s=1.0, start_method=start_method) as pool:
        assert pool.wait_ready(10.0)
        start = time.monotonic()
        results = pool.map(tasks.scenario, SCENARIOS)
        elapsed = time.monotonic() - start
        by_kind = dict(zip((k for k, _ in SCENARIOS), results, strict=True))
        assert [r for (k, _), r in zip(SCENARIOS, results, strict=True) if k == "ok"] == [0, 20, 40, 60, 90]
        assert by_kind["exit"] == TaskFailure("worker_crashed", "worker process died (exit code 7)")
        assert by_kind["segfault"].reason == "worker_crashed" and "-11" in by_kind["segfault"].detail
        assert by_kind["sleep"].reason == "worker_timeout"
        assert by_kind["busy"].reason == "worker_timeout"
        assert by_kind["raise"].reason == "task_error" and "failed on purpose" in by_kind["raise"].detail
        assert all(r.correct is False for r in results if isinstance(r, TaskFailure))
        # two 1 s hangs run on the two workers side by side; 2 crashes + 2 kills need 4
        # respawns, which the other worker covers
        assert elapsed < 1.0 * 1.1 + 2.0, elapsed
        assert pool.replacements == 4
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
    t0 = time.monotonic()
    with VerifierPool(num_workers=2, task_timeout_s=timeout * 3, on_failure=sql_failure) as pool:
        first = pool.map(verify, [(str(db), gold, gold)])
        cold_start = time.monotonic() - t0  # process start + imports + one query
        assert first[0].correct
        assert cold_start < 5.0, cold_start
        assert pool.wait_ready(10.0)  # both workers up: the two timeouts run side by side
        t1 = time.monotonic()
        pool.map(verify, [(str(db), gold, gold)] * 2)
        ipc = time.monotonic() - t1  # warm round trip
        jobs = [
            ("SELECT count(*) FROM t a, t b, t c, t d", "timeout"),
            ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c", "timeout"),
            ("DELETE FROM t", "write_attempt"),
            ("SELECT 1; DROP TABLE t", "multiple_statements"),
            (gold, "ok"),
        ]
        t2 = time.monotonic()
        results = pool.map(verify, [(str(db), q, gold) for q, _ in jobs])
        wall = time.monotonic() - t2
        pids = list(pool.started_pids)
    assert [r.reason for r in results] == [reason for _, reason in jobs]
    assert all(isinstance(r, SQLVerification) for r in results)
    assert all(r.elapsed_s <= timeout * 1.1 for r in results)  # measured inside the worker
    # both timeouts run concurrently on the two workers: one deadline + warm IPC constant
    assert wall <= timeout * 1.1 + ipc + 0.3, (wall, ipc)
    assert pool.replacements == 0  # SQLite's own deadline fired; no worker had to be killed
    assert fingerprint(db) == before
    assert_processes_gone(pids)


def test_pool_hard_deadline_returns_typed_failure(db: Path) -> None:
    verify = functools.partial(verify_sql, timeout_s=30.0)  # SQLite deadline far away
    # the initializer starts each worker's nested SQL sandbox outside the 0.5 s task deadline
    with VerifierPool(num_workers=1, task_timeout_s=0.5, on_failure=sql_failure, initializer=warm_sql_sandbox) as pool:
        assert pool.wait_ready(10.0)
        start = time.monotonic()
        [hung] = pool.map(verify, [(str(db), "SELECT count(*) FROM t a, t b, t c, t d", "SELECT 1")])
        assert time.monotonic() - start < 0.5 * 1.1 + 0.5  # hard deadline + kill + IPC
        assert hung == SQLVerification(False, "worker_timeout", "task exceeded its 0.5s deadline")
        [fine] = pool.map(verify, [(str(db), "SELECT 1", "SELECT 1")])
        assert fine.correct


def test_wait_ready() -> None:
    with VerifierPool(num_workers=2) as pool:
        assert pool.wait_ready(10.0)
        assert len(pool.worker_pids()) == 2
        os.kill(pool.worker_pids()[0], 9)  # an idle worker dies: replaced, ready again
        deadline = time.monotonic() + 10
        while pool.replacements == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.replacements == 1
        assert pool.wait_ready(10.0)
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
    assert time.monotonic() - start < 3.0
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
    assert time.monotonic() - start < 3.0
    assert future.result(timeout=0).reason == "pool_closed"
    assert_processes_gone(pool.started_pids)


def test_cancelled_queued_task_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with VerifierPool(num_workers=1, task_timeout_s=10) as pool:
        first = pool.submit(time.sleep, 0.5)
        cancelled = pool.submit(os.mkdir, str(marker))
        assert cancelled.cancel()
        after = pool.submit(tasks.scenario, "ok", 3)
        assert after.result(timeout=10) == 30
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
    assert pool.wait_ready(10.0)

    def broken_spawn() -> None:
        raise OSError("cannot start a process (simulated: out of file descriptors)")

    pool._spawn = broken_spawn  # type: ignore[method-assign]  # the respawn after the crash fails
    crashed = pool.submit(tasks.scenario, "exit", 0)
    queued = pool.submit(tasks.scenario, "ok", 1)
    assert crashed.result(timeout=10).reason == "worker_crashed"
    assert queued.result(timeout=10).reason == "pool_closed"
    assert pool._closed.wait(10)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(tasks.scenario, "ok", 2)
    pool.close()
    assert_processes_gone(pool.started_pids)


def test_preloading_the_sql_module_starts_each_workers_sandbox(db: Path) -> None:
    """A pool that preloads verl_replay.verifiers.sql starts its workers' SQL sandboxes before
    they report ready, so no task deadline pays for their start-up."""
    verify = functools.partial(verify_sql, timeout_s=5.0)
    with VerifierPool(
        num_workers=1, task_timeout_s=10, preload=("verl_replay.verifiers.sql",), on_failure=sql_failure
    ) as pool:
        assert pool.wait_ready(30.0)
        [worker] = pool.worker_pids()
        sandbox_workers = tasks.children_of(worker)
        assert len(sandbox_workers) == 2  # min_workers, started and ready before any task
        [result] = pool.map(verify, [(str(db), "SELECT 1", "SELECT 1")])
        assert result.correct and result.elapsed_s < 1.0
        assert tasks.children_of(worker) == sandbox_workers  # the same, reused
    assert_processes_gone(sandbox_workers)  # they die with their pool worker
