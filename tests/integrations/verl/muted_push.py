"""A checkpoint engine for one control test: the CPU weight-sync engine, but a rollout worker drops
every push after the first (receives the bytes, hands the rollout server nothing), so vLLM keeps the
first weights it was given. Imported by verl as ``checkpoint_engine.custom_backend_module=muted_push``
(this folder on PYTHONPATH); registered as ``cpu_gloo_muted``."""

from __future__ import annotations

from typing import AsyncIterator, Optional

import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry

from verl_replay.integrations.verl.cpu_checkpoint_engine import GlooCheckpointEngine

BACKEND_NAME = "cpu_gloo_muted"


@CheckpointEngineRegistry.register(BACKEND_NAME)
class MutedAfterFirstPush(GlooCheckpointEngine):
    _pushes_received = 0

    async def receive_weights(self, global_steps: Optional[int] = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        type(self)._pushes_received += 1
        async for name, tensor in super().receive_weights(global_steps):
            if type(self)._pushes_received == 1:
                yield name, tensor
