"""Shared fixtures. Nothing is downloaded: assets are built locally from a seed."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_assets():
    """The tiny tokenizer, Qwen3.5 model, datasets and SQLite databases (built once per machine)."""
    from verl_replay.data.tiny_assets import build_tiny_assets

    return build_tiny_assets()


class MainRun:
    """Outcome of one ``python -m verl_replay.main`` subprocess."""

    def __init__(self, run_dir, returncode: int, output: str):
        self.run_dir = run_dir
        self.returncode = returncode
        self.output = output

    @property
    def metrics(self) -> list[dict]:
        import json

        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line)["data"] for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def run_main(tmp_path):
    """Run verl_replay.main in a subprocess with Hydra overrides; outputs land under tmp_path."""
    import os
    import subprocess
    import sys

    def run(*overrides: str, experiment: str = "e2e", timeout: int = 900, check: bool = True) -> MainRun:
        env = dict(os.environ, VERL_REPLAY_OUTPUT_DIR=str(tmp_path / "outputs"), PYTHONUNBUFFERED="1")
        env.pop("VERL_FILE_LOGGER_PATH", None)
        command = [sys.executable, "-m", "verl_replay.main", f"trainer.experiment_name={experiment}", *overrides]
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
        output = result.stdout + result.stderr
        outcome = MainRun(tmp_path / "outputs" / "verl_replay" / experiment, result.returncode, output)
        if check and result.returncode != 0:
            raise AssertionError(f"verl_replay.main failed ({result.returncode}):\n{output[-6000:]}")
        return outcome

    return run
