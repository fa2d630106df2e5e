"""verl_replay.main: checks before Ray starts, one folder per run, the console, exit codes.

The real GRPO loop through ``python -m verl_replay.main`` is ``tests/integrations/verl/
test_e2e_grpo.py`` (e2e). Here the start-up checks run on composed configs, and the console and
exit codes are checked on subprocesses whose verl loop is replaced by a stand-in that prints,
warns and writes metrics the way verl's file logger does (seconds, not minutes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from verl_replay.main import StartupError, planned_run_dir, startup_checks

NOW = datetime(2026, 1, 2, 3, 4, 5)


@pytest.fixture(scope="module")
def compose():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import verl_replay.main
    from verl_replay.main import register_resolvers

    register_resolvers()
    config_dir = str(Path(verl_replay.main.__file__).parent / "config")

    def make(*overrides: str):
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return hydra_compose(config_name="replay_trainer", overrides=list(overrides))

    return make


def refused(config) -> str:
    with pytest.raises(StartupError) as error:
        startup_checks(config, NOW)
    message = str(error.value)
    assert "\n" not in message
    return message


def sql_rows_file(path: Path, db_path: str) -> Path:
    rows = {
        "prompt": [[{"role": "user", "content": "How many?"}]],
        "data_source": ["tiny_sql"],
        "extra_info": [{"db_path": db_path}],
    }
    pq.write_table(pa.table(rows), path)
    return path


# ---------------------------------------------------------------------------- start-up checks


def test_inputs_are_checked_before_ray_starts(compose, tmp_path, tiny_assets):
    assert refused(compose("data.train_files=/nonexistent/train.parquet")) == (
        "data.train_files: /nonexistent/train.parquet does not exist "
        "(python -m verl_replay.data prepare ... writes one)"
    )
    assert refused(compose(f"data.val_files=[{tiny_assets.math_val},{tmp_path}]")).startswith(
        f"data.val_files: {tmp_path} is a directory"
    )
    assert refused(compose(f"actor_rollout_ref.model.path={tmp_path}")) == (
        f"actor_rollout_ref.model.path: {tmp_path} has no config.json (not a Hugging Face model directory)"
    )
    missing_db = sql_rows_file(tmp_path / "sql.parquet", str(tmp_path / "gone.sqlite"))
    assert refused(compose("tiny_task=sql", f"data.train_files={missing_db}")) == (
        f"data.train_files: {missing_db} row 0 names the database {tmp_path / 'gone.sqlite'}, which does not "
        "exist (prepare the data where the databases are)"
    )


def test_archive_is_checked_before_ray_starts(compose, tmp_path):
    archive = tmp_path / "archive.parquet"
    assert refused(compose("tiny_task=sql", "replay.strategy=elite", f"replay.elite.archive={archive}")).startswith(
        f"replay.elite.archive: {archive} does not exist"
    )
    archive.write_bytes(b"not an archive")
    assert refused(compose("tiny_task=sql", "replay.strategy=elite", f"replay.elite.archive={archive}")).startswith(
        "replay.elite.archive cannot be used for this run: "
    )


def test_settings_are_checked_before_anything_else(compose):
    assert refused(compose("replay.tau=-1")).startswith("invalid config: replay.tau must be a finite number >= 0")
    assert "replay.k_repp (did you mean replay.k_rep?)" in refused(compose("+replay.k_repp=2"))
    assert refused(compose("platform=gpu")) == (
        "these settings are required and have no value: data.train_files, data.val_files, actor_rollout_ref.model.path"
    )
    mismatch = compose(
        "dry_run=true", "trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=3"
    )
    assert refused(mismatch).startswith("verl refuses the config: separate_async needs data.train_batch_size ==")


def test_the_planned_run_dir(compose, tmp_path):
    config = compose("tiny_task=sql", "replay.strategy=naive", f"output_root={tmp_path}")
    assert planned_run_dir(config, NOW) == tmp_path / "verl_replay" / "sql_naive-20260102-030405"
    config = compose(f"run_dir={tmp_path / 'mine'}")
    assert planned_run_dir(config, NOW) == tmp_path / "mine"


def test_a_dry_run_composes_without_reading_inputs(compose, tmp_path):
    replay, probe = startup_checks(compose("dry_run=true", "data.train_files=/elsewhere/train.parquet"), NOW)
    assert replay.strategy == "none" and probe.data.train_files == "/elsewhere/train.parquet"
    assert not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------------------- the command line


def run_cli(cwd: Path, *args: str, script: str | None = None, env: dict | None = None, timeout: int = 300):
    command = [sys.executable, *(["-c", script] if script else ["-m", "verl_replay.main"]), *args]
    full_env = {k: v for k, v in os.environ.items() if k not in ("VERL_FILE_LOGGER_PATH", "VERL_REPLAY_OUTPUT_DIR")}
    started = time.monotonic()
    result = subprocess.run(
        command, cwd=cwd, env={**full_env, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )
    return result, time.monotonic() - started


# The entry point, noting at exit which heavy modules the process ever imported: a refusal that
# never imported ray (nor verl, nor torch) stopped before any cluster or worker could start, however
# long a loaded machine took to get there.
HEAVY_MODULES = ("ray", "verl", "torch", "transfer_queue")
IMPORT_PROBE = textwrap.dedent(f"""
    import atexit, os, sys
    def note():
        with open(os.environ["IMPORTED_HEAVY"], "w") as out:
            out.write(" ".join(m for m in {HEAVY_MODULES!r} if m in sys.modules))
    atexit.register(note)
    import verl_replay.main as main
    main.cli()
