"""Process sandbox for untrusted SQL: a deadline no query can overrun, and bounded memory.

SQLite's progress handler interrupts a statement only *between* VM instructions, and some
single instructions run for minutes (``instr``/``replace`` are quadratic on multi-MB strings,
a sort runs in one instruction). A thread cannot be stopped from outside; a process can. So
:class:`SQLSandbox` runs each query in a persistent worker process and kills that worker if it
has not answered by ``timeout_s + kill_grace_s``:

- **Persistent, reused workers.** A worker serves query after query (it keeps the hardened
  read-only connections of the last few databases open), so the cost per query is one pipe
  round trip (~0.1 ms), not a process start. Workers are started with ``subprocess`` (a fresh
  interpreter, no ``fork`` of a multi-threaded caller, allowed inside daemonic pool workers).
- **No watchdog thread in the caller.** The calling thread sends the query and waits on the
  worker's socket with ``poll(timeout_s + kill_grace_s)``; when that expires it SIGKILLs the
  worker and returns a ``timeout`` result. Callers on different threads use different
  workers; the sandbox starts one per concurrent caller up to ``max_workers``.
- **Cheap recovery.** A killed or crashed worker is replaced at once (starting a process takes
  milliseconds; the new interpreter boots while the caller already has its result), and
  ``min_workers`` (default 2) are kept, so the next query finds a ready worker. A worker counts
  the queries it takes in memory it shares with the sandbox: one that dies before taking its
  query was dead before the query reached it (killed while idle), so the query goes to another
  worker rather than counting as one that crashed its worker.
- **Bounded memory.** Each worker caps its address space (``RLIMIT_AS``, ``memory_limit_mb``)
  and SQLite's heap (``PRAGMA hard_heap_limit``, half of it: a result row is copied once more
  into Python objects), so a query that builds huge values fails with ``out_of_memory``
  instead of exhausting the host; rows are counted per row as they are produced
  (:mod:`verl_replay.verifiers.sql`).
- **Nothing left behind.** A worker holds the read end of a "lifeline" pipe whose write end
  only the sandbox holds; a worker thread blocks on it and ends the process the moment it
  closes -- when the sandbox retires the worker, or when the owning process dies for any
  reason, even while a query is running. Killed workers are reaped; :meth:`SQLSandbox.close`
  (also run at interpreter exit) stops and reaps all of them.

:func:`get_sql_sandbox` returns the process-wide sandbox used by
:func:`~verl_replay.verifiers.sql.verify_sql` (created on first use, again after a fork);
environment variables size it: ``VERL_REPLAY_SQL_WORKERS`` (most workers, default 8),
``VERL_REPLAY_SQL_MIN_WORKERS`` (kept started, default 2), ``VERL_REPLAY_SQL_MEMORY_MB``
(address space per worker, default 1024).
"""

from __future__ import annotations

import atexit
import json
import mmap
import os
import pickle
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from verl_replay.verifiers.sqlite_exec import KILL_GRACE_S, QueryResult

__all__ = ["SQLSandbox", "SandboxError", "get_sql_sandbox", "shutdown_sql_sandbox", "warm_sql_sandbox"]

_READY = b"ready"
_COUNTER = struct.Struct("q")
# Workers in a row that may die before taking one query before that query fails.
_MAX_UNTAKEN = 3
# Consecutive workers that die before reporting ready before the sandbox gives up.
_MAX_START_FAILURES = 3
_BOOT = (
    "import sys, json; cfg = json.loads(sys.argv[3]); sys.path[:] = cfg['sys_path']; "
    "from verl_replay.verifiers.sandbox import _worker_main; _worker_main(int(sys.argv[1]), int(sys.argv[2]), cfg)"
)


class SandboxError(RuntimeError):
    """The sandbox cannot run queries (its workers do not start, or it is closed)."""


# --------------------------------------------------------------------------- worker side


def _watch_lifeline(fd: int) -> None:
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    os._exit(0)  # the owner closed the pipe or died: stop now, even mid-query


def _apply_memory_limits(memory_limit_mb: int | None) -> None:
    if not memory_limit_mb:
        return
    import resource
    import sqlite3

    limit = memory_limit_mb * 1024 * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    # Process-wide in SQLite: fine here, the worker runs nothing else. SQLite then fails an
    # allocation cleanly (SQLITE_NOMEM) before Python's own allocations hit RLIMIT_AS.
    probe = sqlite3.connect(":memory:")
    probe.execute(f"PRAGMA hard_heap_limit={limit // 2}")
    probe.close()


