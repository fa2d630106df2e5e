"""The CPU packed attention: each packed sequence against attention computed by hand on it alone,
against transformers' own masked sdpa on the whole pack, unchanged calls for everything that is not
a packed row, and canaries for the transformers names it plugs into."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from transformers.integrations import sdpa_attention
from transformers.masking_utils import find_packed_sequence_indices, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from verl_replay.integrations.verl import cpu_packed_attention as cpa

LENGTHS = (5, 1, 9, 5, 3, 9)  # packed sequence lengths: repeated lengths share a call, one-token sequence


def _positions(lengths) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]  # [1, T]


def _qkv(total: int, heads: int = 4, kv_heads: int = 2, dim: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, total, dim, generator=gen)
    k = torch.randn(1, kv_heads, total, dim, generator=gen)
    v = torch.randn(1, kv_heads, total, dim, generator=gen)
    return q, k, v


class _Attention(torch.nn.Module):
    """What transformers' attention modules expose to the interface (GQA groups, causal)."""

    def __init__(self, groups: int = 2, sliding_window=None):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.sliding_window = sliding_window


def _by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, causal) v for one sequence, [H, L, d], with explicit loops over queries."""
    out = torch.empty_like(q)
    for t in range(q.shape[1]):
        scores = (q[:, t : t + 1] @ k[:, : t + 1].transpose(-1, -2)) * scale  # [H, 1, t+1]
        out[:, t : t + 1] = torch.softmax(scores, dim=-1) @ v[:, : t + 1]
    return out


def test_packed_row_attends_within_each_sequence():
    q, k, v = (t.requires_grad_() for t in _qkv(sum(LENGTHS)))
    scale = 1 / math.sqrt(q.shape[-1])
    out, weights = cpa.packed_sdpa_attention_forward(
        _Attention(), q, k, v, attention_mask=None, scaling=scale, position_ids=_positions(LENGTHS)
    )
    assert weights is None and out.shape == (1, sum(LENGTHS), 4, 8)  # [1, T, H, d]
    k_full, v_full = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    start = 0
    for n in LENGTHS:
        piece = slice(start, start + n)
        expected = _by_hand(q[0, :, piece], k_full[0, :, piece], v_full[0, :, piece], scale)
        torch.testing.assert_close(out[0, piece].transpose(0, 1), expected)
        start += n


def _transformers_masked(q, k, v, lengths, scale):
    """transformers' own sdpa on the whole pack under the mask it builds from the position ids."""
    sequence_ids = find_packed_sequence_indices(_positions(lengths))
    total = sum(lengths)
    mask = sdpa_mask(
        batch_size=1,
        q_length=total,
        kv_length=total,
        mask_function=lambda b, h, qi, ki: (ki <= qi) & (sequence_ids[b, qi] == sequence_ids[b, ki]),
        allow_is_causal_skip=False,
    )  # [1, 1, T, T]
    return sdpa_attention.sdpa_attention_forward(_Attention(), q, k, v, mask, scaling=scale)[0]


def test_equals_transformers_masked_sdpa_with_gradients():
    inputs = [t.requires_grad_() for t in _qkv(sum(LENGTHS), seed=1)]
    scale = 0.3
    ours = cpa.packed_sdpa_attention_forward(
        _Attention(), *inputs, attention_mask=None, scaling=scale, position_ids=_positions(LENGTHS)
    )[0]
    theirs = _transformers_masked(*inputs, LENGTHS, scale)
    torch.testing.assert_close(ours, theirs)
    weights = torch.randn_like(ours)
    grads = torch.autograd.grad((ours * weights).sum(), inputs)
    reference = torch.autograd.grad((theirs * weights).sum(), inputs)
    for mine, expected in zip(grads, reference, strict=True):
        torch.testing.assert_close(mine, expected)


def test_check_catches_attention_across_sequences():
    """Injected bug: plain causal attention over the whole pack (what sdpa without the packed mask
    does). The reference comparison above must fail on it."""
    q, k, v = _qkv(sum(LENGTHS), seed=2)
    leaky = sdpa_attention.sdpa_attention_forward(_Attention(), q, k, v, None, scaling=0.3)[0]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(leaky, _transformers_masked(q, k, v, LENGTHS, 0.3))


