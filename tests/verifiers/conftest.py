"""Fixtures for the verifier tests: real SQLite files built in tmp_path.

Pool tasks must be importable by name in worker processes, so this folder is put on
``sys.path`` (workers receive the parent's ``sys.path`` when they start) and the helpers live
in uniquely named modules: ``verifier_tasks`` (pool tasks), ``verifier_fixtures`` (database
builder, file fingerprints).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from verifier_fixtures import build_db  # noqa: E402  (importable only once the folder is on sys.path)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    folder = tmp_path / "dbs"
    folder.mkdir()
    return build_db(folder / "shop.sqlite")
