"""Killing a run the way a crash would: SIGKILL to its driver, its Ray cluster and every child, at a
random moment after a checkpoint (shared by the synchronous pair in ``test_e2e_headroom_drift`` and
the split-placement TINY recipe in ``tests/recipes/test_recipes.py``)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

import psutil
import pytest


def kill_after_checkpoint(
    process: subprocess.Popen, latest_file: Path, steps: Sequence[int] = (2, 4), timeout_s: float = 1800.0
) -> int:
    """SIGKILL the run (a process leading its own session) at a random moment within 1.5 s after its
    checkpoint at one of ``steps`` was marked latest; returns that step. The moment is drawn fresh
    each run (and printed)."""
    rng = random.Random()
    target, delay = rng.choice(list(steps)), rng.uniform(0.0, 1.5)
    print(f"killing the run {delay:.2f} s after its checkpoint at step {target}")
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            pytest.fail(f"the run ended (rc {process.returncode}) before its checkpoint at step {target}")
        if latest_file.exists() and latest_file.read_text().strip() == str(target):
            break
        if time.monotonic() > deadline:
            kill_tree(process)
            pytest.fail(f"no checkpoint at step {target} within {timeout_s} s")
        time.sleep(0.05)
    time.sleep(delay)
    if process.poll() is not None:
        pytest.fail("the run ended before it could be killed")
    kill_tree(process)
    return target


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the process group the run leads and every descendant (Ray starts some in sessions of
    their own), then wait until all of them are gone."""
    try:
        children = [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:  # it ended on its own meanwhile: do not hide the caller's error behind this
        children = []
    tree = [process.pid] + children
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=60)
    psutil.wait_procs([p for p in map(_process, tree) if p is not None], timeout=60)


def _process(pid: int):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
