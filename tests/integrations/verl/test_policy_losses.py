"""Replay composes with every policy loss it allows: replayed rows train against their stored anchor.

Each loss runs the way the real update runs it: ``ReplayActorLoss`` -> verl's ``ppo_loss`` -> the
loss verl registered under ``policy_loss.loss_mode``, on a micro-batch of fresh and replayed rows
laid out as verl's engine hands it over (nested per-row tensors, the mini-batch token count). A
replayed row's ``old_log_probs`` are the anchor group replay stored when the group was generated,
which differs from the current log-probs by up to ~0.3 nats per token.

Under ``token-mean`` over N tokens the gradient of the loss at a token is ``-A * w / N``, where
``w`` is the weight that loss gives the token. ``w`` is written out below, per loss, from the
current log-probs and the anchor alone (independently of verl's code): a loss that read anything
but the anchor (the current log-probs, a recomputed old log-prob) would give another gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPActorConfig
from verl.workers.config.actor import PolicyLossConfig

from verl_replay.integrations.verl.actor_loss import ELITE_ROWS_FIELD, ReplayActorLoss
from verl_replay.integrations.verl.guards import (
    MICRO_BATCH_WIDE_POLICY_LOSSES,
    ROW_COUNTING_POLICY_LOSSES,
    ROW_LOCAL_POLICY_LOSSES,
    ReplayIncompatibleSetting,
    check_replay_compatible,
)
from verl_replay.integrations.verl.rows import REPLAY_SOURCE_FIELD, SOURCE_ELITE, SOURCE_FRESH, SOURCE_GROUP_REPLAY

CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # asymmetric, so a loss that mixed the two bounds up would show
TRUNCATION = 20.0  # dppo's truncated IS ratio bound (verl's default clip_ratio_c for dppo)
DRO_BETA = 0.1  # dro has no default
# current - anchor of the replayed rows' tokens, in nats (cycled over the rows)
REPLAY_OFFSETS = torch.tensor([0.35, -0.3, 0.1, -0.05, 0.2, -0.25, 0.02], dtype=torch.float64)

# Rows of one micro-batch: (source, advantage, prompt length, response length); the replayed
# rows' anchors sit below and above the current log-probs, some beyond the clip range.
ROWS = (
    (SOURCE_FRESH, 1.0, 3, 4),
    (SOURCE_FRESH, -0.5, 2, 3),
    (SOURCE_GROUP_REPLAY, 0.75, 4, 5),
    (SOURCE_GROUP_REPLAY, -1.25, 2, 2),
    (SOURCE_GROUP_REPLAY, 0.5, 3, 3),
    (SOURCE_GROUP_REPLAY, 0.5, 2, 2),  # confident tokens (below): p moved 0.43 and 0.0 since generation
)
CONFIDENT_CURRENT = torch.tensor([-0.05, -0.02], dtype=torch.float64)
CONFIDENT_ANCHOR = torch.tensor([-0.7, -0.02], dtype=torch.float64)


def _actor_config(loss_mode: str) -> FSDPActorConfig:
    return FSDPActorConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=1,
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
        loss_agg_mode="token-mean",
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=DRO_BETA),
    )


def _nested(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


class Batch:
    """One micro-batch: per-row current log-probs (leaf tensors), anchors and advantages, float64."""

    def __init__(self, rows=ROWS, seed: int = 0, elite_rows: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.rows = list(rows) + [(SOURCE_ELITE, 0.0, 2, 3)] * elite_rows
        self.current = []  # [T_i] per row, the policy's log-probs now
        self.anchor = []  # [T_i] per row, what the update must use as the old log-probs
        for source, _, _, length in self.rows:
            current = -0.2 - torch.rand(length, generator=generator, dtype=torch.float64) * 1.5
            if source == SOURCE_GROUP_REPLAY:
                # generated some steps ago: the anchor is off by up to 0.35 nats either way, past
                # the clip range (ratios 0.70-1.42 against the bounds 0.8 and 1.28) on some tokens
                offsets = REPLAY_OFFSETS.roll(len(self.current)).repeat(length // len(REPLAY_OFFSETS) + 1)
                anchor = current - offsets[:length]
            else:
                anchor = current + (torch.rand(length, generator=generator, dtype=torch.float64) - 0.5) * 0.02
            if len(self.current) == len(ROWS) - 1:
                current, anchor = CONFIDENT_CURRENT.clone(), CONFIDENT_ANCHOR.clone()
            self.current.append(current.requires_grad_(True))
            self.anchor.append(anchor)

    @property
    def grpo_tokens(self) -> int:
        return sum(length for source, _, _, length in self.rows if source != SOURCE_ELITE)

    def data(self, anchors: list[torch.Tensor] | None = None) -> TensorDict:
        anchors = self.anchor if anchors is None else anchors
        fields = {
            "prompts": _nested([torch.arange(p) for _, _, p, _ in self.rows]),
            "responses": _nested([torch.arange(t) + 7 for _, _, _, t in self.rows]),
            "input_ids": _nested([torch.arange(p + t) for _, _, p, t in self.rows]),
            "response_mask": _nested([torch.ones(t, dtype=torch.float64) for *_, t in self.rows]),
            "loss_mask": _nested([torch.ones(t, dtype=torch.float64) * (s != SOURCE_ELITE) for s, *_, t in self.rows]),
            "old_log_probs": _nested([a.detach() for a in anchors]),
            "advantages": _nested([torch.full((t,), a, dtype=torch.float64) for _, a, _, t in self.rows]),
            REPLAY_SOURCE_FIELD: torch.tensor([s for s, *_ in self.rows]),
        }
        td = TensorDict(fields, batch_size=len(self.rows))
        elite = sum(s == SOURCE_ELITE for s, *_ in self.rows)
        tu.assign_non_tensor(
            td, dp_size=1, batch_num_tokens=self.grpo_tokens, global_batch_size=None, **{ELITE_ROWS_FIELD: elite}
        )
        return td

    def model_output(self) -> dict:
        """Full-sequence per-row values; response token t sits at position prompt_len - 1 + t."""
        values = [
            torch.cat([torch.zeros(p - 1, dtype=torch.float64), current, torch.zeros(1, dtype=torch.float64)])
            for (_, _, p, _), current in zip(self.rows, self.current, strict=True)
        ]
        return {"log_probs": _nested(values)}

    def gradients(self, loss_fn, anchors=None) -> tuple[float, list[torch.Tensor]]:
        for current in self.current:
            current.grad = None
        loss, _ = loss_fn(model_output=self.model_output(), data=self.data(anchors))
        loss.backward()
        return loss.item(), [current.grad.clone() for current in self.current]


def _clip(ratio: torch.Tensor) -> torch.Tensor:
    return ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)


def _weight_vanilla(current, anchor, advantage):
    """PPO clip: the ratio's gradient flows where the unclipped term is the larger loss."""
    ratio = torch.exp(current - anchor)
    unclipped = -advantage * ratio >= -advantage * _clip(ratio)
    return ratio * unclipped


