"""Which validation sampling settings have an exact expected accuracy (stdlib only: the start-up
checks read it before anything heavy is imported).

The teacher-forced probability of a response at temperature T is the probability of sampling it
only when sampling draws from the whole softmax at T: no greedy decoding, no nucleus or top-k cut.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

__all__ = ["EXACT_EVAL_MODES", "SAMPLED_VAL_MODES", "sampled_validation_due", "sampling_is_plain"]

# exact_eval: auto (on where it applies), true (refuse to start where it does not), false (off)
EXACT_EVAL_MODES = ("auto", "true", "false")
# sampled_val: every (verl's sampled validation at every validation), ends (only before training
# and at the last step; the exact metric alone in between)
SAMPLED_VAL_MODES = ("every", "ends")


def sampled_validation_due(mode: str, step: int, total_steps: int, exact_metric: bool) -> bool:
    """Whether a validation at global step ``step`` (0: before training) samples. ``ends`` samples
    before training and at the last step only, and only when the exact metric covers the steps
    between; without it every validation samples."""
    if mode == "every" or not exact_metric:
        return True
    return step == 0 or step >= total_steps


def sampling_is_plain(val_kwargs: Mapping[str, Any]) -> Optional[str]:
    """None when validation samples from the softmax at its temperature, else what differs."""
    if not bool(val_kwargs.get("do_sample", True)):
        return "actor_rollout_ref.rollout.val_kwargs.do_sample=false (greedy validation)"
    top_p, top_k = float(val_kwargs.get("top_p", 1.0)), int(val_kwargs.get("top_k", -1))
    if top_p < 1.0:
        return f"actor_rollout_ref.rollout.val_kwargs.top_p={top_p} (nucleus sampling)"
    if top_k > 0:
        return f"actor_rollout_ref.rollout.val_kwargs.top_k={top_k} (top-k sampling)"
    if not float(val_kwargs.get("temperature", 1.0)) > 0:
        return "actor_rollout_ref.rollout.val_kwargs.temperature=0 (greedy validation)"
    return None
