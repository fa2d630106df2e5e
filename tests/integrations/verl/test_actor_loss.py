"""The mixed GRPO + replay-NLL actor loss against hand-computed values and verl's own ppo_loss.

Micro-batches are built the way verl's FSDP engine hands them to the loss: nested per-row tensors
plus the mini-batch-level ``batch_num_tokens`` / ``dp_size`` / ``elite_rows_global``. The
gradient of a mini-batch is the sum of its micro-batch losses' gradients (averaged over ranks
under data parallelism, as FSDP does), so invariance is checked on that sum.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPActorConfig
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.losses import ppo_loss

from verl_replay.integrations.verl.actor_loss import ELITE_ROWS_FIELD, ReplayActorLoss, replay_nll_term
from verl_replay.integrations.verl.rows import REPLAY_SOURCE_FIELD, SOURCE_ELITE, SOURCE_FRESH, SOURCE_GROUP_REPLAY


def actor_config(**overrides) -> FSDPActorConfig:
    return FSDPActorConfig(
        strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1, **overrides
    )


def nested(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


class MiniBatch:
    """Rows of one mini-batch; per-token policy log-probs are ``logsigmoid(theta)`` slices."""

    def __init__(self, seed: int, num_rows: int = 12, elite_every: int = 3):
        generator = torch.Generator().manual_seed(seed)
        self.rows = []
        offset = 0
        for i in range(num_rows):
            prompt_len = int(torch.randint(2, 6, (1,), generator=generator))
            response_len = int(torch.randint(1, 7, (1,), generator=generator))
            source = (
                SOURCE_ELITE
                if i % elite_every == elite_every - 1
                else (SOURCE_GROUP_REPLAY if i % 5 == 0 else SOURCE_FRESH)
            )
            self.rows.append(
                {
                    "prompt_len": prompt_len,
                    "response_len": response_len,
                    "source": source,
                    "advantage": 0.0 if source == SOURCE_ELITE else float(torch.randn(1, generator=generator)),
                    "old": -torch.rand(response_len, generator=generator) * 3,
                    "offset": offset,
                }
            )
            offset += response_len
        self.theta0 = torch.randn(offset, generator=generator)

    def data(self, indices: list[int], *, dp_size: int = 1, batch_num_tokens: int, elite_rows: int) -> TensorDict:
        rows = [self.rows[i] for i in indices]
        fields = {
            "prompts": nested([torch.arange(r["prompt_len"]) for r in rows]),
            "responses": nested([torch.arange(r["response_len"]) + 7 for r in rows]),
            "input_ids": nested([torch.arange(r["prompt_len"] + r["response_len"]) for r in rows]),
            "response_mask": nested([torch.ones(r["response_len"]) for r in rows]),
            "loss_mask": nested([torch.ones(r["response_len"]) * (r["source"] != SOURCE_ELITE) for r in rows]),
            "old_log_probs": nested([r["old"] for r in rows]),
            "advantages": nested([torch.full((r["response_len"],), r["advantage"]) for r in rows]),
            REPLAY_SOURCE_FIELD: torch.tensor([r["source"] for r in rows]),
            "row_id": torch.tensor(indices),
        }
        td = TensorDict(fields, batch_size=len(rows))
        tu.assign_non_tensor(
            td,
            dp_size=dp_size,
            batch_num_tokens=batch_num_tokens,
            global_batch_size=None,
            **{ELITE_ROWS_FIELD: elite_rows},
        )
        return td

    def model_output(self, theta: torch.Tensor, row_ids: list[int]) -> dict:
        """Per-row full-sequence values; response token t sits at position prompt_len - 1 + t."""
        log_probs = torch.nn.functional.logsigmoid(theta)
        values = []
        for i in row_ids:
            r = self.rows[i]
            response = log_probs[r["offset"] : r["offset"] + r["response_len"]]
            values.append(torch.cat([torch.zeros(r["prompt_len"] - 1), response, torch.zeros(1)]))
        return {"log_probs": nested(values)}

    def grpo_tokens(self, indices: list[int]) -> int:
        return sum(self.rows[i]["response_len"] for i in indices if self.rows[i]["source"] != SOURCE_ELITE)

    def elite_rows(self, indices: list[int]) -> int:
        return sum(self.rows[i]["source"] == SOURCE_ELITE for i in indices)


def gradient(batch: MiniBatch, loss_fn, micro_batches: list[list[int]], *, dp_size: int = 1, all_rows=None):
    """d(sum of micro-batch losses)/d theta, with the mini-batch's global constants."""
    all_rows = all_rows if all_rows is not None else [i for mb in micro_batches for i in mb]
    theta = batch.theta0.clone().requires_grad_(True)
    total = 0.0
    for indices in micro_batches:
        data = batch.data(
            indices,
            dp_size=dp_size,
            batch_num_tokens=batch.grpo_tokens(all_rows),
            elite_rows=batch.elite_rows(all_rows),
        )
        loss, _ = loss_fn(model_output=batch.model_output(theta, indices), data=data)
        total = total + loss
    total.backward()
    return theta.grad.clone(), float(total)


