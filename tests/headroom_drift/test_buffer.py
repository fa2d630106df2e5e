"""HeadroomDriftBuffer / NaiveReplayBuffer: selection, gate and ingress against a brute-force reference."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from verl_replay.headroom_drift.buffer import (
    HeadroomDriftBuffer,
    NaiveReplayBuffer,
    ReplayGroup,
    SelectionResult,
    age_at,
    fresh_stats,
    scan_chunk_multiple,
)
from verl_replay.headroom_drift.scores import (
    headroom_flat,
    policy_drift_flat,
    replay_kl_flat,
)

# what depends on timing or on the chunk sizes, not on the decisions
CHUNK_DEPENDENT_KEYS = {"select_seconds", "scan_forward_seconds", "scan_unused_groups"}


# ----------------------------------------------------------------------------- reference


@dataclass
class RefItem:
    gid: int
    seq: int
    birth: int
    cached: float
    replays: int
    group: ReplayGroup  # only its immutable tensors are read


class ReferenceBuffer:
    """Brute force: a plain FIFO list, a full sort per step, one scorer call per group."""

    def __init__(
        self,
        *,
        capacity,
        k_rep,
        tau,
        weighting="sign",
        drift_norm="l2",
        max_scan_groups=None,
        ingress="answer_disagree",
        scan_order="headroom",
    ):
        self.capacity, self.k_rep, self.tau, self.scan_order = capacity, k_rep, tau, scan_order
        self.weighting, self.norm, self.max_scan, self.ingress = (weighting, drift_norm, max_scan_groups, ingress)
        self.items: list[RefItem] = []
        self.next_id = 0

    def passes(self, g: ReplayGroup) -> bool:
        if self.ingress == "answer_disagree":
            return 0 < int(g.correct.sum()) < g.n
        return bool((g.advantages != 0).any())

    def admit(self, groups, step):
        evicted = []
        for g in groups:
            if not self.passes(g):
                continue
            h = float(headroom_flat(g.gen_log_probs, g.response_mask, g.response_lengths, g.advantages, self.weighting))
            self.items.append(RefItem(self.next_id, self.next_id, step, h, 0, g))
            self.next_id += 1
        while len(self.items) > self.capacity:
            evicted.append(self.items.pop(0).gid)
        return evicted

    def select(self, step, one_scorer):
        if self.scan_order == "headroom":
            order = sorted(self.items, key=lambda it: (-it.cached, -it.birth, it.seq))
        else:  # newest birth step first, Headroom ignored
            order = sorted(self.items, key=lambda it: (-it.birth, it.seq))
        if self.max_scan is not None:
            order = order[: self.max_scan]
        scanned, accepted = [], []
        for it in order:
            if len(accepted) >= self.k_rep:
                break
            g = it.group
            lp = one_scorer(it.gid, g)
            d = float(policy_drift_flat(lp, g.gen_log_probs, g.response_mask, self.norm))
            h = float(headroom_flat(lp, g.response_mask, g.response_lengths, g.advantages, self.weighting))
            kl = float(replay_kl_flat(lp, g.gen_log_probs, g.response_mask))
            scanned.append((it.gid, d, h, kl, it.cached))
            it.cached = h
            if d <= self.tau:
                accepted.append(it.gid)
                it.replays += 1
        return accepted, scanned


def ref_one_scorer(synth, step):
    sc = synth.SynthScorer(step)

    def one(gid, g):
        # SynthScorer keys on group_id: give it a view carrying the reference's id
        proxy = type("P", (), {"group_id": gid, "num_tokens": g.num_tokens, "gen_log_probs": g.gen_log_probs})()
        return sc.one(proxy)

    return one


def _decision_stats(res: SelectionResult) -> dict:
    return {k: v for k, v in res.stats.items() if k not in CHUNK_DEPENDENT_KEYS}


def _caches(buf) -> dict[int, float]:
    return {g.group_id: g.headroom_cached for g in buf}


# ----------------------------------------------------------------------------- basics


def test_constructor_validation():
    ok = dict(capacity=4, k_rep=2, tau=0.1, scan_chunk_groups=2)
    HeadroomDriftBuffer(**ok)
    for key, bad in [
        ("capacity", 0),
        ("k_rep", 0),
        ("tau", -1.0),
        ("tau", float("nan")),
        ("scan_chunk_groups", 0),
        ("max_scan_groups", 0),
        ("weighting", "abs"),
        ("drift_norm", "linf"),
        ("ingress", "score_positive"),
        ("capacity", 2.5),
    ]:
        with pytest.raises(ValueError, match=key):
            HeadroomDriftBuffer(**{**ok, key: bad})
    with pytest.raises(TypeError):
        HeadroomDriftBuffer(4, 2, 0.1, scan_chunk_groups=2)  # keyword-only
    with pytest.raises(ValueError, match="capacity"):
        NaiveReplayBuffer(capacity=0, k_rep=1)


def test_replay_group_validation():
    base = dict(
        prompt_ids=torch.tensor([1, 2]),
        response_ids=torch.tensor([5, 6, 7]),
        response_lengths=torch.tensor([2, 1]),
        response_mask=torch.tensor([1, 1, 0]),
        gen_log_probs=torch.tensor([-0.1, -0.2, -0.3]),
        advantages=torch.tensor([1.0, -1.0]),
        correct=torch.tensor([1, 0]),
        scores=torch.tensor([1.0, 0.0]),
    )
    g = ReplayGroup(**base)
    assert g.response_ids.dtype == torch.int32 and g.response_mask.dtype == torch.bool
    assert (g.n, g.num_tokens, g.num_valid_tokens, g.num_correct) == (2, 3, 2, 1)
    with pytest.raises(ValueError, match="response_ids"):
        ReplayGroup(**{**base, "response_ids": torch.tensor([5, 6])})
    with pytest.raises(ValueError, match="advantages"):
        ReplayGroup(**{**base, "advantages": torch.tensor([1.0])})
    with pytest.raises(ValueError, match="gen_log_probs"):
        ReplayGroup(**{**base, "gen_log_probs": torch.tensor([0, 0, 0])})
    with pytest.raises(ValueError, match="meta"):
        ReplayGroup(**base, meta={"x": object()})


FIELDS = {
    "prompt_ids": torch.int32,
    "response_ids": torch.int32,
    "response_lengths": torch.int64,
    "response_mask": torch.bool,
    "gen_log_probs": torch.float32,
    "advantages": torch.float32,
    "correct": torch.bool,
    "scores": torch.float32,
}


def _big_group(gen, *, vocab, n=8, T=64, P=48, all_valid=True, meta=None):
    L = n * T
    return dict(
        prompt_ids=torch.randint(0, vocab, (P,), generator=gen),
        response_ids=torch.randint(0, vocab, (L,), generator=gen),
        response_lengths=torch.full((n,), T),
        response_mask=(torch.ones(L, dtype=torch.bool) if all_valid else torch.rand(L, generator=gen) > 0.2),
        gen_log_probs=-3 * torch.rand(L, generator=gen),
        advantages=torch.randn(n, generator=gen),
        correct=torch.rand(n, generator=gen) > 0.5,
        scores=torch.rand(n, generator=gen),
        meta=meta,
    )


@pytest.mark.parametrize("vocab", [100, 70_000, 151_936, 2**31 - 1])
@pytest.mark.parametrize("all_valid", [True, False])
def test_group_storage_round_trips_every_field_exactly(vocab, all_valid):
    gen = torch.Generator().manual_seed(vocab)
    src = _big_group(gen, vocab=vocab, all_valid=all_valid, meta={"t": (1, [2.5]), "x": torch.arange(3)})
    src["response_lengths"] = torch.tensor([0, 100, 64, 3, 200, 1, 64, 80])  # ragged, one empty
    g = ReplayGroup(**src)
    for name, dtype in FIELDS.items():
        got = getattr(g, name)
        assert got.dtype == dtype and torch.equal(got, src[name].to(dtype)), name
    assert g.meta["t"] == (1, [2.5]) and torch.equal(g.meta["x"], torch.arange(3))
    assert (g.n, g.num_tokens) == (8, 512)
    assert g.num_valid_tokens == int(src["response_mask"].sum())
    assert g.num_correct == int(src["correct"].sum())
    assert g.response_offsets().tolist() == [0, 0, 100, 164, 167, 367, 368, 432, 512]


def test_group_storage_is_compact_and_immutable():
    gen = torch.Generator().manual_seed(0)
    # Qwen-sized vocabulary: ids take 3 bytes; every token valid: no mask bytes
    g = ReplayGroup(**_big_group(gen, vocab=151_936))
    L, n, P = 512, 8, 48
    assert g.nbytes == 16 + 4 * L + 3 * 4 * n + 3 * P + 3 * L + 1 + len(b"\x00m\x00")
    small_vocab = ReplayGroup(**_big_group(gen, vocab=32_000, all_valid=False))
    assert small_vocab.nbytes == 16 + 4 * L + 3 * 4 * n + 2 * P + 2 * L + 1 + L // 8 + 3
    # accessors hand out copies: writing to them cannot touch the replay anchor
    before = g.gen_log_probs.clone()
    g.gen_log_probs.add_(1.0)
    g.advantages.zero_()
    assert torch.equal(g.gen_log_probs, before) and g.advantages.abs().sum() > 0
    with pytest.raises(AttributeError):
        g.gen_log_probs = before
    g.meta = {"new": [1]}
    assert g.meta == {"new": [1]} and torch.equal(g.gen_log_probs, before)
    m = g.meta
    m["changed"] = True  # a copy: the stored metadata does not change
    assert g.meta == {"new": [1]}
    assert "group_id=-1" in repr(g) and "num_tokens=512" in repr(g)


def test_buffer_memory_per_token_with_verl_like_metadata(synth):
    """Python heap bytes per stored response token (tracemalloc), metadata and ranking included.

    RSS at 1e5 groups is measured by benchmarks/bench_headroom_buffer.py; this guards the
    same budget deterministically at a size that runs in a second: groups of 8 x 64 tokens,
    3-byte ids, metadata shaped like rows_to_group's output for a math row.
    """
    import tracemalloc

    gen = torch.Generator().manual_seed(1)
    templates = [_big_group(gen, vocab=151_936) for _ in range(8)]
    for t in templates:
        t["correct"] = torch.tensor([True, False] * 4)
    size = 1000
    metas = [synth.verl_like_meta(k) for k in range(size)]  # inputs, not kept by the buffer
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        buf = HeadroomDriftBuffer(capacity=size, k_rep=16, tau=0.5, scan_chunk_groups=16)
        for start in range(0, size, 100):
            buf.admit(
                [ReplayGroup(**{**templates[k % 8], "meta": metas[k]}) for k in range(start, start + 100)],
                step=start // 100 + 1000,
            )
        for step in range(3):  # stale heap entries and refreshed caches count too
            buf.select(2000 + step, lambda gs: [g.gen_log_probs - 0.01 for g in gs])
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    per_token = used / (size * 512)
    # measured 8.84 B/token (packed storage 8.2, incl. ~365 B of metadata per group; RSS adds
    # ~0.4 for malloc); before the packed layout: 17 B RSS without metadata, 76 B with it
    assert per_token < 9.5, per_token


def test_from_padded_to_padded_roundtrip_with_tool_tokens():
    # response 0: 4 tokens with a masked tool token inside; response 1: 2 tokens
    ids = torch.tensor([[11, 12, 13, 14, 0], [21, 22, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 0, 0, 0]])
    lp = torch.tensor([[-0.1, -0.2, -0.3, -0.4, 9.0], [-0.5, -0.6, 9.0, 9.0, 9.0]])
    tok_adv = torch.tensor([[0.7] * 5, [-0.7] * 5]) * mask
    g = ReplayGroup.from_padded(
        prompt_ids=torch.tensor([0, 0, 3, 4]),
        prompt_mask=torch.tensor([0, 0, 1, 1]),
        response_ids=ids,
        response_mask=mask,
        gen_log_probs=lp,
        advantages=tok_adv,
        correct=torch.tensor([1, 0]),
        meta={"data_source": "toy"},
    )
    assert g.response_lengths.tolist() == [4, 2]
    assert g.response_ids.tolist() == [11, 12, 13, 14, 21, 22]
    assert g.response_mask.tolist() == [True, True, False, True, True, True]
    assert_close(g.advantages, torch.tensor([0.7, -0.7]))
    assert g.prompt_ids.tolist() == [3, 4]
    assert_close(g.scores, torch.tensor([1.0, 0.0]))
    out = g.to_padded(pad_to=5)
    assert out["response_ids"].shape == (2, 5)
    assert torch.equal(out["response_ids"], ids)
    assert torch.equal(out["response_mask"], mask.bool())
    assert_close(out["gen_log_probs"], torch.where(out["attention_mask"].bool(), lp, 0.0))
    assert_close(out["token_advantages"], tok_adv)
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="pad_to"):
        g.to_padded(pad_to=3)
    # explicit lengths keep trailing masked tokens; mask beyond a length is refused
    g2 = ReplayGroup.from_padded(
        prompt_ids=torch.tensor([3]),
        response_ids=ids,
        response_mask=mask,
        gen_log_probs=lp,
        advantages=torch.tensor([0.7, -0.7]),
        correct=torch.tensor([1, 0]),
        response_lengths=torch.tensor([5, 3]),
    )
    assert g2.num_tokens == 8
    h = lambda x: headroom_flat(
        x.gen_log_probs,
        x.response_mask,
        x.response_lengths,  # noqa: E731
        x.advantages,
    )
    assert_close(h(g2), h(g))
    with pytest.raises(ValueError, match="beyond response_lengths"):
        ReplayGroup.from_padded(
            prompt_ids=torch.tensor([3]),
            response_ids=ids,
            response_mask=mask,
            gen_log_probs=lp,
            advantages=torch.tensor([0.7, -0.7]),
            correct=torch.tensor([1, 0]),
            response_lengths=torch.tensor([2, 2]),
        )
    # from_padded copies: changing the source leaves the group alone
    lp[0, 0] = -5.0
    assert g.gen_log_probs[0].item() == pytest.approx(-0.1)


def _group(correct, adv, lp=(-0.5, -1.0)):
    n = len(correct)
    return ReplayGroup(
        prompt_ids=torch.tensor([1]),
        response_ids=torch.arange(2 * n),
        response_lengths=torch.full((n,), 2),
        response_mask=torch.ones(2 * n, dtype=torch.bool),
        gen_log_probs=torch.tensor(list(lp) * n),
        advantages=torch.tensor(adv),
        correct=torch.tensor(correct),
        scores=torch.tensor(adv),
    )


def test_ingress_criteria():
    buf = HeadroomDriftBuffer(capacity=10, k_rep=1, tau=1.0, scan_chunk_groups=1)
    out = buf.admit(
        [
            _group([1, 1], [0.5, 0.5]),
            _group([0, 0], [1.0, -1.0]),
            _group([1, 0], [0.0, 0.0]),
            _group([0, 1], [-1.0, 1.0]),
        ],
        step=3,
    )
    # answer_disagree: only mixed-correctness groups, whatever their advantages
    assert (out["ingress"], out["rejected_ingress"], out["evicted"]) == (2, 2, 0)
    assert [g.birth_step for g in buf] == [3, 3]
    buf2 = HeadroomDriftBuffer(capacity=10, k_rep=1, tau=1.0, scan_chunk_groups=1, ingress="nonzero_advantage")
    out2 = buf2.admit([_group([1, 1], [0.5, 0.5]), _group([0, 0], [1.0, -1.0]), _group([1, 0], [0.0, 0.0])], step=0)
    assert (out2["ingress"], out2["rejected_ingress"]) == (2, 1)
    ev = [e for e in out2["events"] if e["event"] == "ingress"]
    assert [e["group_id"] for e in ev] == [0, 1] and ev[0]["num_correct"] == 2 and ev[0]["n"] == 2
    # H_ref: all A > 0, p = (e^-0.5, e^-1) -> mean(1 - p)
    h = ((1 - math.exp(-0.5)) + (1 - math.exp(-1.0))) / 2
    assert ev[0]["initial_headroom"] == pytest.approx(h, rel=1e-6)
    assert buf2.groups_by_id[0].headroom_ref == buf2.groups_by_id[0].headroom_cached
    with pytest.raises(ValueError, match="already admitted"):
        buf2.admit([buf2.groups_by_id[0]], step=1)


def test_fifo_eviction_and_iteration(synth):
    buf = HeadroomDriftBuffer(capacity=3, k_rep=1, tau=1.0, scan_chunk_groups=2, ingress="nonzero_advantage")
    out = buf.admit([_group([1, 0], [1.0, -1.0]) for _ in range(5)], step=0)
    assert out["evicted"] == 2
    assert [g.group_id for g in buf] == [2, 3, 4] and len(buf) == 3
    assert [e["group_id"] for e in out["events"] if e["event"] == "evict"] == [0, 1]
    assert 0 not in buf and 4 in buf and buf.groups_by_id[3].group_id == 3
    with pytest.raises(TypeError):
        buf.groups_by_id[9] = None  # read-only view


def test_tie_break_newer_birth_first_then_insertion_order():
    buf = HeadroomDriftBuffer(capacity=10, k_rep=4, tau=math.inf, scan_chunk_groups=2)
    same = lambda: _group([1, 0], [1.0, -1.0])  # identical content -> identical Headroom
    buf.admit([same(), same()], step=0)  # ids 0, 1
    buf.admit([same(), same()], step=1)  # ids 2, 3
    res = buf.select(2, lambda gs: [g.gen_log_probs.clone() for g in gs])  # drift 0
    assert res.accepted_ids == [2, 3, 0, 1]
    assert [r.rank for r in res.records] == [1, 2, 3, 4]
    assert all(r.drift == 0.0 for r in res.records)


def test_selection_hand_example_gate_and_refresh():
    # three groups; scorer lowers the Headroom of the best one and makes group 1 drift
    buf = HeadroomDriftBuffer(capacity=10, k_rep=1, tau=0.15, scan_chunk_groups=5)
    g_hi = _group([1, 0], [1.0, 1.0], lp=(-3.0, -3.0))  # H_ref = 1 - e^-3 = 0.950
    g_mid = _group([1, 0], [1.0, 1.0], lp=(-1.0, -1.0))  # 0.632
    g_lo = _group([1, 0], [1.0, 1.0], lp=(-0.1, -0.1))  # 0.095
    buf.admit([g_lo, g_hi, g_mid], step=0)

    def scorer(gs):
        # g_hi: every token +0.2 -> drift 0.2 > tau (rejected, cache refreshed 1 - e^-2.8)
        # g_mid: +0.1 -> drift 0.1 <= tau (accepted)
        shift = {id(g_hi): 0.2, id(g_mid): 0.1, id(g_lo): 0.0}
        return [g.gen_log_probs + shift[id(g)] for g in gs]

    res = buf.select(1, scorer)
    assert res.accepted_ids == [g_mid.group_id]
    assert [r.group_id for r in res.records] == [g_hi.group_id, g_mid.group_id]
    assert [r.accepted for r in res.records] == [False, True]
    assert res.records[0].drift == pytest.approx(0.2, rel=1e-5)
    assert g_hi.headroom_cached == pytest.approx(1 - math.exp(-2.8), rel=1e-6)
    assert g_mid.headroom_cached == pytest.approx(1 - math.exp(-0.9), rel=1e-6)
    assert g_lo.headroom_cached == pytest.approx(1 - math.exp(-0.1), rel=1e-5)  # not scanned
    assert (g_hi.replay_count, g_mid.replay_count, g_lo.replay_count) == (0, 1, 0)
    s = res.stats
    assert (s["scanned"], s["accepted"], s["candidates"], s["scan_depth"]) == (2.0, 1.0, 3.0, 2.0)
    assert s["acceptance_rate"] == 0.5 and s["fill_ratio"] == 1.0
    assert s["drift_scanned/mean"] == pytest.approx(0.15, rel=1e-5)
    assert s["drift_accepted/p90"] == pytest.approx(0.1, rel=1e-5)
    assert s["headroom_cached_accepted/mean"] == pytest.approx(1 - math.exp(-1.0), rel=1e-6)
    assert s["headroom_refreshed_accepted/mean"] == pytest.approx(1 - math.exp(-0.9), rel=1e-6)
    assert s["replay_kl_accepted/mean"] == pytest.approx(math.expm1(0.1) - 0.1, rel=1e-4)
    assert s["age_accepted/mean"] == 1.0 and s["age_accepted/max"] == 1.0
    assert s["replay_tokens"] == 4.0
    # K_rep = 1 and no evidence yet: the first chunk is the one acceptance needed; after one
    # rejection the acceptance estimate is (0 + 1) / (1 + 1), so the next chunk is 1 / (1/2) = 2
    # groups: g_lo is forwarded but the scan stops before it (no record, its cache unchanged)
    assert (res.scored_groups, res.scorer_calls, res.chunk_groups) == (3, 2, (1, 2))
    assert s["scan_unused_groups"] == 1.0
    # next step: ranking uses the refreshed caches (g_hi 0.939 > g_mid 0.593 > g_lo 0.095)
    res2 = buf.select(2, lambda gs: [g.gen_log_probs.clone() for g in gs])
    assert res2.accepted_ids == [g_hi.group_id]


def test_recency_scan_order_ignores_headroom_and_keeps_the_gate():
    # the Policy-Drift-only ablation: newest birth step first whatever the Headroom, same gate
    buf = HeadroomDriftBuffer(capacity=10, k_rep=2, tau=0.15, scan_chunk_groups=5, scan_order="recency")
    old_hi = _group([1, 0], [1.0, 1.0], lp=(-3.0, -3.0))  # H 0.950, born at step 0
    new_lo = _group([1, 0], [1.0, 1.0], lp=(-0.1, -0.1))  # H 0.095, born at step 1
    new_mid = _group([1, 0], [1.0, 1.0], lp=(-1.0, -1.0))  # H 0.632, born at step 1, inserted after new_lo
    buf.admit([old_hi], step=0)
    buf.admit([new_lo, new_mid], step=1)
    assert buf.config()["scan_order"] == "recency"

    def scorer(gs):  # new_lo drifts by 0.2 (> tau): rejected; the others stay
        return [g.gen_log_probs - (0.2 if g is new_lo else 0.0) for g in gs]

    res = buf.select(2, scorer)
    assert [r.group_id for r in res.records] == [new_lo.group_id, new_mid.group_id, old_hi.group_id]
    assert [r.accepted for r in res.records] == [False, True, True]
    assert res.accepted_ids == [new_mid.group_id, old_hi.group_id]
    # the scan still refreshes Headroom (reported), but the order does not follow it
    assert new_lo.headroom_cached == pytest.approx(1 - math.exp(-0.3), rel=1e-6)
    assert res.records[0].drift == pytest.approx(0.2, rel=1e-5)
    res2 = buf.select(3, lambda gs: [g.gen_log_probs.clone() for g in gs])
    assert res2.accepted_ids == [new_lo.group_id, new_mid.group_id]
    headroom = HeadroomDriftBuffer(capacity=10, k_rep=2, tau=0.15, scan_chunk_groups=5)
    headroom.load_state_dict(buf.state_dict(), strict=False)
    assert headroom.select(3, lambda gs: [g.gen_log_probs.clone() for g in gs]).accepted_ids[0] == old_hi.group_id
    with pytest.raises(ValueError, match="scan_order: saved 'recency' vs 'headroom'"):
        headroom.load_state_dict(buf.state_dict())
    with pytest.raises(ValueError, match="scan_order"):
        HeadroomDriftBuffer(capacity=10, k_rep=2, tau=0.1, scan_chunk_groups=5, scan_order="newest")


def test_states_saved_before_scan_order_existed_load_as_headroom_order(synth):
    a, _ = _run(synth, 3, steps=4, capacity=15, max_scan_groups=9, tau=0.2)
    state = a.state_dict()
    del state["config"]["scan_order"]
    b = _fresh()
    b.load_state_dict(state)
    _same_contents(a, b)
    with pytest.raises(ValueError, match="scan_order: saved 'headroom' vs 'recency'"):
        _fresh(scan_order="recency").load_state_dict(state)


def test_empty_buffer_and_nothing_accepted_stats_are_zero():
    buf = HeadroomDriftBuffer(capacity=4, k_rep=2, tau=0.0, scan_chunk_groups=2)
    calls = []
    res = buf.select(0, lambda gs: calls.append(1) or [])
    assert calls == [] and res.groups == [] and res.records == []
    assert all(v == 0.0 for k, v in res.stats.items() if k not in CHUNK_DEPENDENT_KEYS)
    buf.admit([_group([1, 0], [1.0, -1.0])], step=0)
    res = buf.select(1, lambda gs: [g.gen_log_probs - 0.5 for g in gs])  # drift 0.5 > 0
    assert res.stats["scanned"] == 1.0 and res.stats["accepted"] == 0.0
    assert res.stats["drift_accepted/mean"] == 0.0 and res.stats["acceptance_rate"] == 0.0
    assert res.stats["drift_scanned/mean"] == pytest.approx(0.5)
    assert all(math.isfinite(v) for v in res.stats.values())


def test_infinite_drift_is_rejected_and_stats_stay_nan_free():
    buf = HeadroomDriftBuffer(capacity=10, k_rep=3, tau=0.5, scan_chunk_groups=2)
    buf.admit([_group([1, 0], [1.0, -1.0], lp=(-0.5 - 0.1 * i, -1.0)) for i in range(4)], step=0)

    def scorer(gs):
        out = []
        for g in gs:
            lp = g.gen_log_probs.clone()
            if g.group_id % 2 == 0:
                lp[1] = float("-inf")  # the current policy rules out a stored token
            out.append(lp)
        return out

    res = buf.select(1, scorer)
    assert res.accepted_ids == [1, 3]
    assert [r.drift for r in res.records if not r.accepted] == [math.inf, math.inf]
    assert res.stats["drift_scanned/p50"] == math.inf and res.stats["drift_scanned/p90"] == math.inf
    assert res.stats["drift_accepted/mean"] == 0.0
    assert not any(math.isnan(v) for v in res.stats.values())
    # percentiles interpolate linearly like numpy where values are finite
    buf2 = HeadroomDriftBuffer(capacity=10, k_rep=10, tau=math.inf, scan_chunk_groups=4)
    buf2.admit([_group([1, 0], [1.0, -1.0]) for _ in range(5)], step=0)
    shifts = iter([0.1, 0.2, 0.3, 0.4, 0.5])
    res2 = buf2.select(1, lambda gs: [g.gen_log_probs + next(shifts) for g in gs])
    assert res2.stats["drift_scanned/p90"] == pytest.approx(0.46, rel=1e-5)
    assert res2.stats["drift_scanned/p50"] == pytest.approx(0.3, rel=1e-5)


def test_scorer_contract_errors_leave_buffer_unchanged(synth):
    buf = HeadroomDriftBuffer(capacity=20, k_rep=3, tau=0.3, scan_chunk_groups=3)
    buf.admit(synth.step_groups(1, 0, 12), step=0)
    before = _caches(buf)
    with pytest.raises(ValueError, match="num_tokens"):
        buf.select(1, lambda gs: [torch.zeros(g.num_tokens + 1) for g in gs])
    with pytest.raises(ValueError, match="scorer returned"):
        buf.select(1, lambda gs: [g.gen_log_probs for g in gs[:-1]])

    class Boom(RuntimeError):
        pass

    def boom(gs):
        raise Boom()

    with pytest.raises(Boom):
        buf.select(1, boom)
    assert _caches(buf) == before and all(g.replay_count == 0 for g in buf)
    # the failed calls left no trace: same result as a twin buffer that never saw them
    twin = HeadroomDriftBuffer(capacity=20, k_rep=3, tau=0.3, scan_chunk_groups=3)
    twin.admit(synth.step_groups(1, 0, 12), step=0)
    a = buf.select(1, synth.SynthScorer(1))
    b = twin.select(1, synth.SynthScorer(1))
    assert a.accepted_ids == b.accepted_ids and _caches(buf) == _caches(twin)


def test_scorer_chunk_sizes_and_max_scan(synth):
    buf = HeadroomDriftBuffer(
        capacity=50, k_rep=50, tau=0.0, scan_chunk_groups=4, max_scan_groups=10, ingress="nonzero_advantage"
    )
    buf.admit(synth.step_groups(2, 0, 30), step=0)
    sc = synth.SynthScorer(1)
    res = buf.select(1, sc)
    assert [len(c) for c in sc.calls] == [4, 4, 2]  # last chunk trimmed to the budget
    assert res.stats["scanned"] == 10.0 and len(res.records) == 10


# ----------------------------------------------------------------------------- chunking


def _run(synth, chunk, steps=8, seed=7, multiple=1, **kw):
    cfg = dict(capacity=12, k_rep=3, tau=0.25, scan_chunk_groups=chunk)
    cfg.update(kw)
    buf = HeadroomDriftBuffer(**cfg)
    out = []
    for step in range(steps):
        if step:
            out.append(buf.select(step, synth.SynthScorer(step), chunk_multiple=multiple))
        buf.admit(synth.step_groups(seed, step, 5), step)
    return buf, out


@pytest.mark.parametrize(
    "kw", [{}, {"max_scan_groups": 5, "weighting": "advantage", "drift_norm": "l1", "ingress": "nonzero_advantage"}]
)
def test_chunked_scan_equals_one_by_one(synth, kw):
    ref_buf, ref = _run(synth, 1, **kw)
    # the scenario exercises both outcomes of the gate
    assert sum(len(r.groups) for r in ref) > 0
    assert any(not rec.accepted for r in ref for rec in r.records)
    tails = 0
    for chunk, multiple in ((2, 1), (3, 1), (7, 1), (1, 2), (3, 4), (16, 5)):
        buf, res = _run(synth, chunk, multiple=multiple, **kw)
        tails += sum(r.scored_groups - len(r.records) for r in res)
        for a, b in zip(ref, res, strict=True):
            assert a.accepted_ids == b.accepted_ids
            assert a.records == b.records  # drift, refreshed headroom, ranks: bit-identical
            assert _decision_stats(a) == _decision_stats(b)
        assert _caches(ref_buf) == _caches(buf)
        assert [g.replay_count for g in ref_buf] == [g.replay_count for g in buf]
    assert tails > 0  # rounded-up chunks did give the scorer groups that were never scanned


# ----------------------------------------------------------------------------- properties


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.integers(1, 10),
    k_rep=st.integers(1, 4),
    chunk=st.integers(1, 5),
    multiple=st.integers(1, 4),
    max_scan=st.one_of(st.none(), st.integers(1, 8)),
    tau=st.sampled_from([0.0, 0.05, 0.15, 0.3, math.inf]),
    weighting=st.sampled_from(["sign", "advantage"]),
    norm=st.sampled_from(["l2", "l1"]),
    ingress=st.sampled_from(["answer_disagree", "nonzero_advantage"]),
    scan_order=st.sampled_from(["headroom", "recency"]),
    per_step=st.lists(st.integers(0, 5), min_size=1, max_size=7),
    seed=st.integers(0, 10_000),
)
# a chunk of 3 rounded up to the multiple 2: one call of 4 groups, 3 of them past the first acceptance
@example(
    capacity=4, k_rep=1, chunk=3, multiple=2, max_scan=None, tau=0.0, weighting="sign", norm="l2",
    ingress="answer_disagree", scan_order="recency", per_step=[0, 0, 3, 1, 1, 0], seed=0,
)  # fmt: skip
def test_buffer_matches_reference_and_invariants(
    synth, capacity, k_rep, chunk, multiple, max_scan, tau, weighting, norm, ingress, scan_order, per_step, seed
):
    cfg = dict(
        capacity=capacity,
        k_rep=k_rep,
        tau=tau,
        weighting=weighting,
        drift_norm=norm,
        max_scan_groups=max_scan,
        ingress=ingress,
        scan_order=scan_order,
    )
    buf = HeadroomDriftBuffer(scan_chunk_groups=chunk, **cfg)
    ref = ReferenceBuffer(**cfg)
    admitted_ids: list[int] = []
    previous = (0, 0)  # (accepted, scanned) of the previous selection
    for step, count in enumerate(per_step):
        if step:
            sc = synth.SynthScorer(step)
            candidates = len(buf)
            res = buf.select(step, sc, chunk_multiple=multiple)
            ref_acc, ref_scanned = ref.select(step, ref_one_scorer(synth, step))
            # the brute-force top-K_rep drift-feasible groups, same scan prefix
            assert res.accepted_ids == ref_acc
            assert [r.group_id for r in res.records] == [s[0] for s in ref_scanned]
            for rec, (gid, d, h, kl, before) in zip(res.records, ref_scanned, strict=True):
                assert rec.drift == d and rec.headroom_after == h and rec.replay_kl == kl
                assert rec.headroom_before == before
            assert len(res.groups) <= k_rep
            assert all(r.drift <= tau for r in res.records if r.accepted)
            assert all(not r.accepted for r in res.records if r.drift > tau)
            assert max_scan is None or len(res.records) <= max_scan
            assert [r.rank for r in res.records] == list(range(1, len(res.records) + 1))
            assert res.stats["accepted"] == len(res.groups)
            assert res.stats["scanned"] == len(res.records)
            # each call asks for what the scan is expected to need, rounded up to the multiple
            assert_chunk_rule(
                res,
                sc.calls,
                candidates=candidates,
                chunk=chunk,
                k_rep=k_rep,
                max_scan=max_scan,
                multiple=multiple,
                previous=previous,
            )
            previous = (len(res.groups), len(res.records))
            # a scan stops early only because K_rep was filled
            if len(res.records) < (len(buf) if max_scan is None else min(max_scan, len(buf))):
                assert len(res.groups) == k_rep
        out = buf.admit(synth.step_groups(seed, step, count), step)
        ref_evicted = ref.admit(synth.step_groups(seed, step, count), step)
        admitted_ids.extend(e["group_id"] for e in out["events"] if e["event"] == "ingress")
        assert [e["group_id"] for e in out["events"] if e["event"] == "evict"] == ref_evicted
        assert len(buf) <= capacity
        fifo = [g.group_id for g in buf]
        assert fifo == admitted_ids[-capacity:] if admitted_ids else fifo == []
        assert fifo == [it.gid for it in ref.items]
        assert [g.headroom_cached for g in buf] == [it.cached for it in ref.items]
        assert [g.replay_count for g in buf] == [it.replays for it in ref.items]
        # lazy heap stays bounded: stale entries never exceed a quarter of the live ones (+ slack)
        assert len(buf._heap) - len(buf) <= len(buf) // 4 + 64


def assert_chunk_rule(res, calls, *, candidates, chunk, k_rep, max_scan, multiple, previous):
    """Every scorer call had min(round_up(min(chunk, expected, budget left), multiple), budget
    left, candidates left) groups, expected = ceil((K_rep - accepted) / rate) with the rate
    (A + 1) / (S + 1) over the previous selection and the call's own scan so far (computed here
    in floats, independently of the buffer's integer form); only the last call may have an
    unscanned tail."""
    budget = candidates if max_scan is None else min(candidates, max_scan)
    accepted_by_rank = [r.accepted for r in res.records]
    given = 0
    for i, call in enumerate(calls):
        # every earlier call was scanned in full, so given == scanned here
        acc = sum(accepted_by_rank[:given])
        rate = (previous[0] + acc + 1) / (previous[1] + given + 1)
        expected = math.ceil((k_rep - acc) / rate - 1e-9)
        left = budget - given
        want = min(chunk, expected, left)
        want = min(-(-want // multiple) * multiple, left, candidates - given)
        assert len(call) == want, (i, calls, previous)
        given += len(call)
    assert list(res.chunk_groups) == [len(c) for c in calls]
    assert res.scored_groups == given and res.scorer_calls == len(calls)
    assert res.stats["scan_unused_groups"] == given - len(res.records)
    # the unscanned tail is part of the last call, which holds at most the chunk rounded up to the multiple
    assert len(res.records) <= given <= len(res.records) + -(-chunk // multiple) * multiple - 1


class _PositionGate:
    """Accepts the groups at the given 1-based scan positions (counted over calls, which come in
    rank order), rejects the rest with drift 1; records every call's group ids."""

    def __init__(self, accept_at: set[int]):
        self.accept_at, self.position, self.calls = accept_at, 0, []

    def __call__(self, groups):
        self.calls.append([g.group_id for g in groups])
        out = []
        for g in groups:
            self.position += 1
            out.append(g.gen_log_probs.clone() + (0.0 if self.position in self.accept_at else 1.0))
        return out


