"""A small crash- and hang-proof process pool for verification callables.

Why not ``concurrent.futures.ProcessPoolExecutor``: when one worker dies (segfault in a C
extension, ``os._exit``, the OOM killer) the executor marks itself *broken* and fails every
pending future, and it has no per-task deadline at all -- a hung task occupies a worker
forever. Verification of model outputs needs the opposite: one bad sample costs one failed
result, never the batch.

Design: one supervisor thread owns all worker processes. Each worker has its own duplex pipe,
so the supervisor always knows which task a worker holds; when a worker's process sentinel
fires (it died) or its task deadline passes (the supervisor then SIGKILLs it), exactly that
task resolves to a failure result and a fresh worker replaces it. Callers only touch a queue
and ``concurrent.futures.Future`` objects, so ``submit`` is thread-safe (Ray reward workers
call from many threads).

Start method: ``forkserver`` where available, else ``spawn`` -- never ``fork``. Forking a
process that has other threads (our supervisor thread, Ray/torch/gRPC threads) copies locks
held by those threads in the locked state, so the child can deadlock at random; an inherited
SQLite connection or CUDA context is also unsafe to use after fork. ``forkserver`` forks each
worker from a clean single-threaded server process, so replacing a killed worker costs a fork
plus imports rather than a full interpreter start (``spawn``). The forkserver is a helper
process shared by every forkserver pool in this interpreter; it exits with the interpreter.

Limits: a task that allocates unboundedly is only stopped by ``memory_limit_mb`` (RLIMIT_AS
in the worker) or by the OS. Workers die with the pool's process: on Linux they set
``PR_SET_PDEATHSIG``; elsewhere a watchdog thread polls the owner pid.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

__all__ = ["TaskFailure", "VerifierPool", "in_pool_worker"]

logger = logging.getLogger(__name__)

# Set in worker processes only; verifiers use it to know they may use SIGALRM (they run on
# the worker's main thread and the worker owns its signal handlers).
_IN_WORKER = False

# Consecutive workers that die before reporting ready before the pool gives up on them.
_MAX_START_FAILURES = 5
# Workers in a row that may die holding a task they had not yet taken before that task fails.
_MAX_UNTAKEN = 3
# Pause after a worker start that raised, doubled per failure in a row (0.1 s, 0.2 s, ...).
_SPAWN_RETRY_S = 0.05
# How long an idle pool waits before replacing a worker that died idle: the supervisor sees a
# killed process group's workers die one at a time, and a start in between would meet the dead
# forkserver. Work that arrives meanwhile starts workers at once.
_IDLE_DEATH_GRACE_S = 1.0
# Preloading this module means the tasks verify SQL (see _worker_main).
_SQL_MODULE = "verl_replay.verifiers.sql"


# Pools not closed by their owner are closed at interpreter exit (the supervisor thread keeps
# each pool alive until then). atexit runs LIFO, so this runs before multiprocessing's own
# exit hook and workers are stopped in order rather than left to PDEATHSIG.
_LIVE_POOLS: weakref.WeakSet[VerifierPool] = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_LIVE_POOLS):
        try:
            pool.close(wait=False)
        except Exception:  # noqa: BLE001, S110 - best effort at interpreter exit
            pass


def in_pool_worker() -> bool:
    """True inside a ``VerifierPool`` worker process (tasks run on its main thread)."""
    return _IN_WORKER


@dataclass(frozen=True)
class TaskFailure:
    """Default failure result: a task that crashed, hung, raised, or could not run.

    ``reason`` is one of ``worker_crashed``, ``worker_timeout``, ``task_error``,
    ``pool_closed``, ``worker_start_failed``.
    """

    reason: str
    detail: str = ""
    correct: bool = False


FailureFactory = Callable[[str, str], Any]


def _default_failure(reason: str, detail: str) -> TaskFailure:
    return TaskFailure(reason=reason, detail=detail)


# --------------------------------------------------------------------------- worker side


def _die_with_owner(owner_pid: int) -> None:
    """Make sure this worker cannot outlive the process that owns the pool."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) == 0:
            # The parent may already be gone (race between fork and prctl).
            if os.getppid() == 1:
                os._exit(1)
            return
    except (OSError, AttributeError):
        pass

    def watchdog() -> None:  # portable fallback: poll the owner
        while True:
            time.sleep(0.5)
            try:
                os.kill(owner_pid, 0)
            except OSError:
                os._exit(1)

    threading.Thread(target=watchdog, name="verifier-pool-watchdog", daemon=True).start()


