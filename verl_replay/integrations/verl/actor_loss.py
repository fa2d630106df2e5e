"""The actor loss verl_replay installs on every worker (``actor_rollout_wg.set_loss_fn``).

    L = (1 - mu) * L_GRPO + mu * L_replay

``L_GRPO`` is verl's own ``ppo_loss`` over the fresh (and group-replayed) rows: elite rows are
masked out of it, out of its token count (their ``loss_mask`` is 0, and verl counts
``batch_num_tokens`` from ``loss_mask``), out of KL-to-reference and entropy. ``L_replay`` is the
length-normalised NLL of the elite rows, divided by the number of elite rows in the whole
mini-batch across micro-batches and data-parallel ranks (``elite_rows_global``, counted by
``ReplayTrainingWorker.train_batch``). Each micro-batch returns its share scaled like verl's
``token-mean`` aggregation (x dp_size, because FSDP averages gradients over ranks), so the
accumulated gradient of an optimiser step is exactly that of the formula over its mini-batch,
whatever the micro-batch split, dynamic batch sizing or data-parallel split.

With ``replay.audit_dir`` set, every micro-batch also records what the update actually trained on
for every row (fresh and replayed; with ``replay.strategy=none`` too), so tests can check the
real update from the inside.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, Optional

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from verl_replay.elite.losses import per_row_mean_nll
from verl_replay.integrations.verl.rows import REPLAY_GROUP_FIELD, REPLAY_SOURCE_FIELD, SOURCE_ELITE, SOURCE_FRESH

ELITE_ROWS_FIELD = "elite_rows_global"
OPTIMIZER_STEP_FIELD = "replay_optimizer_step"
# The global step and update round of the update (set by the trainer when auditing).
AUDIT_STEP_FIELD = "replay_global_step"
AUDIT_ROUND_FIELD = "replay_round"
AUDIT_FIELDS = ("responses", "response_mask", "old_log_probs", "advantages")
OPTIONAL_AUDIT_FIELDS = ("rollout_log_probs", "rollout_is_weights")


def _row_scaled_mask(mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``mask`` (nested [B, j] or dense [B, T]) with the rows where ``keep`` is False zeroed."""
    if mask.is_nested:
        rows = [row * keep[i].to(row.dtype) for i, row in enumerate(mask.unbind(0))]
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    return mask * keep.to(mask.dtype).unsqueeze(-1)


def _padded_response_mask(data: Any) -> torch.Tensor:
    mask = data["response_mask"]
    if mask.is_nested:
        return mask.to_padded_tensor(0.0)
    return mask