""")


def test_a_missing_train_file_stops_before_anything_heavy_with_one_line(tmp_path, tiny_assets):
    probe = tmp_path.parent / f"{tmp_path.name}-imported.txt"
    result, _ = run_cli(
        tmp_path, "data.train_files=/nonexistent/train.parquet", script=IMPORT_PROBE, env={"IMPORTED_HEAVY": str(probe)}
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and result.stderr.splitlines() == [
        "verl_replay: data.train_files: /nonexistent/train.parquet does not exist "
        "(python -m verl_replay.data prepare ... writes one)"
    ]
    assert probe.read_text() == ""  # refused before ray, verl or torch was imported
    assert list(tmp_path.iterdir()) == []  # no run dir, no Hydra folder


@pytest.mark.parametrize("override", ["replay.k_repp=2", "+replay.k_repp=2"])
def test_a_misspelled_replay_key_gets_a_did_you_mean_either_way(tmp_path, override):
    result, _ = run_cli(tmp_path, override)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("verl_replay: unknown setting(s) replay.k_repp (did you mean replay.k_rep?); ")
    assert len(result.stderr.splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_a_misspelled_verl_key_gets_a_did_you_mean_not_hydras_plus(tmp_path):
    result, _ = run_cli(tmp_path, "trainer.total_training_stepz=2", "actor_rollout_ref.actr.optim.lr=1")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "verl_replay: unknown setting trainer.total_training_stepz (did you mean trainer.total_training_steps?)"
    ]
    result, _ = run_cli(tmp_path, "actor_rollout_ref.actr.optim.lr=1")
    assert result.stderr.splitlines() == [
        "verl_replay: unknown setting actor_rollout_ref.actr.optim.lr (did you mean actor_rollout_ref.actor?)"
    ]
    # another override Hydra refuses keeps Hydra's own message (exit 2 all the same)
    result, _ = run_cli(tmp_path, "trainer.total_training_steps=[")
    assert result.returncode == 2 and "no viable alternative at input" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("task", "domain", "refused"),
    [("shapes", "sql", False), ("sql", "sql", False), ("shapes", "math", True), ("math", "sql", True)],
)
def test_a_tiny_run_takes_an_archive_of_its_tasks_domain(tmp_path, task, domain, refused):
    from omegaconf import OmegaConf

    from verl_replay.main import check_archive_task

    archive = tmp_path / "elite_archive.parquet"
    (tmp_path / "elite_archive.parquet.manifest.json").write_text(json.dumps({"domain": domain}))
    config = OmegaConf.create({"tiny_task": task})
    if not refused:
        check_archive_task(config, str(archive))  # the query-shapes task is a SQL task
        return
    with pytest.raises(StartupError, match=f"is a {domain} archive and this run trains tiny_task={task}"):
        check_archive_task(config, str(archive))


def test_an_unknown_tiny_task_lists_the_valid_ones(tmp_path):
    result, _ = run_cli(tmp_path, "tiny_task=sqll")
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "verl_replay: tiny_task=sqll is not a tiny task; use one of: math, sql, search, image, arith, shapes"
    ]


@pytest.mark.parametrize(
    "override, message",
    [
        ("exact_eval=maybe", "verl_replay: exact_eval=maybe is not one of auto, true, false"),
        (
            "actor_rollout_ref.rollout.val_kwargs.top_p=0.9",
            "verl_replay: exact_eval=true needs validation that samples at its temperature, but "
            "actor_rollout_ref.rollout.val_kwargs.top_p=0.9 (nucleus sampling): set exact_eval=auto "
            "(off in this case) or sample plainly",
        ),
    ],
)
def test_the_exact_metric_setting_is_checked_before_ray(tmp_path, override, message):
    extra = (
        ()
        if override.startswith("exact_eval")
        else ("exact_eval=true", "actor_rollout_ref.rollout.val_kwargs.do_sample=true")
    )
    result, _ = run_cli(tmp_path, override, *extra)
    assert result.returncode == 2 and result.stderr.splitlines() == [message]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("sampled_val=sometimes",), "verl_replay: sampled_val=sometimes is not one of every, ends"),
        (
            ("sampled_val=ends", "exact_eval=false"),
            "verl_replay: sampled_val=ends measures only the exact metric between the first and the last "
            "validation, but exact_eval=false turns it off: set sampled_val=every or exact_eval=auto",
        ),
    ],
)
def test_the_sampled_validation_setting_is_checked_before_ray(tmp_path, overrides, message):
    result, _ = run_cli(tmp_path, *overrides)
    assert result.returncode == 2 and result.stderr.splitlines() == [message]


# A stand-in for verl's loop: prints and warns like verl and its workers, writes metrics the way
# verl's file logger does, prints at interpreter exit like Ray's shutdown; or fails.
FAKE_VERL = textwrap.dedent(r"""
    import atexit, json, os, sys, time, warnings
    import verl_replay.main as main

    def fake_run_ppo(config):
        print("(ReplayTaskRunner pid=1) verl's own output")
        warnings.warn("torchtitan engine is not available")
        atexit.register(lambda: print("(raylet) a warning at exit", file=sys.stderr))
        if os.environ["FAKE_MODE"] == "fail":
            raise RuntimeError("the reward worker died\nsecond line")
        assert list(config.trainer.logger) == (["console", "file"] if config.verbose else ["file"])
        with open(os.environ["VERL_FILE_LOGGER_PATH"], "wb", buffering=0) as handle:
            for step in range(1, config.trainer.total_training_steps + 1):
                data = {"critic/score/mean": 0.25 * step, "actor/pg_loss": -0.01, "actor/grad_norm": 1.5,
                        "timing_s/step": 3.25}
                if os.environ["FAKE_MODE"] == "floor":  # the fresh groups drift by 0.1 or more
                    data.update({"replay/accepted": 0.0, "replay/drift_fresh/p50": 0.1 * step})
                handle.write(json.dumps({"step": step, "data": data}).encode() + b"\n")
                time.sleep(0.7)
                while os.environ["FAKE_MODE"] == "hold" and not os.path.exists(os.environ["FAKE_RELEASE"]):
                    time.sleep(0.1)  # a live run, until the test lets it finish

    main._run_ppo = fake_run_ppo
    main.cli()
