"""Headroom-Drift Replay through verl's real GRPO loop on CPU (``replay.strategy=headroom_drift``).

One 6-step run checks that groups are scanned, accepted and rejected by the drift gate, and that
inside the actor update the replayed rows carried their stored anchor as ``old_log_probs`` and
their stored advantages (the loss records them with ``replay.audit_dir``). A second run is
interrupted after step 3 and resumed from its checkpoint: it must make the same selections.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from replay_audit import GROUP_REPLAY, first_fresh_occurrences, read_audit
from verl_replay.headroom_drift.buffer import HeadroomDriftBuffer
from verl_replay.headroom_drift.events import read_events

pytestmark = pytest.mark.e2e

# tau sits inside the drift range the tiny model shows after one update (about 0.01-0.1 RMS
# log-ratio at lr 1e-4), so the gate both accepts and rejects.
REPLAY = (
    "replay.strategy=headroom_drift",
    "replay.k_rep=2",
    "replay.tau=0.045",
    "replay.scan_chunk_groups=2",
)


def _selection_events(path) -> tuple[list[tuple], list[float]]:
    """What the buffer decided (exact) and the scores behind it (numbers), per event."""
    decisions, numbers = [], []
    for record in read_events(path):
        if record["event"] == "scan":
            decisions.append(("scan", record["step"], record["group_id"], record["rank"], record["accepted"]))
            numbers += [record["drift"], record["headroom_after"]]
        elif record["event"] == "ingress":
            decisions.append(("ingress", record["step"], record["group_id"]))
            numbers.append(record["initial_headroom"])
        elif record["event"] == "evict":
            decisions.append(("evict", record["step"], record["group_id"]))
    return decisions, numbers


def test_headroom_drift_replay_end_to_end(run_main, tmp_path):
    audit = tmp_path / "audit"
    run = run_main(*REPLAY, "trainer.total_training_steps=6", "trainer.save_freq=6", f"replay.audit_dir={audit}",
                   experiment="hd")
    metrics = run.metrics
    assert len(metrics) == 6
    scanned = sum(m["replay/scanned"] for m in metrics)
    accepted = sum(m["replay/accepted"] for m in metrics)
    rejected = sum(m["replay/rejected_drift"] for m in metrics)
    assert accepted > 0 and rejected > 0 and scanned == accepted + rejected
    for m in metrics:
        assert m["replay/accepted"] <= 2
        assert m["replay/drift_accepted/p90"] <= 0.045 + 1e-6 or m["replay/accepted"] == 0
        for key in ("actor/pg_loss", "critic/score/mean", "replay/buffer_size", "replay/token_share"):
            assert math.isfinite(m[key]), key

    # Inside the real update: every replayed row trained on the old log-probs the trainer computed
    # for those tokens when they were fresh (the synchronous anchor) and on their GRPO advantages
    # then: checked against the fresh rows the update itself recorded, not the buffer's copy.
    rows = read_audit(audit)
    fresh = first_fresh_occurrences(rows)
    replayed = [row for row in rows if row.source == GROUP_REPLAY]
    assert len(replayed) == 4 * accepted  # rollout.n rows per accepted group, each seen once per epoch
    for row in replayed:
        births = [b for b in fresh.get(row.tokens, []) if b.optimizer_step < row.optimizer_step]
        assert any(torch.equal(row.old_log_probs, b.old_log_probs) and torch.equal(row.advantage, b.advantage)
                   for b in births), "replayed row's anchor/advantages differ from what it carried when fresh"
    # and the buffer file agrees with what the update saw
    buffer = HeadroomDriftBuffer.from_file(run.run_dir / "checkpoints" / "global_step_6" / "replay" / "group_buffer.pt")
    for row in replayed:
        if row.group_id in buffer.groups_by_id:
            group = buffer.groups_by_id[row.group_id]
            offsets = group.response_offsets().tolist()
            index = next(i for i in range(group.n) if tuple(group.response_ids[offsets[i]:offsets[i + 1]].tolist()) == row.tokens[1])
            torch.testing.assert_close(row.old_log_probs, group.gen_log_probs[offsets[index]:offsets[index + 1]], rtol=0, atol=0)

    # Replayed rows are reported apart from the fresh rollouts' scores.
    assert any("replay/score/mean" in m for m in metrics)
    events = read_events(run.run_dir / "replay_events.jsonl")
    assert {e["event"] for e in events} >= {"ingress", "scan", "step"}

    # Interrupted after step 3 and resumed: the same selections, group for group.
    resumed = ("trainer.save_freq=3", f"replay.audit_dir={tmp_path / 'audit2'}")
    run_main(*REPLAY, "trainer.total_training_steps=3", *resumed, experiment="hd_resumed")
    second = run_main(*REPLAY, "trainer.total_training_steps=6", *resumed, experiment="hd_resumed")
    decisions, numbers = _selection_events(second.run_dir / "replay_events.jsonl")
    expected_decisions, expected_numbers = _selection_events(run.run_dir / "replay_events.jsonl")
    assert decisions == expected_decisions
    # Rows reach the update in a canonical order, so the resumed run is bitwise the straight one.
    assert numbers == expected_numbers
    assert [m["training/global_step"] for m in second.metrics] == [4, 5, 6]
    first_segment = [json.loads(line)["data"] for line in (second.run_dir / "metrics.1.jsonl").read_text().splitlines()]
    assert [m["training/global_step"] for m in first_segment] == [1, 2, 3]


def test_skipping_the_forwards_of_replayed_rows_changes_nothing(run_main):
    """Replayed rows keep their stored anchor, so their old-log-prob forward is skipped: the update
    must be exactly the one with the forward (``replay.recompute_replayed_log_probs=true``). Run on
    the synchronous trainer, whose runs are bitwise reproducible (under separate_async which fresh
    groups a round gets depends on which rollouts finish first)."""
    common = ("replay.strategy=headroom_drift", "replay.k_rep=2", "replay.tau=1.0", "trainer.total_training_steps=3")
    skipped = run_main(*common, experiment="skip").metrics
    recomputed = run_main(*common, "replay.recompute_replayed_log_probs=true", experiment="recompute").metrics
    assert sum(m["replay/accepted"] for m in skipped) > 0
    for a, b in zip(skipped, recomputed, strict=True):
        for key in ("replay/accepted", "critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm",
                    "actor/entropy"):
            assert a[key] == b[key], (key, a["training/global_step"], a[key], b[key])
