"""replay.scan_skip: the cooldown rule by hand, its shadow over the paper's scan, the live rule in
the buffer (skips, events, stats, state), and the shadow report over an event log."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from verl_replay.headroom_drift.buffer import HeadroomDriftBuffer, ReplayGroup
from verl_replay.headroom_drift.events import ReplayEventLog, read_events
from verl_replay.headroom_drift.scan_skip import CooldownRule
from verl_replay.headroom_drift.shadow import comebacks, drift_by_age, main, shadow_count, shadow_flags

# ----------------------------------------------------------------------------- the rule by hand


def test_cooldown_rule_hand_values():
    rule = CooldownRule(tau=0.1, margin=2.0, versions=3)
    assert rule.bound == pytest.approx(0.2)
    assert not rule.skips(None, 6)  # never scanned
    assert rule.skips((5, 0.25), 6)  # 0.25 > 0.2, the first of the 3 steps after its scan
    assert rule.skips((5, 0.25), 8)  # the third
    assert not rule.skips((5, 0.25), 9)  # 3 skipped: rescanned
    assert not rule.skips((5, 0.2), 6)  # not above the bound
    assert not rule.skips((5, 0.15), 6)  # rejected by the gate, but within the margin
    assert rule.skips((5, math.inf), 7)
    forever = CooldownRule(tau=0.1, margin=2.0, versions=None)
    assert forever.skips((5, 0.25), 10**6)


def test_margin_is_in_rms_units_under_mean_sq():
    rms = CooldownRule(tau=0.1, margin=2.0, versions=4, drift_norm="l2")
    sq = CooldownRule(tau=0.01, margin=2.0, versions=4, drift_norm="mean_sq")
    assert sq.bound == pytest.approx(0.04)  # (2 x 0.1)^2
    for d in (0.05, 0.15, 0.19, 0.21, 0.3):
        assert rms.skips((1, d), 2) == sq.skips((1, d * d), 2)


@pytest.mark.parametrize("kw", [{"margin": 0.9}, {"margin": math.nan}, {"versions": 0}, {"versions": True}])
def test_cooldown_rule_refuses_bad_parameters(kw):
    with pytest.raises(ValueError):
        CooldownRule(**{"tau": 0.1, "margin": 2.0, "versions": 3, **kw})


# ----------------------------------------------------------------------------- in the buffer


def _group(k: int) -> ReplayGroup:
    return ReplayGroup(
        prompt_ids=torch.tensor([1, 2]),
        response_ids=torch.tensor([3, 4, 5, 6]),
        response_lengths=torch.tensor([2, 2]),
        response_mask=torch.ones(4, dtype=torch.bool),
        gen_log_probs=torch.full((4,), -1.0 - 0.01 * k),
        advantages=torch.tensor([1.0, -1.0]),
        correct=torch.tensor([True, False]),
        scores=torch.tensor([1.0, 0.0]),
    )


class DriftScorer:
    """Every token of group g moves by ``shift[g]`` at every step: drift = |shift| (l2, l1)."""

    def __init__(self, shift: dict[int, float]):
        self.shift = shift
        self.scanned: list[int] = []

    def __call__(self, groups):
        self.scanned += [g.group_id for g in groups]
        return [g.gen_log_probs + self.shift[g.group_id] for g in groups]


def _buffer(**kw) -> HeadroomDriftBuffer:
    cfg = dict(capacity=20, k_rep=8, tau=0.1, scan_chunk_groups=4, scan_skip_margin=2.0, scan_skip_versions=2)
    cfg.update(kw)
    buf = HeadroomDriftBuffer(**cfg)
    buf.admit([_group(k) for k in range(6)], step=0)
    return buf


# drifts: 0 and 1 accepted; 2 rejected within the margin; 3, 4, 5 rejected above 2 x tau
SHIFTS = {0: -0.05, 1: 0.1, 2: 0.15, 3: -0.25, 4: 0.5, 5: 0.3}


def test_live_cooldown_skips_and_rescans_after_its_versions():
    buf = _buffer(scan_skip="cooldown")
    first = buf.select(1, DriftScorer(SHIFTS))
    assert len(first.records) == 6 and first.stats["scan_skipped"] == 0.0
    second_scorer = DriftScorer(SHIFTS)
    second = buf.select(2, second_scorer)
    assert sorted(second_scorer.scanned) == [0, 1, 2]
    assert sorted(gid for gid, _, _ in second.skipped) == [3, 4, 5]
    assert second.stats["scan_skipped"] == 3.0 and second.stats["scanned"] == 3.0
    assert dict((g, (s, d)) for g, s, d in second.skipped)[4] == (1, pytest.approx(0.5))
    skip_events = [e for e in second.events() if e["event"] == "skip"]
    assert len(skip_events) == 1 and sorted(skip_events[0]["group_ids"]) == [3, 4, 5]
    assert skip_events[0]["last_step"] == [1, 1, 1]
    assert [r.rank for r in second.records] == [1, 2, 3]  # equal Headroom: insertion order
    third_scorer = DriftScorer(SHIFTS)
    buf.select(3, third_scorer)  # the second step after their scan: still skipped
    assert sorted(third_scorer.scanned) == [0, 1, 2]
    fourth_scorer = DriftScorer(SHIFTS)
    buf.select(4, fourth_scorer)  # 2 steps skipped: rescanned
    assert sorted(fourth_scorer.scanned) == list(range(6))


def test_skipped_groups_keep_their_rank():
    buf = _buffer(scan_skip="cooldown")
    swapped = {**SHIFTS, 0: SHIFTS[4], 4: SHIFTS[0]}  # the first-ranked group is far above tau
    buf.select(1, DriftScorer(swapped))
    second = buf.select(2, DriftScorer(swapped))
    assert [(r.group_id, r.rank) for r in second.records] == [(1, 2), (2, 3), (4, 5)]
    assert second.stats["scan_depth"] == 5.0


def test_live_cooldown_without_versions_skips_for_good_and_forgets_evicted_groups():
    buf = _buffer(scan_skip="cooldown", scan_skip_versions=None, capacity=6)
    buf.select(1, DriftScorer(SHIFTS))
    for step in (2, 3, 7):
        scorer = DriftScorer(SHIFTS)
        buf.select(step, scorer)
        assert sorted(scorer.scanned) == [0, 1, 2]
    assert sorted(buf.skip_history) == list(range(6))
    buf.admit([_group(k) for k in range(6, 10)], step=8)  # evicts groups 0-3
    assert sorted(buf.skip_history) == [4, 5]


def test_shadow_under_none_decides_nothing():
    shadow = _buffer(scan_skip="none")
    plain = _buffer(scan_skip="none", scan_skip_margin=1e9)  # a rule that never skips
    for step in (1, 2, 3, 4):
        a, b = shadow.select(step, DriftScorer(SHIFTS)), plain.select(step, DriftScorer(SHIFTS))
        unflagged = [dataclasses.replace(r, would_skip=None) for r in a.records]
        assert unflagged == [dataclasses.replace(r, would_skip=None) for r in b.records]
        assert a.accepted_ids == b.accepted_ids and not a.skipped
        flagged = sorted(r.group_id for r in a.records if r.would_skip)
        # steps 2 and 3: 3, 4, 5 would be skipped; step 4: rescanned
        assert flagged == ([3, 4, 5] if step in (2, 3) else [])
        assert a.stats["scan_skip_shadow"] == len(flagged) and a.stats["scan_skip_shadow_accepted"] == 0.0
    assert shadow.fingerprint() != plain.fingerprint()  # the configuration differs
    # under none the history decides nothing and is not part of the fingerprint
    other = _buffer(scan_skip="none")
    other.load_state_dict(shadow.state_dict())
    other._skip_history.clear()
    assert other.fingerprint() == shadow.fingerprint()


def test_shadow_counts_accepted_groups_it_would_lose():
    buf = _buffer(scan_skip="none")
    buf.select(1, DriftScorer(SHIFTS))
    back = {**SHIFTS, 4: 0.01}  # group 4 comes back under tau
    result = buf.select(2, DriftScorer(back))
    assert result.stats["scan_skip_shadow_accepted"] == 1.0
    assert [r.group_id for r in result.records if r.would_skip and r.accepted] == [4]


def test_skip_history_survives_save_and_load(tmp_path):
    a = _buffer(scan_skip="cooldown")
    a.select(1, DriftScorer(SHIFTS))
    path = tmp_path / "buf.pt"
    a.save(path)
    b = HeadroomDriftBuffer.from_file(path)
    assert dict(b.skip_history) == dict(a.skip_history) and b.fingerprint() == a.fingerprint()
    sa, sb = DriftScorer(SHIFTS), DriftScorer(SHIFTS)
    ra, rb = a.select(2, sa), b.select(2, sb)
    assert ra.records == rb.records and ra.skipped == rb.skipped and sa.scanned == sb.scanned
    # the history is part of a live rule's fingerprint
    c = HeadroomDriftBuffer.from_file(path)
    c._skip_history.pop(4)
    assert c.fingerprint() != HeadroomDriftBuffer.from_file(path).fingerprint()


def test_load_checks_the_skip_history():
    a = _buffer(scan_skip="cooldown")
    a.select(1, DriftScorer(SHIFTS))
    state = a.state_dict()
    bad = {**state, "scan_history": {**state["scan_history"], "group_id": state["scan_history"]["group_id"] + 100}}
    with pytest.raises(ValueError, match="scan-skip history of group"):
        _buffer(scan_skip="cooldown").load_state_dict(bad)
    nan = {**state, "scan_history": {**state["scan_history"], "drift": state["scan_history"]["drift"] * math.nan}}
    with pytest.raises(ValueError, match="scan-skip history"):
        _buffer(scan_skip="cooldown").load_state_dict(nan)
    short = {**state, "scan_history": {**state["scan_history"], "step": state["scan_history"]["step"][:2]}}
    with pytest.raises(ValueError, match="do not match"):
        _buffer(scan_skip="cooldown").load_state_dict(short)
    old = {**state, "format": 3}
    old.pop("scan_history")
    b = _buffer(scan_skip="cooldown")
    b.load_state_dict(old)  # earlier formats: no history, nothing skipped at first
    assert not b.skip_history


def test_strict_load_refuses_another_rule():
    a = _buffer(scan_skip="cooldown")
    with pytest.raises(ValueError, match="scan_skip"):
        _buffer(scan_skip="none").load_state_dict(a.state_dict())


# ----------------------------------------------------------------------------- the shadow report


def _scan(step, gid, drift, accepted, rank=1, age=0):
    return {
        "event": "scan",
        "step": step,
        "group_id": gid,
        "rank": rank,
        "drift": drift,
        "accepted": accepted,
        "age": age,
    }


def test_shadow_count_by_hand():
    tau = 0.1
    scans = [
        _scan(1, 7, 0.3, False),  # history (1, 0.3)
        _scan(2, 7, 0.35, False),  # skipped (the one step after its scan): history unchanged
        _scan(3, 7, 0.05, True),  # 2 versions since step 1: scanned, accepted
        _scan(4, 7, 0.25, False),  # 0.05 not above 0.2: scanned -> history (4, 0.25)
        _scan(5, 7, 0.08, True),  # skipped, and accepted: one acceptance lost
        _scan(5, 8, 0.15, False, rank=2),  # never seen: scanned
    ]
    rule = CooldownRule(tau=tau, margin=2.0, versions=1)
    assert [skip for _, skip in shadow_flags(scans, rule)] == [False, True, False, False, True, False]
    count = shadow_count(scans, rule)
    assert (count.scans, count.skipped, count.accepted, count.accepted_lost) == (6, 2, 2, 1)
    assert count.kept_share == 0.5 and count.saved_share == pytest.approx(2 / 6)
    # comebacks: pairs after a rejection at > tau: (0.3 -> 0.35), (0.35 -> 0.05), (0.25 -> 0.08)
    rows = {r["previous_drift_over_tau"]: r for r in comebacks(scans, tau)}
    assert rows["3-inf"]["pairs"] == 1 and rows["3-inf"]["accepted_next"] == 1
    assert rows["2-3"]["pairs"] == 2 and rows["2-3"]["drift_grew"] == 0.5 and rows["2-3"]["accepted_next"] == 1
    ages = drift_by_age(scans, tau)
    assert ages[0]["scans"] == 6 and ages[0]["accepted"] == 2


def test_live_shadow_flags_match_the_report(tmp_path, capsys):
    """What the buffer records as would_skip is what the report recomputes from the log."""
    log = ReplayEventLog(tmp_path / "events.jsonl")
    buf = _buffer(scan_skip="none")
    for step in range(1, 7):
        shifts = {g: s * (1 + 0.3 * step) for g, s in SHIFTS.items()}
        log.log_selection(buf.select(step, DriftScorer(shifts)))
        log.log_step(step, {"scanned": 6.0, "scan_forward_seconds": 0.6})
    log.close()
    scans = read_events(tmp_path / "events.jsonl", ["scan"])
    rule = CooldownRule(tau=0.1, margin=2.0, versions=2)
    assert [s["would_skip"] for s in scans] == [skip for _, skip in shadow_flags(scans, rule)]
    assert any(s["would_skip"] for s in scans)
    assert (
        main([str(tmp_path / "events.jsonl"), "--tau", "0.1", "--live", "2,2", "--margins", "2", "--versions", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "live would_skip flags: ok" in out and "cooldown m=2 k=2" in out


@pytest.mark.parametrize("scan_skip", ["none", "cooldown"])
def test_mean_sq_with_squared_tau_decides_like_l2(synth, scan_skip):
    kw = dict(capacity=12, k_rep=3, scan_chunk_groups=4, scan_skip=scan_skip, scan_skip_margin=1.5)
    a = HeadroomDriftBuffer(tau=0.25, drift_norm="l2", scan_skip_versions=2, **kw)
    b = HeadroomDriftBuffer(tau=0.25**2, drift_norm="mean_sq", scan_skip_versions=2, **kw)
    skipped = 0
    for step in range(10):
        if step:
            ra, rb = a.select(step, synth.SynthScorer(step)), b.select(step, synth.SynthScorer(step))
            assert ra.accepted_ids == rb.accepted_ids
            assert [(r.group_id, r.accepted, r.would_skip) for r in ra.records] == [
                (r.group_id, r.accepted, r.would_skip) for r in rb.records
            ]
            assert [s[0] for s in ra.skipped] == [s[0] for s in rb.skipped]
            skipped += len(ra.skipped) + sum(bool(r.would_skip) for r in ra.records)
        a.admit(synth.step_groups(7, step, 5), step)
        b.admit(synth.step_groups(7, step, 5), step)
    assert skipped > 0  # the rule had something to decide


@pytest.mark.parametrize("margin, versions", [(1.0, 1), (1.0, None), (2.0, 8)])
def test_the_papers_scan_is_unchanged_bit_for_bit_whatever_the_shadow(synth, margin, versions):
    """scan_skip=none: records, acceptances, scorer chunks and cached Headroom do not depend on the
    shadow rule's parameters (a rule that never skips: margin 1e9) -- the paper's scan."""

    def run(**kw):
        buf = HeadroomDriftBuffer(capacity=12, k_rep=3, tau=0.25, scan_chunk_groups=4, scan_skip="none", **kw)
        out = []
        for step in range(10):
            if step:
                scorer = synth.SynthScorer(step)
                result = buf.select(step, scorer, chunk_multiple=2)
                out.append((result, scorer.calls))
            buf.admit(synth.step_groups(7, step, 5), step)
        return buf, out

    shadowed, a = run(scan_skip_margin=margin, scan_skip_versions=versions)
    plain, b = run(scan_skip_margin=1e9, scan_skip_versions=None)
    flags = 0
    for (ra, ca), (rb, cb) in zip(a, b, strict=True):
        assert [dataclasses.replace(r, would_skip=None) for r in ra.records] == [
            dataclasses.replace(r, would_skip=None) for r in rb.records
        ]
        assert ra.accepted_ids == rb.accepted_ids and ca == cb and not ra.skipped
        assert {k: v for k, v in ra.stats.items() if "seconds" not in k and "shadow" not in k} == {
            k: v for k, v in rb.stats.items() if "seconds" not in k and "shadow" not in k
        }
        flags += sum(bool(r.would_skip) for r in ra.records)
    assert flags > 0  # the shadow did flag scans, and decided nothing
    assert [(g.group_id, g.headroom_cached, g.replay_count) for g in shadowed] == [
        (g.group_id, g.headroom_cached, g.replay_count) for g in plain
    ]
