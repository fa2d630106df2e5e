"""Math answer verification on math-verify with a deadline that works off the main thread.

math-verify's own timeouts use ``signal.alarm``, which only works on the main thread (Ray
reward workers and thread pools are not) and cannot stop C code anyway. We pass
``parsing_timeout=None`` / ``timeout_seconds=None`` to disable them and enforce our own
deadline:

- **Fast path, in process** (no sympy, microseconds): the final answer is extracted with
  :func:`~verl_replay.verifiers.extract.extract_math_answer`; if it and the ground truth are
  the same string after trivial normalisation, or both are plain numeric literals (integer,
  decimal, ``a/b``, ``\\frac{a}{b}``), the result is decided exactly here. It only decides
  cases where math-verify agrees: equal rationals are equal for math-verify too, and two
  different integers are different (math-verify compares integers exactly). Everything
  else -- expressions, sets, intervals, units, percentages, decimal-vs-fraction mismatches
  where math-verify's 6-decimal rounding applies -- goes to the guarded path. Trade-off:
  the fast path is the common case of RL math data (integer answers) at zero isolation
  cost, but it is deliberately narrow, so it never disagrees with the guarded path.
- **Guarded path, in a sandbox process** (milliseconds): ``parse`` + ``verify`` run in a
  shared :class:`~verl_replay.verifiers.pool.VerifierPool` (started lazily, one per process,
  ``VERL_REPLAY_MATH_WORKERS`` workers, default 2, ``VERL_REPLAY_MATH_MEMORY_MB`` address
  space each, default 4096). A thread cannot be killed, and sympy can spend minutes inside a
  single C-level big-integer operation that never returns to the interpreter
  (``(1+\\sqrt{2})^{10000}-(1-\\sqrt{2})^{10000}``), so the only thing that truly stops a
  runaway computation is killing the process running it. Inside the worker the task runs on
  its main thread under ``SIGALRM`` at ``timeout_s`` (stops Python-level loops cheaply,
  the worker survives); the pool kills the worker at ``timeout_s + HARD_KILL_GRACE_S`` if
  the alarm could not interrupt it (C-level hang), and a fresh worker replaces it.
- Already inside a ``VerifierPool`` worker (a caller mapping ``verify_math`` over a pool),
  the guarded path runs inline under ``SIGALRM``; that pool's own hard deadline is the
  backstop.

Answer extraction: ``\\boxed{}`` content when present, else the last number/expression.
Both answers are wrapped in ``\\boxed{}`` before ``parse`` so math-verify parses exactly the
extracted answer.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from fractions import Fraction

from verl_replay.verifiers.extract import extract_boxed, extract_math_answer
from verl_replay.verifiers.pool import VerifierPool, in_pool_worker

__all__ = ["HARD_KILL_GRACE_S", "REASONS", "MathVerification", "shutdown_math_sandbox", "verify_math"]

#: Reason codes of :class:`MathVerification`.
REASONS: dict[str, str] = {
    "ok": "the answer matches the ground truth",
    "mismatch": "an answer was found and it does not match",
    "no_answer": "no answer could be extracted from the response",
    "unparsable": "math-verify could not parse the extracted answer",
    "gold_error": "the ground truth is empty or unparsable (not the model's fault)",
    "timeout": "the deadline passed (alarm in the worker, or the worker was killed)",
    "worker_crashed": "the sandbox worker died (e.g. out of memory)",
    "internal_error": "an unexpected error in the verifier itself",
}

#: Extra seconds the sandbox pool waits after ``timeout_s`` before killing the worker.
HARD_KILL_GRACE_S = 0.5
# How long a caller may wait for a sandbox worker to become free/ready (cold start imports
# sympy, ~4 s) before giving up on the task; the task is cancelled if still queued.
_QUEUE_ALLOWANCE_S = 60.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MathVerification:
    """Outcome of one math verification. ``reason`` is a key of :data:`REASONS`.

    ``path``: ``"fast"`` (decided in process without sympy), ``"sandbox"`` (math-verify in
    the sandbox pool) or ``"inline"`` (math-verify on this pool worker's main thread).
    """

    correct: bool
    reason: str
    detail: str = ""
    elapsed_s: float = 0.0
    predicted: str | None = None
    path: str = ""


# ----------------------------------------------------------------------------- fast path

_INT_RE = re.compile(r"[+-]?\d+")
_DECIMAL_RE = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)")
_SLASH_RE = re.compile(r"([+-]?)(\d+)/(\d+)")
_FRAC_RE = re.compile(r"([+-]?)\\frac\{(\d+)\}\{(\d+)\}")


def _normalise(answer: str) -> str:
    text = answer.strip()
    while len(text) >= 2 and text[0] == "$" and text[-1] == "$":
        text = text[1:-1].strip()
    text = text.rstrip(".").strip()
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return " ".join(text.split())


def _literal(text: str) -> tuple[Fraction, bool] | None:
    """(value, is_integer_literal) for a plain numeric literal, else None."""
    try:
        if _INT_RE.fullmatch(text):
            return Fraction(int(text)), True
        if _DECIMAL_RE.fullmatch(text):
            return Fraction(text), False
        match = _SLASH_RE.fullmatch(text) or _FRAC_RE.fullmatch(text)
        if match and int(match.group(3)) != 0:
            value = Fraction(int(match.group(2)), int(match.group(3)))
            return (-value if match.group(1) == "-" else value), False
    except ValueError:
        return None  # more digits than int() converts (sys.get_int_max_str_digits): math-verify decides
    return None


def _fast_decision(predicted: str, gold: str) -> bool | None:
    """True/False when decidable without sympy (and math-verify would agree), else None."""
    pred_n, gold_n = _normalise(predicted), _normalise(gold)
    if pred_n and pred_n == gold_n:
        return True
    pred_v, gold_v = _literal(pred_n), _literal(gold_n)
    if pred_v is None or gold_v is None:
        return None
    if pred_v[0] == gold_v[0]:
        return True
    if pred_v[1] and gold_v[1]:
        return False  # two different integers: math-verify compares Integers exactly
    return None  # e.g. 0.333333 vs 1/3: math-verify rounds floats to 6 decimals


# ----------------------------------------------------------------------------- guarded path


class _Deadline(BaseException):
    """Raised by our SIGALRM handler. BaseException so math-verify's ``except Exception``
    handlers (which turn errors into ``False``) cannot swallow it."""


class _SilenceDisabledTimeoutWarning(logging.Filter):
    # math-verify warns once that its timeout is disabled; that is deliberate here.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_SILENCER = _SilenceDisabledTimeoutWarning()


def _import_math_verify():  # type: ignore[no-untyped-def]
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_SILENCER)  # no-op when already added
    return math_verify


def _compare_with_math_verify(predicted: str, gold: str) -> tuple[bool, str, str]:
    """(correct, reason, detail) using math-verify with its signal timeouts disabled."""
    mv = _import_math_verify()  # already imported by the caller; a dict lookup here
    gold_parsed = mv.parse("\\boxed{" + gold + "}", parsing_timeout=None)
    if not gold_parsed:
        return False, "gold_error", f"math-verify cannot parse the ground truth {gold!r}"
    pred_parsed = mv.parse("\\boxed{" + predicted + "}", parsing_timeout=None)
    if not pred_parsed:
        return False, "unparsable", f"math-verify cannot parse {predicted!r}"
    if mv.verify(gold_parsed, pred_parsed, timeout_seconds=None):
        return True, "ok", ""
    return False, "mismatch", ""


def _verify_under_alarm(predicted: str, gold: str, timeout_s: float, path: str) -> MathVerification:
    """Run math-verify on this (main) thread, interrupted by SIGALRM at ``timeout_s``."""
    # Import before arming the alarm: a cold import of sympy takes seconds and is not part of
    # the verification, and an import interrupted half-way would leave broken modules behind.
    _import_math_verify()
    start = time.monotonic()

    def on_alarm(_signum: int, _frame: object) -> None:
        raise _Deadline()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        correct, reason, detail = _compare_with_math_verify(predicted, gold)
    except _Deadline:
        correct, reason, detail = False, "timeout", f"interrupted after {timeout_s:g}s"
    except Exception as exc:  # noqa: BLE001 - never raise for a bad answer
        correct, reason, detail = False, "internal_error", f"{type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return MathVerification(correct, reason, detail, time.monotonic() - start, predicted, path)


def _sandbox_task(predicted: str, gold: str, timeout_s: float) -> MathVerification:
    """Task run in a sandbox worker (main thread of that process)."""
    return _verify_under_alarm(predicted, gold, timeout_s, "sandbox")


def _sandbox_failure(reason: str, detail: str) -> MathVerification:
    if reason == "worker_timeout":
        reason = "timeout"  # a kill at the hard deadline is a timeout from the caller's view
    elif reason != "worker_crashed":
        reason, detail = "internal_error", f"{reason}: {detail}"
    return MathVerification(False, reason, detail, path="sandbox")


def _warm_sandbox_worker() -> None:
    """Worker initializer: import sympy/math-verify and exercise parsing and simplification
    once, before tasks (the first simplify in a process pays ~1-2 s of lazy set-up that must
    not count against a task's deadline)."""
    _compare_with_math_verify("\\frac{1}{2}", "0.5")
    _compare_with_math_verify("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}")


_sandbox_lock = threading.Lock()
_sandbox: VerifierPool | None = None
_sandbox_pid = -1


def _get_sandbox() -> VerifierPool:
    global _sandbox, _sandbox_pid
    with _sandbox_lock:
        # After a fork the inherited pool has no supervisor thread: make a new one.
        if _sandbox is None or _sandbox_pid != os.getpid() or _sandbox.closed:
            _sandbox = VerifierPool(
                num_workers=int(os.environ.get("VERL_REPLAY_MATH_WORKERS", "2")),
                task_timeout_s=60.0,
                max_tasks_per_child=5000,  # bounds growth of sympy's caches
                memory_limit_mb=int(os.environ.get("VERL_REPLAY_MATH_MEMORY_MB", "4096")),
                initializer=_warm_sandbox_worker,
                on_failure=_sandbox_failure,
            )
            _sandbox_pid = os.getpid()
        return _sandbox


def shutdown_math_sandbox() -> None:
    """Stop the sandbox workers (they are also stopped at interpreter exit)."""
    global _sandbox
    with _sandbox_lock:
        pool, _sandbox = _sandbox, None
    if pool is not None and _sandbox_pid == os.getpid():
        pool.close(wait=False)


def _verify_in_sandbox(predicted: str, gold: str, timeout_s: float) -> MathVerification:
    future = _get_sandbox().submit(_sandbox_task, predicted, gold, timeout_s, timeout_s=timeout_s + HARD_KILL_GRACE_S)
    try:
        return future.result(timeout=timeout_s + HARD_KILL_GRACE_S + _QUEUE_ALLOWANCE_S)
    except concurrent.futures.TimeoutError:
        future.cancel()
        return MathVerification(False, "timeout", "sandbox busy: task not started in time", path="sandbox")


# ----------------------------------------------------------------------------- public


def _gold_answer(ground_truth: object) -> str | None:
    if ground_truth is None:
        return None
    text = str(ground_truth).strip()
    boxed = extract_boxed(text)
    text = boxed if boxed is not None else text
    text = _normalise(text)
    return text or None


def verify_math(
    response: str | None,
    ground_truth: object,
    *,
    timeout_s: float = 5.0,
    fast_path: bool = True,
) -> MathVerification:
    """Is the final answer of ``response`` equal to ``ground_truth``? Never raises for bad input.

    Safe from any thread and inside worker processes. Bounded whatever the response is:
    answer extraction is linear in its length; the fast path is exact arithmetic on plain
    literals; the guarded path returns within ``timeout_s + HARD_KILL_GRACE_S`` once a sandbox
    worker is free (its worker is killed then), and the wait for a free worker (all busy, or
    the sandbox starting: sympy's import, a few seconds) is itself capped at
    ``_QUEUE_ALLOWANCE_S`` (a ``timeout`` after that). ``fast_path=False`` forces math-verify
    for every pair (for testing/benchmarking the guarded path).
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    start = time.monotonic()
    try:
        gold = _gold_answer(ground_truth)
        if gold is None:
            return MathVerification(False, "gold_error", "empty ground truth", time.monotonic() - start)
        predicted = extract_math_answer(response) if isinstance(response, str) else None
        if not predicted:
            return MathVerification(False, "no_answer", "", time.monotonic() - start)
        if fast_path:
            decision = _fast_decision(predicted, gold)
            if decision is not None:
                reason = "ok" if decision else "mismatch"
                return MathVerification(decision, reason, "", time.monotonic() - start, predicted, "fast")
        if in_pool_worker() and threading.current_thread() is threading.main_thread():
            outcome = _verify_under_alarm(predicted, gold, timeout_s, "inline")
        else:
            outcome = _verify_in_sandbox(predicted, gold, timeout_s)
        return MathVerification(
            outcome.correct, outcome.reason, outcome.detail, time.monotonic() - start, predicted, outcome.path
        )
    except Exception as exc:  # noqa: BLE001 - the reward path must not crash on one sample
        return MathVerification(False, "internal_error", f"{type(exc).__name__}: {exc}", time.monotonic() - start)
