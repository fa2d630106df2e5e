"""The CPU plugin's contact points with verl 0.9.1: each must exist and take effect.

If one of these fails after a verl upgrade, the message says which private name moved.
"""

import importlib
import os

import pytest
import torch

from verl_replay.integrations.verl import cpu_support


@pytest.fixture(scope="module", autouse=True)
def installed():
    cpu_support.install_cpu_support()


@pytest.mark.parametrize("module_name, attribute", cpu_support.PRIVATE_API_PATCHES)
def test_private_api_names_exist_in_pinned_verl(module_name, attribute):
    module = importlib.import_module(module_name)
    assert hasattr(module, attribute), (
        f"verl moved {module_name}.{attribute}; verl_replay's CPU support must be updated for this verl version"
    )


def test_missing_private_name_fails_with_clear_message(monkeypatch):
    from verl.workers import engine_workers

    monkeypatch.delattr(engine_workers, "initialize_global_process_group_ray")
    with pytest.raises(cpu_support.VerlPrivateApiChanged, match="initialize_global_process_group_ray.*verl==0.9.1"):
        cpu_support.use_plain_gloo_process_group()


_INIT_WITH_PORT_TAKEN = """
import os, socket, sys, torch
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(taken.getsockname()[1]), RANK="0", WORLD_SIZE="1")
from verl.checkpoint_engine import base
from verl.workers import engine_workers
original = engine_workers.initialize_global_process_group_ray
if sys.argv[1] == "patched":
    from verl_replay.integrations.verl import cpu_support
    cpu_support.use_plain_gloo_process_group()
    assert base.initialize_global_process_group_ray is not original
    base.initialize_global_process_group_ray(timeout_second=None, backend="cpu:gloo")
else:
    original(timeout_second=30, backend="gloo")
value = torch.ones(2)
torch.distributed.all_reduce(value)
print("group of", torch.distributed.get_world_size(), "sum", value.tolist())
"""


