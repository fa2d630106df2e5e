"""Fixes for verl 0.9.1 bugs on the path the recipes run, installed by the plugin in every process.

Unlike ``cpu_support`` these apply on GPU hosts too: they make verl do what it documents, nothing
else. Each is applied when its module is first imported (a post-import hook, so the plugin
imports nothing heavy itself) and each has a canary test that fails once verl fixes the bug, so
the patch can be dropped.

- ``trainer_separate_async`` with ``actor_rollout_ref.hybrid_engine=False`` (the split placement:
  training GPUs run no rollout) logs with ``logger.info(..., flush=True)``, which the standard
  library's logger rejects with ``TypeError``: the trainer dies in ``_setup``. Its module logger is
  wrapped to drop the ``flush`` argument.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from typing import Any, Callable

SEPARATE_ASYNC_MODULE = "verl.trainer.ppo.v1.trainer_separate_async"
# (module, attribute) pairs of verl private names these fixes rebind.
PRIVATE_API_PATCHES: tuple[tuple[str, str], ...] = ((SEPARATE_ASYNC_MODULE, "logger"),)


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
