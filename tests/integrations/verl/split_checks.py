"""Checks of a group-replay run on the split placement (verl's ``separate_async`` trainer, 2 update
rounds per global step) against sources outside the replay code: the rows the real update trained
on (``replay.audit_dir``, one record per micro-batch) against what verl itself put in the batch when
those tokens were fresh, the event log counted record by record against the metrics, verl's own
staleness metrics against the groups' generating versions, and verl's own rollout dump against
``critic/score``. Shared by the split-placement tests and the TINY recipe test (the recipes' own
path, with its crash and resume)."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional, Sequence

import pytest
import torch
from replay_audit import ELITE, FRESH, GROUP_REPLAY, AuditedRow, read_audit

from verl_replay.headroom_drift.events import read_events

GROUP_SIZE = 4  # cpu_tiny's rollout.n
ROUND_PROMPTS = 2
ROUNDS = 2
FRESH_GROUPS = ROUNDS * ROUND_PROMPTS  # fresh prompts per global step
SPLIT_OVERRIDES = (
    "trainer.v1.trainer_mode=separate_async",
    f"trainer.v1.separate_async.parameter_sync_step={ROUNDS}",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={ROUND_PROMPTS}",
)


def _expected_optimizer_steps(accepted: int, epochs: int = 1, per_step: int = ROUND_PROMPTS) -> int:
    shares = [accepted // ROUNDS + (1 if r < accepted % ROUNDS else 0) for r in range(ROUNDS)]
    return epochs * sum(math.ceil((ROUND_PROMPTS + share) / per_step) for share in shares)


def _scores_by_step(dump_dir) -> dict[int, list[tuple[str, float]]]:
    """verl's own rollout dump: (row key, score) of every row of each global step."""
    out = {}
    for path in sorted(Path(dump_dir).glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out[int(path.stem)] = [(line["uid"], float(line["score"])) for line in lines]
    return out


def _valid(row: AuditedRow) -> int:
    return len(row.tokens[1])


def check_group_replay_run(
    run_dir,
    metrics: Sequence[dict],
    audit,
    dump,
    *,
    k_rep: int = 2,
    steps: int = 5,
    rollout_correction: bool = True,
    epochs: int = 1,
    elite: bool = False,
    drift_floor: bool = True,
    first_step: int = 1,
) -> None:
    """``audit``: the audit folder, or the rows already read (a crashed and resumed run's merged
    records). ``metrics``: one dict per global step, in order."""
    assert [m["training/global_step"] for m in metrics] == list(range(first_step, steps + 1))  # one line per step
    events = read_events(Path(run_dir) / "replay_events.jsonl")
    rows = read_audit(audit) if isinstance(audit, (str, Path)) else list(audit)
    check_event_log_totals(events, metrics, k_rep=k_rep)
    check_round_totals(events, metrics)
    check_update_audit_totals(rows, metrics, epochs=epochs, elite=elite)
    check_ages_and_drift_floor(events, metrics, rows, drift_floor=drift_floor)
    check_replayed_rows_trained_on_their_anchor(rows, metrics, rollout_correction=rollout_correction)
    if dump is not None:
        check_fresh_only_scores(metrics, dump)


def check_event_log_totals(events: list[dict], metrics: Sequence[dict], *, k_rep: int) -> None:
    """Selection once per global step, before its first round, from groups admitted earlier; every
    count a total of the global step, as the event log's records add up."""
    born = {e["group_id"]: e["step"] for e in events if e["event"] == "ingress"}
    per_step: dict[int, Counter] = defaultdict(Counter)
    for event in events:
        if event["event"] in ("scan", "ingress", "evict"):
            per_step[event["step"]][event["event"]] += 1
        if event["event"] == "scan":
            assert event["step"] > born[event["group_id"]], f"group scanned in the step it was admitted: {event}"
            if event["accepted"]:
                per_step[event["step"]]["accepted"] += 1
                assert event["round"] in range(ROUNDS)
    replayed = [(e["step"], e["group_id"]) for e in events if e["event"] == "scan" and e["accepted"]]
    assert len(replayed) == len(set(replayed)), "a group was replayed twice in one global step"
    steps = [e["step"] for e in events if e["event"] == "step"]
    first = int(metrics[0]["training/global_step"])
    assert [s for s in steps if s >= first] == [int(m["training/global_step"]) for m in metrics]
    assert steps == sorted(set(steps)), "a step summary is missing or repeated"
    size = sum(counts["ingress"] - counts["evict"] for step, counts in per_step.items() if step < first)
    for m in metrics:
        counts = per_step[int(m["training/global_step"])]
        assert m["replay/candidates"] == size  # the buffer as the step began
        size += counts["ingress"] - counts["evict"]
        assert m["replay/accepted"] == counts["accepted"] <= k_rep
        assert m["replay/scanned"] == counts["scan"]
        assert m["replay/ingress"] == counts["ingress"] and m["replay/evicted"] == counts["evict"]
        assert m["replay/buffer_size"] == size
        if "replay/drift_scanned/mean" in m:  # every group given to the scorer went through the forward
            given = (m["replay/scanned"] + m["replay/scan_unused_groups"]) * GROUP_SIZE
            assert given <= m["replay/scan_forward_rows"]  # padded at most to the next chunk multiple
            assert m["replay/scan_forward_rows"] <= given + GROUP_SIZE or m["replay/scanned"] == 0
        else:  # the naive baseline scores nothing
            assert m["replay/scan_forward_rows"] == 0
        assert m["replay/replay_rows"] == GROUP_SIZE * m["replay/accepted"]
    assert sum(m["replay/accepted"] for m in metrics) > 0


def check_round_totals(events: list[dict], metrics: Sequence[dict]) -> None:
    """The step's counts, tokens and seconds are the sums of its rounds' records: never an average
    over the rounds, never one round alone."""
    rounds: dict[int, list[dict]] = defaultdict(list)
    for event in events:
        if event["event"] == "round":
            rounds[event["step"]].append(event)
    for m in metrics:
        step = int(m["training/global_step"])
        records = sorted(rounds[step], key=lambda e: e["round"])
        assert [e["round"] for e in records] == list(range(ROUNDS)), (step, records)

        def total(key: str, records: list[dict] = records) -> float:
            return sum(e["stats"][key] for e in records)

        assert total("replay_groups") == m["replay/accepted"]
        assert total("replay_rows") == m["replay/replay_rows"]
        assert total("optimizer_steps") == m["replay/optimizer_steps"]
        assert total("inject_seconds") == pytest.approx(m["replay/inject_seconds"], rel=1e-9, abs=1e-12)
        tokens = total("tokens_fresh") + total("tokens_group_replay") + total("tokens_elite")
        assert total("tokens_group_replay") / tokens == pytest.approx(m["replay/token_share"], rel=1e-12)
        assert total("tokens_elite") / tokens == pytest.approx(m["replay/elite/token_share"], rel=1e-12, abs=0)
        in_replay_code = total("replay_seconds") + m["replay/end_step_seconds"]
        assert in_replay_code == pytest.approx(m["replay/overhead_seconds"] + m["replay/scan_forward_seconds"], 1e-9)
        assert m["replay/select_seconds"] >= m["replay/scan_forward_seconds"]
        assert in_replay_code <= m["timing_s/step"]


def check_update_audit_totals(rows: list[AuditedRow], metrics: Sequence[dict], *, epochs: int, elite: bool) -> None:
    """Against what the update trained on, per global step: every replayed group at most once (its
    rows once per PPO epoch), as many groups as the metrics say, their rows and tokens, the token
    shares and the optimiser steps."""
    by_step: dict[int, list[AuditedRow]] = defaultdict(list)
    for row in rows:
        assert row.global_step >= 1, "an audit record without its global step"
        by_step[row.global_step].append(row)
    for m in metrics:
        step = int(m["training/global_step"])
        step_rows = by_step[step]
        fresh = [row for row in step_rows if row.source == FRESH]
        replayed = [row for row in step_rows if row.source == GROUP_REPLAY]
        assert len(fresh) == FRESH_GROUPS * GROUP_SIZE * epochs
        per_group: dict[int, list[AuditedRow]] = defaultdict(list)
        for row in replayed:
            per_group[row.group_id].append(row)
        for group_id, group_rows in per_group.items():  # once per step: its n rows, once per PPO epoch
            assert len(group_rows) == GROUP_SIZE * epochs, (
                f"group {group_id} trained {len(group_rows)} rows in step {step}"
            )
        assert len(per_group) == m["replay/accepted"]
        assert len(replayed) == epochs * m["replay/replay_rows"]
        replay_tokens = sum(map(_valid, replayed))
        assert replay_tokens == epochs * m["replay/replay_tokens"]
        all_tokens = sum(map(_valid, step_rows))
        assert replay_tokens / all_tokens == pytest.approx(m["replay/token_share"], rel=1e-12)
        elite_tokens = sum(_valid(row) for row in step_rows if row.source == ELITE)
        assert elite_tokens / all_tokens == pytest.approx(m["replay/elite/token_share"], rel=1e-12, abs=0)
        assert (elite_tokens > 0) == elite
        optimizer_steps = {row.optimizer_step for row in step_rows}
        assert len(optimizer_steps) == m["replay/optimizer_steps"]
        assert optimizer_steps == {row.optimizer_step for row in fresh}  # each with its share of fresh rows
        assert m["replay/optimizer_steps"] == _expected_optimizer_steps(int(m["replay/accepted"]), epochs)
        assert {row.round for row in step_rows} == set(range(ROUNDS))


def check_ages_and_drift_floor(
    events: list[dict], metrics: Sequence[dict], rows: list[AuditedRow], *, drift_floor: bool
) -> None:
    """Generating versions and ages against verl's own staleness metrics; the drift floor against the
    log-probs the update itself trained the fresh rows on."""
    ingress = {e["group_id"]: e for e in events if e["event"] == "ingress"}
    fresh_records = {e["step"]: e for e in events if e["event"] == "fresh"}
    for event in ingress.values():
        assert event["generated_version"] <= event["step"] - 1, event  # generated before its step's update
        assert event["birth_step"] == event["step"]
    by_step = {int(m["training/global_step"]): m for m in metrics}
    for event in (e for e in events if e["event"] == "scan" and e["step"] in by_step):
        born = ingress[event["group_id"]]
        assert event["generated_version"] == born["generated_version"] and event["birth_step"] == born["step"]
        assert event["age"] == event["step"] - 1 - born["generated_version"]  # weight versions since generation
        if event["accepted"]:  # replayed groups are at least as stale as the fresh rows they join
            assert event["age"] >= by_step[event["step"]]["training/off_policy/trajectory_staleness_worst/max"], event
    for step, m in by_step.items():
        # verl's staleness metrics count the same versions from the rows' own tags (per row: a group's age
        # is its oldest row's)
        staleness = "training/off_policy/trajectory_staleness_worst"
        assert m["replay/age_fresh/max"] == m[f"{staleness}/max"]
        assert m[f"{staleness}/mean"] - 1e-9 <= m["replay/age_fresh/mean"] <= m[f"{staleness}/max"]
        record = fresh_records[step]
        assert len(record["age"]) == FRESH_GROUPS and max(record["age"]) == m["replay/age_fresh/max"]
        if not drift_floor:
            assert record["drift"] is None and not any(key.startswith("replay/drift_fresh") for key in m)
            continue
        for key in ("replay/drift_fresh/mean", "replay/drift_fresh/p50", "replay/drift_fresh/p90"):
            assert key in m and math.isfinite(m[key]) and m[key] >= 0, (step, key)
        assert m["replay/drift_fresh/mean"] == pytest.approx(sum(record["drift"]) / len(record["drift"]), rel=1e-6)
        # the same statistic recomputed from the old and rollout log-probs the update saw for the fresh rows
        assert sorted(record["drift"]) == pytest.approx(_fresh_drifts(rows, step), rel=1e-5, abs=1e-7)


def _fresh_drifts(rows: list[AuditedRow], step: int) -> list[float]:
    """RMS of (trainer's old log-probs - rollout log-probs) over each fresh group's valid tokens, from
    the rows the update trained on (a group: the fresh rows of the step that share a prompt; a row
    recorded once per PPO epoch repeats every token equally often, which leaves the RMS as it is)."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for row in rows:
        if row.global_step == step and row.source == FRESH:
            groups[row.tokens[0]].append((row.old_log_probs - row.rollout_log_probs).double())
    assert len(groups) == FRESH_GROUPS
    return sorted(float(torch.cat(parts).pow(2).mean().sqrt()) for parts in groups.values())


def check_replayed_rows_trained_on_their_anchor(
    rows: list[AuditedRow], metrics: Sequence[dict], *, rollout_correction: bool
) -> None:
    """Inside the real update: each replayed row trained on the rollout log-probs verl recorded for
    those tokens when they were fresh (the async anchor) and on the advantages GRPO gave them then."""
    steps = {int(m["training/global_step"]) for m in metrics}
    fresh: dict[tuple, list[AuditedRow]] = defaultdict(list)
    for row in rows:
        if row.source == FRESH:
            fresh[row.tokens].append(row)
    replay_rows = [row for row in rows if row.source == GROUP_REPLAY and row.global_step in steps]
    assert replay_rows
    for row in replay_rows:
        births = [b for b in fresh.get(row.tokens, []) if b.global_step < row.global_step]
        assert births, "a replayed row has no fresh occurrence in an earlier global step"
        assert any(
            torch.equal(row.old_log_probs, b.rollout_log_probs) and torch.equal(row.advantage, b.advantage)
            for b in births
        ), "replayed row's anchor/advantages differ from what it carried when fresh"
        if rollout_correction:  # the anchor is also the rollout log-probs, so the IS weight is exactly 1
            assert row.is_weights is not None and torch.all(row.is_weights == 1.0)


def check_fresh_only_scores(metrics: Sequence[dict], dump, *, fresh_groups: Optional[int] = FRESH_GROUPS) -> None:
    """Replayed rows stay out of verl's critic/score: it is the mean over the fresh rows alone."""
    scores = _scores_by_step(dump)
    for m in metrics:
        step_rows = scores[int(m["training/global_step"])]
        fresh_scores = [score for key, score in step_rows if not key.startswith(("replay-", "elite-", "pad"))]
        assert len(fresh_scores) == fresh_groups * GROUP_SIZE
        assert m["critic/score/mean"] == pytest.approx(sum(fresh_scores) / len(fresh_scores), abs=1e-6)
