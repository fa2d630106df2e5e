"""Actor workers whose training step knows how many elite rows each mini-batch holds.

EliteReplay's NLL term is normalised by the number of elite rows of the whole mini-batch across
data-parallel ranks. Only the worker sees the mini-batch as it is actually split, so
``ReplayTrainingWorker.train_batch`` counts them with one all-reduce per mini-batch (every rank
runs every mini-batch, as for verl's own ``batch_num_tokens``) and attaches the count to the
mini-batch, from where every micro-batch inherits it. The actor/rollout workers below differ from
verl's only in using this training worker for the actor.

With ``replay.audit_dir`` set, each optimiser step also records the weights its gradient was taken
at and that gradient as backpropagated (accumulated over the micro-batches, before clipping), so a
test can recompute the gradient of the loss formula on the same rows and weights.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from verl_replay.integrations.verl.actor_loss import (
    AUDIT_ROUND_FIELD,
    AUDIT_STEP_FIELD,
    ELITE_ROWS_FIELD,
    OPTIMIZER_STEP_FIELD,
)
from verl_replay.integrations.verl.rows import REPLAY_SOURCE_FIELD, SOURCE_ELITE, WORKER_CPU_SECONDS


class ReplayTrainingWorker(TrainingWorker):
    def infer_batch(self, data):
        cpu = time.process_time()
        output = super().infer_batch(data)
        if output is not None:
            metrics = dict(tu.get(output, key="metrics", default=None) or {})
            metrics[WORKER_CPU_SECONDS] = time.process_time() - cpu
            tu.assign_non_tensor(output, metrics=metrics)
        return output

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
        audit_dir = getattr(self.loss_fn, "audit_dir", None)
        if audit_dir is None:
            return super().train_batch(data)
        with self._gradient_audit(Path(audit_dir), data):
            return super().train_batch(data)

    @contextlib.contextmanager
    def _gradient_audit(self, directory: Path, data: Any) -> Iterator[None]:
        """Record, when verl's engine steps the optimiser, the full weights and gradients (every rank
        gathers, rank 0 writes) under the mini-batch's optimiser step, global step and round."""
        engine = self.engine
        step = engine.optimizer_step

        def recorded_step():
            weights, grads = {}, {}
            for name, param in engine.module.named_parameters():
                full = param.full_tensor() if hasattr(param, "full_tensor") else param
                weights[name] = full.detach().float().cpu().clone()
                if param.grad is not None:
                    grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
                    grads[name] = grad.detach().float().cpu().clone()
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if rank == 0:
                record = {"weights": weights, "grads": grads}
                for key in (OPTIMIZER_STEP_FIELD, AUDIT_STEP_FIELD, AUDIT_ROUND_FIELD):
                    record[key] = int(tu.get(data, key=key, default=-1))
                directory.mkdir(parents=True, exist_ok=True)
                name = f"pid{os.getpid()}-step{record[OPTIMIZER_STEP_FIELD]:06d}.grad"
                torch.save(record, directory / name)
            return step()

        engine.optimizer_step = recorded_step  # this mini-batch's step only
        try:
            yield
        finally:
            del engine.optimizer_step


class ReplayActorRolloutRefWorker(ActorRolloutRefWorker):
    actor_worker_cls = ReplayTrainingWorker


class ReplayDetachActorWorker(DetachActorWorker):
    actor_worker_cls = ReplayTrainingWorker
