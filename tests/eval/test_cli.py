"""``python -m verl_replay.eval`` as a subprocess on the tiny SQL data and model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _run(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "verl_replay.eval", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_smoke_on_tiny_sql(tiny_assets, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    proc = _run(
        "--data",
        str(tiny_assets.sql_val),
        "--model",
        str(tiny_assets.sql_model_dir),
        "--out",
        str(out),
        "--limit",
        "2",
        "--n",
        "2",
        "--k",
        "1,2,8",
        "--max-new-tokens",
        "40",
        "--verify-workers",
        "1",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    table_lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert table_lines[0].split("|")[1].strip() == "benchmark"
    assert any(line.startswith("| tiny_sql ") for line in table_lines)
    assert "pass@2" in table_lines[0] and "pass@8" not in table_lines[0]  # k > n is skipped
    assert (out / "table.md").read_text() in proc.stdout  # the same table is printed
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["n"] == 2 and doc["config"]["limit"] == 2 and doc["k_skipped"] == [8]
    assert doc["benchmarks"]["tiny_sql"]["num_questions"] == 2
    assert len((out / "samples.jsonl").read_text().splitlines()) == 2 * 2
    assert (out / "pass_at_k.png").read_bytes()[:4] == b"\x89PNG"
    assert "eval: 2/2 questions, 4 samples done" in proc.stderr  # the per-chunk progress line (no bar: no tty)
    # short lines for a person on the console, none of transformers'; the details in OUT/eval.log
    assert all(line.startswith("eval: ") for line in proc.stderr.splitlines()), proc.stderr
    assert "eval: 2 questions (tiny_sql 2)" in proc.stderr
    log = (out / "eval.log").read_text()
    assert " INFO verl_replay.eval.run: 2 questions (tiny_sql 2)" in log and f"log: {out / 'eval.log'}" in proc.stdout

    # the same command again resumes the finished run: nothing is sampled, the outputs are rewritten
    samples = (out / "samples.jsonl").read_bytes()
    again = _run(
        "--data",
        str(tiny_assets.sql_val),
        "--model",
        str(tiny_assets.sql_model_dir),
        "--out",
        str(out),
        "--limit",
        "2",
        "--n",
        "2",
        "--k",
        "1,2",
        "--max-new-tokens",
        "40",
        "--verify-workers",
        "1",
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert "2 of 2 questions already done" in again.stderr and (out / "samples.jsonl").read_bytes() == samples
    assert json.loads((out / "results.json").read_text())["resume"] == {"sessions": 2, "resumed_questions": 2}
    other = _run(
        "--data",
        str(tiny_assets.sql_val),
        "--model",
        str(tiny_assets.sql_model_dir),
        "--out",
        str(out),
        "--limit",
        "2",
        "--n",
        "3",
        "--k",
        "1",
        "--max-new-tokens",
        "40",
        cwd=tmp_path,
    )
    assert other.returncode == 2 and "n: 2 -> 3" in other.stderr and "--overwrite" in other.stderr


def test_cli_reports_missing_data_file_without_traceback(tmp_path: Path) -> None:
    proc = _run(
        "--data",
        str(tmp_path / "missing.parquet"),
        "--model",
        "m",
        "--out",
        str(tmp_path / "o"),
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no such parquet file" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_the_console_shows_our_lines_not_the_ones_the_bar_shows_nor_other_libraries(tmp_path, monkeypatch) -> None:
    import io
    import logging

    from verl_replay.eval.__main__ import setup_logging

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        setup_logging(str(tmp_path / "out"), quiet=False)
        ours = logging.getLogger("verl_replay.eval.run")
        ours.info("eval: 1/2 questions", extra={"progress_line": True})  # the bar shows it
        ours.info("eval: 2/2 questions", extra={"progress_line": False})
        ours.warning("pass@k skipped for k=[8] > n=2")
        # a library's info line (not transformers' own logger: once transformers is imported in this
        # process, which depends on the tests run before, it drops its info lines itself)
        logging.getLogger("some_library.loading").info("loading weights file")
        # (nor vLLM's logger: once vLLM is imported, it has its own handler and does not propagate)
        logging.getLogger("some_library.engine").warning("a warning of a library")
    finally:
        for handler in root.handlers[len(before) :]:
            handler.close()
        root.handlers[:] = before
    assert err.getvalue().splitlines() == [
        "eval: 2/2 questions",
        "eval: warning: pass@k skipped for k=[8] > n=2",
        "eval: warning: a warning of a library",
    ]
    log = (tmp_path / "out" / "eval.log").read_text()
    assert "1/2 questions" in log and "loading weights file" in log  # everything, in the file