def test_chunks_grow_as_the_gate_rejects(synth):
    # K_rep = 2, chunks of at most 16, the gate accepts scan positions 1 and 10 (hand-computed):
    # no evidence: 2 (the missing count); then rate (1+1)/(2+1) -> ceil(1 / (2/3)) = 2;
    # (1+1)/(4+1) -> ceil(2.5) = 3; (1+1)/(7+1) -> 4, whose 10th position fills K_rep: the 11th
    # was forwarded and never scanned
    buf = HeadroomDriftBuffer(capacity=40, k_rep=2, tau=0.25, scan_chunk_groups=16, ingress="nonzero_advantage")
    buf.admit(synth.step_groups(5, 0, 30), step=0)
    gate = _PositionGate({1, 10})
    res = buf.select(1, gate)
    assert [len(c) for c in gate.calls] == [2, 2, 3, 4]
    assert [r.rank for r in res.records if r.accepted] == [1, 10] and len(res.records) == 10
    assert res.scored_groups == 11 and res.stats["scan_unused_groups"] == 1.0
    assert gate.calls[-1][-1] not in {r.group_id for r in res.records}
    # the next step starts from the previous scan's rate (2+1)/(10+1): ceil(2 x 11 / 3) = 8
    gate2 = _PositionGate({1, 2})
    buf.select(2, gate2)
    assert [len(c) for c in gate2.calls] == [8]
    # and a gate that accepts everything keeps the chunks at the missing count: nothing unused
    open_buf = HeadroomDriftBuffer(capacity=40, k_rep=2, tau=math.inf, scan_chunk_groups=16)
    open_buf.admit(synth.step_groups(5, 0, 30), step=0)
    for step in (1, 2, 3):
        sc = synth.SynthScorer(step)
        res = open_buf.select(step, sc)
        assert [len(c) for c in sc.calls] == [2] and res.stats["scan_unused_groups"] == 0.0


