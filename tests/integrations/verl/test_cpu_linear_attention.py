"""The CPU Gated DeltaNet kernels: each packed sequence against an independent computation of it
alone, the unpacked call against transformers' own torch fallback bit for bit, and canaries for
the transformers / verl names they plug into."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from verl_replay.integrations.verl import cpu_linear_attention as cla

SEGMENTS = (5, 1, 9, 3)  # packed sequence lengths, a one-token sequence among them


def _conv_by_hand(x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> torch.Tensor:
    """out[c, t] = sum_k w[c, k] * x[c, t - (K-1) + k], zero before the sequence: loops, no conv1d."""
    channels, length = x.shape
    width = weight.shape[1]
    out = torch.zeros_like(x)
    for c in range(channels):
        for t in range(length):
            out[c, t] = sum(weight[c, k] * x[c, t - (width - 1) + k] for k in range(width) if t - (width - 1) + k >= 0)
    return F.silu(out) if activation else out


@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_restarts_at_every_sequence(activation):
    torch.manual_seed(0)
    channels, width = 6, 4
    x = torch.randn(1, channels, sum(SEGMENTS))  # [1, C, T]
    weight = torch.randn(channels, width)
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(SEGMENTS)])[None]  # [1, T]
    out = cla.packed_causal_conv1d(x=x, weight=weight, seq_idx=seq_idx, activation=activation)
    start = 0
    for n in SEGMENTS:
        expected = _conv_by_hand(x[0, :, start : start + n], weight, activation)
        torch.testing.assert_close(out[0, :, start : start + n], expected)
        start += n


def test_conv_of_two_rows_equals_each_sequence_convolved_alone_with_gradients():
    """Both rows of a [2, C, T] batch, each with its own packing, against F.conv1d of every sequence
    by itself (the layer's fallback on that sequence), values and gradients into x and the weight."""
    gen = torch.Generator().manual_seed(3)
    channels, width, lengths = 5, 4, ((2, 7, 1, 6), (16,))
    x = torch.randn(2, channels, 16, generator=gen, requires_grad=True)
    weight = torch.randn(channels, width, generator=gen, requires_grad=True)
    seq_idx = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])
    out = cla.packed_causal_conv1d(x=x, weight=weight, seq_idx=seq_idx, activation="silu")
    expected = []
    for row, row_lengths in enumerate(lengths):
        starts = torch.tensor([0, *row_lengths]).cumsum(0).tolist()
        expected.append(
            torch.cat(
                [
                    F.silu(F.conv1d(x[row : row + 1, :, a:b], weight[:, None], padding=width - 1, groups=channels))[
                        ..., : b - a
                    ]
                    for a, b in zip(starts[:-1], starts[1:], strict=True)
                ],
                dim=-1,
            )
        )
    expected = torch.cat(expected)
    torch.testing.assert_close(out, expected)
    weights = torch.randn(out.shape, generator=gen)
    mine = torch.autograd.grad((out * weights).sum(), (x, weight))
    theirs = torch.autograd.grad((expected * weights).sum(), (x, weight))
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b)


def test_conv_without_seq_idx_is_the_layers_own_fallback_bit_for_bit():
    torch.manual_seed(1)
    conv = torch.nn.Conv1d(8, 8, kernel_size=4, groups=8, padding=3, bias=False)
    x = torch.randn(3, 8, 11)
    fallback = F.silu(conv(x)[:, :, :11])  # Qwen3_5GatedDeltaNet.forward without causal_conv1d
    ours = cla.packed_causal_conv1d(x=x, weight=conv.weight.squeeze(1), bias=conv.bias, activation="silu")
    assert torch.equal(ours, fallback)


def _qkv(total: int, heads: int = 2, dk: int = 8, dv: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, total, heads, dk, generator=gen), torch.randn(1, total, heads, dk, generator=gen)
    v = torch.randn(1, total, heads, dv, generator=gen)
    g = -torch.rand(1, total, heads, generator=gen)  # log decay < 0
    beta = torch.rand(1, total, heads, generator=gen)
    return q, k, v, g, beta


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def test_gated_delta_rule_restarts_at_every_sequence():
    """Each packed sequence equals transformers' step-by-step recurrence run on it alone (an
    independent implementation: no chunks), final states included."""
    q, k, v, g, beta = _qkv(sum(SEGMENTS))
    kernel = cla.make_packed_chunk_gated_delta_rule(qwen3_5.torch_chunk_gated_delta_rule)
    offsets = _offsets(SEGMENTS)
    out, states = kernel(
        q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=offsets
    )
    assert out.shape == v.shape and states.shape == (len(SEGMENTS), 2, 8, 4)
    for i, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)):
        alone, state = qwen3_5.torch_recurrent_gated_delta_rule(
            *(t[:, start:end] for t in (q, k, v)),
            g=g[:, start:end],
            beta=beta[:, start:end],
            initial_state=None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[:, start:end], alone)
        torch.testing.assert_close(states[i : i + 1], state)


