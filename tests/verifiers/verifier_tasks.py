"""Top-level task functions for pool tests (workers import this module by name)."""

from __future__ import annotations

import ctypes
import os
import signal
import time


def scenario(kind: str, value: int) -> int:
    """Behave as ``kind`` says; return ``value * 10`` when it returns at all."""
    if kind == "exit":
        os._exit(7)
    if kind == "segfault":
        ctypes.string_at(0)  # reads address 0: SIGSEGV in the worker
    if kind == "sleep":
        time.sleep(3600)
    if kind == "busy":
        busy_loop()
    if kind == "raise":
        raise RuntimeError(f"task {value} failed on purpose")
    return value * 10


def busy_loop() -> None:
    """A pure-Python infinite loop (holds the GIL, never sleeps)."""
    n = 0
    while True:
        n += 1


def worker_pid() -> int:
    return os.getpid()


def alarm_blocked_math_task(predicted: str, gold: str, timeout_s: float):  # type: ignore[no-untyped-def]
    """The sandbox math task with SIGALRM blocked: simulates a computation stuck in C code
    that the in-worker alarm cannot interrupt, so only the pool's hard kill can stop it."""
    from verl_replay.verifiers.math import _sandbox_task

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        return _sandbox_task(predicted, gold, timeout_s)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})


def children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except OSError:
                pass
    return sorted(kids)


def _die_at_first_unpickling(marker: str) -> int:
    if not os.path.exists(marker):
        open(marker, "w").close()  # noqa: SIM115 - an empty marker file
        os._exit(3)
    return 5


class DiesWhenUnpickled:
    """An argument whose unpickling in the worker, before the worker takes its task, ends that
    worker: every time (``marker=None``) or the first time only (then it unpickles to 5)."""

    def __init__(self, marker: str | None = None) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os._exit, (3,)) if self.marker is None else (_die_at_first_unpickling, (self.marker,))
