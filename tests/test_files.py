"""verl_replay._files: persisted files get the user's umask, writes are atomic."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from verl_replay._files import atomic_write_text, default_file_mode


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_default_file_mode_follows_the_umask(umask, mode):
    # a child process: the umask is process-wide state
    code = (
        "import os, sys; os.umask(int(sys.argv[1], 8)); "
        "from verl_replay._files import default_file_mode; print(oct(default_file_mode()))"
    )
    out = subprocess.run([sys.executable, "-c", code, oct(umask)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == oct(mode)


def test_default_file_mode_equals_what_open_gives(tmp_path):
    (tmp_path / "plain").write_text("x")
    assert stat.S_IMODE((tmp_path / "plain").stat().st_mode) == default_file_mode()


def test_atomic_write_text_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "config.yaml"
    atomic_write_text(path, "a: 1\n")
    atomic_write_text(path, "a: 2\n")
    assert path.read_text() == "a: 2\n"
    assert sorted(os.listdir(path.parent)) == ["config.yaml"]
    assert stat.S_IMODE(path.stat().st_mode) == default_file_mode()