""")


def fake_run(tmp_path: Path, mode: str, *args: str):
    result, _ = run_cli(tmp_path, "trainer.total_training_steps=2", *args, script=FAKE_VERL, env={"FAKE_MODE": mode})
    runs = sorted((tmp_path / "outputs" / "verl_replay").glob("math_none-*"))
    return result, runs


def test_console_shows_our_lines_and_verl_log_holds_the_rest(tmp_path, tiny_assets):
    result, runs = fake_run(tmp_path, "ok")
    assert result.returncode == 0, result.stderr
    assert len(runs) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]
    run_dir = runs[0]
    lines = result.stdout.splitlines()
    assert lines[0] == f"verl_replay: strategy=none task=math steps=2; run dir outputs/verl_replay/{run_dir.name}"
    assert lines[1].startswith(f"verl_replay: verl's own output goes to outputs/verl_replay/{run_dir.name}/verl.log")
    assert lines[2:4] == [
        "step 1/2 | score 0.25 | pg_loss -0.01 | grad_norm 1.5 | time 3.2s",
        "step 2/2 | score 0.5 | pg_loss -0.01 | grad_norm 1.5 | time 3.2s",
    ]
    assert lines[4].startswith("verl_replay: done (2 steps, ") and "{metrics.jsonl, config.yaml, verl.log}" in lines[4]
    assert len(lines) == 5 and result.stderr == ""  # nothing after done, no warning
    log = (run_dir / "verl.log").read_text()
    for expected in ("verl's own output", "torchtitan engine is not available", "a warning at exit"):
        assert expected in log, expected
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["run_dir"] == str(run_dir) and config["replay"]["event_log"] == f"{run_dir}/replay_events.jsonl"
    assert config["trainer"]["default_local_dir"] == f"{run_dir}/checkpoints"
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_tau_at_or_below_the_drift_floor_is_told_once_after_two_steps(tmp_path, tiny_assets):
    result, _ = run_cli(
        tmp_path,
        "trainer.total_training_steps=3",
        "replay.strategy=headroom_drift",
        "replay.tau=0.12",
        script=FAKE_VERL,
        env={"FAKE_MODE": "floor"},
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith(("step ", "verl_replay: warning"))]
    assert [line.split(" | ")[0] for line in lines] == [
        "step 1/3",
        "step 2/3",
        "verl_replay: warning: replay.tau=0.12 "
        "is at or below the drift floor 0.15 (median drift of this run's fresh groups, replay/drift_fresh/p50, over 2 "
        "steps): the gate will reject nearly every buffered group; set replay.tau above the floor "
        "(docs/headroom_drift.md, choosing tau)",
        "step 3/3",
    ]
    assert "floor/tau 0.1/0.12" in lines[0]


def test_a_failed_training_ends_with_one_line_and_exit_code_1(tmp_path, tiny_assets):
    result, runs = fake_run(tmp_path, "fail")
    assert result.returncode == 1
    name = runs[0].name
    assert result.stderr.splitlines() == [
        f"verl_replay: training failed: RuntimeError: the reward worker died "
        f"(traceback in outputs/verl_replay/{name}/verl.log)"
    ]
    log = (runs[0] / "verl.log").read_text()
    assert "Traceback (most recent call last)" in log and "second line" in log


def test_verbose_prints_verls_output_on_the_console(tmp_path, tiny_assets):
    result, runs = fake_run(tmp_path, "ok", "verbose=true")
    assert result.returncode == 0, result.stderr
    assert "verl's own output" in result.stdout and "torchtitan engine is not available" in result.stderr
    assert not (runs[0] / "verl.log").exists() and (runs[0] / "config.yaml").exists()
    assert "step 1/2" not in result.stdout  # verl's console logger prints the steps itself


def test_the_done_line_survives_a_deleted_working_directory(tmp_path):
    """A Ray job runs in Ray's unpacked copy of its files, which Ray may delete as the run ends:
    the done line then shows the run dir whole instead of failing the finished run."""
    import os

    from verl_replay.main import _shown

    gone = tmp_path / "job_files"
    gone.mkdir()
    before = os.getcwd()
    os.chdir(gone)
    try:
        assert _shown(gone / "outputs" / "run") == os.path.join("outputs", "run")
        gone.rmdir()
        assert _shown(tmp_path / "outputs" / "run") == str(tmp_path / "outputs" / "run")
    finally:
        os.chdir(before)


@pytest.mark.parametrize("loss_mode", ["clip_cov", "kl_cov"])
def test_a_micro_batch_wide_policy_loss_is_refused_before_ray_with_replay(tmp_path, loss_mode):
    result, _ = run_cli(
        tmp_path, "replay.strategy=headroom_drift", f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}"
    )
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"verl_replay: actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} "
    ), result.stderr
    assert "with replay.strategy=headroom_drift use one of: vanilla, " in lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing written, Ray never started


# ---------------------------------------------------------------------------- run dir refusals


def test_a_second_run_on_a_live_run_dir_is_refused_naming_its_process(tmp_path, tiny_assets):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_FILE_LOGGER_PATH", "VERL_REPLAY_OUTPUT_DIR")}
    release = tmp_path.parent / f"{tmp_path.name}-release"
    first = subprocess.Popen(
        [sys.executable, "-c", FAKE_VERL, "trainer.total_training_steps=4", f"run_dir={run_dir}"],
        cwd=tmp_path,
        env={**env, "FAKE_MODE": "hold", "FAKE_RELEASE": str(release)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.poll() is None, first.communicate()
        config_before = (run_dir / "config.yaml").read_bytes()
        second, _ = run_cli(tmp_path, f"run_dir={run_dir}", script=IMPORT_PROBE, env={"IMPORTED_HEAVY": "/dev/null"})
        assert first.poll() is None  # the first was still running when the second was refused
        assert second.returncode == 2 and second.stdout == ""
        assert second.stderr.splitlines() == [
            f"verl_replay: run_dir {run_dir} is in use by a live run (process {first.pid}): wait for it to end "
            "(or stop it), or give this run another run_dir"
        ]
        assert (run_dir / "config.yaml").read_bytes() == config_before and not (run_dir / "metrics.1.jsonl").exists()
    finally:
        release.write_text("")
        out, err = first.communicate(timeout=240)
    assert first.returncode == 0, err
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]  # every line parses


def _checkpointed_run_dir(tmp_path: Path, compose, tau: float, steps: tuple[int, ...] = (2,)) -> Path:
    """A run dir as a Headroom-Drift run leaves it after its checkpoints at ``steps`` (replay state
    saved with tau, verl's model state as an ``actor/`` folder), its config.yaml saved resolved."""
    from omegaconf import OmegaConf

    from verl_replay.config import ReplayConfig
    from verl_replay.integrations.verl.replay_state import decision_settings, write_state_manifest

    run_dir = tmp_path / "run"
    for step in steps:
        state = run_dir / "checkpoints" / f"global_step_{step}" / "replay"
        state.mkdir(parents=True)
        (state.parent / "actor").mkdir()
        (state / "group_buffer.pt").write_bytes(b"buffer" * 400)
        replay = ReplayConfig.from_mapping({"strategy": "headroom_drift", "k_rep": 2, "tau": tau})
        identity = {"trainer_mode": "sync", "anchor_field": "old_log_probs", "tokenizer_fingerprint": "f"}
        write_state_manifest(state, step=step, identity=identity, settings=decision_settings(replay))
    (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(steps[-1]))
    config = compose(f"run_dir={run_dir}", "replay.strategy=headroom_drift", "replay.k_rep=2", f"replay.tau={tau}")
    OmegaConf.resolve(config)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(config))
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "data": {}}\n{"step": 2, "data": {}}\n')
    return run_dir


