"""Units of work for pytest-xdist: each test file is one unit (its module fixtures are built once),
and on a machine too small for two verl runs at once, all end-to-end tests are one unit, so one
worker runs them one after the other while the other runs everything else.

xdist's own ``--dist loadgroup`` cannot do this under pytest 9.2: it renames test ids through an
attribute pytest no longer reads. The scheduler below sees only test ids, so the workers write
the ids of the end-to-end tests they collected to a folder the controller gives them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

END_TO_END = "end_to_end"
_IDS_FILE = "end_to_end_ids.txt"


def write_end_to_end_ids(folder: Path, ids: list[str]) -> None:
    """Atomically: both workers write the same list, and the controller may read it at any time."""
    handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(handle, "w") as out:
        out.write("\n".join(ids))
    os.replace(temporary, folder / _IDS_FILE)


def read_end_to_end_ids(folder: Path) -> frozenset[str]:
    path = folder / _IDS_FILE
    return frozenset(path.read_text().splitlines()) if path.exists() else frozenset()


def unit_of(nodeid: str, end_to_end: frozenset[str]) -> str:
    return END_TO_END if nodeid in end_to_end else nodeid.split("::", 1)[0]


def make_scheduler(config, log, folder: Path):
    """A LoadScopeScheduling whose scopes are the units above (the ids read once, when the
    controller first splits the collection: after every worker has collected)."""
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndOneEndToEndUnit(LoadScopeScheduling):
        _end_to_end: frozenset[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._end_to_end is None:
                self._end_to_end = read_end_to_end_ids(folder)
            return unit_of(nodeid, self._end_to_end)

    return FilesAndOneEndToEndUnit(config, log)
