"""Headroom / Policy Drift / replay KL against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from verl_replay.headroom_drift.scores import (
    group_scores_flat,
    headroom,
    headroom_flat,
    headroom_segments,
    policy_drift,
    policy_drift_flat,
    policy_drift_segments,
    replay_kl,
    replay_kl_flat,
    replay_kl_segments,
)

LN = math.log


def _hand_group():
    """G=2, n=3, T=2.

    group 0: r0 A=+1 p=(0.5, 0.25) -> h=(0.5, 0.75) mean 0.625
             r1 A=-2 p=(0.8, pad)  -> h=0.8
             r2 A=0  p=(0.1, 0.3)  -> left out
             sign: (0.625 + 0.8) / 2 = 0.7125; advantage: (1*0.625 + 2*0.8) / 3 = 0.741666..
    group 1: all A = 0 -> H = 0
    """
    lp = torch.tensor(
        [
            [[LN(0.5), LN(0.25)], [LN(0.8), 0.0], [LN(0.1), LN(0.3)]],
            [[LN(0.5), LN(0.5)], [LN(0.2), LN(0.9)], [LN(0.7), 0.0]],
        ]
    )
    mask = torch.tensor([[[1, 1], [1, 0], [1, 1]], [[1, 1], [1, 1], [1, 0]]], dtype=torch.bool)
    adv = torch.tensor([[1.0, -2.0, 0.0], [0.0, 0.0, 0.0]])
    return lp, mask, adv


def test_headroom_hand_values_sign_and_advantage():
    lp, mask, adv = _hand_group()
    assert_close(headroom(lp, mask, adv), torch.tensor([0.7125, 0.0]))
    assert_close(headroom(lp, mask, adv, weighting="advantage"), torch.tensor([2.225 / 3, 0.0]))
    assert headroom(lp, mask, adv).dtype == torch.float32


def test_headroom_single_direction_and_excluded_empty_response():
    # A>0 only: h = 1 - p. Response 1 (A<0) has no valid token: left out like A=0.
    lp = torch.tensor([[[LN(0.9), LN(0.6)], [LN(0.3), LN(0.3)]]])
    mask = torch.tensor([[[1, 1], [0, 0]]])
    adv = torch.tensor([[0.5, -1.0]])
    assert_close(headroom(lp, mask, adv), torch.tensor([0.25]))  # mean(0.1, 0.4)
    assert_close(headroom(lp, mask, adv, "advantage"), torch.tensor([0.25]))


def test_headroom_padding_invariance_garbage():
    lp, mask, adv = _hand_group()
    dirty = lp.clone()
    dirty[~mask] = torch.tensor([float("nan"), float("inf"), 1e30])[: int((~mask).sum())]
    for w in ("sign", "advantage"):
        assert_close(headroom(dirty, mask, adv, w), headroom(lp, mask, adv, w))
    # masks given as float 0/1 or int work the same
    assert_close(headroom(dirty, mask.float(), adv), headroom(lp, mask, adv))


def _drift_case():
    """Valid r = (0.1, -0.2, 0.3); the padded position holds garbage in both tensors."""
    gen = torch.tensor([[[-1.0, -2.0], [-0.5, float("nan")]]])
    cur = torch.tensor([[[-0.9, -2.2], [-0.2, float("-inf")]]])
    mask = torch.tensor([[[1, 1], [1, 0]]])
    return cur, gen, mask


def test_policy_drift_hand_values():
    cur, gen, mask = _drift_case()
    assert_close(policy_drift(cur, gen, mask), torch.tensor([math.sqrt(0.14 / 3)]))  # 0.216025
    assert_close(policy_drift(cur, gen, mask, norm="l1"), torch.tensor([0.2]))
    # r = 0.1, -0.2, 0.3 on the valid tokens: mean r^2 = (0.01 + 0.04 + 0.09) / 3 (the paper's units)
    assert_close(policy_drift(cur, gen, mask, norm="mean_sq"), torch.tensor([0.14 / 3]))  # 0.046667
    assert_close(policy_drift(gen.nan_to_num(), gen.nan_to_num(), mask), torch.tensor([0.0]))


def test_replay_kl_hand_values():
    cur, gen, mask = _drift_case()
    # k3(r) = e^r - 1 - r: 0.005170918, 0.018730753, 0.049858808 -> mean 0.024586826
    assert_close(replay_kl(cur, gen, mask), torch.tensor([0.024586826]))
    # near r = 0 (where a "moderate" gate lives) k3 ~ r^2 / 2 must not drown in cancellation
    cur, gen = torch.tensor([[[-1e-4]]]), torch.tensor([[[-2e-4]]])
    r = float(cur) - float(gen)  # exact difference of the float32 inputs
    assert_close(replay_kl(cur, gen, torch.ones(1, 1, 1)), torch.tensor([math.expm1(r) - r]))  # ~5e-9


def test_empty_group_is_zero():
    z = torch.zeros(1, 2, 3)
    m = torch.zeros(1, 2, 3)
    assert_close(headroom(z, m, torch.ones(1, 2)), torch.tensor([0.0]))
    assert_close(policy_drift(z, z, m), torch.tensor([0.0]))
    assert_close(replay_kl(z, z, m), torch.tensor([0.0]))


def _random_padded(seed: int, G: int = 4, n: int = 3, T: int = 6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (G, n), generator=gen)
    in_len = torch.arange(T).expand(G, n, T) < lengths[..., None]
    mask = in_len & (torch.rand(G, n, T, generator=gen) > 0.2)
    lp = -3 * torch.rand(G, n, T, generator=gen)
    cur = lp + 0.3 * torch.randn(G, n, T, generator=gen)
    adv = torch.tensor([-1.0, 0.0, 0.5, 2.0])[torch.randint(0, 4, (G, n), generator=gen)]
    # garbage beyond each response's length and at masked positions
    lp = torch.where(mask, lp, torch.full_like(lp, float("nan")))
    cur = torch.where(mask, cur, torch.full_like(cur, 7.0))
    return lp, cur, mask, adv, lengths


def _to_flat(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[n, T] -> [sum lengths] concatenating the first lengths[i] tokens of each row."""
    return torch.cat([x[i, : int(lengths[i])] for i in range(x.shape[0])])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padded_flat_and_segments_agree(seed):
    lp, cur, mask, adv, lengths = _random_padded(seed)
    G = lp.shape[0]
    flat = [
        (_to_flat(lp[g], lengths[g]), _to_flat(cur[g], lengths[g]), _to_flat(mask[g], lengths[g])) for g in range(G)
    ]
    for w in ("sign", "advantage"):
        ref = headroom(lp, mask, adv, w)
        per = torch.stack([headroom_flat(f[0], f[2], lengths[g], adv[g], w) for g, f in enumerate(flat)])
        seg = headroom_segments(
            torch.cat([f[0] for f in flat]),
            torch.cat([f[2] for f in flat]),
            lengths.reshape(-1),
            adv.reshape(-1),
            torch.full((G,), 3),
            w,
        )
        assert_close(per, ref)
        assert_close(seg, ref)
    counts = torch.tensor([f[0].numel() for f in flat])
    cat = [torch.cat([f[i] for f in flat]) for i in range(3)]
    for norm in ("l2", "l1", "mean_sq"):
        ref = policy_drift(cur, lp, mask, norm)
        assert_close(torch.stack([policy_drift_flat(f[1], f[0], f[2], norm) for f in flat]), ref)
        assert_close(policy_drift_segments(cat[1], cat[0], cat[2], counts, norm), ref)
    ref = replay_kl(cur, lp, mask)
    assert_close(torch.stack([replay_kl_flat(f[1], f[0], f[2]) for f in flat]), ref)
    assert_close(replay_kl_segments(cat[1], cat[0], cat[2], counts), ref)


