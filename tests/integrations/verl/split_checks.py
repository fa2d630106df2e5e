"""Checks of a group-replay run on the split placement (verl's ``separate_async`` trainer, 2 update
rounds per global step) against sources outside the replay code: the event log against the
metrics, the rows the real update trained on (``replay.audit_dir``) against what verl itself put
in the batch when those tokens were fresh, and verl's own rollout dump against ``critic/score``.
Shared by the split-placement tests and the TINY recipe test (the recipes' own path)."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from replay_audit import FRESH, GROUP_REPLAY, first_fresh_occurrences, read_audit, rows_per_optimizer_step

from verl_replay.headroom_drift.events import read_events

GROUP_SIZE = 4  # cpu_tiny's rollout.n
ROUND_PROMPTS = 2
SPLIT_OVERRIDES = (
    "trainer.v1.trainer_mode=separate_async",
    "trainer.v1.separate_async.parameter_sync_step=2",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={ROUND_PROMPTS}",
)


def _expected_optimizer_steps(accepted: int, rounds: int = 2, per_step: int = ROUND_PROMPTS) -> int:
    shares = [accepted // rounds + (1 if r < accepted % rounds else 0) for r in range(rounds)]
    return sum(math.ceil((ROUND_PROMPTS + share) / per_step) for share in shares)


def _scores_by_step(dump_dir) -> dict[int, list[tuple[str, float]]]:
    """verl's own rollout dump: (row key, score) of every row of each global step."""
    out = {}
    for path in sorted(dump_dir.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out[int(path.stem)] = [(line["uid"], float(line["score"])) for line in lines]
    return out


def check_group_replay_run(
    run_dir, metrics, audit, dump, *, k_rep: int = 2, steps: int = 5, rollout_correction: bool = True
) -> None:
    assert [m["training/global_step"] for m in metrics] == list(range(1, steps + 1))  # one line per global step

    # Selection once per global step, before its first round, from groups admitted earlier.
    events = read_events(run_dir / "replay_events.jsonl")
    born = {e["group_id"]: e["step"] for e in events if e["event"] == "ingress"}
    accepted_per_step = Counter()
    for event in (e for e in events if e["event"] == "scan"):
        assert event["step"] > born[event["group_id"]], f"group scanned in the step it was admitted: {event}"
        assert event["age"] >= 1
        if event["accepted"]:
            accepted_per_step[event["step"]] += 1
            assert event["round"] in (0, 1)
    replayed = [(e["step"], e["group_id"]) for e in events if e["event"] == "scan" and e["accepted"]]
    assert len(replayed) == len(set(replayed)), "a group was replayed twice in one global step"
    assert sum(1 for e in events if e["event"] == "step") == steps
    for m in metrics:
        step = int(m["training/global_step"])
        assert m["replay/accepted"] == accepted_per_step[step] <= k_rep
        # counts are totals of the global step, not averages over its rounds
        assert m["replay/replay_rows"] == GROUP_SIZE * m["replay/accepted"]
        assert m["replay/optimizer_steps"] == _expected_optimizer_steps(int(m["replay/accepted"]))
        assert m["replay/scan_forward_rows"] <= (m["replay/scanned"] + 1) * GROUP_SIZE or m["replay/scanned"] == 0
    total_accepted = sum(accepted_per_step.values())
    assert total_accepted > 0

    # Inside the real update: each replayed row trained on the rollout log-probs verl recorded for
    # those tokens when they were fresh (the async anchor) and on the advantages GRPO gave them then.
    rows = read_audit(audit)
    fresh = first_fresh_occurrences(rows)
    replay_rows = [row for row in rows if row.source == GROUP_REPLAY]
    assert len(replay_rows) == GROUP_SIZE * total_accepted  # each replayed row trained once
    for row in replay_rows:
        births = [b for b in fresh.get(row.tokens, []) if b.optimizer_step < row.optimizer_step]
        assert births, "a replayed row has no earlier fresh occurrence"
        assert any(
            torch.equal(row.old_log_probs, b.rollout_log_probs) and torch.equal(row.advantage, b.advantage)
            for b in births
        ), "replayed row's anchor/advantages differ from what it carried when fresh"
        if rollout_correction:  # the anchor is also the rollout log-probs, so the IS weight is exactly 1
            assert row.is_weights is not None and torch.all(row.is_weights == 1.0)
    # optimiser steps: as many as planned, each with its share of fresh rows
    steps = rows_per_optimizer_step(rows)
    assert len(steps) == sum(m["replay/optimizer_steps"] for m in metrics)
    assert all(any(r.source == FRESH and r.optimizer_step == s for r in rows) for s in steps)

    # Replayed rows stay out of verl's critic/score: it is the mean over the fresh rows alone.
    scores = _scores_by_step(dump)
    for m in metrics:
        step_rows = scores[int(m["training/global_step"])]
        fresh_scores = [score for key, score in step_rows if not key.startswith(("replay-", "elite-", "pad"))]
        assert len(fresh_scores) == 4 * GROUP_SIZE
        assert m["critic/score/mean"] == pytest.approx(sum(fresh_scores) / len(fresh_scores), abs=1e-6)
