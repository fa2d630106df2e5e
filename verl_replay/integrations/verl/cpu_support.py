"""Everything verl 0.9.1 needs to run its real GRPO loop on a CPU-only host.

Installed by the plugin in every process when ``VERL_PLATFORM=cpu``. Each step touches one verl
extension point; the ones that go through a private name are listed in ``PRIVATE_API_PATCHES``
and each has a test (``tests/integrations/verl/test_cpu_support.py``) that fails with a clear
message when a verl upgrade moves it. The obstacle numbers refer to ``shared/VERL_NOTES.md``.

1. cpu platform ............. ``platform_cpu`` (public ``PlatformRegistry``)
4. gloo process groups ...... private: ``initialize_global_process_group_ray`` as
                              ``engine_workers`` and ``checkpoint_engine.base`` name it (verl builds
                              "cpu:gloo,<device>:<backend>", which torch rejects when the device is
                              cpu; a one-process group gets an in-process store, not a probed port)
5. FSDP engine for cpu ...... ``EngineRegistry.register`` (public decorator)
8. ``hf`` rollout ............ ``RolloutReplicaRegistry.register`` (public) and the private
                              ``verl.workers.rollout.base._ROLLOUT_REGISTRY`` for the adapter (the
                              CPU profile rolls out with verl's vLLM server; ``hf`` serves the tests
                              that compare two runs token for token: docs/cpu_stack.md)
9. no pinned memory ......... private: the FSDP engine module's ``CPUOffloadPolicy`` name
10. Qwen3.5's processor ...... a venv without torchvision: ``vl_processor`` (a transformers
                              private name, listed there), else verl silently drops the processor
11. packed Qwen3.5 rows ...... no flash-linear-attention / causal-conv1d on the CPU stack:
                              ``cpu_linear_attention`` fills the Gated DeltaNet layer's empty kernel
                              slots (transformers private names, listed there) with torch kernels that
                              keep packed sequences apart, so verl's ``use_remove_padding`` path is
                              exact on CPU; ``cpu_packed_attention`` computes the full-attention
                              layers' packed rows within each sequence, as flash-attention's varlen
                              kernel does (transformers' sdpa would score the whole pack under a
                              dense mask: quadratic in the pack's tokens)
Obstacles 2, 3, 6 and 7 are configuration, set in ``verl_replay/config/platform/cpu_tiny.yaml``.

For verl's split placement (``separate_async``) on CPU:

- weight sync ............... ``cpu_checkpoint_engine`` (public ``CheckpointEngineRegistry`` +
                              ``checkpoint_engine.custom_backend_module``)
- old-policy snapshot ....... private: ``verl.utils.fsdp_utils.fsdp2_sharded_save_to_cpu``. The
                              snapshot of pi_old that later update rounds restore is taken with
                              ``.cpu()``, which on CPU returns the live parameter itself: without a
                              copy, old log-probs of rounds >= 2 would use the current weights.
- token log-probs ........... private: the FSDP engine module's ``logprobs_from_logits`` name. Without
                              flash-attn's cross-entropy kernel verl takes ``logprobs_from_logits_v2``,
                              which loops over the packed tokens one logsumexp at a time (a tenth of a
                              scan's forward on the tiny model); the same arithmetic in row blocks here
- sampler poll .............. private: ``ReplayBuffer.poll_interval`` (a fixed 2 s sleep between
                              TransferQueue polls, most of a tiny CPU step; shortened here only)
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
from typing import Optional

import torch

from verl_replay.integrations.verl.cpu_linear_attention import install_packed_linear_attention_kernels
from verl_replay.integrations.verl.cpu_packed_attention import install_packed_attention
from verl_replay.integrations.verl.vl_processor import allow_vl_processor_without_torchvision

logger = logging.getLogger(__name__)

HF_ADAPTER_PATH = "verl_replay.integrations.verl.hf_rollout.HFServerAdapter"

# (module, attribute) pairs of verl private names this module rebinds or mutates.
PRIVATE_API_PATCHES: tuple[tuple[str, str], ...] = (
    ("verl.workers.rollout.base", "_ROLLOUT_REGISTRY"),
    ("verl.workers.engine.fsdp.transformer_impl", "CPUOffloadPolicy"),
    ("verl.workers.engine_workers", "initialize_global_process_group_ray"),
    ("verl.checkpoint_engine.base", "initialize_global_process_group_ray"),
    ("verl.utils.fsdp_utils", "fsdp2_sharded_save_to_cpu"),
    ("verl.trainer.ppo.v1.replay_buffer", "ReplayBuffer"),
    ("verl.workers.engine.fsdp.transformer_impl", "logprobs_from_logits"),
    ("verl.utils.torch_functional", "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE"),
)
# Seconds between the sampler's TransferQueue polls on CPU (verl: 2.0). Tiny rollouts finish in
# well under a second, so verl's interval would make every CPU step mostly sleep.
CPU_SAMPLER_POLL_INTERVAL_S = 0.05

_installed = False


class VerlPrivateApiChanged(RuntimeError):
    """A verl private name this project patches has moved: the pinned verl version changed."""


def _require(module: object, attribute: str) -> object:
    if not hasattr(module, attribute):
        raise VerlPrivateApiChanged(
            f"verl_replay's CPU support patches {module.__name__}.{attribute}, which this verl version does not "
            "have. verl_replay pins verl==0.9.1; install that version or update "
            "verl_replay/integrations/verl/cpu_support.py."
        )
    return getattr(module, attribute)


def register_fsdp_engine_for_cpu() -> None:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    registered = EngineRegistry._engines.get("language_model", {}).get("fsdp2", {})
    if "cpu" in registered:
        return
    for model_type, engine_cls in (
        ("language_model", transformer_impl.FSDPEngineWithLMHead),
        ("value_model", transformer_impl.FSDPEngineWithValueHead),
    ):
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine_cls)


def disable_pinned_memory_in_fsdp_engine() -> None:
    """FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` needs a device driver; on CPU nothing to pin."""
    from verl.workers.engine.fsdp import transformer_impl

    policy_cls = _require(transformer_impl, "CPUOffloadPolicy")
    if getattr(policy_cls, "_verl_replay_unpinned", False):
        return

    @functools.wraps(policy_cls)
    def unpinned_policy(*args, **kwargs):
        kwargs["pin_memory"] = False
        return policy_cls(*args, **kwargs)

    unpinned_policy._verl_replay_unpinned = True
    transformer_impl.CPUOffloadPolicy = unpinned_policy


def init_single_process_group(backend: str, timeout_second: Optional[int] = None) -> bool:
    """A one-process group (``WORLD_SIZE=1``: each tiny worker group) over an in-process store.

    verl's path gives the group a TCP store on ``MASTER_PORT``, a port its controller found free
    by binding and releasing it; between that probe and the store's bind another process may take
    it (two runs side by side: ``EADDRINUSE``, the run dies at start-up). A group of one process
    needs no port. False when the group has other ranks or exists already: verl's path then."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 1 or torch.distributed.is_initialized():
        return False
    timeout = datetime.timedelta(seconds=timeout_second) if timeout_second is not None else None
    torch.distributed.init_process_group(
        backend=backend, store=torch.distributed.HashStore(), rank=0, world_size=1, timeout=timeout
    )
    return True


def use_plain_gloo_process_group() -> None:
    """The training workers' and the rollout side's checkpoint-engine workers' process groups."""
    from verl.checkpoint_engine import base as checkpoint_engine_base
    from verl.workers import engine_workers

    for module in (engine_workers, checkpoint_engine_base):
        init_fn = _require(module, "initialize_global_process_group_ray")
        if getattr(init_fn, "_verl_replay_gloo", False):
            continue

        @functools.wraps(init_fn)
        def init_gloo(timeout_second=None, backend=None, _verl_init=init_fn):
            # verl's default "cpu:gloo,<device>:<backend>" names no CPU device torch accepts
            backend = "gloo" if backend in (None, "cpu:gloo") else backend
            if not init_single_process_group(backend, timeout_second):
                _verl_init(timeout_second=timeout_second, backend=backend)

        init_gloo._verl_replay_gloo = True
        module.initialize_global_process_group_ray = init_gloo


def register_hf_rollout() -> None:
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    def load_replica():
        from verl_replay.integrations.verl.hf_rollout import HFReplica

        return HFReplica

    RolloutReplicaRegistry.register("hf", load_replica)
    registry = _require(rollout_base, "_ROLLOUT_REGISTRY")
    registry[("hf", "async")] = HF_ADAPTER_PATH


def copy_old_policy_snapshot() -> None:
    """``fsdp2_sharded_save_to_cpu`` keeps ``param._local_tensor.cpu()``: an alias on CPU. Copy it."""
    from verl.utils import fsdp_utils

    save_fn = _require(fsdp_utils, "fsdp2_sharded_save_to_cpu")
    if getattr(save_fn, "_verl_replay_copies", False):
        return

    @functools.wraps(save_fn)
    def save_copy(model):
        state, spec = save_fn(model)
        return {name: (tensor.clone(), tensor_spec) for name, (tensor, tensor_spec) in state.items()}, spec

    save_copy._verl_replay_copies = True
    fsdp_utils.fsdp2_sharded_save_to_cpu = save_copy


def shorten_sampler_poll() -> None:
    """verl's v1 sampler sleeps ``poll_interval`` (2 s, not configurable) between polls."""
    from verl.trainer.ppo.v1 import replay_buffer

    sampler_cls = replay_buffer.ReplayBuffer
    init_fn = sampler_cls.__init__
    if getattr(init_fn, "_verl_replay_poll", False):
        return
    import inspect

    if "poll_interval" not in inspect.signature(init_fn).parameters:
        raise VerlPrivateApiChanged(
            "verl_replay's CPU support sets ReplayBuffer(poll_interval=...), which this verl version does not take; "
            "verl_replay pins verl==0.9.1"
        )

    @functools.wraps(init_fn)
    def init_short_poll(self, *args, **kwargs):
        init_fn(self, *args, **kwargs)
        self.poll_interval = CPU_SAMPLER_POLL_INTERVAL_S

    init_short_poll._verl_replay_poll = True
    sampler_cls.__init__ = init_short_poll


# Rows of logits per logsumexp call: verl's loop is per row to bound the [rows, vocab] temporary.
LOG_PROB_ROW_BLOCK = 1024


def log_probs_in_row_blocks(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[label]`` as verl's float32 path computes it (the label's logit minus the
    row's logsumexp), ``LOG_PROB_ROW_BLOCK`` rows per call instead of one: ``logits`` [T, V] (or
    [B, T, V]), ``labels`` [T] -> [T]."""
    label_logits = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    rows = logits.reshape(-1, logits.shape[-1])  # [N, V]
    normalisers = torch.cat([torch.logsumexp(block, dim=-1) for block in rows.split(LOG_PROB_ROW_BLOCK)])
    return label_logits - normalisers.view(label_logits.shape)


def vectorise_token_log_probs() -> None:
    """verl's engine computes token log-probs with ``logprobs_from_logits``; where flash-attn's
    kernel is missing and the logits are float32/64 it loops over rows. Same values, row blocks."""
    from verl.utils import torch_functional as verl_F
    from verl.workers.engine.fsdp import transformer_impl

    original = _require(transformer_impl, "logprobs_from_logits")
    if getattr(original, "_verl_replay_blocks", False):
        return
    _require(verl_F, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE")

    @functools.wraps(original)
    def logprobs_from_logits(logits, labels, inplace_backward=True):
        if verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE or logits.dtype not in (torch.float32, torch.float64):
            return original(logits, labels, inplace_backward=inplace_backward)
        return log_probs_in_row_blocks(logits, labels)

    logprobs_from_logits._verl_replay_blocks = True
    transformer_impl.logprobs_from_logits = logprobs_from_logits


def read_images_without_torchvision() -> None:
    """Image prompts on a host without torchvision: verl's dataset reads a prompt's pictures with
    ``qwen_vl_utils``, which imports torchvision at module top (its image path does not use it);
    ``multimodal.process_multi_modal_info_without_torchvision`` resizes them the same way."""
    from verl_replay.integrations.verl.vl_processor import torchvision_available

    if torchvision_available():
        return
    from verl.utils.dataset import rl_dataset

    from verl_replay.integrations.verl.multimodal import process_multi_modal_info_without_torchvision

    dataset = _require(rl_dataset, "RLHFDataset")
    _require(dataset, "_process_multi_modal_info")
    dataset._process_multi_modal_info = classmethod(process_multi_modal_info_without_torchvision)


def register_cpu_checkpoint_engine() -> None:
    from verl_replay.integrations.verl import cpu_checkpoint_engine  # noqa: F401  (registers on import)


def install_cpu_support() -> None:
    """Install the CPU extensions into verl; idempotent."""
    global _installed
    if _installed:
        return
    register_fsdp_engine_for_cpu()
    disable_pinned_memory_in_fsdp_engine()
    use_plain_gloo_process_group()
    register_hf_rollout()
    copy_old_policy_snapshot()
    shorten_sampler_poll()
    vectorise_token_log_probs()
    register_cpu_checkpoint_engine()
    allow_vl_processor_without_torchvision()
    read_images_without_torchvision()
    install_packed_linear_attention_kernels()
    install_packed_attention()
    _installed = True
    logger.info("verl_replay: CPU support installed (platform=cpu, engine=fsdp2, rollout=hf)")
