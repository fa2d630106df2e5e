"""Small file helpers shared by the writers of persisted files."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

__all__ = ["atomic_write_text", "default_file_mode"]

_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    try:  # Linux >= 4.7 reports it without changing it
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:  # elsewhere: the only portable way to read it is to set it
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open()`` gives a new file under the user's umask (``tempfile.mkstemp`` gives
    0600, which a file renamed into place would keep)."""
    return 0o666 & ~_umask()


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to a temporary sibling, fsync, rename over ``path`` (umask-mode file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
