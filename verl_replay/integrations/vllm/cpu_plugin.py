"""verl-replay's vLLM plugin (entry point ``vllm.general_plugins: verl_replay_cpu``).

vLLM loads it in every engine process. On vLLM's CPU build it makes the engine behave as its GPU
build does where verl depends on it: new KV-cache blocks are zeroed (``cpu_kv_zeroing``) and linear
layers compute from their live weights, so verl's per-step weight push reaches them
(``cpu_reloadable_linear``). On any other platform it does nothing.
"""

from __future__ import annotations

from verl_replay.integrations.vllm import cpu_kv_zeroing, cpu_reloadable_linear

ENTRY_POINT = ("vllm.general_plugins", "verl_replay_cpu")


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    cpu_kv_zeroing.install()
    cpu_reloadable_linear.install()
