"""Preflight checks: their logic with a probe that reports a chosen machine, the real probe on
this machine's venv, canaries for the verl behaviour they encode, and (skipped unless the GPU
stack is installed) the paper-scale recipe config against the GPU stack."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verl_replay.integrations.verl import preflight as pf
from verl_replay.memory_budget import GIB, QWEN3_5_4B_CONFIG, ModelShape

REPO = Path(__file__).resolve().parents[3]
GPU80 = ("NVIDIA A100-SXM4-80GB", int(79.3 * GIB))  # what CUDA reports for an A100 80GB


class MachineProbe(pf.Probe):
    """A probe that reports a described machine instead of this one (disk and files stay real)."""

    def __init__(
        self,
        *,
        missing=(),
        versions=None,
        cuda="13.0",
        gpus=(GPU80,) * 4,
        cluster=None,
        archs=("Qwen3_5ForConditionalGeneration",),
        engines=("naive", "nccl"),
        free_disk=None,
        host_memory=512 * GIB,
    ):
        self.missing = set(missing)
        self.versions = {
            "torch": "2.11.0",
            "vllm": "0.24.0",
            "flash-attn": "2.8.3",
            "flash-linear-attention": "0.5.2",
            "causal-conv1d": "1.7.0",
            **(versions or {}),
        }
        self.cuda, self._gpus, self.cluster = cuda, list(gpus), cluster
        self.archs, self.engines = set(archs), set(engines)
        self.free_disk, self.host_memory = free_disk, host_memory

    def version(self, distribution):
        return None if distribution in self.missing else self.versions.get(distribution)

    def import_error(self, module):
        top = module.split(".")[0]
        names = {"flash_attn": "flash-attn", "fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}
        return f"ModuleNotFoundError: No module named '{top}'" if names.get(top, top) in self.missing else None

    def has_module(self, module):
        return self.import_error(module) is None

    def torch_cuda(self):
        return self.cuda

    def gpus(self):
        return self._gpus if self.cuda else []

    def ray_cluster_gpus(self):
        return self.cluster

    def vllm_architectures(self):
        return self.archs

    def checkpoint_engine_error(self, backend, custom_module):
        return None if backend in self.engines else f"Checkpoint engine {backend} not registered"

    def free_disk_bytes(self, path):
        return self.free_disk if self.free_disk is not None else super().free_disk_bytes(path)

    def host_memory_bytes(self):
        return self.host_memory


def _model_dir(tmp_path: Path, hf_config=QWEN3_5_4B_CONFIG) -> Path:
    model = tmp_path / "Qwen3.5-4B"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(hf_config))
    return model


def paper_config(tmp_path: Path, **changes) -> dict:
    """The composed-config keys the checks read, as the EliteReplay recipe sets them."""
    config = {
        "trainer": {
            "device": "cuda",
            "nnodes": 1,
            "n_gpus_per_node": 2,
            "save_freq": 25,
            "total_training_steps": 100,
            "max_actor_ckpt_to_keep": 2,
            "default_local_dir": str(tmp_path / "ckpt"),
            "v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": 4}},
        },
        "data": {"max_prompt_length": 16384, "max_response_length": 4096},
        "algorithm": {"rollout_correction": {"bypass_mode": False}},
        "actor_rollout_ref": {
            "model": {
                "path": str(_model_dir(tmp_path)),
                "use_remove_padding": True,
                "enable_gradient_checkpointing": True,
                "override_config": {"attn_implementation": "flash_attention_2"},
            },
            "actor": {
                "ppo_max_token_len_per_gpu": 20480,
                "entropy_from_logits_with_chunking": True,
                "checkpoint": {"save_contents": ["model", "optimizer", "extra", "hf_model"]},
                "fsdp_config": {"param_offload": False, "optimizer_offload": False},
            },
            "rollout": {
                "name": "vllm",
                "nnodes": 1,
                "n_gpus_per_node": 2,
                "tensor_model_parallel_size": 1,
                "gpu_memory_utilization": 0.85,
                "max_model_len": 20480,
                "max_num_batched_tokens": 20480,
                "log_prob_max_token_len_per_gpu": 32768,
                "enable_prefix_caching": False,
                "checkpoint_engine": {"backend": "nccl", "custom_backend_module": None},
            },
        },
    }
    for dotted, value in changes.items():
        node = config
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return config


def _by_name(checks):
    return {c.name: c for c in checks}


def test_a_complete_gpu_host_passes_every_check(tmp_path):
    checks, budget = pf.run_checks(paper_config(tmp_path), MachineProbe(free_disk=10**13))
    assert [c for c in checks if c.status in (pf.FAIL, pf.WARN)] == []
    names = _by_name(checks)
    assert (
        "4 visible" in names["gpus"].detail and "2 training x 1 node(s) + 2 rollout x 1 node(s)" in names["gpus"].detail
    )
    assert "supported by vLLM 0.24.0" in names["model"].detail
    assert budget is not None and budget.training_total < 80 * GIB


def test_each_missing_piece_fails_with_its_fix(tmp_path):
    config = paper_config(tmp_path)
    names = _by_name(pf.run_checks(config, MachineProbe(cuda=None))[0])
    assert names["torch"].status == pf.FAIL and 'pip install -e ".[gpu,test]"' in names["torch"].fix
    assert names["gpus"].status == pf.FAIL and "placement needs 4" in names["gpus"].detail

    names = _by_name(pf.run_checks(config, MachineProbe(missing={"vllm"}))[0])
    assert names["vllm"].status == pf.FAIL and "not installed" in names["vllm"].detail

    names = _by_name(pf.run_checks(config, MachineProbe(engines={"naive"}))[0])
    assert names["weight sync"].status == pf.FAIL and "cupy-cuda13x==14.0.1" in names["weight sync"].fix

    names = _by_name(pf.run_checks(config, MachineProbe(missing={"flash-attn"}))[0])
    assert names["attention"].status == pf.FAIL and "ATTN_IMPL=sdpa" in names["attention"].fix
    assert "docker/install_kernels.sh" in names["attention"].fix

    names = _by_name(pf.run_checks(config, MachineProbe(missing={"flash-linear-attention", "causal-conv1d"}))[0])
    assert (
        names["linear attention"].status == pf.FAIL and "flash-linear-attention==0.5.2" in names["linear attention"].fix
    )
    assert names["causal conv1d"].status == pf.WARN  # verl falls back to a torch convolution

    names = _by_name(pf.run_checks(config, MachineProbe(archs={"Qwen2ForCausalLM"}))[0])
    assert names["model"].status == pf.FAIL and "Qwen3_5ForConditionalGeneration" in names["model"].detail


def test_attention_and_packing_must_agree(tmp_path):
    sdpa = {"actor_rollout_ref.model.override_config": {"attn_implementation": "sdpa"}}
    packed = paper_config(tmp_path, **sdpa)
    check = _by_name(pf.run_checks(packed, MachineProbe(missing={"flash-attn"}))[0])["attention"]
    assert check.status == pf.FAIL and "use_remove_padding=False" in check.fix
    padded = paper_config(tmp_path, **sdpa, **{"actor_rollout_ref.model.use_remove_padding": False})
    assert _by_name(pf.run_checks(padded, MachineProbe(missing={"flash-attn"}))[0])["attention"].status == pf.OK


def test_paper_run_without_flash_attn_stops_with_the_memory_and_the_fix(tmp_path):
    """No silent sdpa: the FAIL line gives what the padded path would need (unchunked entropy, no
    fused cross-entropy: over the A100's 79.3 GiB) and the settings that make it fit."""
    config = paper_config(tmp_path)
    check = _by_name(pf.run_checks(config, MachineProbe(missing={"flash-attn"}))[0])["attention"]
    shape = ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)
    padded = pf.estimate(shape, pf.run_sizes(config, 79.3, fused_cross_entropy=False, packed=False))
    assert padded.training_total > 79.3 * GIB
    assert (
        f"needs {padded.training_total / GIB:.1f} GiB per training GPU" in check.detail
        and "of 79.3 GiB" in check.detail
    )
    assert check.fix.startswith("bash docker/install_kernels.sh")
    # the suggested settings do fit, with the margin
    settings = dict(item.split("=") for item in check.fix.split("ATTN_IMPL=sdpa ", 1)[1].split())
    fitted = pf.run_sizes(
        config,
        79.3,
        fused_cross_entropy=False,
        packed=False,
    )
    fitted = pf.replace(
        fitted,
        optimizer_offload=settings.get("ACTOR_OFFLOAD") == "True",
        log_prob_max_token_len_per_gpu=int(
            settings.get("LOG_PROB_MAX_TOKEN_LEN", fitted.log_prob_max_token_len_per_gpu)
        ),
        ppo_max_token_len_per_gpu=int(settings.get("PPO_MAX_TOKEN_LEN", fitted.ppo_max_token_len_per_gpu)),
    )
    assert pf.estimate(shape, fitted).training_total <= (1 - pf.MEMORY_MARGIN) * 79.3 * GIB


