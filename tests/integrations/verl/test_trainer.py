"""The trainer mixin's own bookkeeping, on bare instances (no Ray): the held checkpoint and the
per-round totals. The hooks inside verl's real loop are covered by the end-to-end runs."""

from __future__ import annotations

import pytest

from verl_replay.config import ReplayConfig
from verl_replay.integrations.verl.rows import SOURCE_ELITE, SOURCE_FRESH, SOURCE_GROUP_REPLAY
from verl_replay.integrations.verl.trainer import ReplaySeparateAsyncTrainer, _StepTotals


class Tracker:
    """verl's Tracking as fit uses it: ``log(data=..., step=...)``."""

    def __init__(self, journal: list) -> None:
        self.journal = journal

    def log(self, data, step):
        self.journal.append(("line", step))


def bare_trainer(journal: list, strategy: str = "headroom_drift") -> ReplaySeparateAsyncTrainer:
    trainer = ReplaySeparateAsyncTrainer.__new__(ReplaySeparateAsyncTrainer)
    trainer.replay_config = ReplayConfig.from_mapping({"strategy": strategy})
    trainer.group_replay = object() if strategy != "none" else None
    trainer.elite_replay = None
    trainer._held_checkpoint = None
    trainer._held_save_seconds = 0.0
    trainer._save_checkpoint_now = lambda: journal.append(("save", trainer.global_steps))
    return trainer


def test_a_checkpoint_is_saved_only_after_its_steps_metrics_line():
    journal: list = []
    trainer = bare_trainer(journal)
    trainer.global_steps = 3
    trainer._save_checkpoint()  # before fit made its logger (no step ran yet): at once
    assert journal == [("save", 3)]
    journal.clear()
    trainer.logger = Tracker(journal)
    trainer._hold_checkpoints_until_logged()
    trainer._hold_checkpoints_until_logged()  # wrapped once
    trainer.global_steps = 4
    trainer._save_checkpoint()  # where fit saves: right after step()
    assert journal == []
    trainer.logger.log(data={"x": 1}, step=4)
    trainer.logger.log(data={"x": 1}, step=4)  # one save per checkpoint
    trainer.global_steps = 5
    trainer.logger.log(data={}, step=5)  # a step without a checkpoint
    assert journal == [("line", 4), ("save", 4), ("line", 4), ("line", 5)]
    assert trainer._held_save_seconds >= 0.0


def test_without_replay_the_checkpoint_is_verls_own():
    journal: list = []
    trainer = bare_trainer(journal, strategy="none")
    trainer.logger = Tracker(journal)
    trainer.global_steps = 2
    trainer._save_checkpoint()
    assert journal == [("save", 2)]


def test_round_totals_add_up_to_the_step():
    totals = _StepTotals()
    marks = []
    for round_index in range(3):
        marks.append(totals.mark())
        totals.optimizer_steps += 2
        totals.tokens[SOURCE_FRESH] += 10
        totals.tokens[SOURCE_GROUP_REPLAY] += 5 * round_index
        totals.tokens[SOURCE_ELITE] += 1
        totals.replay_seconds += 0.5
        share = totals.since(marks[-1])
        assert share == {
            "optimizer_steps": 2.0,
            "tokens_fresh": 10.0,
            "tokens_group_replay": 5.0 * round_index,
            "tokens_elite": 1.0,
            "replay_seconds": pytest.approx(0.5),
        }
    metrics = totals.metrics(scan_forward_seconds=0.25, end_step_seconds=0.1)
    assert metrics["replay/optimizer_steps"] == 6.0  # a total, not a mean over the rounds
    assert metrics["replay/token_share"] == pytest.approx(15 / 48)
    assert metrics["replay/elite/token_share"] == pytest.approx(3 / 48)
    assert metrics["replay/overhead_seconds"] == pytest.approx(1.25)
    assert metrics["replay/end_step_seconds"] == 0.1
