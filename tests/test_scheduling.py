"""How the suite's work is split between its two pytest-xdist workers (``tests/conftest.py``)."""

from __future__ import annotations

from pathlib import Path

from xdist_units import END_TO_END, read_end_to_end_ids, unit_of, write_end_to_end_ids


def test_files_are_units_and_end_to_end_tests_one_unit(tmp_path: Path) -> None:
    ids = ["tests/a.py::test_run[x]", "tests/b.py::TestC::test_run"]
    write_end_to_end_ids(tmp_path, ids)
    e2e = read_end_to_end_ids(tmp_path)
    assert e2e == frozenset(ids)
    assert unit_of("tests/a.py::test_run[x]", e2e) == END_TO_END
    assert unit_of("tests/a.py::test_fast", e2e) == "tests/a.py"
    assert unit_of("tests/b.py::TestC::test_other[a::b]", e2e) == "tests/b.py"
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically


def test_without_the_list_every_file_is_its_own_unit(tmp_path: Path) -> None:
    assert read_end_to_end_ids(tmp_path) == frozenset()
    assert unit_of("tests/a.py::test_run", frozenset()) == "tests/a.py"
