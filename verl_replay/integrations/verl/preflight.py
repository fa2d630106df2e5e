"""Preflight: check the stack a training config needs before any GPU (or Ray) is touched.

:func:`run_checks` takes the composed, resolved training config (what ``python -m
verl_replay.main`` would run) and returns one :class:`Check` per concern, each with the fix when
it is not OK:

- ``python``, ``torch`` (a CUDA build on ``trainer.device=cuda``), ``vllm`` (importable, the
  pinned version) when the rollout is vLLM;
- ``weight sync``: the checkpoint engine the config names (``checkpoint_engine.backend``,
  ``custom_backend_module``) resolves in verl's registry, and is not ``naive`` under
  ``separate_async``;
- ``attention``: flash-attn importable when ``attn_implementation`` asks for it (the GPU default:
  without it the FAIL line says what the padded sdpa path would need in memory, and the fix), and
  no padding-free packing (``use_remove_padding``) without flash attention;
- ``linear attention``: for hybrid models (Qwen3.5) flash-linear-attention (required) and
  causal-conv1d (recommended: verl falls back to a per-sequence torch convolution);
- ``model``: ``config.json`` readable, its architecture registered by the installed vLLM;
- ``gpus``: visible GPUs (or the Ray cluster's, with ``RAY_ADDRESS``) vs the placement,
  ``gpu memory``: :mod:`verl_replay.memory_budget` (every pass, the vision tower, the weight-sync
  buffers) vs the GPUs' usable memory (or an A100 80GB's when none is visible), with
  ``MEMORY_MARGIN`` of it left free;
- ``disk``: free space where checkpoints go vs their size times ``max_actor_ckpt_to_keep``;
- ``settings``: combinations verl accepts but that fail or slow down later (parameter offload
  with separate_async's CPU weight snapshots, prefix caching on a hybrid model).

Everything the checks look at goes through a :class:`Probe`, so the logic is tested on CPU with
a fake one. This is the only preflight code that imports verl (lazily, inside the probe).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from verl_replay.memory_budget import (
    DEFAULT_GPU,
    GIB,
    GPU_MEMORY_GIB,
    MEMORY_MARGIN,
    QWEN3_5_4B_CONFIG,
    MemoryBudget,
    ModelShape,
    RunSizes,
    estimate,
    fit_token_limit,
)

__all__ = [
    "ATTN_FLASH",
    "Check",
    "PlacementNeed",
    "Probe",
    "attention_of",
    "checkpoint_bytes",
    "choose_attention",
    "compose_config",
    "config_value",
    "placement_need",
    "run_checks",
    "run_sizes",
]

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
ATTN_FLASH = ("flash_attention_2", "flash_attention_3")
PYTHON_RANGE = ((3, 10), (3, 12))
# Pins of the GPU stack (setup.py's gpu extra and the kernel builds; docker/check_pins.py keeps
# all of them equal).
VLLM_VERSION = "0.24.0"
FLA_VERSION = "0.5.2"
FLASH_ATTN_VERSION = "2.8.3"
CAUSAL_CONV1D_VERSION = "1.7.0"
# The README's GPU command: the pip stack, then the two CUDA kernels that have no PyPI wheel.
INSTALL_GPU = 'pip install -e ".[gpu,test]" && bash docker/install_kernels.sh'
INSTALL_KERNELS = (
    "bash docker/install_kernels.sh (the README's GPU command runs it: flash-attn from verl's wheelhouse "
    "or built against the installed torch, and causal-conv1d)"
)
# Replay strategies that run Headroom-Drift's teacher-forced drift scan.
SCANNING_STRATEGIES = ("headroom_drift", "headroom_drift+elite")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    fix: str = ""

    def lines(self) -> list[str]:
        out = [f"{self.status.upper():<4}  {self.name:<17} {self.detail}"]
        if self.fix and self.status in (WARN, FAIL):
            out.append(f"{'':<23} fix: {self.fix}")
        return out


# --------------------------------------------------------------------------- probe


class Probe:
    """What is installed and visible on this machine. Tests replace it with a fake."""

    def version(self, distribution: str) -> str | None:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def import_error(self, module: str) -> str | None:
        """None when ``module`` imports, else the error (its type and message)."""
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - a broken install raises anything at import
            return f"{type(exc).__name__}: {exc}"
        return None

    def has_module(self, module: str) -> bool:
        """Whether ``module`` is installed (found without importing it)."""
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            return False

    def entry_point(self, group: str, name: str) -> bool:
        """Whether an installed distribution registers entry point ``name`` in ``group``."""
        return any(ep.name == name for ep in importlib.metadata.entry_points(group=group))

    def torch_cuda(self) -> str | None:
        """CUDA version torch was built for (None: a CPU build)."""
        import torch

        return torch.version.cuda

    def gpus(self) -> list[tuple[str, int]]:
        """(name, total memory in bytes) of every GPU this process sees (CUDA_VISIBLE_DEVICES)."""
        import torch

        if torch.version.cuda is None or not torch.cuda.is_available():
            return []
        return [
            (torch.cuda.get_device_name(i), int(torch.cuda.get_device_properties(i).total_memory))
            for i in range(torch.cuda.device_count())
        ]

    def ray_cluster_gpus(self) -> float | None:
        """GPUs of the Ray cluster at RAY_ADDRESS (None: no cluster address given)."""
        address = os.environ.get("RAY_ADDRESS")
        if not address:
            return None
        import ray

        started = not ray.is_initialized()
        if started:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        try:
            return float(ray.cluster_resources().get("GPU", 0.0))
        finally:
            if started:
                ray.shutdown()

    def vllm_architectures(self) -> set[str]:
        from vllm import ModelRegistry

        return set(ModelRegistry.get_supported_archs())

    def checkpoint_engine_error(self, backend: str, custom_module: str | None) -> str | None:
        """None when verl's registry resolves ``backend`` (after importing ``custom_module``)."""
        if custom_module:
            try:
                importlib.import_module(custom_module)
            except Exception as exc:  # noqa: BLE001
                return f"custom_backend_module {custom_module} does not import ({type(exc).__name__}: {exc})"
        from verl.checkpoint_engine import CheckpointEngineRegistry

        try:
            CheckpointEngineRegistry.get(backend)
        except ValueError as exc:
            return str(exc)
        return None

    def free_disk_bytes(self, path: str) -> int:
        target = Path(path).expanduser().absolute()
        while not target.exists() and target != target.parent:
            target = target.parent
        return int(shutil.disk_usage(target).free)

    def host_memory_bytes(self) -> int | None:
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            return None

    def read_model_config(self, model_path: str) -> dict[str, Any] | None:
        """config.json of a local model folder (None: not a local folder)."""
        folder = Path(model_path).expanduser()
        if not folder.is_dir():
            return None
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- config helpers


