"""The actor loss verl_replay installs on every worker (``actor_rollout_wg.set_loss_fn``).

It is verl's own ``ppo_loss``; replay adds to it only what the strategy needs. With
``replay.audit_dir`` set, every micro-batch also records what the update actually trained on for
its replayed rows (group id, tokens, ``old_log_probs``, advantages), so a test can check from
inside the real update that replayed rows carried their stored anchor and advantages.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, Optional

import torch
from verl.workers.utils.losses import ppo_loss

from verl_replay.integrations.verl.rows import REPLAY_GROUP_FIELD, REPLAY_SOURCE_FIELD, SOURCE_FRESH

AUDIT_FIELDS = ("responses", "response_mask", "old_log_probs", "advantages")


class ReplayActorLoss:
    """Picklable loss callable: ``loss(model_output=..., data=..., dp_group=...)``."""

    def __init__(self, actor_config: Any, *, audit_dir: Optional[str] = None) -> None:
        self.actor_config = actor_config
        self.audit_dir = audit_dir
        self._counter = itertools.count()

    def __call__(self, model_output: dict, data: Any, dp_group: Any = None):
        if self.audit_dir is not None:
            self._audit(data)
        return ppo_loss(self.actor_config, model_output, data, dp_group)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_counter")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._counter = itertools.count()

    def _audit(self, data: Any) -> None:
        if REPLAY_SOURCE_FIELD not in data.keys():
            return
        source = torch.as_tensor(data[REPLAY_SOURCE_FIELD]).reshape(-1)
        rows = torch.nonzero(source != SOURCE_FRESH).reshape(-1)
        if rows.numel() == 0:
            return
        padded = data.select(*AUDIT_FIELDS).to_padded_tensor()
        record = {name: padded[name][rows].detach().cpu() for name in AUDIT_FIELDS}
        record[REPLAY_SOURCE_FIELD] = source[rows].cpu()
        record[REPLAY_GROUP_FIELD] = torch.as_tensor(data[REPLAY_GROUP_FIELD]).reshape(-1)[rows].cpu()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        directory = Path(self.audit_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank{rank}-pid{os.getpid()}-{next(self._counter):06d}.pt"
        torch.save(record, path)