def _weight_gspo(current, anchor, advantage):
    """The row's length-normalised sequence ratio on every token, clipped as a whole."""
    seq_ratio = torch.exp((current - anchor).mean()).expand_as(current)
    unclipped = -advantage * seq_ratio >= -advantage * _clip(seq_ratio)
    return seq_ratio * unclipped


def _weight_cispo(current, anchor, advantage):
    """A detached clipped IS weight times log p: clipped tokens keep the bound's gradient."""
    return _clip(torch.exp(current - anchor))


def _weight_dppo_tv(current, anchor, advantage):
    """Truncated IS weight, tokens masked where p moved more than the bound from the anchor's p."""
    moved = torch.exp(current) - torch.exp(anchor)
    valid = moved <= CLIP_HIGH if advantage > 0 else moved >= -CLIP_LOW
    return torch.exp(current - anchor).clamp(max=TRUNCATION) * valid


def _weight_gpg(current, anchor, advantage):
    """-A log p: the anchor is not read (nor is any other old log-prob)."""
    return torch.ones_like(current)


HAND_WEIGHTS = {
    "vanilla": _weight_vanilla,
    "gspo": _weight_gspo,
    "cispo": _weight_cispo,
    "dppo_tv": _weight_dppo_tv,
    "gpg": _weight_gpg,
}


def test_every_loss_is_classified():
    """A loss verl registers that we never read must not slip through the guards unclassified."""
    classified = set(ROW_LOCAL_POLICY_LOSSES) | set(MICRO_BATCH_WIDE_POLICY_LOSSES)
    assert set(POLICY_LOSS_REGISTRY) == classified


