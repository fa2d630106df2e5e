"""verl_replay.integrations.verl.console: the compact step line and verl's output routing."""

from __future__ import annotations

import json
import threading
import time

from omegaconf import OmegaConf

from verl_replay.config import ReplayConfig
from verl_replay.integrations.verl.console import (
    DriftFloorWatch,
    StartupWatch,
    StepFollower,
    describe_failure,
    quiet_logger_backends,
    quiet_ray_environment,
    resumed_step,
    step_fields,
)

STEP = {
    "critic/score/mean": 0.4375,
    "actor/pg_loss": -0.0078,
    "actor/grad_norm": 2.66,
    "response_length/mean": 6.9,
    "timing_s/step": 20.33,
    "actor/lr": 1e-4,
}
REPLAY = {
    "replay/accepted": 2.0,
    "replay/buffer_size": 12.0,
    "replay/scanned": 3.0,
    "replay/drift_accepted/mean": 0.031,
    "replay/replay_kl_accepted/mean": 0.0021,
    "replay/elite/nll": 1.9,
    "replay/elite/examples": 8.0,
}


def test_plain_grpo_shows_score_losses_length_and_time():
    fields = step_fields(STEP, ReplayConfig.from_mapping(None))
    assert fields == [
        ("score", 0.4375),
        ("pg_loss", -0.0078),
        ("grad_norm", 2.66),
        ("resp_len", 6.9),
        ("time", "20.3s"),
    ]
    fields = step_fields({**STEP, "response_length/clip_ratio": 0.0}, ReplayConfig.from_mapping(None))
    assert ("trunc", 0.0) in fields


def test_trunc_counts_responses_cut_at_the_budget_not_the_batch_longest():
    # verl's ratio counts rows as long as the batch's response tensor: trimmed to its longest row
    # (5 tokens here, budget 8), 70% of the rows "clip" though none was cut
    trimmed = {**STEP, "response_length/clip_ratio": 0.7, "response_length/max": 5.0}
    assert dict(step_fields(trimmed, ReplayConfig.from_mapping(None), max_response_length=8))["trunc"] == 0.0
    at_budget = {**STEP, "response_length/clip_ratio": 0.25, "response_length/max": 8.0}
    assert dict(step_fields(at_budget, ReplayConfig.from_mapping(None), max_response_length=8))["trunc"] == 0.25
    # without a known budget verl's value is shown as it is
    assert dict(step_fields(trimmed, ReplayConfig.from_mapping(None)))["trunc"] == 0.7


def test_lost_and_padded_rollouts_show_only_when_a_step_had_them():
    clean = {**STEP, "rollout/expected": 16, "rollout/lost": 0, "rollout/padding_rows": 4}
    clean["rollout/planned_padding_rows"] = 4  # the replay mini-batch plan's own padding is not news
    labels = [label for label, _ in step_fields(clean, ReplayConfig.from_mapping(None))]
    assert "lost" not in labels and "padded" not in labels
    fields = dict(step_fields({**clean, "rollout/lost": 1, "rollout/padding_rows": 5}, ReplayConfig.from_mapping(None)))
    assert fields["lost"] == "1/16" and fields["padded"] == 1


def test_replay_summary_follows_the_strategy():
    data = {**STEP, **REPLAY}
    hd = dict(step_fields(data, ReplayConfig.from_mapping({"strategy": "headroom_drift", "k_rep": 4})))
    assert hd["replayed"] == "2/4" and hd["buffer"] == 12.0 and hd["replay_kl"] == 0.0021 and hd["drift"] == 0.031
    assert "elite_nll" not in hd
    nothing = dict(
        step_fields({**data, "replay/accepted": 0.0}, ReplayConfig.from_mapping({"strategy": "headroom_drift"}))
    )
    assert nothing["replayed"] == "0/16" and "drift" not in nothing and "replay_kl" not in nothing
    naive = dict(step_fields(data, ReplayConfig.from_mapping({"strategy": "naive", "k_rep": 2})))
    assert naive["replayed"] == "2/2 latest" and naive["buffer"] == 12.0  # what naive replay did: no scan
    assert "scanned" not in naive and "replay_kl" not in naive and "drift" not in naive
    assert hd["scanned"] == 3.0
    elite = dict(step_fields(data, ReplayConfig.from_mapping({"strategy": "elite", "elite": {"archive": "a"}})))
    assert elite["elite_nll"] == 1.9 and elite["elite_rows"] == 8.0 and "replayed" not in elite
    # a step that did not report a key simply leaves it out
    assert "score" not in dict(step_fields({"actor/pg_loss": 0.1}, ReplayConfig.from_mapping(None)))