def test_a_one_process_group_needs_no_port(tmp_path):
    """Two runs side by side: the port verl's controller probed may be taken before the worker binds
    it. A group of one process is built on an in-process store; verl's own path dies on that port."""
    import subprocess
    import sys

    def run(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", _INIT_WITH_PORT_TAKEN, mode],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )

    patched = run("patched")
    assert patched.returncode == 0 and "group of 1 sum [1.0, 1.0]" in patched.stdout, patched.stderr[-2000:]
    verls = run("verl")
    assert verls.returncode != 0 and "EADDRINUSE" in verls.stderr, verls.stderr[-2000:]


def test_cpu_platform_is_registered_and_never_auto_detected():
    from verl.plugin.platform import PlatformRegistry

    platform_cls = PlatformRegistry.get("cpu")
    assert platform_cls is not None
    platform = platform_cls()
    assert platform.device_name == "cpu"
    assert platform.communication_backend_name() == "gloo"
    assert platform.ray_resource_name() == "GPU"
    assert not platform.is_platform_available(use_smi_check=True)
    device = platform.device_module
    assert device.memory_reserved() == 0 and device.max_memory_allocated() == 0
    free, total = device.mem_get_info()
    assert 0 < free <= total
    assert torch.zeros(2).to(platform.current_device()).device.type == "cpu"


def test_fsdp_engine_registered_for_cpu():
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for backend in ("fsdp", "fsdp2"):
        assert EngineRegistry._engines["language_model"][backend]["cpu"] is FSDPEngineWithLMHead
        assert EngineRegistry._engines["value_model"][backend]["cpu"] is FSDPEngineWithValueHead


def test_offload_policy_never_pins_memory():
    from verl.workers.engine.fsdp import transformer_impl

    policy = transformer_impl.CPUOffloadPolicy(pin_memory=True)
    assert policy.pin_memory is False


def test_process_group_init_defaults_to_plain_gloo(monkeypatch):
    from verl.workers import engine_workers

    seen = {}

    def fake_init_process_group(backend=None, **kwargs):
        seen["backend"] = backend

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", fake_init_process_group)
    engine_workers.initialize_global_process_group_ray(timeout_second=None)
    assert seen["backend"] == "gloo"


def test_hf_rollout_is_registered():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from verl_replay.integrations.verl.hf_rollout import HFReplica, HFServerAdapter

    assert get_rollout_class("hf", "async") is HFServerAdapter
    assert get_rollout_replica_class("hf") is HFReplica


def test_install_is_idempotent():
    from verl.workers.engine.fsdp import transformer_impl

    before = transformer_impl.CPUOffloadPolicy
    cpu_support.install_cpu_support()
    cpu_support._installed = False
    cpu_support.install_cpu_support()
    assert transformer_impl.CPUOffloadPolicy is before


def test_old_policy_snapshot_is_a_copy_on_cpu():
    """Rounds >= 2 of a separate_async step restore pi_old from this snapshot: it must not alias."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from verl.utils import fsdp_utils

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        fully_shard(model)
        aliased, _ = fsdp_utils.fsdp2_sharded_save_to_cpu.__wrapped__(model)  # verl's own function
        snapshot, _ = fsdp_utils.fsdp2_sharded_save_to_cpu(model)  # as patched
        before = {name: tensor.clone() for name, (tensor, _) in snapshot.items()}
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
        for name, (tensor, _) in snapshot.items():
            assert torch.equal(tensor, before[name]), f"snapshot of {name} follows the live weights"
        # why the patch exists: verl's .cpu() on a CPU tensor is the tensor itself
        assert any(not torch.equal(tensor, before[name]) for name, (tensor, _) in aliased.items()), (
            "verl's fsdp2_sharded_save_to_cpu now copies on CPU: copy_old_policy_snapshot can be removed"
        )
    finally:
        dist.destroy_process_group()


def test_sampler_polls_transfer_queue_quickly(monkeypatch):
    import time

    from verl.trainer.ppo.v1 import replay_buffer

    sampler = replay_buffer.ReplayBuffer(
        trainer_mode="sync",
        trainer_config={},
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
    )
    assert sampler.poll_interval == cpu_support.CPU_SAMPLER_POLL_INTERVAL_S
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    sampler._wait_for_next_poll("train", last_debug_time=time.time())
    assert slept == [cpu_support.CPU_SAMPLER_POLL_INTERVAL_S], "verl's sampler no longer sleeps poll_interval"


def test_cpu_checkpoint_engine_is_registered():
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from verl_replay.integrations.verl.cpu_checkpoint_engine import BACKEND_NAME, GlooCheckpointEngine

    assert CheckpointEngineRegistry.get(BACKEND_NAME) is GlooCheckpointEngine


_NICENESS_PROBE = r"""
import json, os
import ray
from omegaconf import OmegaConf
from verl_replay.main import prepare_platform

@ray.remote
def niceness():
    return os.nice(0)

def worker_niceness():
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        return ray.get(niceness.remote(), timeout=600)
    finally:
        ray.shutdown()

cpu = OmegaConf.create({"trainer": {"device": "cpu"}})
out = {"ray_default": worker_niceness()}  # Ray's own default, before verl_replay sets anything
os.environ["RAY_worker_niceness"] = "7"
prepare_platform(cpu)
out["user_value_kept"] = os.environ["RAY_worker_niceness"]
del os.environ["RAY_worker_niceness"]
prepare_platform(cpu)
out["cpu_run"] = worker_niceness()
print(json.dumps(out))
"""


def test_cpu_runs_start_ray_workers_at_the_drivers_priority():
    """Ray's workers default to niceness 15 (so any busy process starves a CPU run); a CPU run
    sets Ray's ``RAY_worker_niceness`` to 0 unless the user set it. Canary: Ray itself is asked
    for the niceness its workers got, before and after."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
    proc = subprocess.run(
        [sys.executable, "-c", _NICENESS_PROBE], env=env, capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"ray_default": 15, "user_value_kept": "7", "cpu_run": 0}, seen


def test_gpu_runs_leave_rays_worker_niceness_alone(monkeypatch):
    from omegaconf import OmegaConf

    from verl_replay.main import prepare_platform

    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    prepare_platform(OmegaConf.create({"trainer": {"device": "cuda"}}))
    assert "RAY_worker_niceness" not in os.environ


@pytest.mark.parametrize("shape", [(37, 11), (2, 19, 11)])
def test_token_log_probs_equal_verls_row_loop_bit_for_bit(monkeypatch, shape):
    """The engine's token log-probs in row blocks against verl's own float32 path (one logsumexp per
    row), values and gradients, with blocks that do not divide the rows."""
    from verl.utils.torch_functional import logprobs_from_logits_v2

    monkeypatch.setattr(cpu_support, "LOG_PROB_ROW_BLOCK", 7)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(*shape, generator=gen) * 4).requires_grad_()
    labels = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    ours = cpu_support.log_probs_in_row_blocks(logits, labels)
    verls = logprobs_from_logits_v2(logits, labels)
    assert ours.shape == verls.shape and torch.equal(ours, verls)
    weights = torch.randn(ours.shape, generator=gen)
    (mine,) = torch.autograd.grad((ours * weights).sum(), logits)
    (theirs,) = torch.autograd.grad((verls * weights).sum(), logits)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


def test_the_engine_takes_token_log_probs_in_row_blocks(monkeypatch):
    from verl.workers.engine.fsdp import transformer_impl

    engine_fn = transformer_impl.logprobs_from_logits
    assert engine_fn._verl_replay_blocks
    seen = []
    monkeypatch.setattr(cpu_support, "log_probs_in_row_blocks", lambda *a: seen.append("blocks") or a[0][..., 0])
    engine_fn(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long))
    engine_fn(torch.zeros(3, 5, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.long))  # verl's own bf16 path
    assert seen == ["blocks"]
