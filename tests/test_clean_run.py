"""The suite's check of a finished run's log (tests/clean_run.py): which lines count as hidden errors."""

from __future__ import annotations

from clean_run import hidden_errors

DONE = "(ReplayTaskRunner pid=1) Training Progress: 100%|##| 4/4 [00:18<00:00,  3.15s/it]"
TEARDOWN = (
    "(vLLMHttpServer pid=7) WARNING 12-07 19:13:22 [core_client.py:702] [shutdown] MPClient: "
    "engine core exited unexpectedly; starting cleanup"
)
DEAD = "(vLLMHttpServer pid=7) ERROR 12-07 19:13:22 [async_llm.py:704] AsyncLLM output_handler failed."


def test_a_vllm_server_torn_down_after_training_is_not_an_error():
    assert hidden_errors("\n".join([DONE, TEARDOWN, DEAD])) == []


def test_errors_before_the_end_or_from_other_processes_still_count():
    other = "(AgentLoopWorkerTQ pid=9) ERROR something failed"
    assert hidden_errors("\n".join([TEARDOWN, DEAD, DONE])) == [DEAD]  # before training finished
    assert hidden_errors("\n".join([DONE, DEAD])) == [DEAD]  # no shutdown line: a real engine death
    assert hidden_errors("\n".join([DONE, TEARDOWN, DEAD, other])) == [other]
    assert hidden_errors("Traceback (most recent call last):") == ["Traceback (most recent call last):"]
