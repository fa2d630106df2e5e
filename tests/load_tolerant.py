"""Timing checks that a loaded machine cannot fail.

On a 2-core CI machine the other pytest-xdist worker's verl run (Ray and its worker processes) can
delay this process by 20x or more, so no test compares wall-clock time with a tight bound:

- complexity: the same process's CPU time (``time.process_time``: every thread of this process,
  nothing else) at two input sizes, as a ratio (``assert_cpu_time_scales``);
- a deadline that must fire: the outcome says it fired (a "timeout" reason, a kill count) and the
  work stopped; the wall clock only tells "stopped near its deadline" from "ran on" (minutes or
  forever), with ``STARVED_SCHEDULER_S`` of room (``within_deadline``);
- concurrency: observed from the inside (how many workers were busy at once, ``PeakSampler``),
  never from how long the whole took;
- speed targets live in ``benchmarks/`` (``bench_verifiers.py --sections deadlines``), which
  reports them instead of asserting them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

# Room for a starved scheduler on top of a deadline: 20x a 0.5-1.5 s deadline plus process start-up.
# Every wall-clock bound in the suite is of the form "deadline + STARVED_SCHEDULER_S", and every
# workload it bounds would run for minutes (or forever) if its deadline did not fire.
STARVED_SCHEDULER_S = 30.0


def within_deadline(elapsed_s: float, deadline_s: float) -> bool:
    """True when work that must stop at ``deadline_s`` (wall clock) did not run on past it."""
    return elapsed_s <= deadline_s + STARVED_SCHEDULER_S


def cpu_seconds(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``fn(*args, **kwargs)`` and the CPU seconds this process spent in it (all its threads)."""
    start = time.process_time()
    result = fn(*args, **kwargs)
    return result, time.process_time() - start


def per_call_cpu_seconds(fn: Callable[[], Any], *, min_total_s: float = 0.02, repeats: int = 3) -> float:
    """CPU seconds of one ``fn()`` call: calls are batched until a batch takes ``min_total_s``
    (far above the timer's resolution), and the least of ``repeats`` batches counts (the call's
    own cost, without one-off noise such as a garbage collection)."""
    calls = 1
    while True:
        start = time.process_time()
        for _ in range(calls):
            fn()
        total = time.process_time() - start
        if total >= min_total_s:
            break
        calls *= 2
    best = total / calls
    for _ in range(repeats - 1):
        start = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - start) / calls)
    return best


def assert_cpu_time_scales(
    work: Callable[[int], Callable[[], Any]], small: int, large: int, *, power: float = 1.0, slack: float = 2.5
) -> tuple[float, float]:
    """Assert CPU time grows no faster than ``size ** power`` from ``small`` to ``large``.

    ``work(n)`` builds the input of size ``n`` (not timed) and returns the call to time. A linear
    algorithm gives a ratio near ``large / small``; ``slack`` absorbs cache effects and timer
    noise, far less than the next power (a quadratic algorithm at 4x the size is 16x, not 4x).
    Returns the CPU seconds of one call at each size.
    """
    t_small, t_large = per_call_cpu_seconds(work(small)), per_call_cpu_seconds(work(large))
    limit = slack * (large / small) ** power
    ratio = t_large / t_small
    assert ratio <= limit, (
        f"CPU time x{ratio:.1f} from size {small} to {large} ({t_small:.5f}s -> {t_large:.5f}s per call); "
        f"at most x{limit:.1f} for growth like size**{power:g}"
    )
    return t_small, t_large


class PeakSampler:
    """Samples ``probe()`` in a thread while the ``with`` block runs; ``peak`` is the largest value.

    Used to see concurrency from the inside (how many workers were busy at once), which load
    cannot fake or hide the way a total wall time can.
    """

    def __init__(self, probe: Callable[[], int], interval_s: float = 0.005) -> None:
        self.probe = probe
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.probe())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.probe())