def config_value(config: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """``config[a][b][c]`` for ``"a.b.c"``; ``default`` when a part is missing or null."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node or node[part] is None:
            return default
        node = node[part]
    return node


def attention_of(config: Mapping[str, Any]) -> str:
    # verl's default when override_config leaves it out (workers/config/model.py)
    return str(config_value(config, "actor_rollout_ref.model.override_config.attn_implementation", "flash_attention_2"))


@dataclass(frozen=True)
class PlacementNeed:
    """GPUs a run needs: per node and in total, with the split as words."""

    per_node: int
    total: int
    describe: str


def placement_need(
    config: Mapping[str, Any], stages: Sequence[str] = ("train",), generation_gpus: int = 1
) -> PlacementNeed:
    """GPUs the training placement needs (or ``generation_gpus`` for search / eval only)."""
    if "train" not in stages:
        return PlacementNeed(generation_gpus, generation_gpus, f"{generation_gpus} for {'/'.join(stages)} (vLLM TP)")
    nodes = int(config_value(config, "trainer.nnodes", 1))
    per_node = int(config_value(config, "trainer.n_gpus_per_node", 1))
    if config_value(config, "trainer.v1.trainer_mode", "sync") != "separate_async":
        return PlacementNeed(per_node, nodes * per_node, f"{per_node} per node x {nodes} node(s), colocated")
    r_nodes = int(config_value(config, "actor_rollout_ref.rollout.nnodes", 0))
    r_per_node = int(config_value(config, "actor_rollout_ref.rollout.n_gpus_per_node", 0))
    total = nodes * per_node + r_nodes * r_per_node
    shared = nodes == r_nodes
    need_per_node = per_node + r_per_node if shared else max(per_node, r_per_node)
    return PlacementNeed(
        need_per_node,
        total,
        f"{per_node} training x {nodes} node(s) + {r_per_node} rollout x {r_nodes} node(s)",
    )


def run_sizes(
    config: Mapping[str, Any],
    gpu_memory_gib: float = GPU_MEMORY_GIB[DEFAULT_GPU],
    fused_cross_entropy: bool | None = None,
    gpu_name: str = DEFAULT_GPU,
    packed: bool | None = None,
) -> RunSizes:
    """The memory-relevant sizes of a composed training config.

    ``fused_cross_entropy`` defaults to what the attention implies (flash attention runs with
    flash-attn, whose cross-entropy verl uses); ``packed`` to ``use_remove_padding``."""
    actor = "actor_rollout_ref.actor"
    rollout = "actor_rollout_ref.rollout"
    prompt = int(config_value(config, "data.max_prompt_length", 512))
    response = int(config_value(config, "data.max_response_length", 512))
    max_model_len = int(config_value(config, f"{rollout}.max_model_len", 0) or prompt + response)
    ppo_tokens = int(config_value(config, f"{actor}.ppo_max_token_len_per_gpu", 16384))
    log_prob_tokens = int(config_value(config, f"{rollout}.log_prob_max_token_len_per_gpu", ppo_tokens))
    separate = config_value(config, "trainer.v1.trainer_mode", "sync") == "separate_async"
    engine = f"{rollout}.checkpoint_engine"
    nccl = separate and str(config_value(config, f"{engine}.backend", "naive")) == "nccl"
    bucket_mb = int(config_value(config, f"{engine}.update_weights_bucket_megabytes", 2048))
    if fused_cross_entropy is None:
        fused_cross_entropy = attention_of(config) in ATTN_FLASH
    if packed is None:
        packed = bool(config_value(config, "actor_rollout_ref.model.use_remove_padding", False))
    return RunSizes(
        train_gpus=int(config_value(config, "trainer.nnodes", 1))
        * int(config_value(config, "trainer.n_gpus_per_node", 1)),
        ppo_max_token_len_per_gpu=ppo_tokens,
        log_prob_max_token_len_per_gpu=log_prob_tokens,
        max_model_len=max_model_len,
        gradient_checkpointing=bool(
            config_value(config, "actor_rollout_ref.model.enable_gradient_checkpointing", False)
        ),
        param_offload=bool(config_value(config, f"{actor}.fsdp_config.param_offload", False)),
        optimizer_offload=bool(config_value(config, f"{actor}.fsdp_config.optimizer_offload", False)),
        packed=packed,
        entropy_chunking=bool(config_value(config, f"{actor}.entropy_from_logits_with_chunking", False)),
        entropy_chunk_size=int(config_value(config, f"{actor}.entropy_from_logits_chunk_size", 2048)),
        update_entropy=bool(config_value(config, f"{actor}.calculate_entropy", False))
        or float(config_value(config, f"{actor}.entropy_coeff", 0.0)) != 0.0,
        fused_cross_entropy=fused_cross_entropy,
        temperature=float(config_value(config, f"{rollout}.temperature", 1.0)),
        scan=str(config_value(config, "replay.strategy", "none")) in SCANNING_STRATEGIES,
        parameter_sync_step=int(config_value(config, "trainer.v1.separate_async.parameter_sync_step", 1) or 1),
        weight_sync_bucket_bytes=(bucket_mb << 20) if nccl else 0,
        gpu_name=gpu_name,
        train_gpu_memory_gib=gpu_memory_gib,
        rollout_gpu_memory_gib=gpu_memory_gib,
        rollout_tensor_parallel=int(config_value(config, f"{rollout}.tensor_model_parallel_size", 1)),
        gpu_memory_utilization=float(config_value(config, f"{rollout}.gpu_memory_utilization", 0.5)),
        max_num_batched_tokens=int(config_value(config, f"{rollout}.max_num_batched_tokens", 8192)),
        max_num_seqs=int(config_value(config, f"{rollout}.max_num_seqs", 256)),
    )


def fitting_limits(shape: ModelShape, sizes: RunSizes) -> str:
    """The recipe settings that make ``sizes`` fit ``MEMORY_MARGIN`` below the GPU's memory."""
    target = int((1 - MEMORY_MARGIN) * sizes.train_gpu_memory_gib * GIB)
    settings = []
    for attempt in (sizes, replace(sizes, optimizer_offload=True)):
        ppo = fit_token_limit(shape, attempt, "ppo_max_token_len_per_gpu", target, floor=attempt.max_model_len)
        lp = fit_token_limit(shape, attempt, "log_prob_max_token_len_per_gpu", target, floor=attempt.max_model_len)
        if ppo and lp:
            if attempt.optimizer_offload and not sizes.optimizer_offload:
                settings.append("ACTOR_OFFLOAD=True")
            if ppo < sizes.ppo_max_token_len_per_gpu:
                settings.append(f"PPO_MAX_TOKEN_LEN={ppo}")
            if lp < sizes.log_prob_max_token_len_per_gpu:
                settings.append(f"LOG_PROB_MAX_TOKEN_LEN={lp}")
            return " ".join(settings) or "the current limits"
    return (
        f"nothing on {sizes.train_gpus} training GPU(s): even one {sizes.max_model_len}-token sequence per "
        "micro-batch does not fit; add training GPUs (TRAIN_GPUS)"
    )


def choose_attention(requested: str, probe: Probe | None = None) -> tuple[str, bool, str]:
    """(attn_implementation, use_remove_padding, why) for ``requested`` = ``auto`` or a name.

    ``auto`` is what a GPU host runs: flash_attention_2 with padding-free packing, whatever this
    machine has installed (so that ``DRY_RUN=1`` on a CPU machine shows the GPU config; the
    preflight on the GPU host fails without flash-attn, naming the memory the padded path would
    need). An explicit name is kept; only flash attention packs (verl patches flash-attn's
    varlen path). Never imports anything.
    """
    probe = probe or Probe()
    if requested != "auto":
        return requested, requested in ATTN_FLASH, f"{requested} (asked for)"
    have = probe.version("flash-attn")
    installed = f"flash-attn {have} is installed" if have else "flash-attn not installed here: the preflight checks it"
    return "flash_attention_2", True, f"flash_attention_2 with padding-free packing ({installed})"


# --------------------------------------------------------------------------- checks


def _check_python(_: Mapping[str, Any], __: Probe) -> Check:
    version = sys.version_info[:2]
    (low, high) = PYTHON_RANGE
    if low <= version <= high:
        return Check("python", OK, "{}.{}".format(*version))
    return Check(
        "python",
        FAIL,
        "{}.{} is outside 3.10-3.12".format(*version),
        "use Python 3.10, 3.11 or 3.12 (verl 0.9.1's range)",
    )


def _check_torch(config: Mapping[str, Any], probe: Probe) -> Check:
    version = probe.version("torch")
    if version is None:
        return Check("torch", FAIL, "not installed", INSTALL_GPU)
    if config_value(config, "trainer.device", "cuda") == "cpu":
        return Check("torch", OK, f"{version} (trainer.device=cpu)")
    cuda = probe.torch_cuda()
    if cuda is None:
        return Check(
            "torch",
            FAIL,
            f"{version} is a CPU build but trainer.device=cuda",
            f"install the GPU stack in a fresh venv: {INSTALL_GPU}",
        )
    return Check("torch", OK, f"{version}, CUDA {cuda}")


def _check_vllm(config: Mapping[str, Any], probe: Probe) -> Check:
    name = config_value(config, "actor_rollout_ref.rollout.name", "vllm")
    if name != "vllm":
        return Check("vllm", SKIP, f"rollout is {name}")
    version = probe.version("vllm")
    if version is None:
        return Check("vllm", FAIL, "not installed (actor_rollout_ref.rollout.name=vllm)", INSTALL_GPU)
    error = probe.import_error("vllm")
    if error:
        return Check(
            "vllm", FAIL, f"{version} does not import: {error[:160]}", f"reinstall the GPU stack: {INSTALL_GPU}"
        )
    if version.split("+")[0] != VLLM_VERSION:
        return Check(
            "vllm", WARN, f"{version}, verl 0.9.1 is tested with {VLLM_VERSION}", f"pip install vllm=={VLLM_VERSION}"
        )
    return Check("vllm", OK, version)


# What vLLM's CPU build needs from a rollout config (key under actor_rollout_ref.rollout -> value,
# why); the cpu_tiny profile sets each. docs/cpu_stack.md explains them.
VLLM_CPU_SETTINGS: tuple[tuple[str, Any, str], ...] = (
    ("dtype", "bfloat16", "its Gated DeltaNet kernel runs in bf16 only"),
    ("enforce_eager", True, "no CUDA graphs on CPU"),
    ("enable_sleep_mode", False, "sleep mode is not implemented on CPU"),
    ("free_cache_engine", False, "freeing the engine's cache needs sleep mode"),
    ("enable_prefix_caching", False, "a hybrid model's prefix cache copies Mamba state with a Triton kernel"),
    ("engine_kwargs.vllm.mamba_ssm_cache_dtype", "float32", "its Gated DeltaNet kernel keeps fp32 state"),
)
# The vLLM plugin (setup.py entry point) that zeroes new KV-cache blocks on vLLM's CPU build.
VLLM_CPU_PLUGIN = ("vllm.general_plugins", "verl_replay_cpu")
# vLLM's CPU Gated DeltaNet kernel: "expect qk_head_size to be multiples of 32".
VLLM_CPU_LINEAR_HEAD_MULTIPLE = 32
INSTALL_CPU = "bash scripts/install_cpu.sh (a fresh .venv with torch 2.11.0 and vLLM's CPU build)"


def _check_vllm_cpu(config: Mapping[str, Any], probe: Probe, shape: ModelShape | None) -> Check:
    """vLLM's CPU build as the rollout engine of a trainer.device=cpu run."""
    name = config_value(config, "actor_rollout_ref.rollout.name", "vllm")
    if name != "vllm":
        return Check("vllm", SKIP, f"rollout is {name}")
    version = probe.version("vllm")
    if version is None or not probe.has_module("vllm"):
        return Check("vllm", FAIL, "not installed (rollout.name=vllm, trainer.device=cpu)", INSTALL_CPU)
    if version.split("+")[0] != VLLM_VERSION or "cpu" not in version:
        return Check(
            "vllm",
            FAIL,
            f"{version} is not vLLM {VLLM_VERSION}'s CPU build: vLLM picks its CPU platform from '+cpu' "
            f"in that version, and verl 0.9.1 is tested with {VLLM_VERSION}",
            INSTALL_CPU,
        )
    if not probe.entry_point(*VLLM_CPU_PLUGIN):
        return Check(
            "vllm",
            FAIL,
            f"verl-replay's vLLM plugin {VLLM_CPU_PLUGIN[1]} is not registered: without it vLLM's CPU build "
            "cannot take verl's weight push, and stale KV-cache blocks turn rollouts NaN",
            "pip install -e . (a stale verl_replay.egg-info in the working directory also hides it)",
        )
    rollout = "actor_rollout_ref.rollout"
    for key, wanted, why in VLLM_CPU_SETTINGS:
        value = config_value(config, f"{rollout}.{key}")
        if value != wanted:
            return Check(
                "vllm",
                FAIL,
                f"{rollout}.{key}={value} on vLLM's CPU build ({why})",
                f"set {rollout}.{key}={str(wanted).lower() if isinstance(wanted, bool) else wanted}",
            )
    if shape is not None and shape.linear_key_head_dim:
        dims = {"linear_key_head_dim": shape.linear_key_head_dim, "linear_value_head_dim": shape.linear_value_head_dim}
        odd = {k: v for k, v in dims.items() if v % VLLM_CPU_LINEAR_HEAD_MULTIPLE}
        if odd:
            return Check(
                "vllm",
                FAIL,
                f"model {odd}: vLLM's CPU Gated DeltaNet kernel takes multiples of {VLLM_CPU_LINEAR_HEAD_MULTIPLE}",
                "rebuild the tiny assets (python scripts/build_tiny_assets.py) or use a model with such head dims",
            )
    return Check("vllm", OK, f"{version} (CPU build, verl-replay's vLLM plugin registered)")


def _check_weight_sync(config: Mapping[str, Any], probe: Probe) -> Check:
    engine = "actor_rollout_ref.rollout.checkpoint_engine"
    backend = str(config_value(config, f"{engine}.backend", "naive"))
    custom = config_value(config, f"{engine}.custom_backend_module")
    separate = config_value(config, "trainer.v1.trainer_mode", "sync") == "separate_async"
    if separate and backend == "naive":
        return Check(
            "weight sync",
            FAIL,
            "separate_async with checkpoint_engine.backend=naive (colocated only)",
            f"set {engine}.backend=nccl",
        )
    error = probe.checkpoint_engine_error(backend, custom)
    if error:
        fix = (
            f"pip install {'cupy-cuda13x==14.0.1'} (verl's nccl engine imports cupy)"
            if backend in ("nccl", "nixl")
            else (
                f"make {engine}.custom_backend_module register '{backend}'"
                if custom
                else f"choose a registered {engine}.backend"
            )
        )
        return Check("weight sync", FAIL, f"checkpoint engine '{backend}' is not registered: {error[:220]}", fix)
    where = f" from {custom}" if custom else ""
    return Check(
        "weight sync",
        OK,
        f"checkpoint engine '{backend}'{where} registered" + (" (separate_async)" if separate else ""),
    )


def memory_target(gpus: Sequence[tuple[str, int]]) -> tuple[str, float, bool]:
    """(GPU name, usable GiB, assumed) the budget is held against: the smallest visible GPU, else
    the recipes' A100 80GB (``assumed``)."""
    if gpus:
        name, memory = min(gpus, key=lambda gpu: gpu[1])
        return name, memory / GIB, False
    return DEFAULT_GPU, GPU_MEMORY_GIB[DEFAULT_GPU], True


def _check_attention(
    config: Mapping[str, Any], probe: Probe, shape: ModelShape | None, gpus: Sequence[tuple[str, int]]
) -> Check:
    impl = attention_of(config)
    packed = bool(config_value(config, "actor_rollout_ref.model.use_remove_padding", False))
    on_cpu = config_value(config, "trainer.device", "cuda") == "cpu"
    if impl in ATTN_FLASH:
        error = probe.import_error("flash_attn")
        if error:
            detail = f"attn_implementation={impl} but flash-attn does not import ({error[:100]})"
            by_hand = (
                "actor_rollout_ref.model.override_config.attn_implementation=sdpa "
                "actor_rollout_ref.model.use_remove_padding=False"
            )
            fix = f"{INSTALL_KERNELS}; or run padded on purpose: ATTN_IMPL=sdpa (by hand: {by_hand})"
            if shape is not None and not on_cpu:
                name, memory, assumed = memory_target(gpus)
                padded = run_sizes(config, memory, fused_cross_entropy=False, gpu_name=name, packed=False)
                budget = estimate(shape, padded)
                detail += (
                    f"; without it (sdpa: padded micro-batches, entropy not chunked, no fused cross-entropy) this run "
                    f"needs {budget.training_total / GIB:.1f} GiB per training GPU at the {budget.training_pass}, "
                    f"of {memory:.1f} GiB" + (f" ({name} assumed)" if assumed else f" ({name})")
                )
                fix = f"{INSTALL_KERNELS}; or run padded on purpose: ATTN_IMPL=sdpa {fitting_limits(shape, padded)}"
            return Check("attention", FAIL, detail, fix)
        version = probe.version("flash-attn")
        detail = f"{impl}, flash-attn {version}" + (", padding-free packing" if packed else "")
        if version and version.split("+")[0] != FLASH_ATTN_VERSION:
            return Check("attention", WARN, detail + f" (pinned: {FLASH_ATTN_VERSION})", f"{INSTALL_KERNELS}")
        return Check("attention", OK, detail)
    if on_cpu:
        # verl_replay's CPU support gives Qwen3.5's linear attention packed-sequence kernels and
        # transformers' sdpa masks packed sequences apart: both paths are exact on CPU
        return Check("attention", OK, f"{impl}" + (", padding-free packing" if packed else ", padded micro-batches"))
    if packed:
        return Check(
            "attention",
            FAIL,
            f"attn_implementation={impl} with use_remove_padding=True: verl packs sequences for flash attention only",
            "set actor_rollout_ref.model.use_remove_padding=False (or install flash-attn)",
        )
    return Check(
        "attention",
        OK,
        f"{impl}, padded micro-batches (asked for): each padded to its longest row, entropy on the whole "
        "micro-batch (see the gpu memory check)",
    )


def _check_linear_attention(config: Mapping[str, Any], probe: Probe, shape: ModelShape | None) -> list[Check]:
    if config_value(config, "trainer.device", "cuda") == "cpu":
        return [Check("linear attention", SKIP, "trainer.device=cpu: transformers' torch kernels")]
    if shape is None:
        return [Check("linear attention", SKIP, "model shape unknown (see the model check)")]
    if not shape.linear_attention_layers:
        return [Check("linear attention", SKIP, "the model has no linear-attention layers")]
    checks = []
    error = probe.import_error("fla.ops.gated_delta_rule")
    if error:
        checks.append(
            Check(
                "linear attention",
                FAIL,
                f"{shape.linear_attention_layers} Gated DeltaNet layers but flash-linear-attention does not import "
                f"({error[:100]})",
                f"pip install flash-linear-attention=={FLA_VERSION} (in the gpu extra)",
            )
        )
    else:
        checks.append(
            Check(
                "linear attention",
                OK,
                f"flash-linear-attention {probe.version('flash-linear-attention')} "
                f"for {shape.linear_attention_layers} Gated DeltaNet layers",
            )
        )
    error = probe.import_error("causal_conv1d")
    if error:
        checks.append(
            Check(
                "causal conv1d",
                WARN,
                "causal-conv1d not installed: verl runs the short convolution per packed sequence in torch (slower)",
                INSTALL_KERNELS,
            )
        )
    else:
        checks.append(Check("causal conv1d", OK, f"causal-conv1d {probe.version('causal-conv1d')}"))
    return checks


def _model_shape(config: Mapping[str, Any], probe: Probe) -> tuple[Check, ModelShape | None, dict[str, Any] | None]:
    path = str(config_value(config, "actor_rollout_ref.model.path", ""))
    try:
        hf_config = probe.read_model_config(path)
    except (OSError, ValueError) as exc:
        return (
            Check(
                "model",
                FAIL,
                f"{path}: config.json unreadable ({exc})",
                "point MODEL_PATH / actor_rollout_ref.model.path at a Hugging Face model folder",
            ),
            None,
            None,
        )
    if hf_config is None:
        if "/" in path and not path.startswith((".", "/", "~")):
            return (
                Check(
                    "model",
                    WARN,
                    f"{path} is not a local folder: treated as a hub id, architecture not checked",
                    "download it first (hf download ... --local-dir) and use the folder",
                ),
                None,
                None,
            )
        return (
            Check(
                "model",
                FAIL,
                f"model folder not found: {path}",
                "set MODEL_PATH (recipes) / actor_rollout_ref.model.path",
            ),
            None,
            None,
        )
    try:
        shape = ModelShape.from_hf_config(hf_config)
    except (KeyError, ValueError, TypeError) as exc:
        return (
            Check(
                "model",
                FAIL,
                f"{path}/config.json: cannot read the model's sizes ({exc})",
                "use a Hugging Face model folder",
            ),
            None,
            hf_config,
        )
    size = f"{shape.total_params / 1e9:.2f}B" if shape.total_params >= 1e8 else f"{shape.total_params / 1e6:.2f}M"
    return Check("model", OK, f"{', '.join(shape.architectures) or '?'} ({size} parameters)"), shape, hf_config


def _check_model_arch(config: Mapping[str, Any], probe: Probe, base: Check, shape: ModelShape | None) -> Check:
    if base.status != OK or shape is None or config_value(config, "actor_rollout_ref.rollout.name", "vllm") != "vllm":
        return base
    if probe.version("vllm") is None or probe.import_error("vllm"):
        return Check("model", base.status, base.detail + "; vLLM support not checked (vLLM missing)")
    supported = probe.vllm_architectures()
    missing = [a for a in shape.architectures if a not in supported]
    if missing or not shape.architectures:
        return Check(
            "model",
            FAIL,
            f"architecture {missing or '(none in config.json)'} is not registered by vLLM {probe.version('vllm')}",
            "use a model vLLM supports (vllm.ModelRegistry.get_supported_archs()) or another vLLM",
        )
    return Check("model", OK, base.detail + f", supported by vLLM {probe.version('vllm')}")


def _check_gpus(config: Mapping[str, Any], probe: Probe, need: PlacementNeed) -> tuple[Check, list[tuple[str, int]]]:
    if config_value(config, "trainer.device", "cuda") == "cpu":
        return Check("gpus", SKIP, "trainer.device=cpu"), []
    if probe.torch_cuda() is None:
        return Check(
            "gpus",
            FAIL,
            f"0 visible (torch is a CPU build); the placement needs {need.total}: {need.describe}",
            f"run on a GPU host with the GPU stack ({INSTALL_GPU})",
        ), []
    cluster = probe.ray_cluster_gpus()
    gpus = probe.gpus()
    if cluster is not None:
        ok = cluster >= need.total
        return Check(
            "gpus",
            OK if ok else FAIL,
            f"Ray cluster at RAY_ADDRESS has {cluster:g} GPUs; the placement needs {need.total}: {need.describe}",
            "" if ok else "add nodes to the cluster or lower NNODES / TRAIN_GPUS / ROLLOUT_GPUS",
        ), gpus
    nodes = max(
        int(config_value(config, "trainer.nnodes", 1)),
        int(config_value(config, "actor_rollout_ref.rollout.nnodes", 0) or 0),
    )
    wanted = need.per_node if nodes > 1 else need.total
    if len(gpus) < wanted:
        names = f" ({gpus[0][0]})" if gpus else ""
        fix = (
            "start the Ray cluster first and set RAY_ADDRESS (recipes/README.md, Multi-node)"
            if nodes > 1
            else "use a host with enough GPUs, or lower TRAIN_GPUS / ROLLOUT_GPUS (check CUDA_VISIBLE_DEVICES)"
        )
        return Check(
            "gpus",
            FAIL,
            f"{len(gpus)} visible{names}; the placement needs {wanted}"
            + (" on this node" if nodes > 1 else "")
            + f": {need.describe}",
            fix,
        ), gpus
    return Check("gpus", OK, f"{len(gpus)} visible ({gpus[0][0]}); the placement needs {wanted}: {need.describe}"), gpus


def _check_memory(
    config: Mapping[str, Any], shape: ModelShape | None, gpus: list[tuple[str, int]], flash_attn: bool
) -> tuple[Check, MemoryBudget | None]:
    if config_value(config, "trainer.device", "cuda") == "cpu":
        return Check("gpu memory", SKIP, "trainer.device=cpu"), None
    if shape is None:
        return Check("gpu memory", SKIP, "model shape unknown"), None
    name, memory, assumed = memory_target(gpus)
    # flash attention runs with flash-attn (the attention check fails without it): its cross-entropy
    fused = flash_attn or attention_of(config) in ATTN_FLASH
    sizes = run_sizes(config, memory, fused_cross_entropy=fused, gpu_name=name)
    budget = estimate(shape, sizes)
    passes = ", ".join(f"{pass_name} {budget.pass_total(pass_name) / GIB:.1f}" for pass_name in budget.passes)
    where = f"{memory:.1f} GiB ({name} assumed: no GPU visible)" if assumed else f"{memory:.1f} GiB ({name})"
    detail = (
        f"training {budget.training_total / GIB:.1f} GiB at the {budget.training_pass} ({passes}), rollout "
        f"{budget.rollout_total / GIB:.1f} GiB ({budget.kv_sequences} full-length sequences in its KV cache), "
        f"of {where}"
    )
    limit = budget.train_limit
    if budget.training_total > limit:
        return Check("gpu memory", FAIL, detail, f"set {fitting_limits(shape, sizes)}"), budget
    if budget.rollout_total > budget.rollout_limit:
        return Check("gpu memory", FAIL, detail, "lower ROLLOUT_GPU_MEMORY_UTILIZATION"), budget
    if budget.kv_sequences < 1:
        return Check("gpu memory", FAIL, detail, "raise ROLLOUT_GPU_MEMORY_UTILIZATION or ROLLOUT_TP"), budget
    if budget.training_total > (1 - MEMORY_MARGIN) * limit:
        return Check(
            "gpu memory",
            WARN,
            detail + f": less than {MEMORY_MARGIN:.0%} left free",
            f"for the margin set {fitting_limits(shape, sizes)}",
        ), budget
    return Check("gpu memory", OK, detail), budget


def checkpoint_bytes(shape: ModelShape, contents: Iterable[str]) -> int:
    """verl's FSDP checkpoint: fp32 model shards, fp32 AdamW moments of the trained (text)
    parameters, and a bf16 Hugging Face export."""
    per = {"model": 4 * shape.total_params, "optimizer": 8 * shape.text_params, "hf_model": 2 * shape.total_params}
    return sum(per.get(c, 0) for c in contents)


def _check_disk(config: Mapping[str, Any], probe: Probe, shape: ModelShape | None) -> Check:
    where = str(config_value(config, "trainer.default_local_dir", "checkpoints"))
    save_freq = int(config_value(config, "trainer.save_freq", -1) or -1)
    if save_freq <= 0:
        return Check("disk", SKIP, "no checkpoints (trainer.save_freq <= 0)")
    if shape is None:
        return Check("disk", SKIP, "model shape unknown")
    contents = config_value(config, "actor_rollout_ref.actor.checkpoint.save_contents", ["model", "optimizer", "extra"])
    one = checkpoint_bytes(shape, contents)
    keep = config_value(config, "trainer.max_actor_ckpt_to_keep")
    steps = int(config_value(config, "trainer.total_training_steps", 0) or 0)
    # verl keeps keep-1 old ones while writing the next; keep=1 holds the old one until the new is written
    at_once = 2 if keep == 1 else int(keep) if keep else max(steps // save_freq + 1, 1)
    free = probe.free_disk_bytes(where)
    detail = f"{free / GIB:.0f} GiB free at {where}; one checkpoint ~{one / GIB:.0f} GiB, up to {at_once} at once"
    if free < one:
        return Check("disk", FAIL, detail, "point OUTPUT_DIR / trainer.default_local_dir at a larger disk")
    if free < one * at_once:
        return Check("disk", WARN, detail, "lower KEEP_CHECKPOINTS (trainer.max_actor_ckpt_to_keep) or free disk space")
    return Check("disk", OK, detail)


def _check_settings(
    config: Mapping[str, Any], shape: ModelShape | None, budget: MemoryBudget | None, probe: Probe
) -> list[Check]:
    checks = []
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    separate = config_value(config, "trainer.v1.trainer_mode", "sync") == "separate_async"
    rounds = int(config_value(config, "trainer.v1.separate_async.parameter_sync_step", 1) or 1)
    bypass = bool(config_value(config, "algorithm.rollout_correction.bypass_mode", False))
    if separate and rounds > 1 and not bypass and config_value(config, f"{fsdp}.param_offload", False):
        checks.append(
            Check(
                "offload",
                FAIL,
                f"{fsdp}.param_offload=True with separate_async ({rounds} rounds per weight push): "
                "verl snapshots pi_old with save_model_to_cpu, which assumes GPU-resident parameters",
                f"keep {fsdp}.param_offload=False; offload the optimizer only "
                f"({fsdp}.optimizer_offload=True, recipes: ACTOR_OFFLOAD=True)",
            )
        )
    elif config_value(config, f"{fsdp}.optimizer_offload", False) or config_value(
        config, f"{fsdp}.param_offload", False
    ):
        checks.append(
            Check(
                "offload",
                OK,
                "param_offload={} optimizer_offload={}".format(
                    bool(config_value(config, f"{fsdp}.param_offload", False)),
                    bool(config_value(config, f"{fsdp}.optimizer_offload", False)),
                ),
            )
        )
    if (
        shape is not None
        and shape.linear_attention_layers
        and config_value(config, "actor_rollout_ref.rollout.enable_prefix_caching", False)
        and config_value(config, "trainer.device", "cuda") != "cpu"  # vLLM's setting; the CPU rollout has no cache
    ):
        checks.append(
            Check(
                "prefix caching",
                WARN,
                "enable_prefix_caching=True on a hybrid (linear-attention) model: experimental in vLLM, "
                "verl's Qwen3.5 examples turn it off",
                "actor_rollout_ref.rollout.enable_prefix_caching=False (platform=gpu does)",
            )
        )
    if budget is not None and separate:
        host = sum(r.bytes for r in budget.host) * int(config_value(config, "trainer.n_gpus_per_node", 1))
        have = probe.host_memory_bytes()
        if have is not None and host > 0.8 * have:
            checks.append(
                Check(
                    "host memory",
                    WARN,
                    f"separate_async CPU weight copies ~{host / GIB:.0f} GiB per node, {have / GIB:.0f} GiB RAM",
                    "use a host with more RAM or fewer training GPUs per node",
                )
            )
    return checks


def run_checks(
    config: Mapping[str, Any],
    probe: Probe | None = None,
    *,
    stages: Sequence[str] = ("train",),
    generation_gpus: int = 1,
) -> tuple[list[Check], MemoryBudget | None]:
    """Every check for ``config`` (a plain dict of the resolved training config), in order."""
    probe = probe or Probe()
    on_cpu = config_value(config, "trainer.device", "cuda") == "cpu"
    checks = [_check_python(config, probe), _check_torch(config, probe)]
    model_check, shape, _ = _model_shape(config, probe)
    checks.append(_check_vllm_cpu(config, probe, shape) if on_cpu else _check_vllm(config, probe))
    checks.append(_check_weight_sync(config, probe))
    gpu_check, gpus = _check_gpus(config, probe, placement_need(config, stages, generation_gpus))
    checks.append(_check_attention(config, probe, shape, gpus))
    checks.append(_check_model_arch(config, probe, model_check, shape) if not on_cpu else model_check)
    checks += _check_linear_attention(config, probe, shape)
    checks.append(gpu_check)
    flash_attn = probe.import_error("flash_attn") is None
    memory_check, budget = _check_memory(config, shape, gpus, flash_attn)
    checks.append(memory_check)
    checks.append(_check_disk(config, probe, shape) if "train" in stages else Check("disk", SKIP, "no training stage"))
    checks += _check_settings(config, shape, budget, probe)
    return checks, budget


def reference_shape() -> ModelShape:
    return ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)


def summary(checks: Sequence[Check]) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL, SKIP)}
    return f"{counts[OK]} ok, {counts[WARN]} warning(s), {counts[FAIL]} failed, {counts[SKIP]} skipped"


def to_json(checks: Sequence[Check]) -> list[dict[str, str]]:
    return [asdict(c) for c in checks]


def compose_config(overrides: Sequence[str]) -> dict[str, Any]:
    """The training config ``python -m verl_replay.main OVERRIDES`` would run, resolved."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from verl_replay.main import register_resolvers

    register_resolvers()
    config_dir = Path(__file__).resolve().parents[2] / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        config = compose(config_name="replay_trainer", overrides=list(overrides))
    container = OmegaConf.to_container(config, resolve=True)
    assert isinstance(container, dict)
    return container
