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


def _positions(lengths, leading_ragged: bool):
    import torch
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows = [torch.arange(n).expand(4, n).clone() + i for i, n in enumerate(lengths)]
    if leading_ragged:  # how TransferQueue returns rows of one length: [B, j, L], each j = 4
        return rows, torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    return rows, list_of_dict_to_tensordict([{"position_ids": r} for r in rows])["position_ids"]  # [B, 4, j]


@pytest.mark.parametrize("lengths, leading_ragged", [((38,) * 8, True), ((38, 37, 38), False), ((5,), True)])
def test_position_fix_keeps_each_rows_own_shape(lengths, leading_ragged):
    """Rows cut from the fixed tensor are the rows that went in, for both storage layouts."""
    import torch
    from tensordict import TensorDict

    rows, positions = _positions(lengths, leading_ragged)
    data = TensorDict({"position_ids": positions}, batch_size=len(rows))
    verl_fixes.fix_3d_position_ids_by_layout(data)
    fixed = data["position_ids"]
    assert fixed._ragged_idx == (1 if leading_ragged else 2)
    assert all(torch.equal(a, b) for a, b in zip(fixed.unbind(), rows, strict=True))


def test_canary_verls_own_position_fix_breaks_rows_of_one_length():
    """verl forces _ragged_idx = 2, which breaks rows of one length: drop the patch once it does not."""
    import importlib.util
    from pathlib import Path

    source = Path(importlib.util.find_spec("verl.utils.tensordict_utils").origin).read_text()
    assert 'data["position_ids"]._ragged_idx = 2' in source, (
        "verl changed maybe_fix_3d_position_ids: check whether verl_fixes still needs to replace it"
    )
    _, positions = _positions((38,) * 8, leading_ragged=True)
    positions._ragged_idx = 2  # what verl's version does
    with pytest.raises(RuntimeError, match="split_with_sizes"):
        positions.unbind()