def test_truncation_staleness_and_the_drift_floor_next_to_tau():
    data = {
        **STEP,
        **REPLAY,
        "response_length/clip_ratio": 0.25,
        "training/off_policy/trajectory_staleness/mean": 1.0,
        "replay/drift_fresh/p50": 0.0123,
    }
    hd = ReplayConfig.from_mapping({"strategy": "headroom_drift", "tau": 0.08})
    split = dict(step_fields(data, hd, split=True))
    assert split["trunc"] == 0.25 and split["stale"] == 1.0 and split["floor/tau"] == "0.0123/0.08"
    synchronous = dict(step_fields(data, hd))
    assert "stale" not in synchronous and synchronous["trunc"] == 0.25
    naive = dict(step_fields(data, ReplayConfig.from_mapping({"strategy": "naive"}), split=True))
    assert "floor/tau" not in naive  # no gate
    nothing = dict(step_fields({**data, "replay/accepted": 0.0}, hd))
    assert nothing["floor/tau"] == "0.0123/0.08"  # shown when nothing was accepted: that is when it explains


def test_the_floor_warning_comes_once_after_the_first_steps():
    watch = DriftFloorWatch(0.05, warmup_steps=2)
    assert watch.update({"replay/drift_fresh/p50": 0.2}) is None  # one step is not a floor yet
    assert watch.update({}) is None  # steps without the metric do not count
    message = watch.update({"replay/drift_fresh/p50": 0.04})
    assert message.startswith("verl_replay: warning: replay.tau=0.05 is at or below the drift floor 0.12 ")
    assert "replay/drift_fresh/p50" in message and "set replay.tau above" in message
    assert watch.update({"replay/drift_fresh/p50": 0.3}) is None  # once
    quiet = DriftFloorWatch(0.08)
    for floor in (0.01, 0.03, 0.5, 0.02):  # running medians 0.02, 0.03, 0.025: below tau
        assert quiet.update({"replay/drift_fresh/p50": floor}) is None
    assert DriftFloorWatch(0.02).update({"replay/drift_fresh/p50": 0.02}) is None  # warmup
    at = DriftFloorWatch(0.02)
    at.update({"replay/drift_fresh/p50": 0.02})
    assert at.update({"replay/drift_fresh/p50": 0.02}) is not None  # tau equal to the floor warns


def test_console_backend_is_dropped_and_file_kept():
    for given, expected in (
        (["console", "file"], ["file"]),
        (["console"], ["file"]),
        ("console", ["file"]),
        (["wandb", "console"], ["wandb", "file"]),
        (["file", "wandb"], ["file", "wandb"]),
    ):
        config = OmegaConf.create({"trainer": {"logger": given}})
        OmegaConf.set_struct(config, True)
        quiet_logger_backends(config)
        assert list(config.trainer.logger) == expected, given


def test_ray_prefixes_are_plain_unless_the_user_chose():
    env: dict[str, str] = {}
    quiet_ray_environment(env)
    assert env == {"RAY_COLOR_PREFIX": "0"}
    env = {"RAY_COLOR_PREFIX": "1"}
    quiet_ray_environment(env)
    assert env == {"RAY_COLOR_PREFIX": "1"}


def test_a_ray_task_error_is_told_by_its_cause():
    from ray.exceptions import RayTaskError

    cause = ValueError("data.train_files: bad row 3\nmore detail")
    error = RayTaskError("ReplayTaskRunner.run", "Traceback (most recent call last):\n  ...", cause)
    assert describe_failure(error) == "ValueError: data.train_files: bad row 3"
    assert describe_failure(RuntimeError()) == "RuntimeError"


def test_an_actor_that_died_in_its_init_is_told_by_the_exception_it_raised():
    """Ray hands the driver only the text of the creation task's traceback; its last line is the why."""
    import traceback

    from ray.exceptions import ActorDiedError, RayTaskError

    try:
        raise OSError(98, "Address already in use")
    except OSError as raised:
        task_error = RayTaskError(
            "CheckpointEngineWorker.__init__",
            traceback.format_exc(),
            raised,
            proctitle="ray::rollout_0CheckpointEngineWorker_0:0:CheckpointEngineWorker.__init__",
            pid=3167,
            ip="192.0.2.2",
        )
    assert describe_failure(ActorDiedError(task_error)) == (
        "ActorDiedError: CheckpointEngineWorker.__init__ raised OSError: [Errno 98] Address already in use"
    )
    # a system-level death (no creation-task traceback) keeps Ray's own first line
    assert describe_failure(ActorDiedError()).startswith("ActorDiedError: The actor died unexpectedly")