def test_mean_sq_is_l2_squared_and_gates_alike():
    lp, cur, mask, _, lengths = _random_padded(11, G=6)
    l2, ms = policy_drift(cur, lp, mask, "l2"), policy_drift(cur, lp, mask, "mean_sq")
    assert_close(ms, l2.double().square().float())
    # flat one-group path (the buffer's): mean r^2 by hand
    f_lp, f_cur, f_m = (_to_flat(t[0], lengths[0]) for t in (lp, cur, mask))
    r = (f_cur.double() - f_lp.double())[f_m != 0]
    assert float(policy_drift_flat(f_cur, f_lp, f_m, "mean_sq")) == pytest.approx(float((r * r).mean()), rel=1e-6)
    for tau_rms in (0.05, 0.2, 0.5, 1.0, 2.0):
        assert torch.equal(l2 <= tau_rms, ms <= tau_rms**2)


def test_group_scores_flat_matches_flat_functions_bitwise():
    lp, cur, mask, adv, lengths = _random_padded(5, G=1)
    f_lp, f_cur, f_m = (_to_flat(t[0], lengths[0]) for t in (lp, cur, mask))
    s = group_scores_flat(f_cur, f_lp, f_m, lengths[0], adv[0], "advantage", "l1")
    assert s.headroom == float(headroom_flat(f_cur, f_m, lengths[0], adv[0], "advantage"))
    assert s.drift == float(policy_drift_flat(f_cur, f_lp, f_m, "l1"))
    assert s.replay_kl == float(replay_kl_flat(f_cur, f_lp, f_m))
    assert s.num_valid_tokens == int(f_m.sum())