def _worker_main(
    conn: multiprocessing.connection.Connection,
    taken: Any,
    owner_pid: int,
    preload: Sequence[str],
    memory_limit_mb: int | None,
    initializer: Callable[[], None] | None,
) -> None:
    global _IN_WORKER
    _IN_WORKER = True
    # Ctrl-C goes to the whole process group; the owner decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_owner(owner_pid)
    if memory_limit_mb is not None:
        import resource

        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import importlib

    for module in preload:  # imports happen before "ready", outside any task deadline
        importlib.import_module(module)
    if _SQL_MODULE in preload:
        # SQL tasks run each query in this worker's SQL sandbox: start it now too, so no task
        # deadline pays for its processes' start-up (a fresh worker's first task would)
        from verl_replay.verifiers.sandbox import warm_sql_sandbox

        warm_sql_sandbox()
    if initializer is not None:
        initializer()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return  # owner closed the pipe (or died): nothing more to do
        if not message:
            return  # orderly stop
        task_id = -1
        try:
            task_id, fn, args = pickle.loads(message)
            taken.value = task_id  # from here on, a death is this task's doing
            outcome = ("done", task_id, True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - report everything, keep the worker alive
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) and task_id < 0:
                return
            outcome = ("done", task_id, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            conn.send(outcome)
        except (EOFError, OSError):
            return
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send(("done", task_id, False, f"result could not be sent: {type(exc).__name__}: {exc}"))


# --------------------------------------------------------------------------- owner side


@dataclass
class _Task:
    task_id: int
    payload: bytes
    future: Future
    on_failure: FailureFactory
    timeout_s: float
    untaken_deaths: int = 0  # workers that died holding it before they took it


class _Worker:
    def __init__(self, process: Any, conn: multiprocessing.connection.Connection, taken: Any) -> None:
        self.process = process
        self.conn = conn
        self.ready = False
        self.task: _Task | None = None
        self.taken = taken  # shared memory: the id of the last task the worker took (no message, no wake-up)
        self.deadline = float("inf")
        self.tasks_done = 0
        self.eof = False  # its pipe hit EOF: the process is exiting


class VerifierPool:
    """Run picklable top-level callables in worker processes, surviving crashes and hangs.

    ``num_workers`` processes run tasks concurrently. ``task_timeout_s`` is the default hard
    deadline per task, measured from the moment a worker starts it (queueing time does not
    count); a task past it has its worker SIGKILLed and resolves to
    ``on_failure("worker_timeout", ...)``. A worker that dies mid-task resolves that task to
    ``on_failure("worker_crashed", ...)``; one that dies before it takes its task (killed while
    idle, its forkserver killed) costs that task nothing: it goes to another worker. A task that raises resolves to
    ``on_failure("task_error", traceback)``. In all cases the worker is replaced and every
    other task completes normally. Workers are recycled after ``max_tasks_per_child`` tasks
    (bounds memory growth from caches/leaks; ``None`` = never).

    ``preload`` modules are imported and ``initializer()`` (a picklable top-level callable)
    runs in each worker before it takes tasks, outside any task deadline. Preloading
    ``verl_replay.verifiers.sql`` also starts the worker's SQL sandbox then.
    ``memory_limit_mb`` sets RLIMIT_AS in each worker so runaway allocations raise
    ``MemoryError`` there instead of exhausting the host. A queued task whose future the
    caller cancels is skipped.

    ``on_failure(reason, detail)`` builds the failure result, so callers get results of one
    type (e.g. ``SQLVerification(correct=False, reason="worker_timeout")``); the default is
    :class:`TaskFailure`.

    Use as a context manager, or call :meth:`close`. Closing waits for queued tasks
    (``close(wait=True)``) or fails them with ``"pool_closed"`` (``wait=False``), stops and
    reaps every worker.
    """

    def __init__(
        self,
        num_workers: int = 2,
        task_timeout_s: float = 30.0,
        max_tasks_per_child: int | None = 1000,
        *,
        start_method: str | None = None,
        preload: Sequence[str] = (),
        memory_limit_mb: int | None = None,
        initializer: Callable[[], None] | None = None,
        on_failure: FailureFactory | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not task_timeout_s > 0:
            raise ValueError(f"task_timeout_s must be > 0, got {task_timeout_s}")
        if max_tasks_per_child is not None and max_tasks_per_child < 1:
            raise ValueError(f"max_tasks_per_child must be >= 1 or None, got {max_tasks_per_child}")
        if start_method is None:
            methods = multiprocessing.get_all_start_methods()
            start_method = "forkserver" if "forkserver" in methods else "spawn"
        if start_method == "fork":
            raise ValueError("start_method='fork' is unsafe with a supervisor thread; use forkserver or spawn")
        self._ctx = multiprocessing.get_context(start_method)
        self.num_workers = num_workers
        self.task_timeout_s = float(task_timeout_s)
        self.max_tasks_per_child = max_tasks_per_child
        self.start_method = start_method
        self._preload = tuple(preload)
        self._memory_limit_mb = memory_limit_mb
        self._initializer = initializer
        self._on_failure = on_failure or _default_failure

        self._lock = threading.Lock()
        self._incoming: collections.deque[_Task] = collections.deque()
        self._ids = itertools.count()
        self._closing = False
        self._drain = True
        self._closed = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._owner_pid = os.getpid()
        # Supervisor-thread state (never touched by other threads):
        self._workers: list[_Worker] = []
        self._pending: collections.deque[_Task] = collections.deque()
        self._start_failures = 0
        self._spawn_retry_at = 0.0  # monotonic time before which no start is retried
        # Every worker died while the pool was idle: what a process being torn down sees (its
        # process group killed, the forkserver with it). Workers then start again only for work.
        self._all_died_idle = False
        self._idle_respawn_at = 0.0  # monotonic time before which an idle pool starts no worker
        self._broken = ""
        self._n_ready = 0
        self._all_ready = threading.Event()
        # Diagnostics (read by tests/benchmarks): every worker pid ever started.
        self.started_pids: list[int] = []
        self.replacements = 0
        self._supervisor = threading.Thread(target=self._run, name="verifier-pool-supervisor", daemon=True)
        self._supervisor.start()
        _LIVE_POOLS.add(self)

    # ------------------------------------------------------------------ public API

    def submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float | None = None,
        on_failure: FailureFactory | None = None,
    ) -> Future:
        """Queue ``fn(*args)``; the future always resolves to a result, never an exception.

        Raises at once (in the caller) if ``fn``/``args`` cannot be pickled -- that is a
        programming error, not a verification failure -- or if the pool is closed.
        """
        payload_id = next(self._ids)
        payload = pickle.dumps((payload_id, fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        task = _Task(
            task_id=payload_id,
            payload=payload,
            future=Future(),
            on_failure=on_failure or self._on_failure,
            timeout_s=self.task_timeout_s if timeout_s is None else float(timeout_s),
        )
        with self._lock:
            if self._closing:
                raise RuntimeError("VerifierPool is closed")
            self._incoming.append(task)
        self._wake()
        return task.future

    def map(
        self,
        fn: Callable[..., Any],
        list_of_args: Iterable[Sequence[Any]],
        *,
        timeout_s: float | None = None,
        on_failure: FailureFactory | None = None,
    ) -> list[Any]:
        """``[fn(*args) for args in list_of_args]`` run in the workers, in input order.

        Each item is the tuple of positional arguments for one call (starmap semantics);
        use ``functools.partial`` on a top-level function for keyword arguments.
        """
        futures = [self.submit(fn, *args, timeout_s=timeout_s, on_failure=on_failure) for args in list_of_args]
        return [f.result() for f in futures]

    def close(self, wait: bool = True) -> None:
        """Stop accepting tasks, finish (``wait``) or fail queued ones, stop and reap workers."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self._drain = wait
        self._wake()
        self._supervisor.join()
        self._wake_r.close()
        self._wake_w.close()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until all ``num_workers`` workers have started (imports and initializer
        done); True if they have. Useful before timing-sensitive work or benchmarks."""
        return self._all_ready.wait(timeout_s)

    def worker_pids(self) -> list[int]:
        """Pids of the live workers (snapshot; for diagnostics and tests)."""
        return [w.process.pid for w in list(self._workers) if w.process.pid is not None]

    def __enter__(self) -> VerifierPool:  # noqa: PYI034 - not subclassed
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(wait=exc_type is None)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # ------------------------------------------------------------------ supervisor

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # buffer full means a wake-up is already pending; closed means shutting down

    def _spawn(self) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        taken = self._ctx.RawValue("q", -1)
        process = self._ctx.Process(
            target=_worker_main,
            args=(child_conn, taken, self._owner_pid, self._preload, self._memory_limit_mb, self._initializer),
            name="verifier-pool-worker",
            daemon=True,
        )
        try:
            process.start()
        except BaseException:
            parent_conn.close()
            raise
        finally:
            child_conn.close()
        self.started_pids.append(process.pid)
        self._workers.append(_Worker(process, parent_conn, taken))

    def _spawn_missing(self) -> None:
        """Start workers up to ``num_workers``. A start that raises (the forkserver was killed
        mid-request, fork failed) is a start failure like a worker that dies before it is ready:
        retried after a pause that doubles, the pool broken after ``_MAX_START_FAILURES`` in a row."""
        while len(self._workers) < self.num_workers and time.monotonic() >= self._spawn_retry_at:
            try:
                self._spawn()
                self._all_died_idle = False
            except Exception as exc:  # noqa: BLE001 - any start failure; the supervisor must go on
                self._start_failures += 1
                logger.warning("VerifierPool: a worker did not start (%d in a row): %r", self._start_failures, exc)
                if self._start_failures >= _MAX_START_FAILURES:
                    self._broken = f"{_MAX_START_FAILURES} workers in a row did not start (last: {exc!r})"
                self._spawn_retry_at = time.monotonic() + _SPAWN_RETRY_S * 2**self._start_failures
                return

    @staticmethod
    def _resolve(task: _Task, ok: bool, value: Any, reason: str = "task_error") -> None:
        if task.future.done():
            return
        if ok:
            task.future.set_result(value)
            return
        try:
            task.future.set_result(task.on_failure(reason, str(value)))
        except Exception as exc:  # noqa: BLE001 - a broken failure factory must not kill the supervisor
            task.future.set_result(TaskFailure(reason=reason, detail=f"{value} (on_failure raised {exc!r})"))

    def _reap(self, worker: _Worker, kill: bool) -> int | None:
        """Kill (if asked and alive), wait for and release a worker; return its exit code."""
        if kill and worker.process.is_alive():
            worker.process.kill()
        # Without kill this is only called for a process that is exiting (its sentinel or
        # pipe reported it); join() must block: the sentinel can fire a moment before the
        # kernel makes the exit status available.
        worker.process.join()
        exitcode = worker.process.exitcode
        worker.conn.close()
        if hasattr(worker.process, "close"):
            worker.process.close()
        return exitcode

    def _retire(self, worker: _Worker, reason: str, detail: str, kill: bool) -> None:
        """Remove a worker; fail its task (if any) with ``reason``."""
        self._workers.remove(worker)
        if worker.ready:
            self._set_ready_count(self._n_ready - 1)
        exitcode = self._reap(worker, kill=kill)
        task, worker.task = worker.task, None
        if task is None:
            return
        if reason == "worker_crashed" and worker.taken.value != task.task_id:
            # It died before it took the task (killed while idle): not the task's doing.
            task.untaken_deaths += 1
            if task.untaken_deaths < _MAX_UNTAKEN:
                self._pending.appendleft(task)
                return
            detail = f"{_MAX_UNTAKEN} workers in a row died before they could take the task"
        elif reason == "worker_crashed":
            detail = f"{detail} (exit code {exitcode})"
        self._resolve(task, False, detail, reason)

    def _set_ready_count(self, count: int) -> None:
        self._n_ready = count
        if count >= self.num_workers:
            self._all_ready.set()
        else:
            self._all_ready.clear()

    def _idle_wants_workers(self) -> bool:
        """An idle pool replaces dead workers after the grace, unless every one died idle."""
        return not self._all_died_idle and time.monotonic() >= self._idle_respawn_at

    def _on_death(self, worker: _Worker) -> None:
        if not worker.ready:
            self._start_failures += 1
            if self._start_failures >= _MAX_START_FAILURES:
                self._broken = f"{_MAX_START_FAILURES} workers in a row died before starting"
        idle = worker.task is None
        self._retire(worker, "worker_crashed", "worker process died", kill=False)
        self.replacements += 1
        if idle and worker.ready and not self._pending:
            self._idle_respawn_at = time.monotonic() + _IDLE_DEATH_GRACE_S
            if not self._workers:
                self._all_died_idle = True

    def _handle_message(self, worker: _Worker) -> bool:
        """Read one message; False if the pipe is dead (the sentinel will follow)."""
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            # The worker closed its end: it is exiting. Stop watching the pipe (it would stay
            # readable at EOF) and let the process sentinel report the death.
            worker.eof = True
            return False
        except Exception as exc:  # noqa: BLE001 - corrupt/unpicklable result
            message = ("done", worker.task.task_id if worker.task else -1, False, f"bad result: {exc!r}")
        if message[0] == "ready":
            worker.ready = True
            self._start_failures = 0
            self._set_ready_count(self._n_ready + 1)
            return True
        _, task_id, ok, value = message
        task = worker.task
        worker.task = None
        worker.deadline = float("inf")
        worker.tasks_done += 1
        if task is not None and task.task_id == task_id:
            self._resolve(task, ok, value)
        if self.max_tasks_per_child is not None and worker.tasks_done >= self.max_tasks_per_child:
            self._stop_worker(worker)
        return True

    def _stop_worker(self, worker: _Worker) -> None:
        """Orderly stop of an idle worker (recycling or shutdown)."""
        try:
            worker.conn.send_bytes(b"")
        except OSError:
            pass
        worker.process.join(timeout=2.0)
        self._retire(worker, "pool_closed", "", kill=True)

    def _take_incoming(self) -> bool:
        with self._lock:
            while self._incoming:
                self._pending.append(self._incoming.popleft())
            return self._closing

    def _next_runnable(self) -> _Task | None:
        """Pop the next queued task the caller still wants (marks its future running)."""
        while self._pending:
            task = self._pending.popleft()
            # running(): a task re-queued after a failed send was already marked.
            if task.future.running() or task.future.set_running_or_notify_cancel():
                return task
        return None

    def _fail_pending(self, reason: str, detail: str) -> None:
        while (task := self._next_runnable()) is not None:
            self._resolve(task, False, detail, reason)

    def _dispatch(self) -> None:
        now = time.monotonic()
        for worker in [w for w in self._workers if w.ready and w.task is None and not w.eof]:
            task = self._next_runnable()
            if task is None:
                return
            try:
                worker.conn.send_bytes(task.payload)
            except OSError:
                self._pending.appendleft(task)  # worker died; the sentinel will replace it
                continue
            worker.task = task
            worker.deadline = now + task.timeout_s

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            logger.exception("VerifierPool supervisor failed")
            with self._lock:
                self._closing = True  # later submits raise instead of waiting forever
            self._take_incoming()
            self._fail_pending("pool_closed", "supervisor failed")
            for worker in list(self._workers):
                if worker.task is not None:
                    self._resolve(worker.task, False, "supervisor failed", "pool_closed")
                    worker.task = None
                self._retire(worker, "pool_closed", "", kill=True)
        finally:
            self._closed.set()

    def _loop(self) -> None:
        while True:
            closing = self._take_incoming()
            # a closing pool starts workers only to drain; an idle one after a grace (never if all died idle)
            if not self._broken and (self._pending or (not closing and self._idle_wants_workers())):
                self._spawn_missing()
            if self._broken:
                self._fail_pending("worker_start_failed", self._broken)
            if closing and (not self._drain or (not self._pending and all(w.task is None for w in self._workers))):
                break
            self._dispatch()

            now = time.monotonic()
            next_deadline = min((w.deadline for w in self._workers), default=float("inf"))
            if not self._broken and len(self._workers) < self.num_workers:
                if self._pending:
                    next_deadline = min(next_deadline, self._spawn_retry_at)
                elif not self._all_died_idle:
                    next_deadline = min(next_deadline, max(self._spawn_retry_at, self._idle_respawn_at))
            wait_s = None if next_deadline == float("inf") else max(0.0, next_deadline - now)
            waitables: list[Any] = [self._wake_r]
            for w in self._workers:
                if not w.eof:
                    waitables.append(w.conn)
                waitables.append(w.process.sentinel)
            ready = set(multiprocessing.connection.wait(waitables, timeout=wait_s))

            if self._wake_r in ready:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            for worker in list(self._workers):
                if worker.conn in ready:
                    # Drain everything (a result may be followed by the worker's exit).
                    while (
                        worker in self._workers
                        and not worker.eof
                        and worker.conn.poll()
                        and self._handle_message(worker)
                    ):
                        pass
            for worker in list(self._workers):
                if worker in self._workers and worker.process.sentinel in ready:
                    self._on_death(worker)
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.task is not None and now >= worker.deadline:
                    timeout = worker.task.timeout_s
                    self._retire(worker, "worker_timeout", f"task exceeded its {timeout:g}s deadline", kill=True)
                    self.replacements += 1

        # Shutdown: fail what is left, stop idle workers politely, kill the rest, reap all.
        self._fail_pending("pool_closed", "pool closed before the task ran")
        for worker in list(self._workers):
            if worker.task is None:
                self._stop_worker(worker)
            else:
                self._retire(worker, "pool_closed", "pool closed while the task ran", kill=True)
