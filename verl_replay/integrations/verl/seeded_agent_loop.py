"""The seeded single-turn agent loop (:mod:`verl_replay.integrations.verl.seeded_rollout` says why)."""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from verl_replay.integrations.verl.seeded_rollout import request_seed

__all__ = ["SeededSingleTurnAgentLoop"]


class SeededSingleTurnAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn agent loop with a per-request sampling seed (:func:`request_seed`)."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        seed = request_seed(
            int(self.rollout_config.seed), kwargs.get("index"), kwargs.get("session_id"), kwargs.get("raw_prompt")
        )
        return await super().run({**sampling_params, "seed": seed}, **kwargs)
