"""verl_replay.integrations.verl.metrics_file: metrics.jsonl lines are whole, even under SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

from verl_replay.integrations.verl.metrics_file import WholeLineFileLogger, install_whole_line_file_logger


def test_lines_are_verls_format_and_an_existing_file_is_continued(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "data": {}}\n{"step": 2, "da')  # an older run's torn last line is dropped
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = WholeLineFileLogger("p", "e")
    logger.log({"critic/score/mean": np.float32(0.5), "n": np.int64(3)}, step=2)
    logger.finish()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [{"step": 1, "data": {}}, {"step": 2, "data": {"critic/score/mean": 0.5, "n": 3}}]


def test_trackings_file_backend_becomes_the_whole_line_logger(tmp_path, monkeypatch):
    import verl.utils.tracking as tracking

    monkeypatch.setattr(tracking, "FileLogger", tracking.FileLogger)  # restored after the test
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    install_whole_line_file_logger()
    run = tracking.Tracking(project_name="p", experiment_name="e", default_backend=["file"])
    assert isinstance(run.logger["file"], WholeLineFileLogger)
    run.log({"a": 1.0}, step=1)
    run.finish()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "data": {"a": 1.0}}


WRITER = textwrap.dedent("""
    import os, sys
    from verl_replay.integrations.verl.metrics_file import WholeLineFileLogger
    logger = WholeLineFileLogger("p", "e")
    data = {f"metric/{i}": i * 0.1 for i in range(40)}  # ~900-byte lines: a buffer would cut them
    step = 0
    while True:
        step += 1
        logger.log(data, step)
        if step == 20:
            print("ready", flush=True)
""")


def test_a_sigkilled_writer_leaves_whole_lines_only(tmp_path):
    """A single write() of a line is not enough: Linux stops copying it between pages on SIGKILL
    (one such write tore a line in about one run of six here)."""
    path = tmp_path / "metrics.jsonl"
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(path))
    writer = subprocess.Popen([sys.executable, "-c", WRITER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(0.2)  # killed mid-stream, thousands of lines in
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    text = path.read_bytes()
    assert text.endswith(b"\n")
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 20
