"""Loading Qwen3.5's processor without torchvision (the CPU stack): canaries and the real load."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_replay.integrations.verl import vl_processor
from verl_replay.integrations.verl.vl_processor import (
    PRIVATE_API_PATCHES,
    allow_vl_processor_without_torchvision,
    torchvision_available,
)

REPO = Path(__file__).resolve().parents[3]
needs_no_torchvision = pytest.mark.skipif(torchvision_available(), reason="torchvision installed: nothing to patch")


@pytest.fixture(scope="module")
def model_dir(tiny_assets):
    return tiny_assets.model_dir


def test_private_transformers_names_exist():
    for module_name, attribute in PRIVATE_API_PATCHES:
        module = importlib.import_module(module_name)
        assert hasattr(module, attribute), (
            f"transformers moved {module_name}.{attribute}: update verl_replay/integrations/verl/vl_processor.py"
        )


@needs_no_torchvision
def test_without_the_patch_transformers_cannot_build_the_processor(model_dir):
    """Canary: the reason the patch exists. If this starts passing, transformers loads Qwen3.5's
    processor without torchvision by itself and the patch can go."""
    code = "import sys; from transformers import AutoProcessor; AutoProcessor.from_pretrained(sys.argv[1])"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True, env=env, timeout=180
    )
    assert result.returncode != 0 and "torchvision" in result.stderr.lower()


@needs_no_torchvision
def test_with_the_patch_verl_loads_qwen3_vl_processor(model_dir):
    from verl.utils import hf_processor

    assert allow_vl_processor_without_torchvision() is True
    assert allow_vl_processor_without_torchvision() is True  # idempotent
    processor = hf_processor(str(model_dir))
    assert type(processor).__name__ == "Qwen3VLProcessor"
    assert type(processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
    # verl binds the model's M-RoPE index function to the processor (verl.utils.tokenizer).
    assert hasattr(processor, "get_rope_index") and processor.config.model_type == "qwen3_5"


def test_does_nothing_when_torchvision_is_installed(monkeypatch):
    monkeypatch.setattr(vl_processor, "_installed", False)
    monkeypatch.setattr(vl_processor, "torchvision_available", lambda: True)
    assert allow_vl_processor_without_torchvision() is False


def test_every_verl_process_in_cpu_mode_can_load_it(model_dir):
    """What each Ray worker does: ``import verl`` loads our plugin, which with VERL_PLATFORM=cpu
    installs the CPU support, after which transformers builds the processor."""
    code = (
        "import sys, verl; from transformers import AutoProcessor; "
        "print(type(AutoProcessor.from_pretrained(sys.argv[1])).__name__)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "VERL_PLATFORM": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True, env=env, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "Qwen3VLProcessor"
