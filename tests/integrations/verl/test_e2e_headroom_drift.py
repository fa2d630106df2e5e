"""Headroom-Drift Replay through verl's real GRPO loop on CPU (``replay.strategy=headroom_drift``).

One 6-step run checks that groups are scanned, accepted and rejected by the drift gate, and that
inside the actor update the replayed rows carried their stored anchor as ``old_log_probs`` and
their stored advantages (the loss records them with ``replay.audit_dir``); a run of the same seed
with replay off shows that the fresh rows of the steps up to the first replay are untouched. A second run, with the
replayed rows' old-log-prob forward recomputed (``replay.recompute_replayed_log_probs=true``), is
killed with SIGKILL at a random point after a checkpoint and resumed by naming its run dir: step for
step it must make the same selections and the same update, bitwise, as the straight run, which
skips that forward (so one pair of runs checks both the skip and the resume).
"""

from __future__ import annotations

import math

import pytest
import torch
from crash import kill_after_checkpoint
from independent_checks import check_fresh_rows_untouched
from replay_audit import GROUP_REPLAY, first_fresh_occurrences, read_audit
from reproducible_rollout import HF_ROLLOUT

from verl_replay.compare.collect import read_metrics
from verl_replay.headroom_drift.buffer import HeadroomDriftBuffer
from verl_replay.headroom_drift.events import read_events

# what this file's verl runs take on 2 cores (tests/conftest.py starts the longest first)
E2E_SECONDS = 420

pytestmark = pytest.mark.e2e

# tau sits inside the drift range the tiny model shows after one update (about 0.01-0.1 RMS
# log-ratio at lr 1e-4), so the gate both accepts and rejects.
TAU = 0.045
REPLAY = (
    *HF_ROLLOUT,  # every run here is compared with another of the same seed, token for token
    "replay.strategy=headroom_drift",
    "replay.k_rep=2",
    f"replay.tau={TAU}",
    "replay.scan_chunk_groups=2",
)


def check_gate_decisions(events: list[dict], metrics: list[dict], *, tau: float, k_rep: int) -> None:
    """Every scanned group against tau, both ways: accepted exactly when its drift <= tau; each step's
    scan ends at its K_rep-th acceptance or after its last candidate (the drifts themselves are
    recomputed from an independent forward on the split placement, test_e2e_split.py)."""
    by_step: dict[int, list[dict]] = {}
    for event in events:
        if event["event"] == "scan":
            by_step.setdefault(event["step"], []).append(event)
    for m in metrics:
        scans = sorted(by_step.get(int(m["training/global_step"]), []), key=lambda e: e["rank"])
        for event in scans:
            assert event["accepted"] == (event["drift"] <= tau), event
        accepted = sum(e["accepted"] for e in scans)
        assert accepted == m["replay/accepted"] and len(scans) - accepted == m["replay/rejected_drift"]
        if accepted == k_rep:
            assert scans[-1]["accepted"], "the scan went on after the K_rep-th acceptance"
        else:
            assert len(scans) == m["replay/candidates"], "the scan stopped before K_rep acceptances"


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