def test_chunk_multiple_and_budget_never_change_decisions(synth):
    def run(multiple, tau=0.25, **kw):
        buf = HeadroomDriftBuffer(
            capacity=40, k_rep=2, tau=tau, scan_chunk_groups=16, ingress="nonzero_advantage", **kw
        )
        buf.admit(synth.step_groups(5, 0, 30), step=0)
        sc = synth.SynthScorer(1)
        return buf.select(1, sc, chunk_multiple=multiple), sc, buf

    one, _, _ = run(1)
    assert [r.accepted for r in one.records].count(False) >= 1  # the scan had to go on
    for multiple in (2, 3, 5, 16):
        res, sc, _ = run(multiple)
        assert res.accepted_ids == one.accepted_ids and res.records == one.records
        assert _decision_stats(res) == _decision_stats(one)
        assert all(len(c) % multiple == 0 for c in sc.calls[:-1])
    # a scan budget caps the rounded-up chunk: never a group that cannot be scanned
    res, sc, _ = run(8, tau=0.0, max_scan_groups=3)
    assert [len(c) for c in sc.calls] == [3] and res.scored_groups == 3
    with pytest.raises(ValueError, match="chunk_multiple"):
        run(0)


def test_forward_rows_counts_the_dispatch_padding(synth):
    buf = HeadroomDriftBuffer(capacity=40, k_rep=3, tau=0.25, scan_chunk_groups=4, ingress="nonzero_advantage")
    buf.admit(synth.step_groups(5, 0, 30), step=0)
    sc = synth.SynthScorer(1)
    res = buf.select(1, sc)
    groups = buf.groups_by_id
    assert res.chunk_rows == tuple(sum(groups[gid].n for gid in call) for call in sc.calls)
    assert res.forward_rows() == sum(res.chunk_rows)
    assert res.forward_rows(8) == sum(-(-rows // 8) * 8 for rows in res.chunk_rows)
    assert res.forward_rows(8) % 8 == 0 and res.forward_rows(8) >= sum(res.chunk_rows)
    with pytest.raises(ValueError, match="row_multiple"):
        res.forward_rows(0)


def test_scan_chunk_multiple_never_adds_forward_rows():
    assert scan_chunk_multiple(8, 24) == 3 and scan_chunk_multiple(4, 4) == 1
    assert scan_chunk_multiple(8, 12) == 1 and scan_chunk_multiple(8, 4) == 1
    assert scan_chunk_multiple(1, 16) == 16
    for n in range(1, 13):
        for r in range(1, 49):
            m = scan_chunk_multiple(n, r)
            for c in range(1, 61):
                padded = -(-c * n // r) * r  # rows through the forward for c groups
                rounded = -(-c // m) * m * n  # rows of the rounded-up chunk, before padding
                assert -(-rounded // r) * r == padded  # same forward, padding replaced
                if r % n == 0:
                    assert rounded == padded  # ... by real candidates, entirely
    for bad in ((0, 4), (4, 0), (2.0, 4)):
        with pytest.raises(ValueError):
            scan_chunk_multiple(*bad)


def test_heap_compaction_bounds_stale_entries(synth):
    for capacity, per_step in ((5, 5), (600, 40)):
        buf = HeadroomDriftBuffer(
            capacity=capacity, k_rep=8, tau=math.inf, scan_chunk_groups=3, ingress="nonzero_advantage"
        )
        compacted = False
        for step in range(60):
            before = len(buf._heap)
            buf.admit(synth.step_groups(3, step, per_step), step)
            buf.select(step, synth.SynthScorer(step))
            compacted |= len(buf._heap) < before
            # stale entries stay within a quarter of the live ones (+ slack)
            assert len(buf._heap) - len(buf) <= len(buf) // 4 + 64
            # every group has exactly one live entry, and it is in the heap
            live = {id(e): e[3] for e in buf._heap if buf._is_live(e)}
            assert sorted(live.values()) == sorted(g.group_id for g in buf)
            assert all(id(g._rank) in live for g in buf)
        assert compacted


# ----------------------------------------------------------------------------- persistence


def _fresh(**kw):
    cfg = dict(capacity=15, k_rep=3, tau=0.2, scan_chunk_groups=3, max_scan_groups=9)
    cfg.update(kw)
    return HeadroomDriftBuffer(**cfg)


def test_state_dict_roundtrip_exact(synth):
    a, _ = _run(synth, 3, steps=6, capacity=15, max_scan_groups=9, tau=0.2)
    b = _fresh()
    b.load_state_dict(a.state_dict())
    _same_contents(a, b)


def test_resume_equivalence(synth, tmp_path):
    def step_fn(buf, step):
        res = buf.select(step, synth.SynthScorer(step)) if step else None
        buf.admit(synth.step_groups(11, step, 5), step)
        return res

    a = _fresh()
    run_a = [step_fn(a, s) for s in range(10)]
    b = _fresh()
    run_b = [step_fn(b, s) for s in range(5)]
    path = tmp_path / "buffer.pt"
    b.save(path)
    del b
    c = _fresh()
    c.load(path)
    run_b += [step_fn(c, s) for s in range(5, 10)]
    for ra, rb in zip(run_a[1:], run_b[1:], strict=True):
        assert ra.accepted_ids == rb.accepted_ids
        assert ra.records == rb.records
        assert _decision_stats(ra) == _decision_stats(rb)
    assert sum(len(r.groups) for r in run_a[5:]) > 0
    assert _caches(a) == _caches(c)
    assert [g.replay_count for g in a] == [g.replay_count for g in c]
    # from_file rebuilds the configuration too
    d = HeadroomDriftBuffer.from_file(path)
    assert d.config() == _fresh().config() and len(d) == 15


def _v1_state(buf) -> dict:
    """The format-1 state of earlier versions (one concatenated tensor per field)."""
    gs = list(buf)

    def cat(name):
        return torch.cat([getattr(g, name) for g in gs])

    def scal(name, dtype):
        return torch.tensor([getattr(g, name) for g in gs], dtype=dtype)

    return {
        "format": 1,
        "kind": buf._KIND,
        "config": buf.config(),
        "next_group_id": buf._next_group_id,
        "next_insert_seq": buf._next_insert_seq,
        "groups": {
            "prompt_lengths": torch.tensor([g.prompt_ids.numel() for g in gs]),
            "group_sizes": torch.tensor([g.n for g in gs]),
            **{k: cat(k) for k in FIELDS},
            "group_id": scal("group_id", torch.int64),
            "birth_step": scal("birth_step", torch.int64),
            "insert_seq": scal("insert_seq", torch.int64),
            "headroom_ref": scal("headroom_ref", torch.float64),
            "headroom_cached": scal("headroom_cached", torch.float64),
            "replay_count": scal("replay_count", torch.int64),
            "meta": [g.meta for g in gs],
        },
    }


def _same_contents(a, b):
    assert [g.group_id for g in a] == [g.group_id for g in b]
    for ga, gb in zip(a, b, strict=True):
        for name in FIELDS:
            assert torch.equal(getattr(ga, name), getattr(gb, name)), name
        assert (
            ga.birth_step,
            ga.generated_version,
            ga.insert_seq,
            ga.headroom_ref,
            ga.headroom_cached,
            ga.replay_count,
            ga.meta,
        ) == (
            gb.birth_step,
            gb.generated_version,
            gb.insert_seq,
            gb.headroom_ref,
            gb.headroom_cached,
            gb.replay_count,
            gb.meta,
        )


def test_format_1_files_of_earlier_versions_still_load(synth, tmp_path):
    import hashlib
    import io

    from verl_replay.headroom_drift.buffer import _FILE_MAGIC

    a, _ = _run(synth, 3, steps=6, capacity=15, max_scan_groups=9, tau=0.2)
    raw = io.BytesIO()
    torch.save(_v1_state(a), raw)
    payload = raw.getvalue()
    path = tmp_path / "v1.pt"
    path.write_bytes(
        _FILE_MAGIC
        + hashlib.sha256(payload).hexdigest().encode()
        + b"\n"
        + str(len(payload)).encode()
        + b"\n"
        + payload
    )
    b = _fresh()
    b.load(path)
    _same_contents(a, b)
    # and the next selections agree
    ra, rb = a.select(6, synth.SynthScorer(6)), b.select(6, synth.SynthScorer(6))
    # format 1 has no scan-skip history: only the shadow flags (decided by nothing) may differ
    unflagged = lambda records: [dataclasses.replace(r, would_skip=None) for r in records]  # noqa: E731
    assert unflagged(ra.records) == unflagged(rb.records) and ra.accepted_ids == rb.accepted_ids
    with pytest.raises(ValueError, match="format 5"):
        _fresh().load_state_dict({**a.state_dict(), "format": 5})
    broken = a.state_dict()
    broken["groups"]["packed_sizes"] = broken["groups"]["packed_sizes"] + 1
    with pytest.raises(ValueError, match="packed sizes"):
        _fresh().load_state_dict(broken)


def test_corrupted_truncated_and_foreign_files_refused(synth, tmp_path):
    a, _ = _run(synth, 2, steps=3)
    path = tmp_path / "b.pt"
    a.save(path)
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary file was renamed away
    data = path.read_bytes()
    corrupt = bytearray(data)
    corrupt[-10] ^= 0xFF
    (tmp_path / "c.pt").write_bytes(bytes(corrupt))
    (tmp_path / "t.pt").write_bytes(data[: len(data) - 100])
    (tmp_path / "x.pt").write_bytes(b"hello world")
    fresh = lambda: HeadroomDriftBuffer(capacity=12, k_rep=3, tau=0.25, scan_chunk_groups=2)
    with pytest.raises(ValueError, match="corrupted: sha256"):
        fresh().load(tmp_path / "c.pt")
    with pytest.raises(ValueError, match="truncated"):
        fresh().load(tmp_path / "t.pt")
    with pytest.raises(ValueError, match="not a replay buffer file"):
        fresh().load(tmp_path / "x.pt")
    # configuration mismatch is named; strict=False accepts and trims to capacity
    small = HeadroomDriftBuffer(capacity=4, k_rep=3, tau=0.25, scan_chunk_groups=2)
    with pytest.raises(ValueError, match="capacity"):
        small.load(path)
    small.load(path, strict=False)
    assert [g.group_id for g in small] == [g.group_id for g in a][-4:]
    with pytest.raises(ValueError, match="NaiveReplayBuffer"):
        NaiveReplayBuffer(capacity=12, k_rep=3).load(path)
    ok = fresh()
    ok.load(path, strict=False)
    assert len(ok) == len(a)


# ----------------------------------------------------------------------------- naive


def test_naive_buffer_newest_first_no_scorer(synth, tmp_path):
    buf = NaiveReplayBuffer(capacity=6, k_rep=4, ingress="nonzero_advantage")
    res = buf.select(0, None)
    assert res.groups == [] and res.stats["accepted"] == 0.0
    buf.admit([_group([1, 0], [1.0, -1.0]) for _ in range(3)], step=0)
    buf.admit([_group([1, 0], [1.0, -1.0]) for _ in range(5)], step=1)  # evicts ids 0, 1
    res = buf.select(2, None, chunk_multiple=4)  # same call as the Headroom-Drift buffer
    assert res.accepted_ids == [7, 6, 5, 4]
    assert res.forward_rows(8) == 0 and res.scored_groups == 0
    assert [g.replay_count for g in buf] == [0, 0, 1, 1, 1, 1]
    s = res.stats
    assert s["accepted"] == 4.0 and s["fill_ratio"] == 1.0 and s["age_accepted/max"] == 1.0
    assert s["scan_forward_seconds"] == 0.0 and all(r.drift is None for r in res.records)
    hd_keys = set(HeadroomDriftBuffer(capacity=1, k_rep=1, tau=0.1, scan_chunk_groups=1).select(0, lambda gs: []).stats)
    assert set(s) <= hd_keys
    assert all(e["drift"] is None for e in res.events())
    buf.save(tmp_path / "n.pt")
    again = NaiveReplayBuffer.from_file(tmp_path / "n.pt")
    assert [g.group_id for g in again] == [g.group_id for g in buf]
    assert again.select(3, None).accepted_ids == buf.select(3, None).accepted_ids
    with pytest.raises(ValueError, match="chunk_multiple"):
        buf.select(4, None, chunk_multiple=0)


# ----------------------------------------------------------------------------- ages and the floor


def test_ages_count_weight_versions_since_generation():
    """Version v = the weights after step v, step t trains from version t - 1: a group generated by
    version v is (t - 1) - v versions old at step t, whatever step admitted it."""
    buf = HeadroomDriftBuffer(capacity=10, k_rep=3, tau=10.0, scan_chunk_groups=2)
    groups = [_group([1, 0], [1.0, -1.0], lp=(-0.5 - 0.1 * i, -1.0)) for i in range(3)]
    with pytest.raises(ValueError, match="generated_version 5 is newer than the weights step 5 trained from"):
        buf.admit(groups, step=5, generated_versions=[3, 5, 2])
    with pytest.raises(ValueError, match="2 entries for 3 groups"):
        buf.admit(groups, step=5, generated_versions=[3, 4])
    assert len(buf) == 0 and all(g.group_id == -1 for g in groups)  # refused before anything changed
    admitted = buf.admit(groups, step=5, generated_versions=[3, 4, 2])
    assert [e["generated_version"] for e in admitted["events"]] == [3, 4, 2]
    assert [(e["birth_step"], e["step"]) for e in admitted["events"]] == [(5, 5)] * 3
    res = buf.select(8, lambda gs: [g.gen_log_probs for g in gs])
    ages = {r.group_id: r.age for r in res.records}
    assert ages == {groups[0].group_id: 4, groups[1].group_id: 3, groups[2].group_id: 5}
    assert all(r.birth_step == 5 for r in res.records)  # the admission step, under its own name
    assert res.stats["age_accepted/mean"] == 4.0 and res.stats["age_accepted/max"] == 5.0
    scans = {e["group_id"]: e for e in res.events()}
    assert scans[groups[2].group_id]["generated_version"] == 2 and scans[groups[2].group_id]["age"] == 5
    # synchronous default: generated by the weights the admitting step started from
    late = _group([1, 0], [1.0, -1.0])
    buf.admit([late], step=9)
    assert late.generated_version == 8 and age_at(10, late.generated_version) == 10 - late.birth_step
    naive = NaiveReplayBuffer(capacity=4, k_rep=1)
    naive.admit([_group([1, 0], [1.0, -1.0])], step=3, generated_versions=[0])
    assert naive.select(6).records[0].age == 5


def test_fresh_stats_hand_computed():
    stats = fresh_stats([0.1, 0.3, 0.2, 0.4], [1, 2, 1, 1])
    assert stats["drift_fresh/mean"] == pytest.approx(0.25)
    assert stats["drift_fresh/p50"] == pytest.approx(0.25)
    assert stats["drift_fresh/p90"] == pytest.approx(0.3 + 0.7 * 0.1)  # (4 - 1) * 0.9 = 2.7 between 0.3 and 0.4
    assert (stats["age_fresh/mean"], stats["age_fresh/max"]) == (1.25, 2.0)
    assert fresh_stats(None, [0, 3]) == {"age_fresh/mean": 1.5, "age_fresh/max": 3.0}  # floor not measured
    assert fresh_stats([], []) == {
        "age_fresh/mean": 0.0,
        "age_fresh/max": 0.0,
        "drift_fresh/mean": 0.0,
        "drift_fresh/p50": 0.0,
        "drift_fresh/p90": 0.0,
    }


def test_fingerprint_identifies_the_state(synth, tmp_path):
    """Equal for equal histories and across save/load; any change a later decision could see moves it."""
    a, _ = _run(synth, 3, steps=6, capacity=15, max_scan_groups=9, tau=0.2)
    b, _ = _run(synth, 3, steps=6, capacity=15, max_scan_groups=9, tau=0.2)
    assert a.fingerprint() == b.fingerprint()
    path = tmp_path / "b.pt"
    a.save(path)
    c = _fresh()
    c.load(path)
    assert c.fingerprint() == a.fingerprint() == HeadroomDriftBuffer.from_file(path).fingerprint()
    before = a.fingerprint()
    a.select(6, synth.SynthScorer(6))  # refreshes cached Headroom, counts replays
    assert a.fingerprint() != before
    group = next(iter(c))
    group.generated_version -= 1
    assert c.fingerprint() != before
    group.generated_version += 1
    assert c.fingerprint() == before
    d = _fresh(tau=0.3)
    d.load(path, strict=False)
    assert d.fingerprint() != before  # another gate


def test_format_2_states_load_with_admission_ages(synth):
    """States written before groups carried their generating version: version = admission step - 1,
    the synchronous assumption their ages were counted under."""
    a, _ = _run(synth, 3, steps=6, capacity=15, max_scan_groups=9, tau=0.2)
    old = a.state_dict()
    del old["groups"]["generated_version"]
    b = _fresh()
    b.load_state_dict({**old, "format": 2})
    assert [g.generated_version for g in b] == [g.birth_step - 1 for g in a]
    assert b.fingerprint() == a.fingerprint()  # _run admitted with the default versions