def test_hand_computed_mixed_loss():
    """Two GRPO rows (A=1 over 2 tokens, A=-0.5 over 3 tokens) at ratio 1, one elite row whose
    token log-probs are -1, -2, -3 (NLL 2): (1-mu) * (-1*2 + 0.5*3)/5 + mu * 2."""
    mu = 0.05
    batch = MiniBatch(seed=0, num_rows=3, elite_every=100)
    batch.rows = [
        {"prompt_len": 2, "response_len": 2, "source": SOURCE_FRESH, "advantage": 1.0, "offset": 0},
        {"prompt_len": 3, "response_len": 3, "source": SOURCE_FRESH, "advantage": -0.5, "offset": 2},
        {"prompt_len": 2, "response_len": 3, "source": SOURCE_ELITE, "advantage": 0.0, "offset": 5},
    ]
    target = torch.tensor([-0.3, -0.7, -0.2, -0.4, -1.1, -1.0, -2.0, -3.0])
    theta = torch.log(torch.expm1(-target).reciprocal())  # logsigmoid(theta) == target
    for row in batch.rows:
        row["old"] = target[row["offset"] : row["offset"] + row["response_len"]].clone()
    batch.theta0 = theta
    loss_fn = ReplayActorLoss(actor_config(), elite=True, mu=mu)
    data = batch.data([0, 1, 2], batch_num_tokens=5, elite_rows=1)
    loss, metrics = loss_fn(model_output=batch.model_output(theta, [0, 1, 2]), data=data)
    expected = (1 - mu) * ((-1.0 * 2 + 0.5 * 3) / 5) + mu * 2.0
    torch.testing.assert_close(loss, torch.tensor(expected))
    assert math.isclose(metrics["replay/elite/nll"].aggregate(), 2.0, rel_tol=1e-6)


