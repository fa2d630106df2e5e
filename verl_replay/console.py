"""A run's console: our own lines on the terminal, everything else into the run's log file.

verl, Ray and their worker processes print a lot (a config dump of ~950 lines, every metric of
every step, import-time warnings in every process). :class:`Console` keeps the terminal for the
lines a person reads -- a start line, a progress bar, one line per step, a done line, one-line
errors -- and can point the process's own stdout and stderr (file descriptors 1 and 2, so C
extensions, child processes and Ray's log forwarding follow) at a log file.

The terminal streams are duplicates of fds 1 and 2 taken when the console is created, so they
keep reaching the terminal while fds 1 and 2 point elsewhere. Stdlib only (tqdm for the bar).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any, Optional

__all__ = ["Console", "format_value", "step_line"]


def format_value(value: Any) -> str:
    """Short, fixed-width-ish rendering of a metric: 4 significant digits, ints as ints."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (math.isfinite(value) and float(value).is_integer() and abs(value) < 1e6):
        return str(int(value))
    return f"{value:.4g}"


def step_line(step: int, total: Optional[int], fields: Sequence[tuple[str, Any]]) -> str:
    """``step 2/3 | score 0.4375 | pg_loss -0.0078 | ...`` (fields given as (label, value))."""
    head = f"step {step}/{total}" if total else f"step {step}"
    return " | ".join([head, *(f"{label} {format_value(value)}" for label, value in fields)])


class Console:
    """Terminal output of one process, independent of where fds 1 and 2 point.

    ``out`` / ``err`` default to duplicates of the current fds 1 and 2 (taken now); tests pass
    their own streams.
    """

    def __init__(self, out: Optional[IO[str]] = None, err: Optional[IO[str]] = None) -> None:
        self.out = out if out is not None else _dup_stream(1)
        self.err = err if err is not None else _dup_stream(2)
        self._bar: Any = None
        self._saved: Optional[tuple[int, int]] = None
        self.log_path: Optional[Path] = None

    # ------------------------------------------------------------------ lines

    def line(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.out)
        else:
            print(text, file=self.out, flush=True)

    def error(self, text: str) -> None:
        self.close_progress()
        print(text, file=self.err, flush=True)

    # ------------------------------------------------------------------ progress bar

    def start_progress(self, total: Optional[int], initial: int = 0, desc: str = "training") -> None:
        """A bar on the terminal's stdout, the stream of the step lines, so that ``tqdm.write``
        clears and redraws it around every line (bar and lines on two streams merge on one
        terminal); none when stdout is not a terminal (logs, CI, pipes). ``initial``: the steps
        done before (a resumed run)."""
        self.close_progress()
        if not _isatty(self.out):
            return
        self._bar = _step_timed_bar()(total=total, initial=initial, desc=desc, unit="step", file=self.out, leave=False)

    def advance(self, to_step: int, *, step_seconds: Optional[float] = None) -> None:
        """Move the bar to ``to_step``; ``step_seconds``: that step's own time (the trainer's).

        The bar's rate, and so its ETA, is the mean of the steps' own times: what the run spent
        before its first step (Ray, workers, model loading) and between steps (the file's polling)
        counts in the elapsed time only. Without step times, the rate is the wall time between the
        steps this bar saw, still without the start-up."""
        bar = self._bar
        if bar is None or to_step <= bar.n:
            return
        if step_seconds is not None and math.isfinite(float(step_seconds)) and float(step_seconds) > 0:
            bar.step_seconds += float(step_seconds)
            bar.timed_steps += 1
        if bar.first_seen is None:
            bar.first_seen = (to_step, bar._time())
        bar.update(to_step - bar.n)

    def status(self, text: Optional[str]) -> None:
        """What the bar waits for (shown after it); None clears it."""
        if self._bar is not None:
            self._bar.set_postfix_str(text or "", refresh=True)

    @property
    def has_bar(self) -> bool:
        return self._bar is not None

    def refresh(self) -> None:
        if self._bar is not None:
            self._bar.refresh()

    def close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # ------------------------------------------------------------------ fd redirection

    def redirect_to(self, path: Path, *, carry_over: Iterable[Path] = ()) -> None:
        """Point fds 1 and 2 at ``path`` (appending); prepend the text of ``carry_over`` files.

        Calling it again moves the redirection to another file (a temporary log before the run
        dir exists, the run dir's log after); :meth:`restore` points fds 1 and 2 back.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _flush_std()
        with open(path, "ab") as log:
            for earlier in carry_over:
                log.write(Path(earlier).read_bytes())
            log.flush()
            if self._saved is None:
                self._saved = (os.dup(1), os.dup(2))
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        self.log_path = path

    def restore(self) -> None:
        if self._saved is None:
            return
        _flush_std()
        out, err = self._saved
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        self._saved = None
        self.log_path = None

    @property
    def redirected(self) -> bool:
        return self._saved is not None


@functools.lru_cache(maxsize=1)
def _step_timed_bar() -> type:
    """A tqdm bar whose rate comes from the steps' own times (see :meth:`Console.advance`)."""
    from tqdm import tqdm

    class StepTimedBar(tqdm):
        step_seconds = 0.0  # sum of the timed steps' own times
        timed_steps = 0
        first_seen: Optional[tuple[int, float]] = None  # (step, when) of the first step this bar saw

        @property
        def format_dict(self) -> dict[str, Any]:
            values = super().format_dict
            values["rate"] = self.step_rate()
            return values

        def step_rate(self) -> float:
            """Steps per second of the steps' own time; 0 until known (tqdm shows ``?``: given
            None, it would divide the steps by the elapsed time, start-up included)."""
            if self.timed_steps:
                return self.timed_steps / self.step_seconds
            if self.first_seen is not None and self.n > self.first_seen[0]:
                seconds = self._time() - self.first_seen[1]
                return (self.n - self.first_seen[0]) / seconds if seconds > 0 else 0.0
            return 0.0

    return StepTimedBar


def _dup_stream(fd: int) -> IO[str]:
    return os.fdopen(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace")


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError):
            pass