def replay_nll_term(
    log_prob: torch.Tensor, response_mask: torch.Tensor, is_elite: torch.Tensor, elite_rows_global: int, dp_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This micro-batch's share of ``L_replay`` and the per-row NLL of its elite rows.

    ``log_prob``/``response_mask``: ``[B, T]``; ``is_elite``: ``[B]`` bool. The share is
    ``dp_size * sum_{elite rows here} mean_t NLL / elite_rows_global``.
    """
    if not bool(is_elite.any()) or elite_rows_global <= 0:
        return log_prob.sum() * 0.0, log_prob.new_zeros(0)
    nll = per_row_mean_nll(log_prob[is_elite], response_mask[is_elite])  # [E_local]
    return nll.sum() * dp_size / elite_rows_global, nll.detach()


class ReplayActorLoss:
    """Picklable loss callable: ``loss(model_output=..., data=..., dp_group=...)``."""

    def __init__(
        self, actor_config: Any, *, elite: bool = False, mu: float = 0.0, audit_dir: Optional[str] = None
    ) -> None:
        if not 0.0 <= mu <= 1.0:
            raise ValueError(f"replay.elite.mu must be in [0, 1], got {mu}")
        if elite and actor_config.loss_agg_mode != "token-mean":
            raise ValueError(
                "EliteReplay's mixed loss needs actor_rollout_ref.actor.loss_agg_mode=token-mean (the GRPO term is "
                f"normalised by its own token count); got {actor_config.loss_agg_mode!r}"
            )
        self.actor_config = actor_config
        self.elite = elite
        self.mu = float(mu)
        self.audit_dir = audit_dir
        self._counter = itertools.count()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_counter")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._counter = itertools.count()

    def __call__(self, model_output: dict, data: Any, dp_group: Any = None):
        if REPLAY_SOURCE_FIELD not in data.keys():
            # verl's own rows (replay.strategy=none): every row is fresh; audited like the others so
            # a run without replay is the reference a replay run's fresh rows are checked against
            loss, metrics = ppo_loss(self.actor_config, model_output, data, dp_group)
            if self.audit_dir is not None:
                rows = int(data["responses"].shape[0])
                self._audit(data, torch.full((rows,), SOURCE_FRESH, dtype=torch.int64), None, loss, None)
            return loss, metrics
        source = torch.as_tensor(data[REPLAY_SOURCE_FIELD]).reshape(-1)  # [B]
        is_elite = source == SOURCE_ELITE
        if not self.elite:
            loss, metrics = ppo_loss(self.actor_config, model_output, data, dp_group)
            self._audit(data, source, None, loss, None)
            return loss, metrics

        grpo_data = data
        if bool(is_elite.any()):
            grpo_data = data.clone(recurse=False)
            grpo_data["response_mask"] = _row_scaled_mask(data["response_mask"], ~is_elite)
        if int(data["batch_num_tokens"]) == 0:
            # A mini-batch with no GRPO token (only elite and padding rows; the trainer's row order
            # makes this rare) has a GRPO term of exactly 0, not 0/0.
            grpo_data = grpo_data.clone(recurse=False) if grpo_data is data else grpo_data
            tu.assign_non_tensor(grpo_data, batch_num_tokens=1)
        grpo_loss, metrics = ppo_loss(self.actor_config, model_output, grpo_data, dp_group)

        log_prob = no_padding_2_padding(model_output["log_probs"], data)  # [B, T]
        response_mask = _padded_response_mask(data).to(log_prob.device)  # [B, T]
        elite_rows = int(data[ELITE_ROWS_FIELD]) if ELITE_ROWS_FIELD in data.keys() else 0
        replay_term, row_nll = replay_nll_term(
            log_prob, response_mask, is_elite.to(log_prob.device), elite_rows, int(data["dp_size"])
        )
        loss = (1.0 - self.mu) * grpo_loss + self.mu * replay_term
        # Like verl's pg_loss metric: summed over micro-batches and averaged over ranks (each share
        # carries the dp_size factor), the value is the mini-batch's L_replay. Emitted for every
        # micro-batch, elite rows or not, so every rank reports the same number of values.
        metrics["replay/elite/nll"] = Metric(value=replay_term.detach(), aggregation=AggregationType.SUM)
        metrics["replay/elite/loss_share"] = Metric(
            value=self.mu * replay_term.detach(), aggregation=AggregationType.SUM
        )
        self._audit(
            data,
            source,
            row_nll,
            loss,
            {"grpo_loss": grpo_loss, "replay_term": replay_term, "elite_rows_global": elite_rows, "mu": self.mu},
        )
        return loss, metrics

    # ------------------------------------------------------------------ audit

    def _audit(
        self,
        data: Any,
        source: torch.Tensor,
        row_nll: Optional[torch.Tensor],
        loss: torch.Tensor,
        terms: Optional[dict],
    ) -> None:
        """Record every row of this micro-batch as the update saw it (fresh rows too: they are the
        independent record of what a group carried when it was generated)."""
        if self.audit_dir is None:
            return
        names = [name for name in AUDIT_FIELDS + OPTIONAL_AUDIT_FIELDS if name in data.keys()]
        padded = data.select(*names).to_padded_tensor()
        record: dict[str, Any] = {name: padded[name].detach().cpu() for name in names}
        record["prompts"] = [data["prompts"][i].detach().cpu() for i in range(source.numel())]
        record[REPLAY_SOURCE_FIELD] = source.cpu()
        groups = data[REPLAY_GROUP_FIELD] if REPLAY_GROUP_FIELD in data.keys() else torch.full_like(source, -1)
        record[REPLAY_GROUP_FIELD] = torch.as_tensor(groups).reshape(-1).cpu()
        record["loss"] = float(loss.detach())
        for name in (OPTIMIZER_STEP_FIELD, AUDIT_STEP_FIELD, AUDIT_ROUND_FIELD):
            if name in data.keys():
                record[name] = int(data[name])
        record["dp_size"] = int(data["dp_size"]) if "dp_size" in data.keys() else 1
        if row_nll is not None:
            record["elite_row_nll"] = row_nll.cpu()
        if terms is not None:
            record.update({k: (float(v.detach()) if isinstance(v, torch.Tensor) else v) for k, v in terms.items()})
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        directory = Path(self.audit_dir)
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(record, directory / f"rank{rank}-pid{os.getpid()}-{next(self._counter):06d}.pt")