def _worker_main(sock_fd: int, lifeline_fd: int, config: dict[str, Any]) -> None:
    import signal

    # Ctrl-C goes to the whole process group; the owner decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_lifeline, args=(lifeline_fd,), name="sql-sandbox-lifeline", daemon=True).start()
    _apply_memory_limits(config.get("memory_limit_mb"))
    from verl_replay.verifiers.sqlite_exec import _CachedExecutor

    conn = Connection(sock_fd)
    # Receipts: the count of queries taken, in memory shared with the owner (read only after a death).
    taken = mmap.mmap(config["taken_fd"], _COUNTER.size) if "taken_fd" in config else None
    executor = _CachedExecutor()
    try:
        conn.send_bytes(_READY)
    except (EOFError, OSError):
        return  # the owner closed while this worker started: nothing to serve, nothing to report
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not message:
            break  # orderly stop
        if taken is not None:
            _COUNTER.pack_into(taken, 0, _COUNTER.unpack_from(taken, 0)[0] + 1)
        try:
            db_path, sql, timeout_s, max_rows, max_bytes = pickle.loads(message)
            result = executor.execute(db_path, sql, timeout_s, max_rows, max_bytes)
            payload = pickle.dumps((result.rows, result.reason, result.detail), protocol=pickle.HIGHEST_PROTOCOL)
        except MemoryError:
            payload = pickle.dumps(
                (None, "out_of_memory", f"the result did not fit in {config.get('memory_limit_mb')} MB")
            )
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            payload = pickle.dumps((None, "internal_error", f"{type(exc).__name__}: {exc}"))
        del message
        try:
            conn.send_bytes(payload)
        except (EOFError, OSError):
            break
    executor.close()


# --------------------------------------------------------------------------- owner side


class _Worker:
    """One worker process. Only the thread that holds it (it is in ``_busy``) reads its socket."""

    __slots__ = ("_fd_lock", "_taken", "conn", "lifeline", "proc", "ready", "sent", "tasks")

    def __init__(self, proc: subprocess.Popen[bytes], conn: Connection, lifeline: int, taken: mmap.mmap) -> None:
        self.proc = proc
        self.conn = conn
        self.lifeline = lifeline
        self._taken = taken  # shared with the worker: the queries it took (no message, no wake-up)
        self.ready = False
        self.tasks = 0
        self.sent = 0  # queries sent to it
        self._fd_lock = threading.Lock()

    def took_last_query(self) -> bool:
        """Whether the worker received the last query sent to it (read after it died)."""
        return _COUNTER.unpack_from(self._taken, 0)[0] == self.sent

    @property
    def pid(self) -> int:
        return self.proc.pid

    def release_fds(self) -> None:
        """Close the socket and the lifeline (the worker then exits); idempotent and
        thread-safe: closing a descriptor twice could close an unrelated file that reused it."""
        with self._fd_lock:
            if self.lifeline < 0:
                return
            lifeline, self.lifeline = self.lifeline, -1
            try:
                self.conn.close()
            except OSError:
                pass
            try:
                os.close(lifeline)
            except OSError:
                pass


