"""The CPU weight-sync engine: bit-identical weights over a dedicated gloo group."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from verl_replay.integrations.verl.cpu_checkpoint_engine import BACKEND_NAME, GlooCheckpointEngine


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=generator),
        "odd.bf16": torch.randn(3, generator=generator).to(torch.bfloat16),  # 6 bytes: misaligns what follows
        "layer.weight": torch.randn(4, 4, generator=generator),
        "big.weight": torch.randn(64, generator=generator),  # 256 bytes > the 100-byte bucket
        "counts": torch.arange(5, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "transposed": torch.randn(3, 2, generator=generator).t(),  # not contiguous
        "nan_inf": torch.tensor([float("nan"), float("inf"), -0.0]),
    }


def _run(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args)
    thread.start()
    return thread


def _sync_once(actor_world: int, rollout_world: int, bucket_size: int) -> list[dict[str, torch.Tensor]]:
    actors = [GlooCheckpointEngine(bucket_size, is_master=(rank == 0)) for rank in range(actor_world)]
    rollouts = [GlooCheckpointEngine(bucket_size) for _ in range(rollout_world)]
    metadata = [engine.prepare() for engine in actors + rollouts]
    actor_kwargs, rollout_kwargs = GlooCheckpointEngine.build_topology(actor_world, rollout_world, metadata)

    def kwargs_of(table: dict, index: int) -> dict:
        return {key: values[index] for key, values in table.items()}

    def init(engine: GlooCheckpointEngine, kwargs: dict):
        return _run(lambda: engine.init_process_group(**kwargs))

    inits = [init(e, kwargs_of(actor_kwargs, i)) for i, e in enumerate(actors)]
    inits += [init(e, kwargs_of(rollout_kwargs, i)) for i, e in enumerate(rollouts)]
    for thread in inits:
        thread.join(timeout=300)  # a hang guard

    drained = [0] * actor_world
    received: list[dict[str, torch.Tensor]] = [{} for _ in rollouts]

    def send(index: int) -> None:
        def generate():
            for name, tensor in _weights().items():
                drained[index] += 1
                yield name, tensor

        asyncio.run(actors[index].send_weights(generate()))

    def receive(index: int) -> None:
        async def collect():
            async for name, tensor in rollouts[index].receive_weights():
                received[index][name] = tensor

        asyncio.run(collect())

    threads = [_run(send, i) for i in range(actor_world)] + [_run(receive, i) for i in range(rollout_world)]
    for thread in threads:
        thread.join(timeout=300)  # a hang guard
        assert not thread.is_alive(), "weight sync hung"
    for engine in actors + rollouts:
        engine.finalize()
    assert drained == [len(_weights())] * actor_world  # every actor rank walks the whole generator
    return received


@pytest.mark.parametrize("actor_world,rollout_world,bucket_size", [(1, 1, 1 << 20), (2, 2, 100), (3, 1, 64)])
def test_weights_arrive_bit_identical(actor_world, rollout_world, bucket_size):
    expected = _weights()
    for received in _sync_once(actor_world, rollout_world, bucket_size):
        assert list(received) == list(expected)
        for name, tensor in expected.items():
            got = received[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            # raw bytes compared: NaN payloads and -0.0 must survive too
            assert torch.equal(got.contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def test_two_syncs_in_a_row_use_fresh_groups():
    first, second = _sync_once(1, 1, 128), _sync_once(1, 1, 128)
    assert all(
        torch.equal(first[0][k].view(torch.uint8), second[0][k].view(torch.uint8))
        for k in first[0]
        if first[0][k].numel()
    )


def test_topology_requires_actor_rank_zero_as_master():
    with pytest.raises(RuntimeError, match="master"):
        GlooCheckpointEngine.build_topology(1, 1, [None, None])


def test_registered_in_verls_registry():
    from verl.checkpoint_engine import CheckpointEngineRegistry

    assert CheckpointEngineRegistry.get(BACKEND_NAME) is GlooCheckpointEngine