@pytest.mark.parametrize(
    "case",
    ["one sequence", "batch of rows", "cached keys", "no positions", "sliding window", "not causal"],
)
def test_everything_else_is_transformers_sdpa_bit_for_bit(case):
    q, k, v = _qkv(12, seed=3)
    module, kwargs, mask = _Attention(), {"position_ids": _positions((5, 7))}, None
    if case == "one sequence":
        kwargs["position_ids"] = _positions((12,))
    elif case == "batch of rows":
        q, k, v = (torch.cat([t, t.flip(2)]) for t in (q, k, v))
        kwargs["position_ids"] = torch.cat([_positions((5, 7))] * 2)
    elif case == "cached keys":
        q = q[:, :, -1:]
        kwargs["position_ids"] = torch.tensor([[6]])
    elif case == "no positions":
        kwargs = {}
    elif case == "sliding window":
        module, mask = _Attention(sliding_window=4), _random_mask(12)
    elif case == "not causal":
        module.is_causal, mask = False, _random_mask(12)
    ours = cpa.packed_sdpa_attention_forward(module, q, k, v, mask, scaling=0.3, **kwargs)[0]
    theirs = sdpa_attention.sdpa_attention_forward(module, q, k, v, mask, scaling=0.3, **kwargs)[0]
    assert torch.equal(ours, theirs)


def _random_mask(total: int) -> torch.Tensor:
    mask = torch.rand(1, 1, total, total, generator=torch.Generator().manual_seed(9)) > 0.5
    mask[..., torch.arange(total), torch.arange(total)] = True  # every query sees itself
    return mask


@pytest.mark.parametrize("module", [_Attention(sliding_window=4), _Attention(groups=2)], ids=["window", "not causal"])
def test_a_packed_row_without_its_mask_is_refused_where_attention_is_not_causal_within_sequences(module):
    module.is_causal = module.sliding_window is not None
    q, k, v = _qkv(12, seed=4)
    with pytest.raises(NotImplementedError, match="packed sequences without a mask"):
        cpa.packed_sdpa_attention_forward(module, q, k, v, None, scaling=0.3, position_ids=_positions((5, 7)))


class _Config:
    _attn_implementation = "sdpa"


def _mask_calls(**changes):
    calls = []

    def create_causal_mask(config, inputs_embeds, attention_mask, past_key_values, position_ids=None, **overlays):
        calls.append(overlays)
        return "built"

    args = {
        "config": _Config(),
        "inputs_embeds": torch.zeros(1, 12, 4),
        "attention_mask": None,
        "past_key_values": None,
        "position_ids": _positions((5, 7)),
    }
    args.update(changes)
    result = cpa.skip_mask_of_packed_rows(create_causal_mask)(**args)
    return result, calls


def test_the_mask_of_a_packed_row_is_not_built():
    assert _mask_calls() == (None, [])


@pytest.mark.parametrize(
    "changes",
    [
        {"inputs_embeds": torch.zeros(2, 12, 4), "position_ids": torch.cat([_positions((5, 7))] * 2)},
        {"attention_mask": torch.ones(1, 12)},
        {"past_key_values": object()},
        {"position_ids": _positions((12,))},
        {"position_ids": None},
        {"or_mask_function": lambda *a: True},
        {"block_sequence_ids": torch.zeros(1, 12)},
    ],
    ids=["two rows", "padding mask", "cache", "one sequence", "no positions", "overlay", "blocks"],
)
def test_every_other_mask_is_built(changes):
    assert _mask_calls(**changes)[0] == "built"
    config = _Config()
    config._attn_implementation = "eager"
    assert _mask_calls(config=config)[0] == "built"


def test_segments_split_where_transformers_splits():
    assert cpa.packed_segments(_positions((3, 1, 2))) == [(0, 3), (3, 4), (4, 6)]
    assert cpa.packed_segments(_positions((6,))) is None


@pytest.mark.parametrize("module_name, attribute", cpa.PRIVATE_API_PATCHES)
def test_transformers_names_exist(module_name, attribute):
    assert hasattr(importlib.import_module(module_name), attribute), (
        f"transformers moved {module_name}.{attribute}; verl_replay's CPU packed attention must be updated"
    )


def test_installed_in_the_sdpa_slot_and_the_qwen3_5_masks():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from verl_replay.integrations.verl import cpu_support

    cpu_support.install_cpu_support()
    assert AttentionInterface()["sdpa"] is cpa.packed_sdpa_attention_forward
    assert modeling_qwen3_5.create_causal_mask._verl_replay_packed
    assert cpa.install_packed_attention() == cpa.install_packed_attention()  # idempotent
    wrapped = modeling_qwen3_5.create_causal_mask
    cpa._installed.clear()
    cpa.install_packed_attention()  # installing again never wraps twice
    assert modeling_qwen3_5.create_causal_mask is wrapped
