"""verl_replay.runs: one folder per run, explicit resume, nothing of another run moved."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from datetime import datetime

import pytest

from verl_replay.runs import RunDirBusy, keep_previous_metrics, lock_run_dir, new_run_dir, open_run_dir, run_dir_name

NOW = datetime(2026, 1, 2, 3, 4, 5)


def test_run_dir_name_carries_the_name_and_the_time():
    assert run_dir_name("math_none", NOW) == "math_none-20260102-030405"
    assert run_dir_name("a/b c", NOW) == "a_b_c-20260102-030405"
    assert run_dir_name("  ", NOW) == "run-20260102-030405"


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path):
    first = new_run_dir(tmp_path / "p", "math_none", now=NOW)
    second = new_run_dir(tmp_path / "p", "math_none", now=NOW)
    third = new_run_dir(tmp_path / "p", "math_none", now=NOW)
    assert [d.name for d in (first, second, third)] == [
        "math_none-20260102-030405",
        "math_none-20260102-030405-2",
        "math_none-20260102-030405-3",
    ]
    assert all(d.is_dir() for d in (first, second, third))


def test_a_new_run_never_touches_an_earlier_one(tmp_path):
    earlier = open_run_dir(None, tmp_path, "math_none", now=NOW)
    (earlier.path / "metrics.jsonl").write_text('{"step": 1}\n')
    later = open_run_dir(None, tmp_path, "math_none", now=NOW)
    assert later.path != earlier.path and not later.resumed and later.kept_metrics is None
    assert (earlier.path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in earlier.path.iterdir()) == ["metrics.jsonl", "run.lock"]


def test_naming_an_existing_run_dir_resumes_it_and_keeps_its_metrics(tmp_path):
    run = tmp_path / "run"
    first = open_run_dir(str(run), tmp_path, "ignored")
    assert first.path == run and not first.resumed
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    second = open_run_dir(str(run), tmp_path, "ignored")
    assert second.resumed and second.kept_metrics == run / "metrics.1.jsonl"
    assert (run / "metrics.1.jsonl").read_text() == '{"step": 1}\n' and not (run / "metrics.jsonl").exists()
    (run / "metrics.jsonl").write_text('{"step": 2}\n')
    third = open_run_dir(str(run), tmp_path, "ignored")
    assert third.kept_metrics == run / "metrics.2.jsonl"
    assert (run / "metrics.1.jsonl").read_text() == '{"step": 1}\n'


def test_empty_metrics_are_not_kept_and_a_file_is_not_a_run_dir(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    assert keep_previous_metrics(tmp_path / "metrics.jsonl") is None
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FileExistsError, match="afile is a file"):
        open_run_dir(str(tmp_path / "afile"), tmp_path, "x")


HOLDER = textwrap.dedent("""
    import sys
    from verl_replay.runs import lock_run_dir
    lock_run_dir(sys.argv[1])
    print("locked", flush=True)
    sys.stdin.read()  # holds the lock until the test closes stdin
""")


@contextlib.contextmanager
def _held_by_another_process(run):
    """A live process holding ``run``'s lock until the block ends (then it exits; yields it)."""
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.stdin.close()
        holder.wait()


def test_a_run_dir_a_live_process_holds_is_refused_naming_it(tmp_path):
    run = tmp_path / "run"
    with _held_by_another_process(run) as holder:
        with pytest.raises(RunDirBusy, match=rf"in use by a live run \(process {holder.pid}\)"):
            open_run_dir(str(run), tmp_path, "x")
        assert sorted(p.name for p in run.iterdir()) == ["run.lock"]  # nothing else written
    # the holder ended: its lock went with it; a folder holding only the lock file is not a resumed run
    opened = open_run_dir(str(run), tmp_path, "x")
    assert not opened.resumed and (run / "run.lock").read_text() == f"{os.getpid()}\n"
    lock_run_dir(run)  # this process holds it already: no-op


def test_a_refused_run_leaves_the_holders_pid_and_the_holder_removes_the_file_at_exit(tmp_path):
    run = tmp_path / "run"
    with _held_by_another_process(run) as holder:
        for _ in range(2):
            with pytest.raises(RunDirBusy):
                lock_run_dir(run)
            assert (run / "run.lock").read_text() == f"{holder.pid}\n"  # the refused run wrote nothing
    assert holder.returncode == 0 and not (run / "run.lock").exists()  # no dead process id left behind


def test_a_lock_file_removed_after_it_was_opened_is_not_held(tmp_path, monkeypatch):
    """The holder removes run.lock as it exits: a run that had opened that file before and locks it
    after must not count it as held (a third run would lock the new file): it locks the new one."""
    import verl_replay.runs as runs

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.lock").write_text("12345\n")
    real_open, opened = os.open, []

    def open_then_replaced(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        if not opened:  # the first open: the file is then removed and made anew by another run
            os.unlink(path)
            real_open(path, os.O_RDWR | os.O_CREAT, 0o666)
        opened.append(fd)
        return fd

    monkeypatch.setattr(runs.os, "open", open_then_replaced)
    try:
        lock_run_dir(run)
        assert len(opened) == 2 and runs._HELD_LOCKS[run.absolute()] == opened[1]
        assert os.path.samestat(os.fstat(opened[1]), os.stat(run / "run.lock"))
        assert (run / "run.lock").read_text() == f"{os.getpid()}\n"
    finally:
        monkeypatch.undo()
        runs.release_run_dirs()
    assert not (run / "run.lock").exists() and run.absolute() not in runs._HELD_LOCKS
    lock_run_dir(run)  # taken again after the release
    runs.release_run_dirs()
