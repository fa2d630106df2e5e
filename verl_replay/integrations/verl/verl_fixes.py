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
  ``position_ids`` (M-RoPE, per row ``(4, L)``: ragged in the last dimension, values
  ``[4, sum L]``). TransferQueue builds its batches with ``torch.nested.as_nested_tensor``, which
  stores rows that all have one length ragged in the *leading* row dimension instead (``[B, j, L]``,
  each ``j`` = 4, values ``[4B, L]``). Forcing 2 on that layout makes the next ``unbind`` split the
  wrong dimension (the padded path dies in ``split_with_sizes``), and even with the right ragged
  dimension the packed path (``use_remove_padding``) reads ``values()`` as ``[4, sum L]`` and gets
  position ids ``(4B, 1, L)`` for input ids ``(1, B*L)``: Qwen3.5's forward raises a size mismatch
  in its rotary embedding. Such shards are common: a one-group scan chunk whose responses all stop
  at the length cap, or any small mini-batch. The replacement reads the layout from the storage
  (against the rows' token counts in ``input_ids``) and rebuilds a leading-ragged tensor into the
  layout verl expects, so both paths see ``[B, 4, j]`` with values ``[4, sum L]``.
- The colocated weight push (trainer worker -> vLLM worker, ZMQ over an IPC socket) names its
  socket ``/tmp/rl-colocate-zmq-<Ray job id>-replica-<r>-rank-<k>.sock``. verl counts on the job
  id to keep two jobs on one host apart, but every Ray cluster numbers its jobs from
  ``01000000``: two runs on one host, each with its own cluster, bind the same path. The second
  sender removes the first one's socket file and binds its own; the first run's vLLM worker then
  waits on a socket nobody serves, and the run hangs in its first weight push, every process idle.
  Both ends are named after the node's raylet as well (``RAY_RAYLET_PID``, which the trainer
  worker and the vLLM worker it feeds share, and which two live clusters cannot).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
from typing import Any, Callable