def test_flat_trailing_padding_kept_or_trimmed_agree():
    # keeping masked trailing tokens inside response_lengths changes nothing
    lp = torch.tensor([LN(0.5), LN(0.2), -9.0, LN(0.4)])
    mask = torch.tensor([True, True, False, True])
    a = headroom_flat(lp, mask, torch.tensor([3, 1]), torch.tensor([1.0, -1.0]))
    keep = [0, 1, 3]
    b = headroom_flat(lp[keep], mask[keep], torch.tensor([2, 1]), torch.tensor([1.0, -1.0]))
    assert_close(a, b)
    assert_close(a, torch.tensor(((0.5 + 0.8) / 2 + 0.4) / 2))


def test_nan_at_valid_position_is_reported():
    with pytest.raises(ValueError, match="NaN"):
        group_scores_flat(
            torch.tensor([float("nan")]),
            torch.tensor([-1.0]),
            torch.tensor([True]),
            torch.tensor([1]),
            torch.tensor([1.0]),
        )


def test_validation_errors_name_the_argument():
    lp, mask, adv = _hand_group()
    with pytest.raises(ValueError, match="weighting"):
        headroom(lp, mask, adv, weighting="abs")
    with pytest.raises(ValueError, match="norm"):
        policy_drift(lp, lp, mask, norm="linf")
    with pytest.raises(ValueError, match="log_probs"):
        headroom(lp[0], mask, adv)
    with pytest.raises(ValueError, match="response_mask"):
        headroom(lp, mask[:, :, :1], adv)
    with pytest.raises(ValueError, match="advantages"):
        headroom(lp, mask, adv[:, :2])
    with pytest.raises(ValueError, match="gen_log_probs"):
        policy_drift(lp, lp[:, :2], mask)
    with pytest.raises(ValueError, match="log_probs"):
        replay_kl(lp.long(), lp, mask)
    with pytest.raises(ValueError, match="response_lengths"):
        headroom_flat(torch.zeros(4), torch.ones(4), torch.tensor([1, 2]), torch.ones(2))
    with pytest.raises(ValueError, match="advantages"):
        headroom_flat(torch.zeros(3), torch.ones(3), torch.tensor([1, 2]), torch.ones(3))
    with pytest.raises(ValueError, match="group_token_counts"):
        policy_drift_segments(torch.zeros(3), torch.zeros(3), torch.ones(3), torch.tensor([1]))
    with pytest.raises(ValueError, match="group_sizes"):
        headroom_segments(torch.zeros(3), torch.ones(3), torch.tensor([1, 2]), torch.ones(2), torch.tensor([3]))


def test_deterministic_repeated_calls():
    lp, cur, mask, adv, _ = _random_padded(9, G=8, n=4, T=32)
    a = headroom(cur, mask, adv)
    b = headroom(cur, mask, adv)
    assert torch.equal(a, b)
    assert torch.equal(policy_drift(cur, lp, mask), policy_drift(cur, lp, mask))
