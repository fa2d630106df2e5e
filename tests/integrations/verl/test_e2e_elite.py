"""EliteReplay's start-up checks with an archive built by the search command.

The archive comes from ``python -m verl_replay.elite.search`` on the tiny SQL dataset with the
frozen tiny SQL model. The replay term inside the real actor update (the mixed loss, its
normaliser, the first optimiser step's NLL against a separate forward pass) is checked on the
recipes' split placement, ``test_e2e_split.py``.
"""

from __future__ import annotations

import pytest

# what this file's verl runs take on 2 cores (tests/conftest.py starts the longest first)
E2E_SECONDS = 15

pytestmark = pytest.mark.e2e


def test_archive_mismatch_fails_at_start_up(run_main, tiny_archive, tmp_path):
    # training on the math data with an archive built from the SQL data
    run = run_main(
        "tiny_task=math",
        "replay.strategy=elite",
        f"replay.elite.archive={tiny_archive}",
        experiment="mismatch",
        check=False,
        timeout=600,
    )
    assert run.returncode == 2
    assert f"{tiny_archive} is a sql archive and this run trains tiny_task=math; add tiny_task=sql" in run.output