def test_gated_delta_rule_starts_each_sequence_from_its_own_state():
    q, k, v, g, beta = _qkv(sum(SEGMENTS), seed=2)
    initial = torch.randn(len(SEGMENTS), 2, 8, 4)
    kernel = cla.make_packed_chunk_gated_delta_rule(qwen3_5.torch_chunk_gated_delta_rule)
    offsets = _offsets(SEGMENTS)
    out, _ = kernel(q, k, v, g=g, beta=beta, initial_state=initial, cu_seqlens=offsets, use_qk_l2norm_in_kernel=True)
    start, end = offsets[2].item(), offsets[3].item()
    alone, _ = qwen3_5.torch_recurrent_gated_delta_rule(
        *(t[:, start:end] for t in (q, k, v)),
        g=g[:, start:end],
        beta=beta[:, start:end],
        initial_state=initial[2:3],
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(out[:, start:end], alone)


# one, two and three 64-token chunks, an empty sequence, sequences that share a chunk count
MIXED_SEGMENTS = (5, 70, 1, 0, 64, 9, 130, 65)


def _each_alone(q, k, v, g, beta, lengths, initial=None):
    """transformers' chunked fallback on every packed sequence by itself (the kernel's reference)."""
    offsets = _offsets(lengths).tolist()
    outs, states = [], []
    for i, (start, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        state = initial[i : i + 1] if initial is not None else None
        if end == start:
            states.append(state if state is not None else torch.zeros(1, q.shape[2], q.shape[3], v.shape[3]))
            continue
        out, final = qwen3_5.torch_chunk_gated_delta_rule(
            *(t[:, start:end] for t in (q, k, v)),
            g=g[:, start:end],
            beta=beta[:, start:end],
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        outs.append(out)
        states.append(final)
    return torch.cat(outs, dim=1), torch.cat(states, dim=0)


@pytest.mark.parametrize("with_initial_state", [False, True])
def test_sequences_of_one_chunk_count_run_together_as_each_would_alone(with_initial_state):
    """The kernel runs the sequences that fill the same number of chunks as rows of one fallback
    call; each row must still be that sequence's own computation: outputs, final states and the
    gradients into every input equal the fallback run on each sequence by itself."""
    inputs = [t.requires_grad_() for t in _qkv(sum(MIXED_SEGMENTS), seed=4)]
    initial = torch.randn(len(MIXED_SEGMENTS), 2, 8, 4) if with_initial_state else None
    kernel = cla.make_packed_chunk_gated_delta_rule(qwen3_5.torch_chunk_gated_delta_rule)
    q, k, v, g, beta = inputs
    out, states = kernel(
        q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=_offsets(MIXED_SEGMENTS),
    )  # fmt: skip
    weights = torch.randn_like(out)
    ours = torch.autograd.grad((out * weights).sum() + states.sum(), inputs)
    ref_out, ref_states = _each_alone(q, k, v, g, beta, MIXED_SEGMENTS, initial)
    reference = torch.autograd.grad((ref_out * weights).sum() + ref_states.sum(), inputs)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(states, ref_states, rtol=1e-6, atol=1e-6)
    for mine, theirs in zip(ours, reference, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_one_fallback_call_per_chunk_size_and_count(monkeypatch):
    calls = []

    def counting(*args, **kwargs):
        calls.append((*args[0].shape[:2], kwargs["chunk_size"]))  # rows, padded length, chunk
        return qwen3_5.torch_chunk_gated_delta_rule(*args, **kwargs)

    counting.__signature__ = inspect.signature(qwen3_5.torch_chunk_gated_delta_rule)
    kernel = cla.make_packed_chunk_gated_delta_rule(counting)
    q, k, v, g, beta = _qkv(sum(MIXED_SEGMENTS))
    kernel(q, k, v, g=g, beta=beta, cu_seqlens=_offsets(MIXED_SEGMENTS), use_qk_l2norm_in_kernel=True)
    # in 16-token chunks: 130 (9 chunks) | 70, 65 (5) | 64 (4) | 5, 1, 9 (1); the empty one: no call
    assert sorted(calls) == [(1, 64, 16), (1, 144, 16), (2, 80, 16), (3, 16, 16)]


def test_block_size_of_a_sequence():
    assert [cla.block_size(n, 64) for n in (1, 16, 17, 200)] == [16, 16, 16, 16]
    assert cla.block_size(5, 8) == 8  # never above the fallback's own chunk


def test_packed_chunks_equal_the_fallbacks_default_chunk():
    """16-token chunks against the fallback's own 64-token chunk on each sequence alone, from short
    answers to several default chunks."""
    lengths = (12, 13, 3, 16, 64, 97, 200)
    q, k, v, g, beta = _qkv(sum(lengths), seed=5)
    kernel = cla.make_packed_chunk_gated_delta_rule(qwen3_5.torch_chunk_gated_delta_rule)
    out, states = kernel(
        q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=_offsets(lengths)
    )
    ref_out, ref_states = _each_alone(q, k, v, g, beta, lengths)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(states, ref_states, rtol=1e-6, atol=1e-6)


def test_gated_delta_rule_without_boundaries_is_the_torch_fallback_bit_for_bit():
    q, k, v, g, beta = _qkv(70, seed=3)  # more than one 64-token chunk
    kernel = cla.make_packed_chunk_gated_delta_rule(qwen3_5.torch_chunk_gated_delta_rule)
    ours = kernel(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    fallback = qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    assert torch.equal(ours, fallback)


def test_check_catches_a_kernel_that_ignores_the_boundaries():
    """Injected bug: transformers' fallback itself takes cu_seqlens and drops it. The packed-sequence
    check of the test above must fail on it (this is also the canary: transformers still drops it)."""
    q, k, v, g, beta = _qkv(sum(SEGMENTS))
    offsets = _offsets(SEGMENTS)
    leaky, _ = qwen3_5.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=offsets
    )
    start, end = offsets[1].item(), offsets[2].item()
    alone, _ = qwen3_5.torch_recurrent_gated_delta_rule(
        *(t[:, start:end] for t in (q, k, v)),
        g=g[:, start:end],
        beta=beta[:, start:end],
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
    )
    with pytest.raises(AssertionError):
        torch.testing.assert_close(leaky[:, start:end], alone)


def test_bad_boundaries_are_refused():
    q, k, v, g, beta = _qkv(6)
    kernel = cla.make_packed_chunk_gated_delta_rule(qwen3_5.torch_chunk_gated_delta_rule)
    with pytest.raises(ValueError, match="does not cover"):
        kernel(q, k, v, g=g, beta=beta, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(NotImplementedError):
        cla.packed_causal_conv1d(torch.zeros(1, 2, 3), torch.zeros(2, 4), initial_states=torch.zeros(1, 2, 3))


def test_what_the_cpu_kernels_do_not_compute_is_refused_by_name():
    """A convolution state, an activation causal-conv1d lacks, a scale other than the torch rule's."""
    with pytest.raises(NotImplementedError, match="activation 'relu'"):
        cla.packed_causal_conv1d(torch.zeros(1, 2, 3), torch.zeros(2, 4), activation="relu")
    q, k, v, g, beta = _qkv(6)
    kernel = cla.make_packed_chunk_gated_delta_rule(qwen3_5.torch_chunk_gated_delta_rule)
    with pytest.raises(NotImplementedError, match="1/sqrt"):
        kernel(q, k, v, g=g, beta=beta, scale=0.5 * q.shape[-1] ** -0.5, cu_seqlens=torch.tensor([0, 6]))


# --------------------------------------------------------------------------- installation + canaries


@pytest.mark.parametrize("module_name, attribute", cla.PRIVATE_API_PATCHES)
def test_patched_names_exist_in_pinned_transformers(module_name, attribute):
    assert hasattr(importlib.import_module(module_name), attribute), f"transformers moved {module_name}.{attribute}"


def test_install_fills_only_empty_slots(monkeypatch):
    for name in cla.QWEN3_5_MODULES:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "causal_conv1d_fn", None)
        monkeypatch.setattr(module, "chunk_gated_delta_rule", None)
    gpu_kernel = object()
    monkeypatch.setattr(qwen3_5, "chunk_gated_delta_rule", gpu_kernel)  # as if flash-linear-attention were installed
    monkeypatch.setattr(cla, "_installed", [])
    filled = cla.install_packed_linear_attention_kernels()
    assert f"{qwen3_5.__name__}.chunk_gated_delta_rule" not in filled and qwen3_5.chunk_gated_delta_rule is gpu_kernel
    assert qwen3_5.causal_conv1d_fn is cla.packed_causal_conv1d
    assert f"{cla.QWEN3_5_MODULES[1]}.chunk_gated_delta_rule" in filled


def test_canary_the_layer_reads_its_kernels_from_the_module_when_built():
    source = inspect.getsource(qwen3_5.Qwen3_5GatedDeltaNet.__init__)
    assert "self.causal_conv1d_fn = causal_conv1d_fn" in source
    assert "self.chunk_gated_delta_rule = chunk_gated_delta_rule or torch_chunk_gated_delta_rule" in source


def test_canary_verls_packed_forward_passes_boundaries_to_the_layers_kernels():
    """verl hands cu_seqlens to chunk_gated_delta_rule when it takes the keyword, and seq_idx to
    causal_conv1d_fn when the layer has one: the two slots the CPU kernels fill."""
    from verl.models.transformers import qwen3_5 as verl_qwen3_5

    assert '_call_accepts_kwarg(self.chunk_gated_delta_rule, "cu_seqlens")' in inspect.getsource(
        verl_qwen3_5._packed_chunk_gated_delta_rule
    )
    forward = inspect.getsource(verl_qwen3_5.qwen3_5_gated_delta_net_forward)
    assert "if self.causal_conv1d_fn is not None:" in forward and "seq_idx=seq_idx" in forward