def test_explicit_sdpa_is_budgeted_as_verls_padded_path(tmp_path):
    sdpa = {
        "actor_rollout_ref.model.override_config": {"attn_implementation": "sdpa"},
        "actor_rollout_ref.model.use_remove_padding": False,
    }
    check = _by_name(pf.run_checks(paper_config(tmp_path, **sdpa), MachineProbe(missing={"flash-attn"}))[0])
    assert check["attention"].status == pf.OK and "padded micro-batches (asked for)" in check["attention"].detail
    assert check["gpu memory"].status == pf.FAIL and "ACTOR_OFFLOAD=True" in check["gpu memory"].fix
    _, packed = pf.run_checks(paper_config(tmp_path), MachineProbe())
    _, padded = pf.run_checks(paper_config(tmp_path, **sdpa), MachineProbe(missing={"flash-attn"}))
    v, t = 248320, 32768
    # the log-prob pass: the whole micro-batch's entropy (2 bf16 logits-sized tensors) instead of a chunk
    entropy = {r.what: r.bytes for r in padded.logprob_pass}["entropy (whole micro-batch, bf16)"]
    assert entropy == 2 * 2 * t * v
    assert padded.logprob_total - packed.logprob_total == 2 * 2 * t * v - 3 * 4 * 2048 * v