def test_headroom_drift_replay_end_to_end(run_main, spawn_main, tmp_path):
    audit = tmp_path / "audit"
    run = run_main(
        *REPLAY, "trainer.total_training_steps=6", "trainer.save_freq=6", f"replay.audit_dir={audit}", experiment="hd"
    )
    metrics = run.metrics
    assert len(metrics) == 6
    scanned = sum(m["replay/scanned"] for m in metrics)
    accepted = sum(m["replay/accepted"] for m in metrics)
    rejected = sum(m["replay/rejected_drift"] for m in metrics)
    assert accepted > 0 and rejected > 0 and scanned == accepted + rejected
    for m in metrics:
        assert m["replay/accepted"] <= 2
        for key in ("actor/pg_loss", "critic/score/mean", "replay/buffer_size", "replay/token_share"):
            assert math.isfinite(m[key]), key
    check_gate_decisions(read_events(run.run_dir / "replay_events.jsonl"), metrics, tau=TAU, k_rep=2)

    # Inside the real update: every replayed row trained on the old log-probs the trainer computed
    # for those tokens when they were fresh (the synchronous anchor) and on their GRPO advantages
    # then: checked against the fresh rows the update itself recorded, not the buffer's copy.
    rows = read_audit(audit)
    fresh = first_fresh_occurrences(rows)
    replayed = [row for row in rows if row.source == GROUP_REPLAY]
    assert len(replayed) == 4 * accepted  # rollout.n rows per accepted group, each seen once per epoch
    for row in replayed:
        births = [b for b in fresh.get(row.tokens, []) if b.optimizer_step < row.optimizer_step]
        assert any(
            torch.equal(row.old_log_probs, b.old_log_probs) and torch.equal(row.advantage, b.advantage) for b in births
        ), "replayed row's anchor/advantages differ from what it carried when fresh"
    # and the buffer file agrees with what the update saw
    buffer = HeadroomDriftBuffer.from_file(run.run_dir / "checkpoints" / "global_step_6" / "replay" / "group_buffer.pt")
    for row in replayed:
        if row.group_id in buffer.groups_by_id:
            group = buffer.groups_by_id[row.group_id]
            offsets = group.response_offsets().tolist()
            index = next(
                i
                for i in range(group.n)
                if tuple(group.response_ids[offsets[i] : offsets[i + 1]].tolist()) == row.tokens[1]
            )
            torch.testing.assert_close(
                row.old_log_probs, group.gen_log_probs[offsets[index] : offsets[index + 1]], rtol=0, atol=0
            )

    # Replayed rows are reported apart from the fresh rollouts' scores.
    assert any("replay/score/mean" in m for m in metrics)

    # Fresh rows untouched: the same seed with replay off (verl's own GRPO), through the first step
    # that trained on replayed rows, gives the same fresh responses, advantages, old log-probs and
    # fresh-only metrics.
    first_replay = next(int(m["training/global_step"]) for m in metrics if m["replay/accepted"] > 0)
    assert first_replay <= 3, f"no replayed group before step {first_replay}: the off run would be long"
    off = run_main(
        *HF_ROLLOUT,
        "replay.strategy=none",
        f"trainer.total_training_steps={first_replay}",
        f"replay.audit_dir={tmp_path / 'audit_off'}",
        experiment="off",
    )
    replayed_rows = check_fresh_rows_untouched(
        rows, read_audit(tmp_path / "audit_off"), metrics, off.metrics, through_step=first_replay
    )
    assert replayed_rows > 0

    events = read_events(run.run_dir / "replay_events.jsonl")
    assert {e["event"] for e in events} >= {"ingress", "scan", "step"}

    # Killed with SIGKILL at a random point after a checkpoint, then resumed by naming its run dir:
    # the same selections, group for group. This pair recomputes the replayed rows' old-log-prob
    # forward that the straight run skips (they keep their stored anchor): the update must be the
    # same bitwise, before the kill and after the resume.
    crashed_dir = tmp_path / "outputs" / "hd_crashed"
    checkpointed = (
        "trainer.save_freq=2",
        f"replay.audit_dir={tmp_path / 'audit2'}",
        "replay.recompute_replayed_log_probs=true",
    )
    killed_after = kill_after_checkpoint(
        spawn_main(
            *REPLAY, "trainer.total_training_steps=6", *checkpointed, experiment="hd_crashed", run_dir=crashed_dir
        ),
        crashed_dir / "checkpoints" / "latest_checkpointed_iteration.txt",
    )
    second = run_main(
        *REPLAY, "trainer.total_training_steps=6", *checkpointed, experiment="hd_crashed", run_dir=crashed_dir
    )
    assert "resuming outputs/hd_crashed" in second.output
    assert [m["training/global_step"] for m in second.metrics] == list(range(killed_after + 1, 7))
    # The killed run's metrics were kept aside (metrics.1.jsonl): every step up to its checkpoint, the
    # checkpointed step included (a checkpoint is marked latest only after its step's line is written).
    recomputed = {step: data for step, data in read_metrics(crashed_dir / "metrics.1.jsonl") if step <= killed_after}
    assert sorted(recomputed) == list(range(1, killed_after + 1))
    recomputed.update((m["training/global_step"], m) for m in second.metrics)
    assert sum(recomputed[step]["replay/accepted"] for step in recomputed) > 0  # replayed rows in the compared steps
    for step, again in recomputed.items():
        straight = metrics[step - 1]
        for key in (
            "replay/accepted",
            "critic/score/mean",
            "actor/pg_loss",
            "actor/ppo_kl",
            "actor/grad_norm",
            "actor/entropy",
        ):
            assert straight[key] == again[key], (key, step, straight[key], again[key])
    decisions, numbers = _selection_events(second.run_dir / "replay_events.jsonl")
    expected_decisions, expected_numbers = _selection_events(run.run_dir / "replay_events.jsonl")
    assert decisions == expected_decisions
    # Rows reach the update in a canonical order, so the resumed run is bitwise the straight one.
    assert numbers == expected_numbers
    # each global step's records once: the killed run's records past its checkpoint were dropped
    steps = [e["step"] for e in read_events(second.run_dir / "replay_events.jsonl") if e["event"] == "step"]
    assert steps == [1, 2, 3, 4, 5, 6]