def _files(run_dir: Path) -> dict[Path, bytes]:
    return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != "run.lock"}


# The entry point, noting at exit whether it ever started Ray.
RAY_PROBE = textwrap.dedent("""
    import atexit, os, sys
    def note():
        ray = sys.modules.get("ray")
        with open(os.environ["RAY_STARTED"], "w") as out:
            out.write(str(ray is not None and ray.is_initialized()))
    atexit.register(note)
    import verl_replay.main as main
    main.cli()
""")


def test_resuming_with_a_changed_setting_is_refused_before_anything_changes(tmp_path, compose, tiny_assets):
    run_dir = _checkpointed_run_dir(tmp_path, compose, tau=0.08)
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    probe = tmp_path.parent / f"{tmp_path.name}-ray.txt"
    result, _ = run_cli(
        tmp_path,
        f"run_dir={run_dir}",
        "replay.strategy=headroom_drift",
        "replay.k_rep=4",
        "replay.tau=0.1",
        script=RAY_PROBE,
        env={"RAY_STARTED": str(probe)},
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"verl_replay: run_dir {run_dir} resumes a run saved with replay.k_rep=2 (given 4), replay.tau=0.08 "
        "(given 0.1): a resumed run keeps the settings it was started with; drop these overrides "
        f"(run_dir={run_dir} alone resumes it), or start a new run (another run_dir, or none for a new folder)"
    ]
    assert probe.read_text() == "False"  # refused before Ray started
    assert _files(run_dir) == before  # config.yaml and metrics.jsonl untouched, nothing renamed