@pytest.mark.parametrize("loss_mode", sorted(HAND_WEIGHTS))
def test_replayed_rows_train_against_their_anchor(loss_mode):
    batch = Batch()
    loss, grads = batch.gradients(ReplayActorLoss(_actor_config(loss_mode)))
    assert math.isfinite(loss)
    weight = HAND_WEIGHTS[loss_mode]
    clipped_somewhere = False
    for (source, advantage, *_), current, anchor, grad in zip(
        batch.rows, batch.current, batch.anchor, grads, strict=True
    ):
        w = weight(current.detach(), anchor, advantage)
        torch.testing.assert_close(grad, -advantage * w / batch.grpo_tokens, msg=f"{loss_mode} {source}")
        if source == SOURCE_GROUP_REPLAY:
            clipped_somewhere |= bool((w != torch.exp(current.detach() - anchor)).any())
    # the anchors reach past the clip range, so the check sees each loss's clipping rule at work
    assert clipped_somewhere or loss_mode == "gpg"


@pytest.mark.parametrize("loss_mode", sorted(HAND_WEIGHTS))
def test_a_recomputed_old_log_prob_would_be_caught(loss_mode):
    """The control: handing the loss the current log-probs instead of the anchor (what verl's own
    old-log-prob pass computes) changes the replayed rows' gradient for every loss that reads one."""
    batch = Batch()
    loss_fn = ReplayActorLoss(_actor_config(loss_mode))
    _, with_anchor = batch.gradients(loss_fn)
    _, recomputed = batch.gradients(loss_fn, anchors=[c.detach() for c in batch.current])
    replayed = [i for i, (source, *_) in enumerate(batch.rows) if source == SOURCE_GROUP_REPLAY]
    differs = any(not torch.allclose(with_anchor[i], recomputed[i]) for i in replayed)
    assert differs == (loss_mode != "gpg")


@pytest.mark.parametrize("loss_mode", sorted(ROW_LOCAL_POLICY_LOSSES))
@pytest.mark.parametrize("elite", [False, True], ids=["group_replay", "elite"])
def test_every_allowed_loss_updates_with_replayed_rows(loss_mode, elite):
    """Each allowed loss runs on fresh + replayed (+ elite) rows, its gradient finite and reaching the
    replayed rows (a row may be clipped whole, as gspo clips the confident one); with elite rows,
    the GRPO part of the loss ignores them (their gradient is the NLL term's alone) and fresh rows
    keep the gradient they get without any elite row."""
    if elite and loss_mode in ROW_COUNTING_POLICY_LOSSES:
        pytest.skip(f"{loss_mode} with EliteReplay is refused (tested below)")
    config = _actor_config(loss_mode)
    mu = 0.05
    batch = Batch(elite_rows=2 if elite else 0)
    loss, grads = batch.gradients(ReplayActorLoss(config, elite=elite, mu=mu))
    assert math.isfinite(loss)
    assert all(torch.isfinite(grad).all() for grad in grads)
    replayed = [grad for (source, *_), grad in zip(batch.rows, grads, strict=True) if source == SOURCE_GROUP_REPLAY]
    assert sum(grad.abs().sum() for grad in replayed) > 0, (loss_mode, "no gradient reaches the replayed rows")
    if elite:
        without = Batch()
        _, grads_without = without.gradients(ReplayActorLoss(config))
        for i, (source, *_rest, length) in enumerate(batch.rows):
            if source == SOURCE_ELITE:
                # d/dlogp of mu * mean_rows(mean_t(-logp)): -mu / (elite rows * row length)
                torch.testing.assert_close(grads[i], torch.full((length,), -mu / (2 * length), dtype=torch.float64))
            else:
                torch.testing.assert_close(grads[i], (1 - mu) * grads_without[i])


def _config(strategy: str, loss_mode: str):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "algorithm": {"adv_estimator": "grpo"},
            "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": loss_mode}, "loss_agg_mode": "token-mean"}},
        }
    )


@pytest.mark.parametrize("loss_mode", sorted(MICRO_BATCH_WIDE_POLICY_LOSSES))
def test_a_micro_batch_wide_loss_is_refused_naming_the_key(loss_mode):
    with pytest.raises(ReplayIncompatibleSetting) as error:
        check_replay_compatible(_config("headroom_drift", loss_mode), "headroom_drift")
    message = str(error.value)
    assert f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}" in message
    assert "gspo" in message and "cispo" in message  # the allowed ones are listed
    check_replay_compatible(_config("none", loss_mode), "none")  # without replay, anything goes


@pytest.mark.parametrize("loss_mode", sorted(ROW_COUNTING_POLICY_LOSSES))
def test_a_row_counting_loss_is_refused_with_elite_replay(loss_mode):
    check_replay_compatible(_config("headroom_drift", loss_mode), "headroom_drift")
    with pytest.raises(ReplayIncompatibleSetting, match=f"loss_mode={loss_mode}"):
        check_replay_compatible(_config("elite", loss_mode), "elite")
