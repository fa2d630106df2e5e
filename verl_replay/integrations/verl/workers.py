"""Actor workers whose training step knows how many elite rows each mini-batch holds.

EliteReplay's NLL term is normalised by the number of elite rows of the whole mini-batch across
data-parallel ranks. Only the worker sees the mini-batch as it is actually split, so
``ReplayTrainingWorker.train_batch`` counts them with one all-reduce per mini-batch (every rank
runs every mini-batch, as for verl's own ``batch_num_tokens``) and attaches the count to the
mini-batch, from where every micro-batch inherits it. The actor/rollout workers below differ from
verl's only in using this training worker for the actor.
"""

from __future__ import annotations

import torch
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from verl_replay.integrations.verl.actor_loss import ELITE_ROWS_FIELD, OPTIMIZER_STEP_FIELD
from verl_replay.integrations.verl.rows import REPLAY_SOURCE_FIELD, SOURCE_ELITE


class ReplayTrainingWorker(TrainingWorker):
    def train_batch(self, data):
        # Which optimiser step of this worker the mini-batch feeds (the actor loss's audit records it).
        self._optimizer_steps = getattr(self, "_optimizer_steps", 0)
        tu.assign_non_tensor(data, **{OPTIMIZER_STEP_FIELD: self._optimizer_steps})
        self._optimizer_steps += 1
        if REPLAY_SOURCE_FIELD in data.keys():
            local = (torch.as_tensor(data[REPLAY_SOURCE_FIELD]) == SOURCE_ELITE).sum().to(get_device_id())
            group = self.engine.get_data_parallel_group()
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.SUM, group=group)
            tu.assign_non_tensor(data, **{ELITE_ROWS_FIELD: int(local.item())})
        return super().train_batch(data)


class ReplayActorRolloutRefWorker(ActorRolloutRefWorker):
    actor_worker_cls = ReplayTrainingWorker


class ReplayDetachActorWorker(DetachActorWorker):
    actor_worker_cls = ReplayTrainingWorker