def test_the_advised_resume_keeps_every_saved_setting_and_a_conflict_is_refused_fast(tmp_path, tiny_assets):
    """``run_dir=DIR`` alone (what ^C advises) continues the run as it was started: the saved
    strategy, tau and step count, not the defaults; its config.yaml is left as it was. A setting
    given against the saved one is refused in seconds, before Ray, naming both values."""
    run_dir = tmp_path / "outputs" / "hd"
    first, _ = run_cli(
        tmp_path,
        "trainer.total_training_steps=2",
        "replay.strategy=headroom_drift",
        "replay.tau=0.08",
        "replay.k_rep=2",
        f"run_dir={run_dir}",
        script=FAKE_VERL,
        env={"FAKE_MODE": "ok"},
    )
    assert first.returncode == 0, first.stderr
    saved = (run_dir / "config.yaml").read_bytes()
    resumed, _ = run_cli(tmp_path, f"run_dir={run_dir}", script=FAKE_VERL, env={"FAKE_MODE": "ok"})
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines()[0] == (
        "verl_replay: strategy=headroom_drift task=math k_rep=2 tau=0.08 steps=2; resuming outputs/hd"
    )
    assert (run_dir / "config.yaml").read_bytes() == saved
    # where the run ends may be moved; what it is may not
    longer, _ = run_cli(
        tmp_path, f"run_dir={run_dir}", "trainer.total_training_steps=3", script=FAKE_VERL, env={"FAKE_MODE": "ok"}
    )
    assert longer.returncode == 0, longer.stderr
    assert "tau=0.08 steps=3; resuming" in longer.stdout.splitlines()[0]
    before = _files(run_dir)
    probe = tmp_path.parent / f"{tmp_path.name}-ray.txt"
    refused, seconds = run_cli(
        tmp_path, f"run_dir={run_dir}", "replay.strategy=naive", script=RAY_PROBE, env={"RAY_STARTED": str(probe)}
    )
    assert refused.returncode == 2 and refused.stdout == "" and seconds <= 20
    assert refused.stderr.splitlines() == [
        f"verl_replay: run_dir {run_dir} resumes a run saved with replay.strategy=headroom_drift (given naive): "
        "a resumed run keeps the settings it was started with; drop these overrides "
        f"(run_dir={run_dir} alone resumes it), or start a new run (another run_dir, or none for a new folder)"
    ]
    assert probe.read_text() == "False" and _files(run_dir) == before


