"""vLLM's CPU build as the cpu_tiny profile runs it, on the tiny model, against a plain transformers
fp32 forward of the same tokens (engine_probe.py runs the engine in its own process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is part of the CPU stack")
pytestmark = pytest.mark.slow

PROBE = Path(__file__).with_name("engine_probe.py")
# bf16 engine vs fp32 forward, per token: the engine floor (docs/cpu_stack.md)
FLOOR_MEAN = 0.02


def _probe(model_dir: Path, out: Path, *args: str, plugins: str | None = None) -> dict:
    env = dict(os.environ)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins  # vLLM loads only the general plugins named here
    result = subprocess.run(
        [sys.executable, str(PROBE), str(model_dir), str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(tiny_assets, tmp_path_factory) -> dict:
    return _probe(tiny_assets.model_dir, tmp_path_factory.mktemp("engine") / "report.json")


def test_stale_nan_in_the_kv_cache_never_reaches_a_sequence(report):
    stale = report["stale_nan"]
    assert stale["caches_poisoned"] >= 1 and stale["tokens"] > 0
    assert stale["nan"] == 0 and stale["mean"] < FLOOR_MEAN, stale


def test_without_verl_replays_plugin_stale_nan_poisons_the_rollout(tiny_assets, tmp_path):
    """The control that shows the check above can fail: vLLM's own CPU runner, plugin not loaded."""
    stale = _probe(tiny_assets.model_dir, tmp_path / "report.json", "--stale-nan-only", plugins="none")["stale_nan"]
    assert stale["caches_poisoned"] >= 1 and stale["nan"] > 0, stale


def test_log_probs_are_the_temperature_scaled_distribution(report):
    """verl recomputes log_softmax(logits / T) in the trainer; vLLM's processed log-probs (verl's
    logprobs_mode) are that distribution, not the raw one."""
    scaled, unscaled = report["temperature"]["scaled"], report["temperature"]["unscaled"]
    assert scaled["nan"] == 0 and scaled["mean"] < FLOOR_MEAN, scaled
    assert unscaled["mean"] > 5 * scaled["mean"], (scaled, unscaled)


def test_top_k_log_probs_are_renormalised_over_the_kept_tokens(report):
    """With top_k (or top_p) the processed log-probs are renormalised over the kept tokens: not what
    the trainer recomputes. The recipes keep top_k=-1, top_p=1 for that reason (docs/cpu_stack.md)."""
    kept, full = report["top_k"]["renormalised"], report["top_k"]["full"]
    assert kept["nan"] == 0 and kept["mean"] < FLOOR_MEAN, kept
    assert full["mean"] > 5 * kept["mean"], (kept, full)
