"""verl_replay.console: compact step lines, and fds 1/2 routed to a log file."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from verl_replay.console import Console, format_value, step_line


def test_format_value_keeps_four_significant_digits_and_ints():
    assert format_value(0.43751) == "0.4375"
    assert format_value(-0.0078020) == "-0.007802"
    assert format_value(3.0) == "3" and format_value(7) == "7"
    assert format_value(float("nan")) == "nan" and format_value(float("inf")) == "inf"
    assert format_value(12345678.9) == "1.235e+07"
    assert format_value("2/4") == "2/4" and format_value(True) == "True"


def test_step_line():
    assert step_line(2, 3, [("score", 0.5), ("time", "2.8s")]) == "step 2/3 | score 0.5 | time 2.8s"
    assert step_line(4, None, []) == "step 4"


def test_lines_and_errors_go_to_the_given_streams_without_a_bar():
    out, err = io.StringIO(), io.StringIO()
    console = Console(out, err)
    console.start_progress(3)  # not a terminal: no bar
    console.advance(1)
    console.line("step 1/3")
    console.error("verl_replay: failed")
    assert out.getvalue() == "step 1/3\n" and err.getvalue() == "verl_replay: failed\n"


def _terminal():
    """A pseudo-terminal: (what the console writes to, the bytes written so far)."""
    import os

    main, child = os.openpty()
    os.set_blocking(main, False)
    stream = os.fdopen(child, "w", buffering=1, encoding="utf-8")

    def read() -> str:
        chunks = []
        while True:
            try:
                chunks.append(os.read(main, 65536))
            except BlockingIOError:
                return b"".join(chunks).decode("utf-8", "replace")

    return stream, read


def test_on_a_terminal_the_bar_and_the_lines_share_one_stream():
    out, read = _terminal()
    err = io.StringIO()
    console = Console(out, err)
    console.start_progress(3)
    assert console.has_bar
    console.status("starting Ray (12s)")
    assert "starting Ray (12s)" in read()
    console.advance(1)
    console.line("step 1/3 | score 0.5")
    shown = read()
    # tqdm.write blanks the bar's row, writes the line, and redraws the bar below it: one stream
    blank, rest = shown.split("\r", 2)[1:]
    assert blank.strip() == "" and rest.startswith("step 1/3 | score 0.5\r\n") and "training:" in rest
    console.close_progress()
    assert err.getvalue() == ""  # nothing on the other stream


def test_the_eta_counts_step_times_not_start_up():
    """Five minutes of start-up, then steps of 2 s and 4 s: the rate and the ETA come from the
    steps' own times (3 s a step), never from the wall time since the bar started."""
    from tqdm import tqdm

    out, _ = _terminal()
    console = Console(out, io.StringIO())
    console.start_progress(4)
    bar = console._bar
    bar.start_t -= 300.0  # start-up before the first step
    bar.last_print_t -= 300.0
    assert "?" in tqdm.format_meter(**bar.format_dict)  # nothing measured yet
    console.advance(1, step_seconds=2.0)
    shown = tqdm.format_meter(**bar.format_dict)
    assert bar.format_dict["rate"] == 0.5 and "2.00s/step" in shown and "<00:06" in shown, shown
    assert bar.format_dict["elapsed"] >= 300.0  # the elapsed time stays the wall time
    console.advance(2, step_seconds=4.0)
    shown = tqdm.format_meter(**bar.format_dict)
    assert bar.format_dict["rate"] == pytest.approx(2 / 6) and "3.00s/step" in shown and "<00:06" in shown, shown
    console.close_progress()


def test_without_step_times_the_rate_is_the_time_between_steps_not_start_up():
    out, _ = _terminal()
    console = Console(out, io.StringIO())
    console.start_progress(5, initial=2)  # a resumed run: two steps done before
    bar = console._bar
    bar.start_t -= 300.0
    clock = [1000.0]
    bar._time = lambda: clock[0]
    console.advance(3)
    assert bar.format_dict["rate"] == 0.0  # one step seen: its time is unknown
    clock[0] += 5.0
    console.advance(4)
    assert bar.format_dict["rate"] == pytest.approx(1 / 5)
    console.close_progress()


SCRIPT = r"""
import os, sys, subprocess, warnings
from pathlib import Path
from verl_replay.console import Console

console = Console()
early, log = Path(sys.argv[1]), Path(sys.argv[2])
console.redirect_to(early)
print("before the run dir")
console.redirect_to(log, carry_over=[early])
print("python print")
warnings.warn("a warning")
os.write(2, b"raw fd 2\n")
subprocess.run([sys.executable, "-c", "print('child process')"], check=True)
console.line("our line")
console.error("our error")
console.restore()
print("restored")
"""


def test_redirect_sends_everything_but_our_lines_to_the_log(tmp_path):
    early, log = tmp_path / "early.log", tmp_path / "run" / "verl.log"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(early), str(log)], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert result.stdout == "our line\nrestored\n"
    assert result.stderr == "our error\n"
    text = log.read_text()
    for expected in ("before the run dir", "python print", "UserWarning: a warning", "raw fd 2", "child process"):
        assert expected in text, expected
    assert text.index("before the run dir") < text.index("python print")
    assert "our line" not in text and "restored" not in text