def test_a_damaged_replay_state_is_refused_before_anything_changes_naming_the_intact_checkpoint(
    tmp_path, compose, tiny_assets
):
    run_dir = _checkpointed_run_dir(tmp_path, compose, tau=0.08, steps=(2, 4))
    damaged = run_dir / "checkpoints" / "global_step_4" / "replay" / "group_buffer.pt"
    os.truncate(damaged, 1000)
    before = _files(run_dir)
    probe = tmp_path.parent / f"{tmp_path.name}-ray.txt"
    result, seconds = run_cli(tmp_path, f"run_dir={run_dir}", script=RAY_PROBE, env={"RAY_STARTED": str(probe)})
    intact = run_dir / "checkpoints" / "global_step_2"
    assert result.returncode == 2 and result.stdout == "" and seconds <= 20
    assert result.stderr.splitlines() == [
        f"verl_replay: run_dir {run_dir} cannot be resumed from global_step_4: {damaged} is missing or does not "
        f"match its recorded sha256 (torn or edited checkpoint); the newest intact checkpoint is {intact}: resume "
        f"from it with run_dir={run_dir} trainer.resume_mode=resume_path trainer.resume_from_path={intact}"
    ]
    assert probe.read_text() == "False" and _files(run_dir) == before  # config.yaml, metrics.jsonl untouched


