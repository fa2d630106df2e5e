"""A CPU weight-sync engine for verl's split placement (``trainer.v1.trainer_mode=separate_async``).

verl's ``separate_async`` trainer pushes the trainer's weights to standalone rollout workers through
a checkpoint engine (``nccl``, ``nixl``, ... on GPUs) and refuses the in-process ``naive`` one. This
engine does the same job between CPU processes so the split placement runs on a CPU-only host:

- transport: a **dedicated gloo process group** built for each sync from its own ``TCPStore``
  (opened by actor rank 0 in ``prepare``). It is independent of the default process groups both
  sides already hold (the trainer's FSDP world, the rollout workers' world), which is why Ray's
  ``torch_gloo`` collective, bound to the default group, cannot be used here;
- protocol: actor rank 0 packs the named tensors into buckets of ``bucket_size`` bytes and
  broadcasts each bucket's table of contents, then its bytes; every rollout worker unpacks them
  back into tensors of the original dtype and shape (bit-identical: raw bytes are copied);
- other actor ranks take no part in the group but still drain the weight generator, because
  producing each full tensor is itself a collective over the actor's FSDP group.

Registered as backend ``cpu_gloo`` when this module is imported: the ``cpu_tiny`` profile names it
in ``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module``, which verl imports in the
driver, the actor workers and the rollout workers before building the engine.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import pickle
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Optional

import ray
import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

logger = logging.getLogger(__name__)

BACKEND_NAME = "cpu_gloo"
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
_HEADER_WORDS = 3  # [table-of-contents bytes, payload bytes, is_last]


@dataclass(frozen=True)
class SyncEndpoint:
    """Where the sync group's store listens (actor rank 0)."""

    host: str
    port: int


@dataclass(frozen=True)
class TensorEntry:
    """One tensor inside a bucket's payload."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _node_ip() -> str:
    try:
        return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # outside a Ray worker (unit tests)
        return "127.0.0.1"


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a CPU tensor's data (copied only when it is not contiguous)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous().reshape(-1).view(torch.uint8)


async def _iterate(weights: Iterable | AsyncIterator) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


@CheckpointEngineRegistry.register(BACKEND_NAME)
class GlooCheckpointEngine(CheckpointEngine):
    """Bucketed broadcast of full tensors from actor rank 0 to every rollout worker over gloo.

    Args:
        bucket_size: bytes per broadcast (``update_weights_bucket_megabytes``); a tensor larger
            than a bucket travels alone in a bucket of its own size.
        is_master: True on actor rank 0 (verl passes it to the training side only).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, **unused: Any) -> None:
        if bucket_size <= 0:
            raise ValueError(f"bucket_size must be positive, got {bucket_size}")
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self._store: Optional[dist.TCPStore] = None
        self._group: Optional[dist.ProcessGroupGloo] = None
        self._syncs = 0

    # ------------------------------------------------------------------ topology

    def prepare(self) -> Optional[SyncEndpoint]:
        """Actor rank 0 opens this sync's store; everyone else has nothing to announce."""
        if not self.is_master:
            return None
        host = _node_ip()
        # port 0: the store binds a free port itself (no probe-then-bind race)
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=GROUP_TIMEOUT)
        return SyncEndpoint(host=host, port=int(self._store.port))

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        endpoint = metadata[0]
        if not isinstance(endpoint, SyncEndpoint):
            raise RuntimeError("cpu_gloo checkpoint engine: actor rank 0 must be the master (it opens the store)")
        world_size = 1 + rollout_world_size
        actor_kwargs = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world_size] * actor_wg_world_size,
            "endpoint": [endpoint] * actor_wg_world_size,
        }
        rollout_kwargs = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "endpoint": [endpoint] * rollout_world_size,
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, endpoint: SyncEndpoint) -> None:
        self.rank, self.world_size = rank, world_size
        if rank < 0:  # an actor rank outside the sync group
            return
        if self._store is None:
            self._store = dist.TCPStore(
                endpoint.host, endpoint.port, is_master=False, wait_for_workers=False, timeout=GROUP_TIMEOUT
            )
        self._syncs += 1
        # The port is new for every sync; the prefix keeps a reused port's keys apart anyway.
        store = dist.PrefixStore(f"verl_replay/cpu_gloo/{endpoint.port}/{self._syncs}", self._store)
        self._group = dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)

    def finalize(self) -> None:
        self._group = None
        self._store = None
        self.rank = self.world_size = None

    # ------------------------------------------------------------------ transfer

    def _broadcast(self, tensor: torch.Tensor) -> None:
        assert self._group is not None, "init_process_group must run before a transfer"
        self._group.broadcast(tensor, 0).wait()

    def _send_bucket(self, entries: list[TensorEntry], parts: list[torch.Tensor], is_last: bool) -> None:
        table = torch.frombuffer(bytearray(pickle.dumps(entries)), dtype=torch.uint8)
        payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        self._broadcast(torch.tensor([table.numel(), payload.numel(), int(is_last)], dtype=torch.int64))
        self._broadcast(table)
        if payload.numel():
            self._broadcast(payload)

    def _receive_bucket(self) -> tuple[list[TensorEntry], torch.Tensor, bool]:
        header = torch.zeros(_HEADER_WORDS, dtype=torch.int64)
        self._broadcast(header)
        table_bytes, payload_bytes, is_last = (int(v) for v in header.tolist())
        table = torch.empty(table_bytes, dtype=torch.uint8)
        self._broadcast(table)
        payload = torch.empty(payload_bytes, dtype=torch.uint8)
        if payload_bytes:
            self._broadcast(payload)
        return pickle.loads(table.numpy().tobytes()), payload, bool(is_last)

    @torch.no_grad()
    async def send_weights(self, weights: Iterable | AsyncIterator, global_steps: Optional[int] = None) -> dict:
        if self.rank is None:
            raise RuntimeError("cpu_gloo checkpoint engine: send_weights before init_process_group")
        if self.rank < 0:
            async for _ in _iterate(weights):
                pass
            return {}
        entries: list[TensorEntry] = []
        parts: list[torch.Tensor] = []
        filled = 0
        sent_bytes = 0
        async for name, tensor in _iterate(weights):
            data = _as_bytes(tensor)
            if entries and filled + data.numel() > self.bucket_size:
                await asyncio.to_thread(self._send_bucket, entries, parts, False)
                sent_bytes += filled
                entries, parts, filled = [], [], 0
            entries.append(TensorEntry(name, tensor.dtype, tuple(tensor.shape), filled, data.numel()))
            # FSDP may reuse the gathered buffer for the next tensor: keep our own bytes.
            parts.append(data.clone())
            filled += data.numel()
        await asyncio.to_thread(self._send_bucket, entries, parts, True)
        sent_bytes += filled
        logger.info("cpu_gloo: sent %d bytes to %d rollout workers", sent_bytes, (self.world_size or 1) - 1)
        return {}

    @torch.no_grad()
    async def receive_weights(self, global_steps: Optional[int] = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if self.rank is None or self.rank <= 0:
            raise RuntimeError("cpu_gloo checkpoint engine: only rollout workers (rank >= 1) receive weights")
        while True:
            entries, payload, is_last = await asyncio.to_thread(self._receive_bucket)
            for entry in entries:
                # a copy starts at offset 0, so any dtype can view it (alignment)
                raw = payload[entry.offset : entry.offset + entry.nbytes].clone()
                yield entry.name, raw.view(entry.dtype).reshape(entry.shape)
            if is_last:
                return
