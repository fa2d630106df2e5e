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
GPU80 = ("NVIDIA A100-SXM4-80GB", 80 * GIB)


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
                "log_prob_max_token_len_per_gpu": 40960,
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
    assert names["torch"].status == pf.FAIL and 'pip install -e ".[gpu]"' in names["torch"].fix
    assert names["gpus"].status == pf.FAIL and "placement needs 4" in names["gpus"].detail

    names = _by_name(pf.run_checks(config, MachineProbe(missing={"vllm"}))[0])
    assert names["vllm"].status == pf.FAIL and "not installed" in names["vllm"].detail

    names = _by_name(pf.run_checks(config, MachineProbe(engines={"naive"}))[0])
    assert names["weight sync"].status == pf.FAIL and "cupy-cuda13x==14.0.1" in names["weight sync"].fix

    names = _by_name(pf.run_checks(config, MachineProbe(missing={"flash-attn"}))[0])
    assert names["attention"].status == pf.FAIL and "ATTN_IMPL=sdpa" in names["attention"].fix

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


def test_choose_attention_follows_what_is_installed():
    assert pf.choose_attention("auto", MachineProbe())[:2] == ("flash_attention_2", True)
    assert pf.choose_attention("auto", MachineProbe(missing={"flash-attn"}))[:2] == ("sdpa", False)
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
    assert small.status == pf.FAIL and "PPO_MAX_TOKEN_LEN" in small.fix
    big = _by_name(pf.run_checks(config, MachineProbe())[0])["gpu memory"]
    assert big.status == pf.OK
    # without flash-attn the logits' gradient is a separate tensor: ~9.5 GiB more per training GPU
    _, with_flash = pf.run_checks(config, MachineProbe())
    _, without = pf.run_checks(config, MachineProbe(missing={"flash-attn"}))
    assert without.update_total - with_flash.update_total == 4 * 20480 * 248320


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
    if gpus and min(memory for _, memory in gpus) < 80 * GIB:
        allowed.add("gpu memory")  # the paper's 80 GB GPUs
    assert failed <= allowed, "\n".join(lines)
    assert len(gpus) >= 4 or "gpus" in failed, "\n".join(lines)
    assert any("OK    weight sync       checkpoint engine 'nccl' registered" in line for line in lines)
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