def test_follower_reads_each_complete_line_once_as_it_is_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    seen: list[tuple[int, float]] = []
    follower = StepFollower(path, lambda step, data: seen.append((step, data["x"])), interval_s=0.02)
    follower.start()

    def writer() -> None:  # like verl's FileLogger: unbuffered writes, one JSON object per line
        with open(path, "wb", buffering=0) as handle:
            for step in (1, 2, 3):
                line = json.dumps({"step": step, "data": {"x": step / 10}}).encode() + b"\n"
                handle.write(line[:7])  # a line can arrive in pieces
                time.sleep(0.05)
                handle.write(line[7:])
                time.sleep(0.05)
            handle.write(b"not json\n")

    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    follower.stop()
    assert seen == [(1, 0.1), (2, 0.2), (3, 0.3)] and follower.steps == [1, 2, 3]


def test_follower_starts_over_when_the_file_is_truncated(tmp_path):
    path = tmp_path / "metrics.jsonl"
    steps: list[int] = []
    follower = StepFollower(path, lambda step, data: steps.append(step))
    follower.poll()  # no file yet
    path.write_text(json.dumps({"step": 5, "data": {}}) + "\n" + json.dumps({"step": 6, "data": {}}) + "\n")
    follower.poll()
    path.write_text(json.dumps({"step": 1, "data": {}}) + "\n")
    follower.poll()
    assert steps == [5, 6, 1]


def test_startup_watch_names_what_the_run_waits_for(tmp_path):
    log = tmp_path / "verl.log"
    watch = StartupWatch(log)
    assert watch.poll() == "starting Ray"  # no log yet
    log.write_text("2026-12-02 18:43:26,662\tINFO worker.py:2038 -- Started a local Ray ")
    assert watch.poll() == "starting Ray"
    with open(log, "a") as handle:
        handle.write("instance.\n")  # the marker completed by the next write
    assert watch.poll() == "starting the trainer"
    with open(log, "a") as handle:
        handle.write("(ReplayTaskRunner pid=10482) INFO: ... actor and ref model engine initialized\n")
    assert watch.poll() == "starting the rollout and reward workers"
    with open(log, "a") as handle:
        handle.write("(ReplayTaskRunner pid=10482) INFO: all initialize finished, ready to fit\n")
    assert watch.poll() == "running step 1"
    with open(log, "a") as handle:
        handle.write("(ReplayTaskRunner pid=10482) Started a local Ray instance\n")
    assert watch.poll() == "running step 1"  # stages never go back


def test_the_step_line_says_what_was_admitted_and_what_could_not_be_stored():
    config = ReplayConfig.from_mapping({"strategy": "headroom_drift", "k_rep": 2})
    data = {**STEP, **REPLAY, "replay/ingress": 3.0, "replay/ingress_multi_turn": 2.0, "replay/ingress_images": 0.0}
    fields = dict(step_fields(data, config))
    assert fields["admitted"] == "3 (2 multi-turn, 0 image)" and "not_replayable" not in fields
    fields = dict(step_fields({**data, "replay/ingress_multi_turn": 0.0, "replay/ingress_images": 1.0}, config))
    assert fields["admitted"] == "3 (0 multi-turn, 1 image)"
    # text-only single-turn runs keep their line as it was; refusals are shown when there are some
    plain = {**data, "replay/ingress_multi_turn": 0.0, "replay/ingress_images": 0.0}
    assert "admitted" not in dict(step_fields(plain, config))
    assert dict(step_fields({**plain, "replay/skipped_ingress": 2.0}, config))["not_replayable"] == 2


def test_a_resumed_run_waits_for_the_step_after_its_checkpoint(tmp_path):
    log = tmp_path / "verl.log"
    log.write_text("(ReplayTaskRunner pid=1) all initialize finished, ready to fit\n")
    assert StartupWatch(log).poll() == "running step 1"
    assert StartupWatch(log, first_step=3).poll() == "running step 3"


def test_resumed_step_follows_verls_resume_rule(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    auto = {"resume_mode": "auto", "default_local_dir": str(checkpoints)}
    assert resumed_step(auto) is None  # no checkpoint yet: step 1
    (checkpoints / "global_step_2").mkdir(parents=True)
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("2\n")
    assert resumed_step(auto) == 2
    assert resumed_step({**auto, "resume_mode": "disable"}) is None
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("5")
    assert resumed_step(auto) is None  # the tracker names a folder that is not there: verl starts afresh
    path = {"resume_mode": "resume_path", "resume_from_path": str(checkpoints / "global_step_4") + "/"}
    assert resumed_step(path) == 4
    assert resumed_step({**path, "resume_from_path": str(tmp_path / "elsewhere")}) is None
