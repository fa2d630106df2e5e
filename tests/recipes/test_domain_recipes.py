"""The search and multimodal recipes: composed at paper scale (DRY_RUN=1) and run at TINY scale.

* ``DRY_RUN=1``: ``headroom_drift_search.sh`` composes verl's tool agent loop with the search tool
  config, ``headroom_drift_multimodal.sh`` the Geometry3K files; both refuse the eval stage.
* ``TINY=1`` (``e2e``): both recipes run, one after the other, on CPU through verl's separate_async trainer
  (2 global steps, 2 rounds each) and replay: an accepted scan of a group with ``turns >= 2``
  (tool call + answer, verl's real tool agent loop and BM25 tool) and one with ``images >= 1``
  (the tiny model's vision tower, pictures rebuilt from the buffer's PNG bytes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from verl_replay.headroom_drift.events import read_events

REPO = Path(__file__).resolve().parents[2]
# variables of the caller's shell that would change what a recipe does
_CLEARED = ("VERL_FILE_LOGGER_PATH", "TINY", "DRY_RUN", "RAY_ADDRESS", "PREFLIGHT")

# Both tiny tasks built side by side (cold), then both tiny recipes one after the other (a vLLM run
# takes ~6-7 GiB: two here beside the other test worker's run exhausted 24 GiB).
E2E_SECONDS = 450  # measured: 449 s on the shared 2-core machine under load ~20 (tasks built cold)


def _env(env: dict[str, str]) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in _CLEARED}, **env}


def spawn_recipe(script: str, env: dict[str, str], log_dir: Path) -> subprocess.Popen:
    """A recipe in a session of its own (bash, the driver, its Ray cluster), output in ``log_dir``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "stdout", "w") as out, open(log_dir / "stderr", "w") as err:
        return subprocess.Popen(
            ["bash", str(REPO / "recipes" / script)],
            cwd=REPO,
            env=_env(env),
            stdout=out,
            stderr=err,
            start_new_session=True,
        )


def dry_run(script: str, env: dict[str, str], tmp_path: Path) -> tuple[int, dict, str]:
    """(exit status, the composed training config, stderr) of a DRY_RUN=1 recipe."""
    proc = spawn_recipe(script, {**env, "DRY_RUN": "1"}, tmp_path / f"dry_{script}")
    try:
        proc.wait(timeout=1800)  # a hang guard: dry runs take minutes beside a verl run on 2 cores
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stdout = (tmp_path / f"dry_{script}" / "stdout").read_text()
    stderr = (tmp_path / f"dry_{script}" / "stderr").read_text()
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line and not line[0].isspace() and line.endswith(":")), None)
    end = next((i for i, line in enumerate(lines) if line.startswith("verl_replay: dry run OK")), len(lines))
    config = yaml.safe_load("\n".join(lines[start:end])) if start is not None else {}
    return proc.returncode, config, stderr


