"""Fixes of verl 0.9.1 bugs on the recipes' path: each applies, and each has a canary."""

from __future__ import annotations

import importlib
import inspect
import logging
import subprocess
import sys

import pytest

from verl_replay.integrations.verl import verl_fixes


@pytest.mark.parametrize("module_name, attribute", verl_fixes.PRIVATE_API_PATCHES)
def test_patched_names_exist_in_pinned_verl(module_name, attribute):
    assert hasattr(importlib.import_module(module_name), attribute), f"verl moved {module_name}.{attribute}"


def test_separate_async_logger_takes_flush_after_import():
    module = importlib.import_module(verl_fixes.SEPARATE_ASYNC_MODULE)  # the plugin ran on `import verl`
    assert isinstance(module.logger, verl_fixes.FlushTolerantLogger)
    module.logger.info("split placement: %s", "ok", flush=True)  # what verl's _setup does; raised before


def test_canary_verl_still_logs_with_flush():
    """If verl stops passing flush= to its logger, the fix can go."""
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    assert "flush=True" in inspect.getsource(PPOTrainerSeparateAsync._setup), (
        "verl's separate_async _setup no longer logs with flush=True: remove verl_fixes.tolerate_flush_keyword"
    )
    plain = logging.getLogger("verl_replay.canary")
    plain.setLevel(logging.INFO)  # the standard logger rejects flush= once the record is built
    with pytest.raises(TypeError, match="flush"):
        plain.info("x", flush=True)


def test_fix_is_applied_in_a_fresh_process_that_only_imports_verl():
    code = (
        "import verl, logging\n"
        "from verl.trainer.ppo.v1 import trainer_separate_async as m\n"
        "m.logger.info('x', flush=True)\n"
        "print(type(m.logger).__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "FlushTolerantLogger"