def test_choose_attention_is_the_gpu_default_whatever_is_installed():
    """auto is what a GPU host runs (DRY_RUN=1 on a CPU machine shows it); only the preflight looks."""
    assert pf.choose_attention("auto", MachineProbe())[:2] == ("flash_attention_2", True)
    assert pf.choose_attention("auto", MachineProbe(missing={"flash-attn"}))[:2] == ("flash_attention_2", True)
    assert pf.choose_attention("sdpa", MachineProbe())[:2] == ("sdpa", False)
    assert pf.choose_attention("flash_attention_2", MachineProbe(missing={"flash-attn"}))[:2] == (
        "flash_attention_2",
        True,
    )


@pytest.mark.parametrize(
    ("changes", "per_node", "total"),
    [
        ({}, 4, 4),  # 2 training + 2 rollout GPUs on one node
        ({"trainer.nnodes": 2, "actor_rollout_ref.rollout.nnodes": 2}, 4, 8),  # both roles on every node
        (
            {
                "trainer.nnodes": 1,
                "trainer.n_gpus_per_node": 8,
                "actor_rollout_ref.rollout.nnodes": 1,
                "actor_rollout_ref.rollout.n_gpus_per_node": 8,
            },
            16,
            16,
        ),
        ({"trainer.v1.trainer_mode": "sync", "trainer.nnodes": 2}, 2, 4),  # colocated
    ],
)
def test_placement_need(tmp_path, changes, per_node, total):
    need = pf.placement_need(paper_config(tmp_path, **changes))
    assert (need.per_node, need.total) == (per_node, total)


def test_whole_node_split_needs_a_gpu_count_per_node(tmp_path):
    config = paper_config(
        tmp_path,
        **{
            "trainer.nnodes": 1,
            "trainer.n_gpus_per_node": 8,
            "actor_rollout_ref.rollout.nnodes": 2,
            "actor_rollout_ref.rollout.n_gpus_per_node": 8,
        },
    )
    assert pf.placement_need(config).per_node == 8  # training and rollout on different nodes