def _inputs(tmp_path: Path) -> dict[str, str]:
    data = tmp_path / "data"
    data.mkdir()
    for name in ("search_train", "search_test", "geo3k_train", "geo3k_test"):
        (data / f"{name}.parquet").write_bytes(b"")
    (data / "search_tools.yaml").write_text("tools: []\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return {"DATA_DIR": str(data), "MODEL_PATH": str(model), "OUTPUT_DIR": str(tmp_path / "out")}


def test_search_recipe_composes_the_tool_agent_loop_and_refuses_eval(tmp_path) -> None:
    env = _inputs(tmp_path)
    returncode, config, stderr = dry_run("headroom_drift_search.sh", env, tmp_path)
    assert returncode == 0, stderr[-3000:]
    rollout = config["actor_rollout_ref"]["rollout"]
    assert rollout["agent"]["default_agent_loop"] == "tool_agent"
    assert rollout["multi_turn"]["tool_config_path"] == env["DATA_DIR"] + "/search_tools.yaml"
    assert rollout["multi_turn"]["max_assistant_turns"] == 4 and rollout["multi_turn"]["format"] == "hermes"
    assert config["data"]["train_files"] == env["DATA_DIR"] + "/search_train.parquet"
    assert config["trainer"]["v1"]["trainer_mode"] == "separate_async"
    assert "STAGES=train " in stderr and "eval (DRY_RUN=1" not in stderr  # the train stage only
    returncode, _, stderr = dry_run("headroom_drift_search.sh", {**env, "STAGES": "train,eval"}, tmp_path)
    assert returncode == 2 and "STAGES" in stderr, stderr


def test_multimodal_recipe_composes_geometry3k(tmp_path) -> None:
    returncode, config, stderr = dry_run("headroom_drift_multimodal.sh", _inputs(tmp_path), tmp_path)
    assert returncode == 0, stderr[-3000:]
    assert config["data"]["train_files"] == str(tmp_path / "data" / "geo3k_train.parquet")
    assert config["trainer"]["project_name"] == "headroom_drift_multimodal"
    assert config["actor_rollout_ref"]["rollout"]["multi_turn"]["tool_config_path"] is None


def _accepted_kinds(run_dir: Path) -> list[dict]:
    """The accepted scans, each with its group's ingress record (turns, images)."""
    events = read_events(run_dir / "replay_events.jsonl")
    ingress = {e["group_id"]: e for e in events if e["event"] == "ingress"}
    return [
        {**e, **{k: ingress[e["group_id"]][k] for k in ("turns", "images")}}
        for e in events
        if e["event"] == "scan" and e["accepted"]
    ]


def _prebuild_tasks(tmp_path: Path) -> None:
    """Both tiny tasks' first build, side by side (single-threaded warm starts: one core each)."""
    builds = {
        task: spawn_module(["verl_replay.data", "prepare", f"tiny-{task}"], tmp_path / f"build_{task}")
        for task in ("search", "image")
    }
    for task, proc in builds.items():
        assert proc.wait(timeout=1200) == 0, (tmp_path / f"build_{task}" / "stderr").read_text()[-3000:]


def spawn_module(args: list[str], log_dir: Path) -> subprocess.Popen:
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "stdout", "w") as out, open(log_dir / "stderr", "w") as err:
        return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=_env({}), stdout=out, stderr=err)


@pytest.mark.e2e
def test_tiny_search_and_multimodal_recipes_replay_their_groups(tmp_path) -> None:
    # 2 global steps: the first admits groups, the second scans and replays them; the preflight is the
    # math recipe's (tested there)
    common = {"TINY": "1", "TOTAL_STEPS": "2", "K_REP": "2", "TAU": "0.5", "PREFLIGHT": "0", "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    _prebuild_tasks(tmp_path)
    search_dir = tmp_path / "search" / "headroom_drift_search" / "hd_b16_r8"
    image_dir = tmp_path / "multimodal" / "headroom_drift_multimodal" / "hd_b16_r8"
    # One after the other: with the other test worker's run, two recipe runs side by side here made
    # three vLLM runs at once, ~21 of the machine's 24 GB, and Ray's memory monitor killed workers.
    runs = {}
    try:
        for name, script, out_dir in (
            ("search", "headroom_drift_search.sh", tmp_path / "search"),
            ("multimodal", "headroom_drift_multimodal.sh", tmp_path / "multimodal"),
        ):
            runs[name] = spawn_recipe(script, {**common, "OUTPUT_DIR": str(out_dir)}, tmp_path / f"log_{name}")
            runs[name].wait(timeout=1500)  # a hang guard, not a speed target
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    print(f"both tiny recipes, one after the other: {time.monotonic() - start:.0f} s")
    for name, proc in runs.items():
        out = (tmp_path / f"log_{name}" / "stdout").read_text() + (tmp_path / f"log_{name}" / "stderr").read_text()
        assert proc.returncode == 0, f"{name}:\n{out[-4000:]}"

    search = _accepted_kinds(search_dir)
    assert search and all(e["turns"] >= 2 and e["images"] == 0 for e in search), search
    images = _accepted_kinds(image_dir)
    assert images and all(e["images"] >= 1 and e["turns"] == 1 for e in images), images
    print(
        "accepted:",
        [(e["group_id"], e["turns"], round(e["drift"], 3)) for e in search],
        [(e["group_id"], e["images"], round(e["drift"], 3)) for e in images],
    )

    # the step line tells what the buffer took in; nothing was refused
    search_out = (tmp_path / "log_search" / "stdout").read_text()
    assert "multi-turn, 0 image)" in search_out and "not_replayable" not in search_out, search_out
    image_out = (tmp_path / "log_multimodal" / "stdout").read_text()
    assert "(0 multi-turn, " in image_out and "not_replayable" not in image_out, image_out
    for run_dir in (search_dir, image_dir):
        metrics = [
            json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
        ]
        assert metrics[-1]["replay/accepted"] >= 1 and all(m.get("replay/skipped_ingress", 0) == 0 for m in metrics)
        assert metrics[-1]["replay/replay_rows"] >= 4  # the accepted groups' rows went into the update