def test_the_advice_for_a_damaged_checkpoint_passes_the_checks(tmp_path, compose, tiny_assets):
    from verl_replay.main import check_resume, resumed_run_config

    run_dir = _checkpointed_run_dir(tmp_path, compose, tau=0.08, steps=(2, 4))
    (run_dir / "checkpoints" / "global_step_4" / "replay" / "replay_state.json").write_text("{torn")
    intact = run_dir / "checkpoints" / "global_step_2"
    advice = (f"run_dir={run_dir}", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={intact}")
    config = resumed_run_config(compose(*advice), advice)
    replay_config, probe = startup_checks(config, NOW)
    check_resume(config, probe, replay_config)
    (intact / "replay" / "group_buffer.pt").write_bytes(b"edited")  # now no checkpoint is intact
    with pytest.raises(StartupError, match="no earlier checkpoint of this run is intact"):
        check_resume(config, probe, replay_config)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("output_root=/proc/x", "output_root: /proc/x cannot be written (/proc: No such file or directory)"),
        ("run_dir={file}/run", "run_dir: {file}/run lies under {file}, which is a file"),
        ("run_dir={file}", "run_dir: {file} is a file, not a folder"),
    ],
)
def test_an_output_dir_no_run_can_write_is_refused_with_one_line(tmp_path, tiny_assets, override, message):
    afile = tmp_path.parent / f"{tmp_path.name}-afile"
    afile.write_text("x")
    probe = tmp_path.parent / f"{tmp_path.name}-imported.txt"
    result, _ = run_cli(tmp_path, override.format(file=afile), script=IMPORT_PROBE, env={"IMPORTED_HEAVY": str(probe)})
    key = override.split("=")[0]
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"verl_replay: {message.format(file=afile)}; set {key}= to a writable folder"
    ], result.stderr
    assert list(tmp_path.iterdir()) == [] and probe.read_text() == ""  # before ray, verl or torch was imported


def test_a_resume_without_replay_state_is_refused_unless_allowed(tmp_path, compose, tiny_assets):
    from verl_replay.main import check_resume

    run_dir = _checkpointed_run_dir(tmp_path, compose, tau=0.08)
    (run_dir / "checkpoints" / "global_step_2" / "replay" / "replay_state.json").unlink()
    overrides = (f"run_dir={run_dir}", "replay.strategy=headroom_drift", "replay.k_rep=2", "replay.tau=0.08")
    config = compose(*overrides)
    with pytest.raises(StartupError, match=r"global_step_2, which holds no replay state .*allow_missing_state=true"):
        startup_checks(config, NOW)
    allowed = compose(*overrides, "replay.allow_missing_state=true")
    check_resume(allowed, *reversed(startup_checks(allowed, NOW)))
    fresh = compose(*overrides, "trainer.resume_mode=disable", "replay.tau=0.5")  # not resuming: no check
    check_resume(fresh, *reversed(startup_checks(fresh, NOW)))


# verl's loop as a stand-in that leaves what kept real runs alive after "done": a thread that never
# ends and an exit handler (Ray's); the process itself looks an hour old (under
# `bash -c 'install && python ...'` bash execs Python in a process created before the install).
LINGERING_VERL = textwrap.dedent(r"""
    import atexit, json, os, sys, threading, time
    import psutil
    psutil.Process.create_time = lambda self: time.time() - 3600.0
    import verl_replay.main as main

    def fake_run_ppo(config):
        with open(os.environ["VERL_FILE_LOGGER_PATH"], "wb", buffering=0) as handle:
            handle.write(json.dumps({"step": 1, "data": {"timing_s/step": 1.0}}).encode() + b"\n")
        threading.Thread(target=time.sleep, args=(3600,), name="never-ends").start()  # not a daemon
        atexit.register(lambda: print("(raylet) shutting down at exit", file=sys.stderr, flush=True))
        time.sleep(0.7)

    main._run_ppo = fake_run_ppo
    main.cli()
""")


def test_the_done_line_counts_from_the_command_and_the_process_exits_right_after_it(tmp_path, tiny_assets):
    result, _ = run_cli(tmp_path, "trainer.total_training_steps=1", script=LINGERING_VERL, timeout=600)
    assert result.returncode == 0, result.stderr
    done = result.stdout.splitlines()[-1]
    # one step, singular; the command's own time (seconds on a quiet machine), not the process's hour
    assert re.match(r"verl_replay: done \(1 step, (\d+s|[1-9]m\d\ds|[1-5]\dm\d\ds)\): ", done), done
    run_dir = next((tmp_path / "outputs" / "verl_replay").glob("math_none-*"))
    # the exit handlers still ran (their output in verl.log), then the thread was not waited for
    assert "(raylet) shutting down at exit" in (run_dir / "verl.log").read_text()
    assert not (run_dir / "run.lock").exists()


def test_a_failed_run_keeps_its_exit_code_through_the_prompt_exit(tmp_path, tiny_assets):
    script = LINGERING_VERL.replace("time.sleep(0.7)", "raise RuntimeError('the reward worker died')")
    result, _ = run_cli(tmp_path, "trainer.total_training_steps=1", script=script, timeout=600)
    assert result.returncode == 1 and "training failed: RuntimeError: the reward worker died" in result.stderr