SEPARATE_ASYNC_MODULE = "verl.trainer.ppo.v1.trainer_separate_async"
# the two ends of the colocated weight push: the sender (trainer worker) and the receiver (vLLM worker)
COLOCATED_SENDER_MODULE = "verl.workers.rollout.vllm_rollout.vllm_rollout"
COLOCATED_RECEIVER_MODULE = "verl.workers.rollout.vllm_rollout.utils"
COLOCATED_SOCKET_PREFIX = "ipc:///tmp/rl-colocate-zmq-"
# verl's modules that hold maybe_fix_3d_position_ids (imported by name, so each is rebound)
POSITION_FIX_MODULES = ("verl.utils.tensordict_utils", "verl.workers.engine_workers", "verl.workers.engine.base")
# (module, attribute) pairs of verl private names these fixes rebind.
PRIVATE_API_PATCHES: tuple[tuple[str, str], ...] = (
    (SEPARATE_ASYNC_MODULE, "logger"),
    *((name, "maybe_fix_3d_position_ids") for name in POSITION_FIX_MODULES),
    (COLOCATED_SENDER_MODULE, "ServerAdapter"),
    (COLOCATED_RECEIVER_MODULE, "vLLMColocateWorkerExtension"),
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


MROPE_ROWS = 4  # verl's M-RoPE position ids per row: text + temporal / height / width


def _row_lengths(data: Any) -> list[int] | None:
    """Token count of every row, from ``input_ids`` (a nested tensor ragged in its last dimension)."""
    if "input_ids" not in data.keys():
        return None
    input_ids = data["input_ids"]
    if not getattr(input_ids, "is_nested", False) or input_ids.dim() != 2:
        return None
    return input_ids.offsets().diff().tolist()


def ragged_dim_of_3d_positions(position_ids: Any, lengths: list[int] | None = None) -> int:
    """The ragged dimension (1 or 2, batch dimension 0) a 3-D jagged tensor's storage has.

    Rows ``(R, L_i)`` ragged in the last dimension are stored as values ``[R, sum L_i]`` with the
    offsets of the ``L_i``; rows of one length ragged in the leading one as ``[sum R_i, L]`` with the
    offsets of the ``R_i`` (= ``MROPE_ROWS`` each). ``lengths`` (each row's token count, from
    ``input_ids``) decides; without it the row count ``MROPE_ROWS`` does. When both readings fit
    (one row of ``MROPE_ROWS`` tokens) they give the same row, and verl's choice, 2, stands.
    """
    values, offsets = position_ids.values(), position_ids.offsets()
    steps = offsets.diff().tolist()
    total = int(offsets[-1])
    if lengths is not None:
        last = values.shape[1] == total and steps == list(lengths)
        leading = values.shape[0] == total and all(n == values.shape[1] for n in lengths)
    else:
        last = values.shape[0] == MROPE_ROWS and values.shape[1] == total
        leading = values.shape[0] == total and all(step == MROPE_ROWS for step in steps)
    if leading and not last:
        return 1
    if last or leading:
        return 2
    raise ValueError(
        f"position_ids storage {tuple(values.shape)} with offsets {offsets.tolist()} fits neither (4, L) rows "
        f"ragged in the last dimension nor rows of one length (row lengths {lengths})"
    )


def as_last_dim_ragged(position_ids: Any) -> Any:
    """Rows of one length stored ragged in the leading dimension (values ``[B*R, L]``), rebuilt as
    verl's layout: ragged in the last dimension, values ``[R, B*L]`` (each row ``(R, L)`` unchanged)."""
    import torch

    offsets = position_ids.offsets()
    rows, width = len(offsets) - 1, int(position_ids.values().shape[1])
    per_row = int(offsets[1] - offsets[0]) if rows else MROPE_ROWS
    values = position_ids.values().reshape(rows, per_row, width).permute(1, 0, 2).reshape(per_row, rows * width)
    row_offsets = torch.arange(0, rows * width + 1, width, dtype=offsets.dtype, device=offsets.device)
    return torch.nested.nested_tensor_from_jagged(values, row_offsets, jagged_dim=2)


def fix_3d_position_ids_by_layout(data: Any) -> None:
    """verl's ``maybe_fix_3d_position_ids``, for every layout TransferQueue returns."""
    if "position_ids" not in data.keys():
        return
    positions = data["position_ids"]
    if positions.dim() != 3 or not positions.is_nested:
        return
    if ragged_dim_of_3d_positions(positions, _row_lengths(data)) == 1:
        data["position_ids"] = as_last_dim_ragged(positions)
    else:
        positions._ragged_idx = 2


def use_layout_aware_position_fix(module: Any) -> None:
    if not hasattr(module, "maybe_fix_3d_position_ids"):
        raise RuntimeError(
            f"verl_replay fixes {module.__name__}.maybe_fix_3d_position_ids, which this verl version does not have"
        )
    module.maybe_fix_3d_position_ids = fix_3d_position_ids_by_layout


def socket_of_this_cluster(handle: str) -> str:
    """verl's colocated-push socket, also named after this node's raylet (when known)."""
    raylet = os.environ.get("RAY_RAYLET_PID", "").strip()
    if not raylet or not handle.startswith(COLOCATED_SOCKET_PREFIX) or f"-raylet{raylet}-" in handle:
        return handle
    return f"{COLOCATED_SOCKET_PREFIX}raylet{raylet}-{handle[len(COLOCATED_SOCKET_PREFIX) :]}"


def _wrap_once(owner: Any, name: str, make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` with ``make_wrapper(original)``, once however often it is called."""
    original = getattr(owner, name)
    if getattr(original, "_verl_replay_socket_fix", False):
        return
    wrapped = functools.wraps(original)(make_wrapper(original))
    wrapped._verl_replay_socket_fix = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapped)


def name_sender_socket_by_cluster(module: Any) -> None:
    def rename_after(init: Callable[..., None]) -> Callable[..., None]:
        def init_then_rename(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if isinstance(getattr(self, "zmq_handle", None), str):
                self.zmq_handle = socket_of_this_cluster(self.zmq_handle)

        return init_then_rename

    _wrap_once(module.ServerAdapter, "__init__", rename_after)


def name_receiver_socket_by_cluster(module: Any) -> None:
    def rename_result(get_handle: Callable[[Any], str]) -> Callable[[Any], str]:
        return lambda self: socket_of_this_cluster(get_handle(self))

    _wrap_once(module.vLLMColocateWorkerExtension, "_get_zmq_handle", rename_result)


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
    patch_when_imported(COLOCATED_SENDER_MODULE, name_sender_socket_by_cluster)
    patch_when_imported(COLOCATED_RECEIVER_MODULE, name_receiver_socket_by_cluster)
    for name in POSITION_FIX_MODULES:
        patch_when_imported(name, use_layout_aware_position_fix)
