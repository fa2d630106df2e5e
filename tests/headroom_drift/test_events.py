"""ReplayEventLog / read_events: schema, per-step flush, append/resume, crash leftovers."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from verl_replay.headroom_drift.buffer import HeadroomDriftBuffer
from verl_replay.headroom_drift.events import (
    EVENT_TYPES,
    ReplayEventLog,
    buffer_state_record,
    fresh_record,
    read_events,
    round_record,
    scan_record,
    step_record,
)


def _run_logged(synth, log: ReplayEventLog, steps: range, buf: HeadroomDriftBuffer, seed=5):
    totals = Counter()
    for step in steps:
        res = buf.select(step, synth.SynthScorer(step))
        log.log_selection(res)
        adm = buf.admit(synth.step_groups(seed, step, 4), step)
        log.log_admit(adm)
        totals["scan"] += len(res.records)
        totals["ingress"] += adm["ingress"]
        totals["evict"] += adm["evicted"]
        totals["accepted"] += len(res.groups)
        log.log_step(step, {**res.stats, "ingress": adm["ingress"], "evicted": adm["evicted"]})
    return totals


def _buf():
    return HeadroomDriftBuffer(capacity=6, k_rep=2, tau=0.3, scan_chunk_groups=2)


def test_log_matches_buffer_activity(synth, tmp_path):
    path = tmp_path / "run" / "replay_events.jsonl"
    buf = _buf()
    with ReplayEventLog(path) as log:
        totals = _run_logged(synth, log, range(8), buf)
    ev = read_events(path)
    kinds = Counter(e["event"] for e in ev)
    assert kinds["scan"] == totals["scan"] and kinds["ingress"] == totals["ingress"]
    assert kinds["evict"] == totals["evict"] > 0 and kinds["step"] == 8
    assert sum(e["accepted"] for e in ev if e["event"] == "scan") == totals["accepted"] > 0
    # an evicted group's lifetime replay count = its accepted scans in the log
    acc = Counter(e["group_id"] for e in ev if e["event"] == "scan" and e["accepted"])
    for e in (e for e in ev if e["event"] == "evict"):
        assert e["lifetime_replay_count"] == acc[e["group_id"]]
    # scan events carry the ranking position, the age and both Headroom values
    s = next(e for e in ev if e["event"] == "scan")
    assert {"step", "group_id", "rank", "drift", "headroom_before", "headroom_after", "accepted", "age"} <= set(s)
    steps = [e for e in ev if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(8))
    assert steps[-1]["stats"]["buffer_size"] == 6.0 and "ingress" in steps[-1]["stats"]
    assert read_events(path, events=["step"]) == steps
    with pytest.raises(ValueError, match="events"):
        read_events(path, events=["bogus"])


def test_buffered_until_step_then_flushed(synth, tmp_path):
    path = tmp_path / "e.jsonl"
    buf = _buf()
    buf.admit(synth.step_groups(1, 0, 5), 0)
    log = ReplayEventLog(path)
    log.log_selection(buf.select(1, synth.SynthScorer(1)))
    assert len(log.pending) > 0 and path.read_text() == ""
    log.log_step(1, {"accepted": 1.0, "note": "text is dropped"})
    assert not log.pending
    last = read_events(path)[-1]
    assert last == {"event": "step", "step": 1, "stats": {"accepted": 1.0}}
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.flush()


def test_append_resume_and_crash_leftovers(synth, tmp_path):
    path = tmp_path / "e.jsonl"
    buf = _buf()
    with ReplayEventLog(path) as log:
        _run_logged(synth, log, range(0, 4), buf)
    first = read_events(path)
    n_first = len(first)
    # appending continues the same file
    with ReplayEventLog(path) as log:
        _run_logged(synth, log, range(4, 6), buf)
    all_ev = read_events(path)
    assert len(all_ev) > n_first and all_ev[:n_first] == first
    assert max(e["step"] for e in all_ev) == 5
    # a crash mid-write leaves an unterminated line: ignored on read, removed on reopen
    with open(path, "a") as fh:
        fh.write('{"event": "scan", "step": 6, "gro')
    assert read_events(path) == all_ev
    ReplayEventLog(path).close()
    assert path.read_text().endswith("\n") and read_events(path) == all_ev
    # resuming from the step-3 checkpoint drops what steps 4..5 wrote
    ReplayEventLog(path, resume_from_step=3).close()
    assert max(e["step"] for e in read_events(path)) == 3
    assert read_events(path) == [e for e in all_ev if e["step"] <= 3]


def test_malformed_lines_and_records_rejected(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"event": "step", "step": 0, "stats": {}}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_events(path)
    path.write_text('{"kind": "step"}\n')
    with pytest.raises(ValueError, match="not a replay event"):
        read_events(path)
    with ReplayEventLog(tmp_path / "ok.jsonl") as log:
        with pytest.raises(ValueError, match="event"):
            log.write({"event": "bogus"})


def test_infinite_drift_and_none_roundtrip(tmp_path):
    path = tmp_path / "e.jsonl"
    rec = scan_record(
        step=1,
        group_id=3,
        rank=1,
        drift=math.inf,
        replay_kl=None,
        headroom_before=0.5,
        headroom_after=0.4,
        accepted=False,
        age=2,
        birth_step=-1,
        generated_version=-3,
    )
    with ReplayEventLog(path) as log:
        log.write(rec)
        log.write(step_record(step=1, stats={"scanned": 1, "drift_scanned/mean": math.inf, "t": torch.tensor(1.0)}))
    back = read_events(path)
    assert back[0]["drift"] == math.inf and back[0]["replay_kl"] is None
    assert back[1]["stats"] == {"scanned": 1, "drift_scanned/mean": math.inf}


def test_fresh_round_and_buffer_state_records_roundtrip(tmp_path):
    path = tmp_path / "e.jsonl"
    records = [
        fresh_record(step=3, age=[1, 2], drift=[0.01, math.inf]),
        fresh_record(step=3, age=[1]),
        round_record(step=3, round=1, stats={"replay_rows": 8, "inject_seconds": 0.5, "note": "dropped"}),
        buffer_state_record("checkpoint", step=4, buffer_fingerprint="ab" * 32, buffer_size=7, next_group_id=9),
        buffer_state_record("resume", step=4, buffer_fingerprint="ab" * 32, buffer_size=7, next_group_id=9),
    ]
    with ReplayEventLog(path) as log:
        log.extend(records)
    back = read_events(path)
    assert back == records and {r["event"] for r in back} <= set(EVENT_TYPES)
    assert back[0]["drift"][1] == math.inf and back[1]["drift"] is None
    assert back[2]["stats"] == {"replay_rows": 8, "inject_seconds": 0.5}
    with pytest.raises(ValueError, match="2 drifts for 1 ages"):
        fresh_record(step=1, age=[1], drift=[0.1, 0.2])
    with pytest.raises(ValueError, match="'checkpoint' or 'resume'"):
        buffer_state_record("step", step=1, buffer_fingerprint="", buffer_size=0, next_group_id=0)
    # a resume from step 3 keeps the checkpoint of step 3 and drops what later steps wrote
    with ReplayEventLog(path, resume_from_step=3) as log:
        pass
    assert [r["event"] for r in read_events(path)] == ["fresh", "fresh", "round"]