def test_replay_nll_term_normalises_by_global_rows():
    log_prob = torch.tensor([[-1.0, -3.0, 0.0], [-2.0, 0.0, 0.0], [-5.0, -5.0, -5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    elite = torch.tensor([True, True, False])
    term, rows = replay_nll_term(log_prob, mask, elite, elite_rows_global=4, dp_size=2)
    torch.testing.assert_close(rows, torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(term, torch.tensor(2 * (2.0 + 2.0) / 4))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradient_invariant_to_micro_batch_split(seed):
    batch = MiniBatch(seed=seed)
    loss_fn = ReplayActorLoss(actor_config(), elite=True, mu=0.05)
    rows = list(range(len(batch.rows)))
    reference, _ = gradient(batch, loss_fn, [rows])
    for parts in (2, 4):
        size = len(rows) // parts
        split = [rows[i * size : (i + 1) * size] for i in range(parts)]
        torch.testing.assert_close(gradient(batch, loss_fn, split)[0], reference)
    # an uneven split in another order
    torch.testing.assert_close(gradient(batch, loss_fn, [rows[7:], rows[:3], rows[3:7]])[0], reference)


def test_gradient_invariant_to_dynamic_batch_sizing():
    """verl's own micro-batching, fixed-size vs token-budget (dynamic) rearrangement."""
    batch = MiniBatch(seed=5)
    loss_fn = ReplayActorLoss(actor_config(), elite=True, mu=0.05)
    rows = list(range(len(batch.rows)))
    reference, _ = gradient(batch, loss_fn, [rows])
    full = batch.data(rows, batch_num_tokens=batch.grpo_tokens(rows), elite_rows=batch.elite_rows(rows))
    for dynamic in (False, True):
        data = full.clone()
        tu.assign_non_tensor(data, use_dynamic_bsz=dynamic, micro_batch_size_per_gpu=3, max_token_len_per_gpu=14)
        micro_batches, _ = prepare_micro_batches(data=data, dp_group=None, same_micro_num_in_dp=False)
        split = [mb["row_id"].tolist() for mb in micro_batches]
        assert sorted(i for mb in split for i in mb) == rows and len(split) > 1
        torch.testing.assert_close(gradient(batch, loss_fn, split, all_rows=rows)[0], reference)


def test_gradient_invariant_to_data_parallel_split():
    """Two ranks each backpropagate their micro-batches with dp_size=2; FSDP averages the grads."""
    batch = MiniBatch(seed=7)
    loss_fn = ReplayActorLoss(actor_config(), elite=True, mu=0.05)
    rows = list(range(len(batch.rows)))
    reference, _ = gradient(batch, loss_fn, [rows])
    rank0, rank1 = rows[::2], rows[1::2]
    grad0, _ = gradient(batch, loss_fn, [rank0[:3], rank0[3:]], dp_size=2, all_rows=rows)
    grad1, _ = gradient(batch, loss_fn, [rank1[:2], rank1[2:]], dp_size=2, all_rows=rows)
    torch.testing.assert_close((grad0 + grad1) / 2, reference)


def test_mu_zero_reproduces_verl_ppo_gradient_exactly():
    batch = MiniBatch(seed=3)
    non_elite = [i for i, r in enumerate(batch.rows) if r["source"] != SOURCE_ELITE]
    config = actor_config()
    verl_loss = lambda model_output, data, dp_group=None: ppo_loss(config, model_output, data, dp_group)  # noqa: E731
    ours = ReplayActorLoss(actor_config(), elite=True, mu=0.0)
    # no elite row in the batch: identical to verl's loss
    expected, _ = gradient(batch, verl_loss, [non_elite[:4], non_elite[4:]])
    got, _ = gradient(batch, ours, [non_elite[:4], non_elite[4:]])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # elite rows present but mu=0: the GRPO gradient is verl's over the non-elite rows
    rows = list(range(len(batch.rows)))
    got, _ = gradient(batch, ours, [rows[:6], rows[6:]])
    torch.testing.assert_close(got, expected)


def test_elite_rows_take_no_part_in_grpo_term():
    """Changing an elite row's advantage or old log-probs changes nothing; its NLL does."""
    batch = MiniBatch(seed=11)
    loss_fn = ReplayActorLoss(actor_config(), elite=True, mu=0.05)
    rows = list(range(len(batch.rows)))
    reference, _ = gradient(batch, loss_fn, [rows])
    for row in batch.rows:
        if row["source"] == SOURCE_ELITE:
            row["advantage"] = 5.0
            row["old"] = row["old"] - 1.0
    torch.testing.assert_close(gradient(batch, loss_fn, [rows])[0], reference)


def test_mini_batch_without_grpo_tokens_gives_the_replay_term_alone():
    batch = MiniBatch(seed=2)
    elite = [i for i, r in enumerate(batch.rows) if r["source"] == SOURCE_ELITE]
    loss_fn = ReplayActorLoss(actor_config(), elite=True, mu=0.05)
    theta = batch.theta0.clone()
    data = batch.data(elite, batch_num_tokens=0, elite_rows=len(elite))
    loss, _ = loss_fn(model_output=batch.model_output(theta, elite), data=data)
    assert torch.isfinite(loss)
    log_probs = torch.nn.functional.logsigmoid(theta)
    nll = [
        -log_probs[batch.rows[i]["offset"] : batch.rows[i]["offset"] + batch.rows[i]["response_len"]].mean()
        for i in elite
    ]
    torch.testing.assert_close(loss, 0.05 * torch.stack(nll).mean())


def test_non_token_mean_aggregation_is_refused():
    with pytest.raises(ValueError, match="loss_agg_mode=token-mean"):
        ReplayActorLoss(actor_config(loss_agg_mode="seq-mean-token-mean"), elite=True, mu=0.05)
