"""Replay loss: hand values, masking, gradients, split invariance."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from verl_replay.elite.losses import length_normalized_nll, mixed_loss, per_row_mean_nll, replay_nll_sum


def hand_batch(pad: float):
    # row 0: 3 valid tokens, row 1: 1 valid token, row 2: 2 valid tokens; padding holds `pad`
    lp = torch.tensor(
        [
            [-1.0, -2.0, -3.0, pad],
            [-0.5, pad, pad, pad],
            [pad, -4.0, -2.0, pad],  # left padding too
        ],
        dtype=torch.float64,
    )
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 1, 1, 0]])
    return lp, mask


@pytest.mark.parametrize("pad", [0.0, float("-inf"), float("nan"), 1e30, float("inf")])
def test_hand_values_with_garbage_padding(pad):
    lp, mask = hand_batch(pad)
    # per-row mean NLL: (1+2+3)/3 = 2, 0.5/1 = 0.5, (4+2)/2 = 3 ; mean = 5.5 / 3
    assert_close(per_row_mean_nll(lp, mask), torch.tensor([2.0, 0.5, 3.0], dtype=torch.float64))
    assert_close(length_normalized_nll(lp, mask), torch.tensor(5.5 / 3, dtype=torch.float64))
    assert_close(length_normalized_nll(lp, mask.bool()), torch.tensor(5.5 / 3, dtype=torch.float64))


def test_whole_sequence_averaging_is_different():
    lp, mask = hand_batch(0.0)
    ours = length_normalized_nll(lp, mask).item()
    token_mean = -(lp * mask).sum().item() / mask.sum().item()  # 12.5 / 6
    sequence_sum_mean = -(lp * mask).sum(dim=-1).mean().item()  # (6 + 0.5 + 6) / 3
    assert ours == pytest.approx(5.5 / 3)
    assert token_mean == pytest.approx(12.5 / 6) and sequence_sum_mean == pytest.approx(12.5 / 3)
    assert abs(ours - token_mean) > 0.1 and abs(ours - sequence_sum_mean) > 1.0


def test_gradient_matches_manual_formula_and_padding_gets_none():
    torch.manual_seed(0)
    lengths = [5, 1, 3, 7]
    R, T = len(lengths), 8
    raw = torch.randn(R, T, dtype=torch.float64)
    mask = torch.zeros(R, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    garbage = raw.masked_fill(~mask, float("-inf")).detach().requires_grad_(True)
    loss = length_normalized_nll(garbage, mask)
    loss.backward()

    clean = raw.clone().requires_grad_(True)
    manual = sum(-sum(clean[i, t] for t in range(n)) / n for i, n in enumerate(lengths)) / R
    manual.backward()
    assert_close(loss.detach(), manual.detach())
    assert_close(garbage.grad, clean.grad)  # zero at padding in both
    expected = torch.zeros(R, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        expected[i, :n] = -1.0 / (R * n)
    assert_close(garbage.grad, expected)
    assert torch.isfinite(garbage.grad).all()


def _random_batch(seed: int, R: int = 8, T: int = 12):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(R, T, generator=g, dtype=torch.float32) * 5
    lengths = torch.randint(1, T + 1, (R,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [R, T]
    lp = lp.masked_fill(~mask, float("nan"))
    is_replay = torch.tensor([True, False, True, True, False, True, True, False])
    return lp, mask, is_replay


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_micro_batch_split_invariance(chunks):
    lp, mask, is_replay = _random_batch(1)
    global_replay_rows = int(is_replay.sum())
    reference = length_normalized_nll(lp[is_replay], mask[is_replay])

    lp_ref = lp.clone().requires_grad_(True)
    length_normalized_nll(lp_ref[is_replay], mask[is_replay]).backward()

    leaf = lp.clone().requires_grad_(True)
    total = sum(
        replay_nll_sum(lp_c, m_c, r_c) / global_replay_rows
        for lp_c, m_c, r_c in zip(leaf.chunk(chunks), mask.chunk(chunks), is_replay.chunk(chunks), strict=True)
    )
    assert_close(total, reference)
    total.backward()
    assert_close(leaf.grad, lp_ref.grad)
    assert torch.isfinite(leaf.grad).all()
    assert (leaf.grad[~is_replay] == 0).all()


def test_replay_sum_ignores_non_replay_rows_even_empty_ones():
    lp, mask = hand_batch(float("nan"))
    lp = torch.cat([lp, torch.full((1, 4), float("nan"), dtype=torch.float64)])
    mask = torch.cat([mask, torch.zeros(1, 4, dtype=mask.dtype)])  # a non-replay row with no token
    is_replay = torch.tensor([True, False, True, False])
    assert_close(replay_nll_sum(lp, mask, is_replay), torch.tensor(5.0, dtype=torch.float64))  # 2 + 3
    leaf = lp.clone().requires_grad_(True)
    none = replay_nll_sum(leaf, mask, torch.zeros(4, dtype=torch.bool))
    assert none.item() == 0.0
    none.backward()
    assert (leaf.grad == 0).all()
    with pytest.raises(ValueError, match=r"replay rows \[3\]"):
        replay_nll_sum(lp, mask, torch.tensor([True, False, True, True]))


def test_validation_errors():
    lp, mask = hand_batch(0.0)
    empty_row = mask.clone()
    empty_row[1] = 0
    with pytest.raises(ValueError, match=r"rows \[1\] have no valid token"):
        length_normalized_nll(lp, empty_row)
    with pytest.raises(ValueError, match="shape"):
        length_normalized_nll(lp, mask[:, :3])
    with pytest.raises(ValueError, match="0/1"):
        length_normalized_nll(lp, mask * 0.5)
    with pytest.raises(ValueError, match="R == 0"):
        length_normalized_nll(lp[:0], mask[:0])
    with pytest.raises(ValueError, match=r"\[R, T\]"):
        length_normalized_nll(lp[0], mask[0])
    with pytest.raises(TypeError, match="floating"):
        length_normalized_nll(mask, mask)
    with pytest.raises(ValueError, match="row_is_replay has shape"):
        replay_nll_sum(lp, mask, torch.ones(2, dtype=torch.bool))


def test_half_precision_accumulates_in_float32():
    lp, mask = hand_batch(float("-inf"))
    out = length_normalized_nll(lp.to(torch.bfloat16), mask)
    assert out.dtype == torch.float32
    assert_close(out, torch.tensor(5.5 / 3, dtype=torch.float32))


def test_mixed_loss():
    grpo = torch.tensor(2.0, requires_grad=True)
    replay = torch.tensor(10.0, requires_grad=True)
    out = mixed_loss(grpo, replay, 0.05)
    assert_close(out, torch.tensor(0.95 * 2.0 + 0.05 * 10.0))
    out.backward()
    assert grpo.grad.item() == pytest.approx(0.95) and replay.grad.item() == pytest.approx(0.05)
    assert mixed_loss(grpo, replay, 0).item() == 2.0 and mixed_loss(grpo, replay, 1).item() == 10.0
    for bad in (-0.01, 1.01, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            mixed_loss(grpo, replay, bad)
    with pytest.raises(TypeError):
        mixed_loss(grpo, replay, True)
    with pytest.raises(TypeError):
        mixed_loss(grpo, replay, "0.05")  # type: ignore[arg-type]
