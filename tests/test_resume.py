"""verl_replay.resume: a resumed run takes its saved config; command-line settings must agree."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl_replay.resume import (
    ResumeConflict,
    ResumeError,
    adopt_saved_config,
    conflicting_overrides,
    describe_conflicts,
    load_saved_config,
)


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    """A config folder with one group, ``platform``, whose two choices set different batch sizes."""
    folder = tmp_path / "config" / "platform"
    folder.mkdir(parents=True)
    (folder / "small.yaml").write_text("# @package _global_\ndata:\n  train_batch_size: 4\n")
    (folder / "big.yaml").write_text("# @package _global_\ndata:\n  train_batch_size: 256\n")
    return folder.parent


def _saved(run_dir: str = "/runs/a") -> OmegaConf:
    return OmegaConf.create(
        {
            "run_dir": run_dir,
            "verbose": False,
            "data": {"train_batch_size": 4, "train_files": ["/d/train.parquet"]},
            "trainer": {
                "logger": ["file"],
                "total_training_steps": 6,
                "resume_mode": "auto",
                "default_local_dir": f"{run_dir}/checkpoints",
            },
            "replay": {"strategy": "headroom_drift", "tau": 0.08, "event_log": f"{run_dir}/replay_events.jsonl"},
        }
    )


def _composed(**changes) -> OmegaConf:
    """What Hydra composes from the defaults plus the command line (strategy none, 3 steps)."""
    composed = _saved()
    composed.replay.strategy = "none"
    composed.trainer.total_training_steps = 3
    composed.trainer.logger = ["console", "file"]
    for key, value in changes.items():
        OmegaConf.update(composed, key, value, merge=False)
    return composed


def test_only_settings_given_against_the_saved_ones_conflict(config_dir):
    saved = _saved()
    given = _composed(**{"replay.strategy": "headroom_drift", "replay.tau": 0.1})
    overrides = ["run_dir=/runs/a", "replay.strategy=headroom_drift", "replay.tau=0.1", "hydra.searchpath=[x]"]
    assert conflicting_overrides(saved, given, overrides, config_dir=config_dir) == [
        ResumeConflict("replay.tau", 0.08, 0.1)
    ]
    # not given: the saved value is kept, whatever the default (strategy none, 3 steps) says
    assert conflicting_overrides(saved, _composed(), ["run_dir=/runs/a"], config_dir=config_dir) == []


def test_resume_time_settings_and_the_quiet_consoles_logger_never_conflict(config_dir):
    overrides = [
        "trainer.total_training_steps=9",
        "trainer.resume_mode=resume_path",
        "verbose=true",
        "trainer.logger=[console,file]",
    ]
    given = _composed(**{"trainer.total_training_steps": 9, "trainer.resume_mode": "resume_path", "verbose": True})
    assert conflicting_overrides(_saved(), given, overrides, config_dir=config_dir) == []
    given.trainer.logger = ["console", "file", "wandb"]
    (conflict,) = conflicting_overrides(_saved(), given, overrides, config_dir=config_dir)
    assert conflict == ResumeConflict("trainer.logger", ["file"], ["file", "wandb"])


def test_a_config_group_choice_conflicts_where_its_file_sets_another_value(config_dir):
    assert conflicting_overrides(_saved(), _composed(), ["platform=small"], config_dir=config_dir) == []
    given = _composed(**{"data.train_batch_size": 256})
    assert conflicting_overrides(_saved(), given, ["platform=big"], config_dir=config_dir) == [
        ResumeConflict("platform (data.train_batch_size)", 4, 256)
    ]


def test_a_deleted_or_added_setting_conflicts_with_a_saved_value():
    saved = _saved()
    given = _composed()
    del given.replay["tau"]
    (conflict,) = conflicting_overrides(saved, given, ["~replay.tau"], config_dir=Path("/nonexistent"))
    assert conflict == ResumeConflict("replay.tau", 0.08, "(not set)")


def test_the_adopted_config_is_the_saved_one_with_given_resume_time_settings():
    given = _composed(**{"trainer.total_training_steps": 9})
    adopted = adopt_saved_config(_saved(), given, Path("/runs/a"), ["trainer.total_training_steps=9"])
    assert adopted.replay.strategy == "headroom_drift" and adopted.replay.tau == 0.08
    assert adopted.trainer.total_training_steps == 9 and adopted.trainer.logger == ["file"]
    # a resume-time setting not on the command line keeps its saved value, not the composed default
    assert adopt_saved_config(_saved(), given, Path("/runs/a"), []).trainer.total_training_steps == 6
    assert OmegaConf.is_struct(adopted)


def test_a_run_dir_copied_elsewhere_resumes_where_it_is_now():
    adopted = adopt_saved_config(_saved("/runs/a"), _composed(), Path("/copies/a2"), [])
    assert adopted.run_dir == "/copies/a2"
    assert adopted.trainer.default_local_dir == "/copies/a2/checkpoints"
    assert adopted.replay.event_log == "/copies/a2/replay_events.jsonl"
    assert list(adopted.data.train_files) == ["/d/train.parquet"]  # paths outside the run dir are kept
    # a sibling whose name only starts like the run dir is not moved
    saved = _saved("/runs/a")
    saved.replay.event_log = "/runs/ab/events.jsonl"
    assert adopt_saved_config(saved, _composed(), Path("/copies/a2"), []).replay.event_log == "/runs/ab/events.jsonl"


def test_the_refusal_names_saved_and_given_values_and_how_to_resume():
    line = describe_conflicts(Path("/runs/a"), [ResumeConflict("replay.strategy", "headroom_drift", "naive")])
    assert line == (
        "run_dir /runs/a resumes a run saved with replay.strategy=headroom_drift (given naive): a resumed run keeps "
        "the settings it was started with; drop these overrides (run_dir=/runs/a alone resumes it), or start a new "
        "run (another run_dir, or none for a new folder)"
    )


def test_a_saved_config_is_read_back_or_refused_by_name(tmp_path):
    assert load_saved_config(tmp_path, "config.yaml") is None
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(_saved()))
    assert load_saved_config(tmp_path, "config.yaml").replay.tau == 0.08
    (tmp_path / "config.yaml").write_text("trainer: [unclosed")
    with pytest.raises(ResumeError, match=r"config.yaml cannot be read"):
        load_saved_config(tmp_path, "config.yaml")
    (tmp_path / "config.yaml").write_text("just: a mapping\n")
    with pytest.raises(ResumeError, match=r"is not a verl_replay run config"):
        load_saved_config(tmp_path, "config.yaml")
