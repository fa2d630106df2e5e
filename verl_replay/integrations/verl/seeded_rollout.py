"""Common random numbers for paired runs: every vLLM request sampled from its own seed.

Two arms of a comparison that share a seed see the same prompts in the same order; what pairing
by seed cannot remove is the sampler: vLLM draws each request's random numbers from one engine
stream, so the same prompt under the same weights gets other responses in another run, and the
runs drift apart from their first step on. The agent loop registered here as
``seeded_single_turn_agent`` (verl's single-turn loop otherwise) gives each request a seed of its
own, a hash of the run's ``actor_rollout_ref.rollout.seed``, the dataset row (``index``), the
response's place in its group (``session_id``) and the prompt's text, so a request draws the
same random numbers in every run of a seed whatever arrives beside it. Under the same weights the
responses are then the same; under nearly the same weights nearly the same, and the paired
difference keeps what the arms changed (the tiny comparisons ask for it with
``actor_rollout_ref.rollout.agent.default_agent_loop=seeded_single_turn_agent``).

A prompt met again (a second epoch) draws the same numbers again, under the weights of then; the
comparisons train within one epoch. verl's own ``rollout.full_determinism`` gives every request
the one seed of the replica, so the ``n`` responses of a group would be the same response.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["AGENT_LOOP_MODULE", "SEEDED_AGENT_LOOP", "register_seeded_agent_loop", "request_seed"]

SEEDED_AGENT_LOOP = "seeded_single_turn_agent"
AGENT_LOOP_MODULE = "verl.experimental.agent_loop.agent_loop"  # verl's registry lives here
# the class (verl_replay.integrations.verl.seeded_agent_loop) imports verl's agent loop; this module
# does not, so the plugin registers it in every process without importing the agent loop early
_TARGET = "verl_replay.integrations.verl.seeded_agent_loop.SeededSingleTurnAgentLoop"


def request_seed(base_seed: int, index: Any, session_id: Any, raw_prompt: Any) -> int:
    """A 63-bit seed that depends only on the run's seed and what is asked: the dataset row, the
    response's place in its group and the prompt (not on arrival order, batching or the arm)."""
    prompt = json.dumps(raw_prompt, sort_keys=True, default=str)
    digest = hashlib.sha256(f"{int(base_seed)}|{index}|{session_id}|{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def register_seeded_agent_loop(agent_loop_module: Any) -> None:
    """Add the seeded loop to verl's agent loop registry (``agent_loop_module``: verl's
    ``verl.experimental.agent_loop.agent_loop``), by name, as verl's ``register`` does; hydra
    imports the class where verl instantiates it, in the agent loop worker."""
    agent_loop_module._agent_loop_registry.setdefault(SEEDED_AGENT_LOOP, {"_target_": _TARGET})