def _vm_hwm_kb(pid: int) -> int:
    """Peak resident memory of a live process (Linux), 0 when unknown.

    ``VmHWM`` belongs to the process's address space, which exec replaces. ``ru_maxrss`` would
    not do: Linux carries it across exec, so a worker started by a 1 GB process "peaks" at 1 GB.
    """
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class SQLSandbox:
    """Run read-only queries in killable worker processes (see the module docstring).

    ``execute`` is thread-safe; each concurrent caller gets its own worker (up to
    ``max_workers``; beyond that callers wait for a free one). ``kill_grace_s`` is how long past
    its own deadline a query may run before its worker is killed. ``memory_limit_mb`` caps
    each worker's address space (``None``: no cap). Workers are recycled after
    ``max_tasks_per_worker`` queries.
    """

    def __init__(
        self,
        *,
        max_workers: int = 8,
        min_workers: int = 2,
        memory_limit_mb: int | None = 1024,
        kill_grace_s: float = KILL_GRACE_S,
        start_timeout_s: float = 60.0,
        max_tasks_per_worker: int = 100_000,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if not 0 <= min_workers <= max_workers:
            raise ValueError(f"min_workers must be in [0, max_workers={max_workers}], got {min_workers}")
        if memory_limit_mb is not None and memory_limit_mb < 64:
            raise ValueError(f"memory_limit_mb must be >= 64 (or None), got {memory_limit_mb}")
        if not kill_grace_s > 0 or not start_timeout_s > 0:
            raise ValueError(f"kill_grace_s and start_timeout_s must be > 0, got {kill_grace_s}, {start_timeout_s}")
        if max_tasks_per_worker < 1:
            raise ValueError(f"max_tasks_per_worker must be >= 1, got {max_tasks_per_worker}")
        if not sys.executable:
            raise SandboxError("cannot start SQL sandbox workers: sys.executable is empty (embedded interpreter)")
        self.max_workers = max_workers
        self.min_workers = min_workers
        self.memory_limit_mb = memory_limit_mb
        self.kill_grace_s = float(kill_grace_s)
        self.start_timeout_s = float(start_timeout_s)
        self.max_tasks_per_worker = max_tasks_per_worker
        self._cond = threading.Condition(threading.Lock())
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._exiting: list[subprocess.Popen[bytes]] = []  # retired or killed, not yet reaped
        self._closed = False
        self._start_failures = 0
        self._owner_pid = os.getpid()
        # The directory holding this package first: an editable install is found through a
        # site hook (.pth), which -S workers do not run.
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self._sys_path = [package_root, *(p for p in sys.path if p != package_root)]
        # Diagnostics (tests, benchmarks).
        self.started_pids: list[int] = []
        self.kills = 0
        self.crashes = 0
        self.recycled = 0
        self._gone_peak_kb = 0  # largest peak RSS of the workers no longer running

    # ------------------------------------------------------------------ public API

    def execute(self, db_path: str, sql: str, *, timeout_s: float, max_rows: int, max_bytes: int) -> QueryResult:
        """``execute_readonly`` in a worker; returns by ``timeout_s + kill_grace_s`` at the latest
        once the worker is running (the first call, or one past ``max_workers`` concurrent
        callers, also waits for a worker to start or free up)."""
        start = time.monotonic()
        request = pickle.dumps(
            (db_path, sql, float(timeout_s), int(max_rows), int(max_bytes)), protocol=pickle.HIGHEST_PROTOCOL
        )
        for _ in range(_MAX_UNTAKEN):
            worker = self._acquire()
            try:
                result = self._run_on(worker, request, timeout_s, start)
            except BaseException:
                self._kill(worker)  # interrupted mid-query (KeyboardInterrupt, ...): state unknown
                raise
            if result is not None:
                return result
        return QueryResult(
            None,
            "worker_crashed",
            f"{_MAX_UNTAKEN} sandbox workers in a row died before they could take the query",
            time.monotonic() - start,
        )

    def _run_on(self, worker: _Worker, request: bytes, timeout_s: float, start: float) -> QueryResult | None:
        """The query's result on ``worker`` (released or removed after), or None if the worker was
        dead before it took the query (an idle worker the OOM killer or an operator stopped)."""
        try:
            worker.sent += 1
            worker.conn.send_bytes(request)
            if not worker.conn.poll(timeout_s + self.kill_grace_s):
                self._kill(worker)
                return QueryResult(
                    None,
                    "timeout",
                    f"no answer {timeout_s:g}s + {self.kill_grace_s:g}s after the query started (one SQLite "
                    "step ran past the deadline); its worker process was killed",
                    time.monotonic() - start,
                )
            reply = worker.conn.recv_bytes()
        except (EOFError, OSError):
            code = self._crashed(worker)
            if not worker.took_last_query():
                return None
            return QueryResult(
                None,
                "worker_crashed",
                f"the sandbox worker died while running the query (exit code {code})",
                time.monotonic() - start,
            )
        rows, reason, detail = pickle.loads(reply)
        self._release(worker, recycle=reason == "out_of_memory")
        return QueryResult(rows, reason, detail, time.monotonic() - start)

    def worker_pids(self) -> list[int]:
        """Pids of the live workers (idle and busy)."""
        with self._cond:
            return [w.pid for w in (*self._idle, *self._busy)]

    def busy_count(self) -> int:
        """Workers held by a caller right now (running a query, or starting for one)."""
        with self._cond:
            return len(self._busy)

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Start ``min_workers`` workers (if needed) and wait until they answer; True if they do."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._closed:
                return False
            self._top_up()
            starting = [w for w in self._idle if not w.ready]
            for worker in starting:  # held while waiting: no caller reads their sockets meanwhile
                self._idle.remove(worker)
                self._busy.add(worker)
        ok = True
        for worker in starting:
            if self._await_ready(worker, max(0.0, deadline - time.monotonic())):
                self._release(worker, count_task=False)
            else:
                ok = False
                self._crashed(worker, start_failure=True)
        return ok

    @property
    def peak_rss_kb(self) -> int:
        """Largest peak resident memory (``VmHWM``) of any worker so far, in KiB."""
        with self._cond:
            live = [w.pid for w in (*self._idle, *self._busy)]
            gone = self._gone_peak_kb
        return max([gone, *map(_vm_hwm_kb, live)])

    def _note_peak(self, worker: _Worker) -> None:
        """Record a worker's peak before it goes (read from /proc while it still exists)."""
        peak = _vm_hwm_kb(worker.pid)
        with self._cond:
            self._gone_peak_kb = max(self._gone_peak_kb, peak)

    def stats(self) -> dict[str, int]:
        with self._cond:
            counts = {
                "workers": len(self._idle) + len(self._busy),
                "started": len(self.started_pids),
                "kills": self.kills,
                "crashes": self.crashes,
                "recycled": self.recycled,
            }
        return {**counts, "peak_rss_kb": self.peak_rss_kb}

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop every worker (busy ones are killed) and reap them all."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            workers = [*self._idle, *self._busy]
            self._idle.clear()
            self._busy.clear()
            exiting = list(self._exiting)
            self._exiting.clear()
            self._cond.notify_all()
        if os.getpid() != self._owner_pid:
            return  # inherited through fork: those processes belong to the parent
        for worker in workers:
            self._note_peak(worker)
            worker.release_fds()  # the lifeline closes: each worker exits at once
            exiting.append(worker.proc)
        deadline = time.monotonic() + timeout_s
        for proc in exiting:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> SQLSandbox:  # noqa: PYI034 - not subclassed
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ workers

    def _spawn(self) -> _Worker:
        """Start one worker process (returns at once; it reports ready on its socket)."""
        parent_sock, child_sock = socket.socketpair()
        lifeline_r, lifeline_w = os.pipe()
        with tempfile.TemporaryFile() as taken_file:  # unlinked: gone with the last mapping
            taken_file.truncate(_COUNTER.size)
            taken = mmap.mmap(taken_file.fileno(), _COUNTER.size)
            taken_fd = os.dup(taken_file.fileno())
        config = {"sys_path": self._sys_path, "memory_limit_mb": self.memory_limit_mb, "taken_fd": taken_fd}
        try:
            # -S: no site import (.pth files, sitecustomize): the worker gets this interpreter's
            # sys.path explicitly and needs only the standard library and this package
            proc = subprocess.Popen(
                [sys.executable, "-S", "-c", _BOOT, str(child_sock.fileno()), str(lifeline_r), json.dumps(config)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(child_sock.fileno(), lifeline_r, taken_fd),
                close_fds=True,
            )
        except BaseException:
            parent_sock.close()
            os.close(lifeline_w)
            taken.close()
            raise
        finally:
            child_sock.close()
            os.close(lifeline_r)
            os.close(taken_fd)
        self.started_pids.append(proc.pid)
        return _Worker(proc, Connection(parent_sock.detach()), lifeline_w, taken)

    def _top_up(self) -> None:
        """Keep ``min_workers`` started (called with the lock held)."""
        while not self._closed and len(self._idle) + len(self._busy) < self.min_workers:
            self._idle.insert(0, self._spawn())  # booting workers go to the back of the queue

    def _reap_exiting(self) -> None:
        self._exiting = [p for p in self._exiting if p.poll() is None]

    def _mark_ready(self, worker: _Worker) -> bool:
        if not worker.ready and worker.conn.poll(0):
            try:
                worker.ready = worker.conn.recv_bytes() == _READY
            except (EOFError, OSError):
                return False
        return worker.ready

    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise SandboxError("the SQL sandbox is closed")
                if os.getpid() != self._owner_pid:
                    raise SandboxError("the SQL sandbox belongs to the parent process (use get_sql_sandbox())")
                self._reap_exiting()
                self._top_up()
                worker = None
                # Prefer a worker that is ready (the last released one: warm caches).
                for candidate in reversed(self._idle):
                    if self._mark_ready(candidate):
                        worker = candidate
                        break
                if worker is None and len(self._idle) + len(self._busy) < self.max_workers:
                    worker = self._spawn()
                    self._idle.append(worker)
                if worker is None and self._idle:
                    worker = self._idle[-1]  # still starting: wait for it below
                if worker is not None:
                    self._idle.remove(worker)
                    self._busy.add(worker)
                    break
                self._cond.wait()
        if worker.ready:
            if worker.proc.poll() is None:
                return worker
            self._crashed(worker)  # died while idle (e.g. the OOM killer): take another
            return self._acquire()
        if self._await_ready(worker, self.start_timeout_s):
            return worker
        code = self._crashed(worker, start_failure=True)
        with self._cond:
            failures = self._start_failures
        if failures >= _MAX_START_FAILURES:
            raise SandboxError(
                f"SQL sandbox workers do not start ({failures} in a row; last exit code {code}); their error is "
                f"printed above. Run `{sys.executable} -c 'import verl_replay.verifiers.sandbox'` to see why, or "
                "verify with isolation='inline'"
            )
        return self._acquire()

    def _await_ready(self, worker: _Worker, timeout_s: float) -> bool:
        if worker.ready:
            return worker.proc.poll() is None
        try:
            if worker.conn.poll(timeout_s) and worker.conn.recv_bytes() == _READY:
                worker.ready = True
                with self._cond:
                    self._start_failures = 0
                return True
        except (EOFError, OSError):
            pass
        return False

    def _release(self, worker: _Worker, *, recycle: bool = False, count_task: bool = True) -> None:
        with self._cond:
            self._busy.discard(worker)
            worker.tasks += int(count_task)
            if self._closed:
                worker.release_fds()
                self._reap_later(worker.proc)
            elif recycle or worker.tasks >= self.max_tasks_per_worker:
                self.recycled += 1
                self._gone_peak_kb = max(self._gone_peak_kb, _vm_hwm_kb(worker.pid))
                worker.release_fds()  # the worker exits on its own
                self._reap_later(worker.proc)
                self._top_up()
            else:
                self._idle.append(worker)
            self._cond.notify()

    def _reap_later(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            self._exiting.append(proc)

    def _remove(self, worker: _Worker, counter: str) -> None:
        with self._cond:
            setattr(self, counter, getattr(self, counter) + 1)
            self._busy.discard(worker)
            if worker in self._idle:
                self._idle.remove(worker)
            # The replacement starts now (Popen returns in milliseconds; the interpreter boots
            # while the caller returns), so back-to-back kills do not wait for a boot.
            self._top_up()
            self._cond.notify()

    def _kill(self, worker: _Worker) -> None:
        self._note_peak(worker)
        try:
            worker.proc.kill()
        except OSError:
            pass
        worker.release_fds()
        with self._cond:
            self._reap_later(worker.proc)  # reaped by the next call (or close), never waited for here
        self._remove(worker, "kills")

    def _crashed(self, worker: _Worker, *, start_failure: bool = False) -> int | None:
        self._note_peak(worker)  # (a dead process has no /proc entry left: 0)
        worker.release_fds()
        try:
            code = worker.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            code = worker.proc.wait()
        self._remove(worker, "_start_failures" if start_failure else "crashes")
        return code


# --------------------------------------------------------------------------- process-wide


def _env_int(name: str, default: int, low: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer >= {low}") from None
    if value < low:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer >= {low}")
    return value


_global_lock = threading.Lock()
_global: SQLSandbox | None = None


def get_sql_sandbox() -> SQLSandbox:
    """The process-wide sandbox (created on first use; a forked child gets its own)."""
    global _global
    with _global_lock:
        if _global is None or _global.closed or _global._owner_pid != os.getpid():
            max_workers = _env_int("VERL_REPLAY_SQL_WORKERS", 8, 1)
            _global = SQLSandbox(
                max_workers=max_workers,
                min_workers=min(max_workers, _env_int("VERL_REPLAY_SQL_MIN_WORKERS", 2, 0)),
                memory_limit_mb=_env_int("VERL_REPLAY_SQL_MEMORY_MB", 1024, 64),
            )
        return _global


def warm_sql_sandbox() -> None:
    """Start the process-wide sandbox's workers and wait until they answer.

    A :class:`~verl_replay.verifiers.pool.VerifierPool` ``initializer`` for SQL tasks: the
    nested sandbox then starts before the pool worker takes tasks, outside any task deadline.
    """
    sandbox = get_sql_sandbox()
    if not sandbox.wait_ready(sandbox.start_timeout_s):
        raise SandboxError(f"SQL sandbox workers did not start within {sandbox.start_timeout_s:g}s")


def shutdown_sql_sandbox() -> None:
    """Stop and reap the process-wide sandbox's workers (also done at interpreter exit)."""
    global _global
    with _global_lock:
        sandbox, _global = _global, None
    if sandbox is not None:
        sandbox.close()


atexit.register(shutdown_sql_sandbox)
