from __future__ import annotations

import functools
import threading
import time

import pytest
import verifier_tasks as tasks
from load_tolerant import STARVED_SCHEDULER_S, within_deadline

from verl_replay.verifiers import math as mathmod
from verl_replay.verifiers.math import (
    HARD_KILL_GRACE_S,
    REASONS,
    MathVerification,
    shutdown_math_sandbox,
    verify_math,
)
from verl_replay.verifiers.pool import VerifierPool

# Pure-Python-level runaway (the in-worker alarm interrupts it) and a C-level big-integer
# computation (sympy evaluates it inside one call).
PATHOLOGICAL = [r"(1+\sqrt{2})^{10000}-(1-\sqrt{2})^{10000}", r"10^{10^{10}}"]


@pytest.fixture(scope="module", autouse=True)
def sandbox():  # type: ignore[no-untyped-def]
    """Start the shared sandbox once (cold start imports sympy) and stop it at the end."""
    verify_math(r"\boxed{\sqrt{4}}", "2")
    pool = mathmod._get_sandbox()
    yield pool
    pids = list(pool.started_pids)
    shutdown_math_sandbox()
    deadline = time.monotonic() + STARVED_SCHEDULER_S  # a poll: ends as soon as they are gone
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    assert not [pid for pid in pids if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except FileNotFoundError:
        return False


def in_thread(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    """Run fn in a non-main thread; return (result, seconds)."""
    box: list = []

    def target() -> None:
        start = time.monotonic()
        box.append(fn(*args, **kwargs))
        box.append(time.monotonic() - start)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return box[0], box[1]


class TestFastPath:
    @pytest.mark.parametrize(
        ("response", "gold", "correct"),
        [
            (r"so the answer is \boxed{42}", "42", True),
            ("The answer is 42.", "42", True),
            (r"\boxed{41}", "42", False),
            (r"\boxed{\frac{1}{2}}", "0.5", True),
            (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", True),
            (r"\boxed{-3/6}", "-0.5", True),
            (r"\boxed{007}", "7", True),
            (r"\boxed{5.0}", "5", True),
            (r"\boxed{x^2 + 1}", r"$x^2 + 1$", True),
            ("answer: 12", r"\boxed{12}", True),
        ],
    )
    def test_decided_without_sympy(self, response: str, gold: str, correct: bool) -> None:
        result = verify_math(response, gold)
        assert (result.correct, result.path) == (correct, "fast")  # no sympy, no sandbox round trip
        assert result.reason == ("ok" if correct else "mismatch")

    def test_fast_path_never_rejects_what_it_cannot_decide(self) -> None:
        # decimal vs fraction that differ exactly: math-verify's rounding decides
        assert mathmod._fast_decision("0.333333", r"\frac{1}{3}") is None
        assert mathmod._fast_decision(r"\sqrt{2}", "1.41421") is None
        assert mathmod._fast_decision("10", "11") is False

    def test_fast_path_agrees_with_math_verify(self) -> None:
        pairs = [("42", "42"), ("41", "42"), (r"\frac{1}{2}", "0.5"), ("-3/6", "-0.5"), ("5.0", "5"), ("007", "7")]
        for predicted, gold in pairs:
            fast = verify_math(rf"\boxed{{{predicted}}}", gold)
            slow = verify_math(rf"\boxed{{{predicted}}}", gold, fast_path=False)
            assert (fast.path, slow.path) == ("fast", "sandbox")
            assert fast.correct == slow.correct, (predicted, gold)


class TestSandbox:
    @pytest.mark.parametrize(
        ("response", "gold", "correct"),
        [
            (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", True),
            (r"\boxed{\frac{1}{3}}", "0.333333", True),
            (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", True),
            (r"\boxed{\{1, 2\}}", r"\{2, 1\}", True),
            (r"\boxed{1,000}", "1000", True),
            (r"\boxed{\pi}", "3.14", False),
            (r"\boxed{\frac{1}{2}}", "0.6", False),
            (r"\boxed{x+1}", "x+2", False),
        ],
    )
    def test_equivalence(self, response: str, gold: str, correct: bool) -> None:
        result = verify_math(response, gold)
        assert result.path == "sandbox"
        assert (result.correct, result.reason) == (correct, "ok" if correct else "mismatch")

    def test_works_off_the_main_thread(self) -> None:
        result, _ = in_thread(verify_math, r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}")
        assert result.correct and result.path == "sandbox"

    @pytest.mark.parametrize("expression", PATHOLOGICAL)
    def test_pathological_expression_stopped_by_deadline_off_main_thread(self, expression: str) -> None:
        timeout = 1.0
        result, seconds = in_thread(verify_math, rf"\boxed{{{expression}}}", "1", timeout_s=timeout)
        assert (result.correct, result.reason) == (False, "timeout")  # the deadline fired
        assert within_deadline(seconds, timeout + HARD_KILL_GRACE_S), seconds  # both never finish on their own
        # the sandbox is still healthy
        assert verify_math(r"\boxed{\sqrt{9}}", "3").correct

    def test_uninterruptible_computation_is_killed_at_the_hard_deadline(self, sandbox: VerifierPool) -> None:
        timeout = 0.5
        replacements = sandbox.replacements
        start = time.monotonic()
        future = sandbox.submit(
            tasks.alarm_blocked_math_task, PATHOLOGICAL[0], "1", timeout, timeout_s=timeout + HARD_KILL_GRACE_S
        )
        result = future.result(timeout=30 + STARVED_SCHEDULER_S)
        assert isinstance(result, MathVerification)
        assert (result.correct, result.reason) == (False, "timeout")
        assert sandbox.replacements == replacements + 1  # the stuck worker was killed, not waited for
        assert within_deadline(time.monotonic() - start, timeout + HARD_KILL_GRACE_S)
        assert verify_math(r"\boxed{\sqrt{16}}", "4").correct  # the other worker serves meanwhile

    def test_concurrent_callers(self) -> None:
        results: list[MathVerification] = []
        lock = threading.Lock()

        def call(k: int) -> None:
            r = verify_math(rf"\boxed{{\sqrt{{{k * k}}}}}", str(k))
            with lock:
                results.append(r)

        threads = [threading.Thread(target=call, args=(k,)) for k in range(2, 10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(results) == 8 and all(r.correct for r in results)


def test_inline_inside_a_pool_worker() -> None:
    with VerifierPool(num_workers=1, task_timeout_s=30) as pool:
        # generous deadline: this worker is cold (its first simplify pays sympy's set-up)
        ok = pool.submit(
            functools.partial(verify_math, timeout_s=20.0), r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"
        )
        slow = pool.submit(functools.partial(verify_math, timeout_s=1.0), rf"\boxed{{{PATHOLOGICAL[1]}}}", "1")
        ok, slow = ok.result(), slow.result()
    assert (ok.correct, ok.reason, ok.path) == (True, "ok", "inline")
    assert (slow.reason, slow.path) == ("timeout", "inline")
    assert pool.replacements == 0  # the in-worker alarm stopped it; nothing was killed


@pytest.mark.parametrize(
    ("response", "gold", "reason"),
    [
        ("I do not know.", "3", "no_answer"),
        (None, "3", "no_answer"),
        (r"<think>it is \boxed{3}", "3", "no_answer"),
        (r"\boxed{3}", "", "gold_error"),
        (r"\boxed{3}", None, "gold_error"),
    ],
)
def test_failure_reasons(response: object, gold: object, reason: str) -> None:
    result = verify_math(response, gold)  # type: ignore[arg-type]
    assert (result.correct, result.reason) == (False, reason)
    assert reason in REASONS


def test_invalid_timeout() -> None:
    with pytest.raises(ValueError):
        verify_math("1", "1", timeout_s=0)
