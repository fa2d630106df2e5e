"""What every finished verl run of the test suite must show: nothing hidden, no rollout lost.

verl's agent loop logs a rollout whose post-processing fails (``ERROR ... Traceback``) and goes on
without it; its trainer then pads the batch with a synthetic row. The console showed nothing of
it, so every successful e2e run is checked here, on its own files: no ``ERROR`` or ``Traceback``
in ``verl.log``, every training step's ``rollout/lost`` is 0 and its padding rows are those the
replay mini-batch plan asked for (none for verl's own GRPO, ``replay.strategy=none``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

__all__ = ["check_clean_run", "hidden_errors"]

_HIDDEN_ERROR = re.compile(r"\bERROR\b|Traceback \(most recent call last\)")
_TRAINING_DONE = re.compile(r"Training Progress: 100%")
# vLLM's engine core killed by the cluster's shutdown before its API server: the server logs that
# it saw the core go ("[shutdown] ... engine core exited unexpectedly") and then its output
# handler's EngineDeadError. A teardown race after the last step, not an error of the run.
_VLLM_TEARDOWN = re.compile(r"\((?P<actor>vLLMHttpServer pid=\d+)\).*\[shutdown\] MPClient: engine core exited")


def hidden_errors(log: str) -> list[str]:
    """The log's error lines, less a vLLM server's teardown lines once training has finished."""
    hidden, done, torn_down = [], False, set()
    for line in log.splitlines():
        done = done or bool(_TRAINING_DONE.search(line))
        teardown = _VLLM_TEARDOWN.search(line) if done else None
        if teardown:
            torn_down.add(teardown["actor"])
        if _HIDDEN_ERROR.search(line) and not any(f"({actor})" in line for actor in torn_down):
            hidden.append(line)
    return hidden


def check_clean_run(run_dir: Path) -> None:
    run_dir = Path(run_dir)
    # verbose=true runs print verl's output instead of writing verl.log
    log = (run_dir / "verl.log").read_text(errors="replace") if (run_dir / "verl.log").exists() else ""
    hidden = hidden_errors(log)
    assert not hidden, f"{run_dir}/verl.log hides an error:\n" + "\n".join(hidden[:10])
    steps = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if "timing_s/step" in record["data"]:  # a training step (validation lines have no timing)
                steps.append(record)
    assert steps, f"{run_dir}/metrics.jsonl: no training step"
    lost = {r["step"]: r["data"].get("rollout/lost") for r in steps if r["data"].get("rollout/lost") != 0}
    assert not lost, f"{run_dir}: rollouts lost per step (None: not counted): {lost}"
    # padding beyond what the replay mini-batch plan asked for makes up for a lost rollout
    unplanned = {
        r["step"]: (r["data"]["rollout/padding_rows"], r["data"]["rollout/planned_padding_rows"])
        for r in steps
        if r["data"]["rollout/padding_rows"] != r["data"]["rollout/planned_padding_rows"]
    }
    assert not unplanned, f"{run_dir}: (padding rows, planned) per step: {unplanned}"
    strategy = (yaml.safe_load((run_dir / "config.yaml").read_text()).get("replay") or {}).get("strategy")
    if strategy == "none":  # verl's own GRPO plans no padding
        assert "synthetic padding" not in log, f"{run_dir}/verl.log: verl padded a batch"
