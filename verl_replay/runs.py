"""One folder per training run.

A run without an explicit ``run_dir`` gets a new folder ``<root>/<name>-<YYYYmmdd-HHMMSS>``
(``-2``, ``-3``, ... when that name is taken), created with an exclusive ``mkdir`` so that two
runs started in the same second never share one. A run given an existing folder resumes it.

What a run folder holds (file names used by ``verl_replay.main`` and the tools):

- ``config.yaml``: the fully resolved config the run was started with;
- ``verl.log``: everything verl, Ray and the workers printed (unless ``verbose=true``);
- ``metrics.jsonl``: verl's file logger, one line per step (``{"step", "data"}``);
- ``replay_events.jsonl``: the replay buffer's event log (Headroom-Drift / naive);
- ``checkpoints/``: verl's checkpoints, when ``trainer.save_freq`` > 0;
- ``run.lock``: held (``flock``) by the live run's driver, with its process id: one run per folder.
  A run refused because another holds it reads the file and leaves it as it is. The holder removes
  the file when it exits; the kernel drops the lock when that process ends, however it ends, so a
  file left by a killed run blocks nothing.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import itertools
import os
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional

__all__ = [
    "LOCK_FILE",
    "RunDirBusy",
    "CONFIG_FILE",
    "EVENTS_FILE",
    "LOG_FILE",
    "METRICS_FILE",
    "RunDir",
    "keep_previous_metrics",
    "lock_run_dir",
    "new_run_dir",
    "open_run_dir",
    "release_run_dirs",
    "run_dir_name",
]

CONFIG_FILE = "config.yaml"
LOG_FILE = "verl.log"
METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "replay_events.jsonl"
CHECKPOINTS_DIR = "checkpoints"
LOCK_FILE = "run.lock"

# run dir -> the open lock file descriptor this process holds (kept open until the process ends)
_HELD_LOCKS: dict[Path, int] = {}
_HOLDER_PID: list[int] = []  # the process that took them (a forked child inherits the dict, not the locks' files)


class RunDirBusy(Exception):
    """Another live process holds the run dir's lock; the message names its process id."""


def lock_run_dir(path: Path) -> None:
    """Take the run dir's lock for the rest of this process, before anything else is written there.

    ``flock`` on ``run.lock``: exclusive, never waited for; the holder's process id is written into
    the file so a refused run can name it. Raises :class:`RunDirBusy` when a live run holds it.
    Calling it again for a folder this process holds is a no-op.
    """
    path = Path(path).absolute()
    if path in _HELD_LOCKS:
        return
    lock_file = path / LOCK_FILE
    while True:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)  # umask applies; not inherited
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)  # read only: the holder's process id stays in the file
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunDirBusy(
                f"run_dir {path} is in use by a live run (process {holder}): wait for it to end (or stop it), "
                "or give this run another run_dir"
            ) from None
        if _is_current(fd, lock_file):
            break
        os.close(fd)  # the holder removed that file as it exited, after we opened it: lock the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    if not _HOLDER_PID:
        atexit.register(release_run_dirs)
    _HOLDER_PID[:] = [os.getpid()]
    _HELD_LOCKS[path] = fd


def _is_current(fd: int, lock_file: Path) -> bool:
    """The locked file is still the one at ``lock_file`` (not removed or replaced since it was opened)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(lock_file))
    except FileNotFoundError:
        return False


def release_run_dirs() -> None:
    """Remove the lock files this process holds, then drop the locks (at exit; idempotent).

    The file goes while still locked: a run that opened it in the meantime finds it removed once
    it gets the lock (:func:`_is_current`) and locks a new file, so no two runs ever hold one folder.
    """
    if _HOLDER_PID != [os.getpid()]:
        return  # a forked child exiting: the files are its parent's
    for path, fd in list(_HELD_LOCKS.items()):
        try:
            if _is_current(fd, path / LOCK_FILE):
                os.unlink(path / LOCK_FILE)
        except OSError:
            pass  # a folder removed or made read-only meanwhile: the lock still ends with the fd
        os.close(fd)
        del _HELD_LOCKS[path]


def holds_content(path: Path) -> bool:
    """A folder an earlier run wrote to (its lock file alone does not count)."""
    return path.is_dir() and any(entry.name != LOCK_FILE for entry in path.iterdir())


@dataclass(frozen=True)
class RunDir:
    path: Path
    resumed: bool  # the folder existed: this run continues it
    kept_metrics: Optional[Path] = None  # where the earlier metrics.jsonl was moved when resuming


def run_dir_name(name: str, now: datetime) -> str:
    """``<name>-<YYYYmmdd-HHMMSS>``; path separators and spaces in ``name`` become ``_``."""
    safe = re.sub(r"[\s/\\]+", "_", name.strip()) or "run"
    return f"{safe}-{now:%Y%m%d-%H%M%S}"


def new_run_dir(root: Path, name: str, *, now: Optional[datetime] = None) -> Path:
    """Create and return a folder under ``root`` that did not exist before this call."""
    base = run_dir_name(name, now or datetime.now())
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for index in itertools.count(1):
        candidate = root / (base if index == 1 else f"{base}-{index}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        lock_run_dir(candidate)
        return candidate
    raise AssertionError("unreachable")  # pragma: no cover


def keep_previous_metrics(metrics_path: Path) -> Optional[Path]:
    """verl's file logger truncates its file: a resumed run moves the earlier segment aside
    to ``metrics.<k>.jsonl`` (the first free k) and returns where it went."""
    if not metrics_path.exists() or metrics_path.stat().st_size == 0:
        return None
    for index in itertools.count(1):
        kept = metrics_path.with_name(f"{metrics_path.stem}.{index}{metrics_path.suffix}")
        if not kept.exists():
            os.replace(metrics_path, kept)
            return kept
    raise AssertionError("unreachable")  # pragma: no cover


def open_run_dir(explicit: Optional[str], root: Path, name: str, *, now: Optional[datetime] = None) -> RunDir:
    """The run's folder: ``explicit`` (created if missing, resumed if it exists) or a new one."""
    if explicit is None:
        return RunDir(new_run_dir(root, name, now=now).absolute(), resumed=False)
    path = Path(explicit).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"run_dir: {path} is a file, not a folder")
    resumed = holds_content(path)
    path.mkdir(parents=True, exist_ok=True)
    lock_run_dir(path)  # before anything in it changes
    kept = keep_previous_metrics(path / METRICS_FILE) if resumed else None
    return RunDir(path, resumed=resumed, kept_metrics=kept)
