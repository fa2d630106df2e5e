"""Fixes for verl 0.9.1 bugs on the path the recipes run, installed by the plugin in every process.

Unlike ``cpu_support`` these apply on GPU hosts too: they make verl do what it documents, nothing
else. Each is applied when its module is first imported (a post-import hook, so the plugin
imports nothing heavy itself) and each has a canary test that fails once verl fixes the bug, so
the patch can be dropped.

- ``trainer_separate_async`` with ``actor_rollout_ref.hybrid_engine=False`` (the split placement:
  training GPUs run no rollout) logs with ``logger.info(..., flush=True)``, which the standard
  library's logger rejects with ``TypeError``: the trainer dies in ``_setup``. Its module logger is
  wrapped to drop the ``flush`` argument.
- ``tensordict_utils.maybe_fix_3d_position_ids`` sets ``_ragged_idx = 2`` on every 3-D nested
  ``position_ids`` (M-RoPE, per row ``(4, L)``: ragged in the last dimension). TransferQueue hands
  back a batch whose rows all have one length ragged in the *leading* row dimension instead
  (``[B, j, L]``, each ``j`` = 4); forcing 2 on that layout makes the next ``unbind`` split the
  wrong dimension, and verl's update dies in ``split_with_sizes`` whenever a mini-batch's rows
  all have one length (common on small batches, any strategy). The replacement sets the ragged
  dimension the tensor's storage actually has.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from typing import Any, Callable

SEPARATE_ASYNC_MODULE = "verl.trainer.ppo.v1.trainer_separate_async"
# verl's modules that hold maybe_fix_3d_position_ids (imported by name, so each is rebound)
POSITION_FIX_MODULES = ("verl.utils.tensordict_utils", "verl.workers.engine_workers", "verl.workers.engine.base")
# (module, attribute) pairs of verl private names these fixes rebind.
PRIVATE_API_PATCHES: tuple[tuple[str, str], ...] = (
    (SEPARATE_ASYNC_MODULE, "logger"),
    *((name, "maybe_fix_3d_position_ids") for name in POSITION_FIX_MODULES),
)


class FlushTolerantLogger(logging.LoggerAdapter):
    """A logger that accepts (and ignores) ``print``'s ``flush`` keyword."""

    def process(self, msg: Any, kwargs: dict) -> tuple[Any, dict]:
        kwargs.pop("flush", None)
        return msg, kwargs


def tolerate_flush_keyword(module: Any) -> None:
    logger = getattr(module, "logger", None)
    if logger is None:
        raise RuntimeError(f"verl_replay fixes {module.__name__}.logger, which this verl version does not have")
    if not isinstance(logger, FlushTolerantLogger):
        module.logger = FlushTolerantLogger(logger, {})


def ragged_dim_of_3d_positions(position_ids: Any) -> int:
    """The ragged dimension (1 or 2, batch dimension 0) a 3-D jagged tensor's storage has.

    Rows ``(R, L_i)`` ragged in the last dimension are stored as values ``[R, sum L_i]``; rows of
    one length ragged in the leading one as ``[sum R_i, L]``: the ragged dimension is the one whose
    size is the offsets' total. When both sizes are (one row of R = L) verl's choice, 2, stands.
    """
    values, total = position_ids.values(), int(position_ids.offsets()[-1])
    if values.shape[0] == total and values.shape[1] != total:
        return 1
    return 2


def fix_3d_position_ids_by_layout(data: Any) -> None:
    """verl's ``maybe_fix_3d_position_ids``, with the ragged dimension read from the storage."""
    if "position_ids" in data.keys():
        positions = data["position_ids"]
        if positions.dim() == 3 and positions.is_nested:
            positions._ragged_idx = ragged_dim_of_3d_positions(positions)


def use_layout_aware_position_fix(module: Any) -> None:
    if not hasattr(module, "maybe_fix_3d_position_ids"):
        raise RuntimeError(
            f"verl_replay fixes {module.__name__}.maybe_fix_3d_position_ids, which this verl version does not have"
        )
    module.maybe_fix_3d_position_ids = fix_3d_position_ids_by_layout


class _PostImportPatch(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after ``name`` is executed, whoever imports it."""

    def __init__(self, name: str, patch: Callable[[Any], None]) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        patch = self.patch

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def patch_when_imported(name: str, patch: Callable[[Any], None]) -> None:
    """``patch(module)`` now if ``name`` is imported already, else as soon as it is."""
    if name in sys.modules:
        patch(sys.modules[name])
        return
    if not any(isinstance(f, _PostImportPatch) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportPatch(name, patch))


def install_verl_fixes() -> None:
    patch_when_imported(SEPARATE_ASYNC_MODULE, tolerate_flush_keyword)
    for name in POSITION_FIX_MODULES:
        patch_when_imported(name, use_layout_aware_position_fix)