def test_gpu_count_single_node_multi_node_and_ray_cluster(tmp_path):
    config = paper_config(tmp_path)
    check = _by_name(pf.run_checks(config, MachineProbe(gpus=[GPU80] * 2))[0])["gpus"]
    assert check.status == pf.FAIL and "2 visible" in check.detail and "needs 4" in check.detail
    two_nodes = paper_config(tmp_path, **{"trainer.nnodes": 2, "actor_rollout_ref.rollout.nnodes": 2})
    check = _by_name(pf.run_checks(two_nodes, MachineProbe(gpus=[GPU80] * 4))[0])["gpus"]
    assert check.status == pf.OK and "on this node" not in check.detail  # 4 per node are here
    check = _by_name(pf.run_checks(two_nodes, MachineProbe(gpus=[GPU80] * 2))[0])["gpus"]
    assert check.status == pf.FAIL and "RAY_ADDRESS" in check.fix
    check = _by_name(pf.run_checks(two_nodes, MachineProbe(gpus=[GPU80] * 2, cluster=8.0))[0])["gpus"]
    assert check.status == pf.OK and "Ray cluster" in check.detail
    only_eval = _by_name(pf.run_checks(config, MachineProbe(gpus=[GPU80]), stages=["eval"])[0])
    assert only_eval["gpus"].status == pf.OK and only_eval["disk"].status == pf.SKIP


def test_memory_against_the_visible_gpus(tmp_path):
    config = paper_config(tmp_path)
    small = _by_name(pf.run_checks(config, MachineProbe(gpus=[("L40S", 48 * GIB)] * 4))[0])["gpu memory"]
    assert small.status == pf.FAIL and "ACTOR_OFFLOAD=True" in small.fix and "of 48.0 GiB (L40S)" in small.detail
    big, budget = pf.run_checks(config, MachineProbe())
    assert _by_name(big)["gpu memory"].status == pf.OK
    # the paper recipe leaves MEMORY_MARGIN of an A100 80GB free at its peak pass
    assert budget.training_total <= (1 - pf.MEMORY_MARGIN) * 79.3 * GIB
    # no GPU visible: held against the recipes' A100 80GB
    none = _by_name(pf.run_checks(config, MachineProbe(cuda=None))[0])["gpu memory"]
    assert none.status == pf.OK and "A100-80GB assumed" in none.detail
    tight = paper_config(tmp_path, **{"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 45056})
    warn = _by_name(pf.run_checks(tight, MachineProbe())[0])["gpu memory"]
    assert warn.status == pf.WARN and "LOG_PROB_MAX_TOKEN_LEN=" in warn.fix


def test_budget_counts_the_weight_sync_buffers_and_the_scan(tmp_path):
    _, nccl = pf.run_checks(paper_config(tmp_path), MachineProbe())
    rows = {r.what: r.bytes for r in nccl.resident}
    assert rows["weight-sync buffers (training rank 0)"] == 2 * 2048 << 20  # verl's update_weights_bucket_megabytes
    assert {r.what: r.bytes for r in nccl.rollout}["weight-sync buffers (during a push)"] == 2 * 2048 << 20
    hd = paper_config(tmp_path, **{"replay.strategy": "headroom_drift"})
    assert "scan pass" in pf.run_checks(hd, MachineProbe())[1].passes
    assert "scan pass" not in nccl.passes  # EliteReplay does not scan


def test_disk_for_checkpoints(tmp_path):
    config = paper_config(tmp_path)
    shape = ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)
    one = pf.checkpoint_bytes(shape, ["model", "optimizer", "extra", "hf_model"])
    assert one == 4 * shape.total_params + 8 * shape.text_params + 2 * shape.total_params
    assert _by_name(pf.run_checks(config, MachineProbe(free_disk=one - 1))[0])["disk"].status == pf.FAIL
    assert _by_name(pf.run_checks(config, MachineProbe(free_disk=one + 1))[0])["disk"].status == pf.WARN  # keep 2
    assert _by_name(pf.run_checks(config, MachineProbe(free_disk=2 * one))[0])["disk"].status == pf.OK


def test_settings_that_fail_later(tmp_path):
    offload = paper_config(tmp_path, **{"actor_rollout_ref.actor.fsdp_config.param_offload": True})
    check = _by_name(pf.run_checks(offload, MachineProbe(free_disk=10**13))[0])["offload"]
    assert check.status == pf.FAIL and "save_model_to_cpu" in check.detail
    bypass = paper_config(
        tmp_path,
        **{"actor_rollout_ref.actor.fsdp_config.param_offload": True, "algorithm.rollout_correction.bypass_mode": True},
    )
    assert _by_name(pf.run_checks(bypass, MachineProbe(free_disk=10**13))[0])["offload"].status == pf.OK
    caching = paper_config(tmp_path, **{"actor_rollout_ref.rollout.enable_prefix_caching": True})
    assert _by_name(pf.run_checks(caching, MachineProbe(free_disk=10**13))[0])["prefix caching"].status == pf.WARN
    on_cpu = paper_config(
        tmp_path, **{"actor_rollout_ref.rollout.enable_prefix_caching": True, "trainer.device": "cpu"}
    )
    assert "prefix caching" not in _by_name(pf.run_checks(on_cpu, MachineProbe(free_disk=10**13))[0])
    naive = paper_config(tmp_path, **{"actor_rollout_ref.rollout.checkpoint_engine.backend": "naive"})
    assert _by_name(pf.run_checks(naive, MachineProbe())[0])["weight sync"].status == pf.FAIL


def test_model_folder_problems(tmp_path):
    missing = paper_config(tmp_path, **{"actor_rollout_ref.model.path": str(tmp_path / "nope")})
    assert _by_name(pf.run_checks(missing, MachineProbe())[0])["model"].status == pf.FAIL
    hub = paper_config(tmp_path, **{"actor_rollout_ref.model.path": "Qwen/Qwen3.5-4B"})
    check = _by_name(pf.run_checks(hub, MachineProbe())[0])["model"]
    assert check.status == pf.WARN and "hub id" in check.detail


# --------------------------------------------------------------------------- the real machine


def _compose_paper(tmp_path: Path, model: Path) -> dict:
    return pf.compose_config(
        [
            "platform=gpu",
            f"actor_rollout_ref.model.path={model}",
            "data.train_files=t.parquet",
            "data.val_files=v.parquet",
            "trainer.v1.trainer_mode=separate_async",
            "actor_rollout_ref.hybrid_engine=False",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
            "data.train_batch_size=128",
            "actor_rollout_ref.actor.ppo_mini_batch_size=32",
            "trainer.v1.separate_async.parameter_sync_step=4",
            f"run_dir={tmp_path / 'run'}",
        ]
    )


def test_gpu_profile_sets_verls_qwen3_5_memory_settings(tmp_path):
    config = _compose_paper(tmp_path, _model_dir(tmp_path))
    actor = config["actor_rollout_ref"]["actor"]
    assert actor["entropy_from_logits_with_chunking"] is True and actor["entropy_checkpointing"] is True
    # verl's engine config reads the actor-level keys (oc.select): they reach the FSDP engine
    assert actor["fsdp_config"]["entropy_checkpointing"] is True
    assert actor["fsdp_config"]["entropy_from_logits_with_chunking"] is True
    assert actor["fsdp_config"]["param_offload"] is False
    assert config["actor_rollout_ref"]["model"]["enable_gradient_checkpointing"] is True
    assert config["actor_rollout_ref"]["rollout"]["enable_prefix_caching"] is False
    assert config["actor_rollout_ref"]["model"]["override_config"]["attn_implementation"] == "flash_attention_2"
    # verl's Qwen3.5 examples: torch.compile off for the actor and the reference, both keys each
    for role in ("actor", "ref"):
        assert config["actor_rollout_ref"][role]["use_torch_compile"] is False
        assert config["actor_rollout_ref"][role]["fsdp_config"]["use_torch_compile"] is False


def test_real_probe_on_a_cpu_venv_names_what_is_missing(tmp_path):
    import torch

    if torch.version.cuda is not None or shutil.which("nvidia-smi"):
        pytest.skip("this interpreter has the GPU stack")
    checks, _ = pf.run_checks(_compose_paper(tmp_path, _model_dir(tmp_path)))
    names = _by_name(checks)
    assert names["torch"].status == pf.FAIL and "CPU build" in names["torch"].detail
    assert names["gpus"].status == pf.FAIL
    if pf.Probe().version("vllm") is None:
        assert names["vllm"].status == pf.FAIL
    if pf.Probe().import_error("cupy"):
        assert (
            names["weight sync"].status == pf.FAIL and "cupy" in names["weight sync"].detail + names["weight sync"].fix
        )


def _gpu_stack_installed() -> bool:
    probe = pf.Probe()
    import torch

    return torch.version.cuda is not None and probe.version("vllm") is not None and probe.import_error("cupy") is None


@pytest.mark.skipif(not _gpu_stack_installed(), reason="the GPU stack is not installed (pip install -e '.[gpu,test]')")
def test_gpu_stack_paper_recipe_fails_only_for_missing_gpus(tmp_path):
    """`pip install -e ".[gpu,test]"` on a machine without GPUs: nccl resolves, vLLM registers
    Qwen3.5, the preflight of the paper-scale recipe config fails only the GPU count (and the
    disk check, if this disk cannot hold one checkpoint)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    assert CheckpointEngineRegistry.get("nccl").__name__ == "NCCLCheckpointEngine"
    model = _model_dir(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    for name in ("bird_train", "bird_dev", "spider_dev"):  # the recipe checks that its inputs exist first
        (data / f"{name}.parquet").write_bytes(b"")
    env = dict(
        os.environ,
        PREFLIGHT="only",
        MODEL_PATH=str(model),
        OUTPUT_DIR=str(tmp_path / "out"),
        DATA_DIR=str(data),
        PYTHON=sys.executable,
        PYTHONUNBUFFERED="1",
    )
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        ["bash", str(REPO / "recipes" / "elite_replay_qwen4b.sh")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [
        line for line in result.stderr.splitlines() + result.stdout.splitlines() if line.startswith("[preflight] ")
    ]
    failed = {line.split()[2] for line in lines if line.split()[1:2] == ["FAIL"]}
    shape = ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)
    one = pf.checkpoint_bytes(shape, ["model", "optimizer", "extra", "hf_model"])
    gpus = pf.Probe().gpus()
    allowed = ({"gpus"} if len(gpus) < 4 else set()) | ({"disk"} if shutil.disk_usage(tmp_path).free < one else set())
    if gpus and min(memory for _, memory in gpus) < 79 * GIB:
        allowed.add("gpu memory")  # the paper's 80 GB GPUs
    flash_attn = pf.Probe().import_error("flash_attn") is None
    if not flash_attn:  # the pip stack before docker/install_kernels.sh
        allowed.add("attention")
    assert failed <= allowed, "\n".join(lines)
    assert len(gpus) >= 4 or "gpus" in failed, "\n".join(lines)
    assert any("OK    weight sync       checkpoint engine 'nccl' registered" in line for line in lines)
    if not flash_attn:
        attention = next(line for line in lines if " FAIL  attention " in line)
        assert "GiB per training GPU" in attention, "\n".join(lines)
        assert any("fix: bash docker/install_kernels.sh" in line for line in lines), "\n".join(lines)
    assert result.returncode == (2 if failed else 0), result.stderr[-2000:]


# --------------------------------------------------------------------------- canaries (verl 0.9.1)


def test_canary_checkpoint_engine_registry_reports_unknown_backends():
    from verl.checkpoint_engine import CheckpointEngineRegistry

    with pytest.raises(ValueError, match="not registered"):
        CheckpointEngineRegistry.get("no_such_engine")
    assert pf.Probe().checkpoint_engine_error("naive", None) is None


def test_canary_verl_defaults_attention_to_flash_attention_2():
    from verl.workers.config import model as model_config

    assert 'override_config.get("attn_implementation", "flash_attention_2")' in inspect.getsource(model_config)


def test_canary_separate_async_snapshots_pi_old_on_cpu():
    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    source = inspect.getsource(PPOTrainerSeparateAsync._compute_old_log_prob)
    assert "save_model_to_cpu" in source and "restore_model_from_cpu" in source and "bypass_mode" in source
    assert "param_offload" in inspect.getsource(DetachActorWorker)  # the caveat the offload check encodes


def test_canary_engine_reads_actor_level_entropy_keys():
    import verl

    generated = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    content = generated.read_text()
    assert "${oc.select:actor_rollout_ref.actor.entropy_from_logits_with_chunking,False}" in content
    assert "${oc.select:actor_rollout_ref.actor.entropy_checkpointing,False}" in content


def _cpu_vllm_config(tmp_path: Path, **changes) -> dict:
    """The keys the CPU vLLM check reads, as the cpu_tiny profile sets them (Qwen3.5-4B's linear head
    dims, 128, are multiples of 32)."""
    profile = {f"actor_rollout_ref.rollout.{key}": value for key, value, _ in pf.VLLM_CPU_SETTINGS}
    return paper_config(tmp_path, **{"trainer.device": "cpu", **profile, **changes})


class _CPUProbe(MachineProbe):
    def __init__(self, plugin: bool = True, **kwargs):
        super().__init__(cuda=None, gpus=(), versions={"vllm": "0.24.0+cpu", **kwargs.pop("versions", {})}, **kwargs)
        self.plugin = plugin

    def entry_point(self, group, name):
        return self.plugin and (group, name) == pf.VLLM_CPU_PLUGIN


def test_vllm_cpu_build_with_the_profile_settings_passes(tmp_path):
    check = _by_name(pf.run_checks(_cpu_vllm_config(tmp_path), _CPUProbe(free_disk=10**13))[0])["vllm"]
    assert check.status == pf.OK and "0.24.0+cpu" in check.detail


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("dtype", "float32", "bf16"),
        ("enforce_eager", False, "CUDA graphs"),
        ("enable_sleep_mode", True, "sleep mode"),
        ("free_cache_engine", True, "sleep mode"),
        ("enable_prefix_caching", True, "Triton"),
        ("engine_kwargs.vllm.mamba_ssm_cache_dtype", "auto", "fp32 state"),
    ],
)
def test_vllm_cpu_settings_the_build_cannot_run(tmp_path, key, value, named):
    config = _cpu_vllm_config(tmp_path, **{f"actor_rollout_ref.rollout.{key}": value})
    check = _by_name(pf.run_checks(config, _CPUProbe(free_disk=10**13))[0])["vllm"]
    assert check.status == pf.FAIL and f"actor_rollout_ref.rollout.{key}" in check.detail + check.fix
    assert named in check.detail


def test_vllm_cpu_install_problems(tmp_path):
    config = _cpu_vllm_config(tmp_path)
    missing = _by_name(pf.run_checks(config, _CPUProbe(missing={"vllm"}, free_disk=10**13))[0])["vllm"]
    assert missing.status == pf.FAIL and "install_cpu.sh" in missing.fix
    no_record = _by_name(pf.run_checks(config, _CPUProbe(versions={"vllm": "0.24.0"}, free_disk=10**13))[0])["vllm"]
    assert no_record.status == pf.FAIL and "+cpu" in no_record.detail
    no_plugin = _by_name(pf.run_checks(config, _CPUProbe(plugin=False, free_disk=10**13))[0])["vllm"]
    assert no_plugin.status == pf.FAIL and pf.VLLM_CPU_PLUGIN[1] in no_plugin.detail


def test_vllm_cpu_needs_linear_head_dims_of_32(tmp_path):
    config = _cpu_vllm_config(tmp_path)
    model = Path(config["actor_rollout_ref"]["model"]["path"])
    hf_config = json.loads((model / "config.json").read_text())
    hf_config["text_config"]["linear_key_head_dim"] = 16
    (model / "config.json").write_text(json.dumps(hf_config))
    check = _by_name(pf.run_checks(config, _CPUProbe(free_disk=10**13))[0])["vllm"]
    assert check.status == pf.FAIL and "'linear_key_head_dim': 16" in check.detail


def test_the_cpu_profile_and_the_installed_plugin_pass_the_check():
    """The composed cpu_tiny profile against this venv's real vLLM record and entry point."""
    if pf.Probe().version("vllm") is None:
        pytest.skip("no vLLM in this venv")
    check = pf._check_vllm_cpu(pf.compose_config(["platform=cpu_tiny"]), pf.Probe(), None)
    assert check.status == pf.OK, check
