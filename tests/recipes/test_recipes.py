"""The full-scale recipes (``recipes/``): what they compose, what they refuse, and their tiny runs.

* ``DRY_RUN=1``: every recipe and baseline runs its real training command with ``dry_run=true``
  (Hydra composes, verl_replay validates, the resolved config is printed) and prints its search /
  evaluation commands. The tests parse the printed YAML and check the papers' settings.
  The dry runs start together (one subprocess each, ~6-9 s of verl import apiece).
* Refusals (bad settings, missing inputs) are caught by the recipe's own checks before any
  Python starts, so they cost milliseconds.
* ``TINY=1`` (``e2e``): each main recipe runs all its stages on CPU with the tiny assets.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

# what this file's verl runs take on 2 cores (tests/conftest.py starts the longest first)
E2E_SECONDS = 500  # the HD recipe runs twice: killed after a checkpoint, then resumed

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
DRY_RUN_OK = "verl_replay: dry run OK"

SQL_FILES = ("bird_train", "bird_dev", "spider_dev", "ambiqt_validation")
MATH_FILES = (
    "math_train",
    "math_math500",
    "math_aime24",
    "math_aime25",
    "math_amc23",
    "math_minerva",
    "math_olympiadbench",
)
PASS_THROUGH = ("replay.elite.seed=7", "actor_rollout_ref.actor.clip_ratio_high=0.28")


@dataclass
class RecipeRun:
    script: str
    returncode: int
    stdout: str
    stderr: str

    @property
    def config(self) -> dict:
        """The YAML the training command printed, up to its "dry run OK" line."""
        lines = self.stdout.splitlines()
        end = next((i for i, line in enumerate(lines) if line.startswith(DRY_RUN_OK)), None)
        assert end is not None, f"{self.script}: no '{DRY_RUN_OK}' line\n{self.stdout[-2000:]}\n{self.stderr[-3000:]}"
        start = next(
            i for i, line in enumerate(lines) if line and not line[0].isspace() and line.rstrip().endswith(":")
        )
        return yaml.safe_load("\n".join(lines[start:end]))

    def command(self, stage: str) -> list[str]:
        """The command a stage printed (``[recipe] stage: CMD`` / ``[recipe] stage (DRY_RUN=1, not run): CMD``)."""
        for line in self.stderr.splitlines():
            for marker in (f"] {stage}: ", f"] {stage} (DRY_RUN=1, not run): "):
                if marker in line:
                    return shlex.split(line.split(marker, 1)[1])
        raise AssertionError(f"{self.script}: no printed '{stage}' command\n{self.stderr[-3000:]}")


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def run_recipe(script: str, env: dict[str, str], *args: str, timeout: int = 1800) -> RecipeRun:
    # ``timeout`` is a hang guard, not a speed target: a dry run takes seconds on a quiet machine and
    # minutes when a dozen of them start beside a verl run on 2 cores
    full_env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("VERL_FILE_LOGGER_PATH", "TINY", "DRY_RUN", "RAY_ADDRESS", "PREFLIGHT")
    }
    full_env.update(env)
    # its own session: on a timeout the whole process group goes, not just bash (its Python children
    # would otherwise keep running on the shared machine)
    proc = subprocess.Popen(
        ["bash", str(RECIPES / script), *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return RecipeRun(script, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """Dummy inputs: DRY_RUN=1 composes without reading them; refusal tests need them to exist."""
    root = tmp_path_factory.mktemp("recipe_inputs")
    data, model = root / "data", root / "Qwen3.5-4B"
    data.mkdir()
    model.mkdir()
    for name in SQL_FILES + MATH_FILES:
        (data / f"{name}.parquet").write_bytes(b"")
    return {"DATA_DIR": str(data), "MODEL_PATH": str(model), "OUTPUT_DIR": str(root / "outputs")}


DRY_CASES = {
    "elite": ("elite_replay_qwen4b.sh", {}, PASS_THROUGH),
    "hd": ("headroom_drift_math.sh", {}, ()),
    # the comparison's ablations: Drift-only (recency order) and Headroom-only (no gate)
    "drift_only": ("headroom_drift_math.sh", {"SCAN_ORDER": "recency"}, ()),
    "headroom_only": ("headroom_drift_math.sh", {"TAU": "1e+09"}, ()),
    # also two validation files: the recipe hands them to verl as a Hydra list
    "b256": (
        "baselines/grpo_onpolicy_b256.sh",
        {"VAL_FILES": "{DATA_DIR}/math_math500.parquet,{DATA_DIR}/math_aime24.parquet"},
        (),
    ),
    "b384": ("baselines/grpo_onpolicy_b384.sh", {}, ()),
    "naive_r256": ("baselines/naive_replay.sh", {"K_REP": "32"}, ()),
    "dapo": ("baselines/dapo.sh", {}, ()),
    "iid": ("baselines/iid_archive_replay.sh", {}, ()),
    # also the multi-node layout: 2 nodes x 8 GPUs, 4 training + 4 rollout GPUs on each
    "grpo_sql_2nodes": (
        "baselines/grpo_sql.sh",
        {"NNODES": "2", "GPUS_PER_NODE": "8", "TRAIN_GPUS": "4", "ROLLOUT_GPUS": "4"},
        (),
    ),
    # flash attention asked for explicitly (the GPU image), optimizer offload
    "hd_flash": ("headroom_drift_math.sh", {"ATTN_IMPL": "flash_attention_2", "ACTOR_OFFLOAD": "True"}, ()),
    # the per-GPU memory budget of both recipes' defaults and of sdpa (recipes/README.md shows these tables)
    "elite_table": ("elite_replay_qwen4b.sh", {"PREFLIGHT": "table"}, ()),
    "hd_table": ("headroom_drift_math.sh", {"PREFLIGHT": "table"}, ()),
    "elite_sdpa_table": ("elite_replay_qwen4b.sh", {"PREFLIGHT": "table", "ATTN_IMPL": "sdpa"}, ()),
}


@pytest.fixture(scope="module")
def dry(inputs) -> dict[str, RecipeRun]:
    def one(case: str) -> RecipeRun:
        script, env, args = DRY_CASES[case]
        env = {key: value.format(**inputs) for key, value in env.items()}
        # one thread per dry run: they only compose and validate, and run side by side
        return run_recipe(script, {**inputs, "DRY_RUN": "1", "OMP_NUM_THREADS": "1", **env}, *args)

    with ThreadPoolExecutor(max_workers=len(DRY_CASES)) as pool:
        runs = dict(zip(DRY_CASES, pool.map(one, DRY_CASES), strict=True))
    for case, run in runs.items():
        assert run.returncode == 0, f"{case}: rc={run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
        lines = run.stderr.splitlines()  # the recipe's own lines go to stderr
        if not any("] memory: " in line for line in lines):  # a memory-table run stops after its table
            assert "] dry run: nothing was run (stages: " in lines[-1], f"{case}: {run.stderr[-500:]}"
    return runs


def check_split_placement(config: dict, *, train_gpus: int = 2, rollout_gpus: int = 2, nnodes: int = 1) -> None:
    trainer, rollout = config["trainer"], config["actor_rollout_ref"]["rollout"]
    assert trainer["v1"]["trainer_mode"] == "separate_async"
    assert config["actor_rollout_ref"]["hybrid_engine"] is False
    assert (trainer["nnodes"], trainer["n_gpus_per_node"]) == (nnodes, train_gpus)
    assert (rollout["nnodes"], rollout["n_gpus_per_node"]) == (nnodes, rollout_gpus)
    assert rollout["checkpoint_engine"]["backend"] == "nccl"
    assert rollout["name"] == "vllm" and trainer["device"] == "cuda"
    # verl's separate_async invariant: a global step is parameter_sync_step rounds of one mini-batch
    sync = trainer["v1"]["separate_async"]["parameter_sync_step"]
    assert config["data"]["train_batch_size"] == sync * config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"]


def check_hf_checkpoints(config: dict) -> None:
    checkpoint = config["actor_rollout_ref"]["actor"]["checkpoint"]
    assert "hf_model" in checkpoint["save_contents"] and "hf_model" not in checkpoint["load_contents"]
    assert config["trainer"]["save_freq"] > 0


# ============================================================================ EliteReplay (SQL)


def test_elite_recipe_composes_the_paper_settings(dry, inputs) -> None:
    config = dry["elite"].config
    data, arr = config["data"], config["actor_rollout_ref"]
    check_split_placement(config)
    check_hf_checkpoints(config)
    assert (data["train_batch_size"], arr["rollout"]["n"], config["trainer"]["total_training_steps"]) == (128, 8, 100)
    assert (data["max_prompt_length"], data["max_response_length"]) == (16384, 4096)
    assert arr["rollout"]["max_model_len"] == 16384 + 4096
    assert arr["actor"]["ppo_max_token_len_per_gpu"] >= 16384 + 4096 and arr["actor"]["use_dynamic_bsz"] is True
    assert arr["actor"]["optim"]["lr"] == pytest.approx(1e-6)
    assert arr["model"]["path"] == inputs["MODEL_PATH"]
    assert data["train_files"] == f"{inputs['DATA_DIR']}/bird_train.parquet"
    replay = config["replay"]
    assert replay["strategy"] == "elite" and replay["elite"]["mu"] == pytest.approx(0.05)
    archive = f"{inputs['OUTPUT_DIR']}/elite_replay_sql/archive/elite_archive.parquet"
    assert replay["elite"]["archive"] == archive
    assert config["run_dir"] == f"{inputs['OUTPUT_DIR']}/elite_replay_sql/elite_q128x8"
    assert config["trainer"]["default_local_dir"] == config["run_dir"] + "/checkpoints"


def test_elite_recipe_passes_extra_arguments_through_as_hydra_overrides(dry) -> None:
    config = dry["elite"].config
    assert config["replay"]["elite"]["seed"] == 7  # the recipe sets 0: the user's value comes last and wins
    assert config["actor_rollout_ref"]["actor"]["clip_ratio_high"] == pytest.approx(0.28)
    train = dry["elite"].command("train")
    assert train[-3:] == [*PASS_THROUGH, "dry_run=true"]


def test_elite_recipe_prints_search_and_eval_commands(dry, inputs) -> None:
    run, data = dry["elite"], inputs["DATA_DIR"]
    search = run.command("search")
    assert search[1:3] == ["-m", "verl_replay.elite.search"]
    assert flag(search, "--backend") == "vllm" and flag(search, "--model") == inputs["MODEL_PATH"]
    assert flag(search, "--data") == f"{data}/bird_train.parquet"
    assert flag(search, "--out") == run.config["replay"]["elite"]["archive"]
    evaluation = run.command("eval")
    assert evaluation[1:3] == ["-m", "verl_replay.eval"]
    assert flag(evaluation, "--n") == "128" and flag(evaluation, "--k").split(",")[-1] == "128"
    assert flag(evaluation, "--data").split(",") == [
        f"{data}/bird_dev.parquet",
        f"{data}/spider_dev.parquet",
        f"{data}/ambiqt_validation.parquet",
    ]
    # the trained checkpoint's HF export at the last step
    run_dir = run.config["run_dir"]
    assert flag(evaluation, "--model") == f"{run_dir}/checkpoints/global_step_100/actor/huggingface"
    assert flag(evaluation, "--out") == f"{run_dir}/eval"


def test_iid_archive_baseline_replays_the_same_archive_iid(dry) -> None:
    elite, iid = dry["elite"].config, dry["iid"].config
    check_split_placement(iid)
    assert iid["replay"]["strategy"] == "elite_iid"
    assert iid["replay"]["elite"]["archive"] == elite["replay"]["elite"]["archive"]
    assert iid["replay"]["elite"]["mu"] == pytest.approx(0.05)
    assert iid["run_dir"] != elite["run_dir"]
    for key in ("train_batch_size", "max_prompt_length", "max_response_length"):
        assert iid["data"][key] == elite["data"][key]


def test_grpo_sql_baseline_has_no_replay_and_spans_two_nodes(dry) -> None:
    run = dry["grpo_sql_2nodes"]
    config = run.config
    check_split_placement(config, train_gpus=4, rollout_gpus=4, nnodes=2)
    assert config["replay"]["strategy"] == "none" and config["replay"]["elite"]["archive"] is None
    assert config["data"]["train_batch_size"] == 128 and config["trainer"]["total_training_steps"] == 100
    assert "search:" not in run.stderr and "search (DRY_RUN" not in run.stderr  # GRPO needs no archive


# ============================================================================ Headroom-Drift (math)


def test_headroom_drift_recipe_composes_b256_plus_r128(dry, inputs) -> None:
    config = dry["hd"].config
    check_split_placement(config)
    check_hf_checkpoints(config)
    data, arr, replay = config["data"], config["actor_rollout_ref"], config["replay"]
    assert (data["train_batch_size"], arr["rollout"]["n"]) == (32, 8)  # 256 fresh responses
    rounds = config["trainer"]["v1"]["separate_async"]["parameter_sync_step"]
    # b256 + r128 in 6 optimiser steps of 64 responses, like b384: 2 rounds of 16 fresh
    # prompts + 8 replayed groups, each round 3 steps of 8 groups
    assert (rounds, arr["actor"]["ppo_mini_batch_size"], replay["ppo_mini_batch_size"]) == (2, 16, 8)
    fresh_per_round, replay_per_round = 32 // rounds, replay["k_rep"] // rounds
    assert rounds * (fresh_per_round + replay_per_round) // replay["ppo_mini_batch_size"] == 6
    # K_rep = 16 groups (128 responses) per global step, selected once per global step
    assert replay["strategy"] == "headroom_drift" and replay["k_rep"] == 16
    assert replay["tau"] == pytest.approx(0.08) and replay["drift_norm"] == "l2" and replay["weighting"] == "sign"
    assert replay["ingress"] == "answer_disagree" and replay["scan_order"] == "headroom"
    assert arr["model"]["path"] == inputs["MODEL_PATH"]
    assert config["run_dir"].endswith("/headroom_drift_math/hd_b256_r128")
    evaluation = dry["hd"].command("eval")
    assert flag(evaluation, "--n") == "32" and "32" in flag(evaluation, "--k").split(",")
    benchmarks = [Path(p).stem for p in flag(evaluation, "--data").split(",")]
    assert benchmarks == [
        "math_math500",
        "math_aime24",
        "math_aime25",
        "math_amc23",
        "math_minerva",
        "math_olympiadbench",
    ]


def test_ablation_settings_reach_the_replay_config(dry) -> None:
    drift_only, headroom_only = dry["drift_only"].config["replay"], dry["headroom_only"].config["replay"]
    assert drift_only["scan_order"] == "recency" and drift_only["tau"] == pytest.approx(0.08)
    assert headroom_only["scan_order"] == "headroom" and headroom_only["tau"] == pytest.approx(1e9)


def test_on_policy_baselines_b256_and_b384(dry) -> None:
    b256, b384 = dry["b256"].config, dry["b384"].config
    for config in (b256, b384):
        check_split_placement(config)
        assert config["replay"]["strategy"] == "none" and config["actor_rollout_ref"]["rollout"]["n"] == 8
        assert config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] == 8
    assert b256["data"]["train_batch_size"] == 32 and b384["data"]["train_batch_size"] == 48
    assert b384["trainer"]["v1"]["separate_async"]["parameter_sync_step"] == 6  # six mini-batches, as in the paper
    assert b256["run_dir"].endswith("/grpo_b256") and b384["run_dir"].endswith("/grpo_b384")
    data = dry["b256"].config["data"]
    assert [Path(p).name for p in data["val_files"]] == ["math_math500.parquet", "math_aime24.parquet"]


def test_naive_replay_baseline_r256(dry) -> None:
    config = dry["naive_r256"].config
    check_split_placement(config)
    assert config["replay"]["strategy"] == "naive" and config["replay"]["k_rep"] == 32
    # b256 + r256: 4 rounds of 8 fresh + 8 replayed groups, 2 steps of 8 groups each
    assert config["trainer"]["v1"]["separate_async"]["parameter_sync_step"] == 4
    assert config["replay"]["ppo_mini_batch_size"] == 8
    assert config["data"]["train_batch_size"] == 32
    assert config["run_dir"].endswith("/naive_b256_r256")


def test_dapo_baseline_composes_verls_dapo_arm(dry) -> None:
    config = dry["dapo"].config
    check_split_placement(config)
    actor = config["actor_rollout_ref"]["actor"]
    assert config["replay"]["strategy"] == "none"
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"], actor["loss_agg_mode"]) == (0.2, 0.28, "token-mean")
    assert config["reward"]["reward_manager"]["name"] == "dapo"
    kwargs = config["reward"]["reward_kwargs"]
    assert kwargs["max_resp_len"] == config["data"]["max_response_length"] == 4096
    assert kwargs["overlong_buffer_cfg"] == {"enable": True, "len": 819, "penalty_factor": 1.0, "log": False}
    assert config["run_dir"].endswith("/dapo_b256")  # beside, not over, the on-policy arm's grpo_b256


def test_dapo_reward_manager_keeps_our_reward_and_shapes_overlong_answers(dry, tiny_assets) -> None:
    """verl's own dapo reward manager, built from the recipe's composed config, around our reward:
    a correct answer keeps score 1 and acc 1 until it runs into the overlong buffer, then loses
    (length - (4096 - 819)) / 819 of a point; a wrong one is shaped the same way from 0."""
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls

    from verl_replay.rewards import compute_score

    config = OmegaConf.create(dry["dapo"].config)
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.tokenizer)
    manager = get_reward_manager_cls("dapo")(config, tokenizer, compute_score)
    filler = tokenizer(" so", add_special_tokens=False)["input_ids"]
    prompt = torch.tensor(tokenizer("1+3=", add_special_tokens=False)["input_ids"])

    def reward(answer: str, length: int) -> dict:
        tail = tokenizer(f" The answer is \\boxed{{{answer}}}", add_special_tokens=False)["input_ids"]
        response = torch.tensor((filler * length)[: length - len(tail)] + tail)
        data = DataProto.from_dict(
            tensors={
                "prompts": prompt[None],
                "responses": response[None],
                "attention_mask": torch.ones(1, len(prompt) + length, dtype=torch.long),
            },
            non_tensors={
                "data_source": np.array(["math500"], dtype=object),
                "reward_model": np.array([{"ground_truth": "4"}], dtype=object),
                "extra_info": np.array([{"benchmark": "math500"}], dtype=object),
            },
        )
        return manager.loop.run_until_complete(manager.run_single(data))

    for answer, acc in (("4", 1.0), ("5", 0.0)):
        short = reward(answer, 3277)
        assert short["reward_score"] == pytest.approx(acc) and short["reward_extra_info"]["acc"] == acc
        long = reward(answer, 4000)
        assert long["reward_score"] == pytest.approx(acc - (4000 - 3277) / 819)
        assert long["reward_extra_info"]["acc"] == acc  # the ingress reads acc, not the shaped score


# ============================================================================ refusals (no Python started)


@pytest.mark.parametrize(
    ("script", "env", "message"),
    [
        ("headroom_drift_math.sh", {"STRATEGY": "elite"}, "STRATEGY must be one of"),
        ("elite_replay_qwen4b.sh", {"STAGES": "search,tain"}, "unknown stage 'tain'"),
        ("headroom_drift_math.sh", {"PARAMETER_SYNC_STEP": "3"}, "must split evenly over PARAMETER_SYNC_STEP (3)"),
        ("headroom_drift_math.sh", {"TRAIN_PROMPTS": "30"}, "must be a multiple of PPO_MINI_PROMPTS"),
        ("elite_replay_qwen4b.sh", {"TRAIN_GPUS": "3"}, "exceed GPUS_PER_NODE (4)"),
        ("elite_replay_qwen4b.sh", {"ROLLOUT_TP": "4"}, "must be a multiple of ROLLOUT_TP"),
        ("headroom_drift_math.sh", {"TAU": "moderate"}, "TAU must be a number"),
        ("headroom_drift_math.sh", {"SCAN_ORDER": "newest"}, "SCAN_ORDER must be one of"),
        (
            "elite_replay_qwen4b.sh",
            {"MAX_RESPONSE_LENGTH": "4096", "PPO_MAX_TOKEN_LEN": "8192"},
            "PPO_MAX_TOKEN_LEN (8192) must hold one full sequence",
        ),
    ],
)
def test_recipes_refuse_bad_settings(inputs, script, env, message) -> None:
    run = run_recipe(script, {**inputs, "DRY_RUN": "1", **env})
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert DRY_RUN_OK not in run.stdout


def test_missing_inputs_stop_the_recipe_before_training(inputs, tmp_path) -> None:
    run = run_recipe("headroom_drift_math.sh", {**inputs, "DATA_DIR": str(tmp_path / "nowhere")})
    assert run.returncode == 2 and f"math training set (TRAIN_FILES) not found: {tmp_path}/nowhere" in run.stderr
    assert "] train:" not in run.stderr

    # EliteReplay training needs the archive the search stage writes
    run = run_recipe("elite_replay_qwen4b.sh", {**inputs, "STAGES": "train", "OUTPUT_DIR": str(tmp_path)})
    assert run.returncode == 2 and "frozen archive (ARCHIVE; run the search stage first) not found" in run.stderr
    assert "] train:" not in run.stderr

    # evaluation without a training run (and no EVAL_MODEL) has no checkpoint to read
    run = run_recipe("baselines/grpo_sql.sh", {**inputs, "STAGES": "eval", "OUTPUT_DIR": str(tmp_path)})
    assert run.returncode == 2 and "no checkpoint under" in run.stderr and "set EVAL_MODEL" in run.stderr


def test_relative_paths_are_made_absolute(tmp_path) -> None:
    """Every stage (and every Ray worker) reads the same files whatever its working directory."""
    (tmp_path / "data").mkdir()
    (tmp_path / "ckpt" / "hf").mkdir(parents=True)  # a local folder; a missing org/name is a hub id
    env = {"DRY_RUN": "1", "STAGES": "eval", "DATA_DIR": "data", "OUTPUT_DIR": "out", "EVAL_MODEL": "ckpt/hf"}
    full_env = {key: value for key, value in os.environ.items() if key not in ("TINY", "DRY_RUN")}
    result = subprocess.run(
        ["bash", str(RECIPES / "headroom_drift_math.sh")],
        cwd=tmp_path,
        env={**full_env, **env},
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard: the recipe takes seconds
    )
    assert result.returncode == 0, result.stderr
    evaluation = RecipeRun("headroom_drift_math.sh", 0, result.stdout, result.stderr).command("eval")
    assert flag(evaluation, "--data").split(",")[0] == f"{tmp_path}/data/math_math500.parquet"
    assert flag(evaluation, "--model") == f"{tmp_path}/ckpt/hf"
    assert flag(evaluation, "--out") == f"{tmp_path}/out/headroom_drift_math/hd_b256_r128/eval"


# ============================================================================ TINY=1 end to end (CPU)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _tiny_env(tmp_path: Path) -> dict[str, str]:
    return {"TINY": "1", "OUTPUT_DIR": str(tmp_path / "out"), "PYTHONUNBUFFERED": "1"}


def _check_eval(eval_dir: Path, benchmark: str) -> dict:
    results = json.loads((eval_dir / "results.json").read_text())
    assert results["config"]["n"] == 4 and results["config"]["limit"] == 2
    bench = results["benchmarks"][benchmark]
    assert bench["num_questions"] == 2 and bench["n"] == 4
    assert {"pass@1", "pass@4", "mean@n", "best@n"} <= set(bench["metrics"])
    assert len((eval_dir / "samples.jsonl").read_text().splitlines()) == 2 * 4
    return results


# The recipe's TINY=1 path is the full recipe scaled down: verl's separate_async trainer, one training
# and one rollout worker, the CPU weight-sync engine, 2 update rounds per global step.
TINY_SPLIT = (
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.hybrid_engine=False",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo",
    "trainer.v1.separate_async.parameter_sync_step=2",
)


def test_tiny_recipe_dry_run_prints_the_split_placement(tmp_path) -> None:
    run = run_recipe("headroom_drift_math.sh", {**_tiny_env(tmp_path), "DRY_RUN": "1", "STAGES": "train"}, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    config = run.config
    assert config["trainer"]["v1"]["trainer_mode"] == "separate_async"
    assert config["trainer"]["v1"]["separate_async"]["parameter_sync_step"] == 2
    assert config["actor_rollout_ref"]["rollout"]["checkpoint_engine"]["backend"] == "cpu_gloo"
    assert config["actor_rollout_ref"]["rollout"]["name"] == "vllm" and config["trainer"]["device"] == "cpu"
    assert (
        config["actor_rollout_ref"]["rollout"]["nnodes"],
        config["actor_rollout_ref"]["rollout"]["n_gpus_per_node"],
    ) == (1, 1)


def spawn_recipe(script: str, env: dict[str, str], *args: str, log_dir: Path) -> subprocess.Popen:
    """Start a recipe without waiting, leading a session of its own (bash, the driver, the Ray
    cluster), its output in ``log_dir``: a test can kill all of it."""
    full_env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("VERL_FILE_LOGGER_PATH", "TINY", "DRY_RUN", "RAY_ADDRESS", "PREFLIGHT")
    }
    full_env.update(env)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "stdout", "w") as out, open(log_dir / "stderr", "w") as err:
        return subprocess.Popen(
            ["bash", str(RECIPES / script), *args],
            cwd=REPO,
            env=full_env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )


@pytest.mark.e2e
def test_tiny_headroom_drift_recipe_runs_every_stage_through_a_crash(tmp_path) -> None:
    """The recipe's own path (separate_async, 2 rounds per global step), killed with SIGKILL at a random
    moment after a checkpoint and resumed by running it again on its run dir: the buffer the resumed
    run loaded is the one the checkpoint saved, no group is lost or trained twice, the event log and
    the metrics go on without a gap or a repeat, and over the whole run every replay count, token
    share and second is a total of its global step, checked against the update's own record of what
    it trained on (``split_checks``)."""
    from clean_run import check_clean_run
    from crash import kill_after_checkpoint
    from replay_audit import FRESH, read_audit
    from split_checks import check_group_replay_run

    from verl_replay.compare.collect import read_metrics
    from verl_replay.headroom_drift.buffer import HeadroomDriftBuffer
    from verl_replay.headroom_drift.events import read_events

    env = {
        **_tiny_env(tmp_path),
        "TOTAL_STEPS": "5",
        "TRAIN_PROMPTS": "4",
        "PPO_MINI_PROMPTS": "2",
        "K_REP": "2",
        "TAU": "10",
        "SCAN_CHUNK_GROUPS": "16",
        "SAVE_FREQ": "2",
    }
    audit, dump = tmp_path / "audit", tmp_path / "rollouts"
    # extra arguments reach the training stage as Hydra overrides: what the update trained on, and
    # verl's own rollout dump, for the checks against independent sources below
    overrides = (
        f"replay.audit_dir={audit}",
        f"trainer.rollout_data_dir={dump}",
        "algorithm.rollout_correction.rollout_is=token",
    )
    run_dir = tmp_path / "out" / "headroom_drift_math" / "hd_b16_r8"
    checkpoints = run_dir / "checkpoints"
    started = time.monotonic()
    killed_after = kill_after_checkpoint(
        spawn_recipe("headroom_drift_math.sh", env, *overrides, log_dir=tmp_path / "killed"),
        checkpoints / "latest_checkpointed_iteration.txt",
        timeout_s=1200,
    )
    killed_at = time.monotonic()
    saved = HeadroomDriftBuffer.from_file(checkpoints / f"global_step_{killed_after}" / "replay" / "group_buffer.pt")
    killed_audit = [row for row in read_audit(audit) if row.global_step <= killed_after]  # later steps run again
    audit.rename(tmp_path / "audit_killed")

    run = run_recipe("headroom_drift_math.sh", env, *overrides, timeout=1200)  # the same command: its run dir
    print(
        f"killed run {killed_at - started:.0f} s, resumed run (steps {killed_after + 1}-5, eval) "
        f"{time.monotonic() - killed_at:.0f} s"
    )
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    assert "verl_replay: " in run.stdout and "resuming" in run.stdout, run.stdout[-2000:]
    train = run.command("train")
    assert all(override in train for override in TINY_SPLIT), train

    # metrics: the killed run's segment (kept aside) holds every step up to its checkpoint, the resumed
    # run every step after it, once
    killed = [step for step, _ in read_metrics(run_dir / "metrics.1.jsonl")]
    resumed = _metrics(run_dir)
    assert [m["step"] for m in resumed] == list(range(killed_after + 1, 6))
    assert [step for step in killed if step <= killed_after] == list(range(1, killed_after + 1))
    merged = {step: data for step, data in read_metrics(run_dir / "metrics.1.jsonl") if step <= killed_after}
    merged.update((m["step"], m["data"]) for m in resumed)
    metrics = [merged[step] for step in sorted(merged)]

    # the buffer right after the resumed load is the one the checkpoint saved: the resume record's
    # fingerprint is the killed run's own at its save and the saved file's; its groups are those the
    # event log, counted record by record, says were buffered then
    events = read_events(run_dir / "replay_events.jsonl")
    checkpoint = [e for e in events if e["event"] == "checkpoint" and e["step"] == killed_after]
    resume = [e for e in events if e["event"] == "resume"]
    assert len(checkpoint) == 1 and len(resume) == 1 and resume[0]["step"] == killed_after
    assert resume[0]["buffer_fingerprint"] == checkpoint[0]["buffer_fingerprint"] == saved.fingerprint()
    buffered = {e["group_id"] for e in events if e["event"] == "ingress" and e["step"] <= killed_after}
    buffered -= {e["group_id"] for e in events if e["event"] == "evict" and e["step"] <= killed_after}
    assert set(saved.groups_by_id) == buffered and resume[0]["buffer_size"] == len(buffered)
    # no group lost or duplicated: ids handed out once, in order; the last checkpoint holds exactly the
    # groups admitted and not evicted; no fresh group of one step trained again in another
    admitted = [e["group_id"] for e in events if e["event"] == "ingress"]
    assert admitted == list(range(len(admitted)))
    evicted = {e["group_id"] for e in events if e["event"] == "evict"}
    final = HeadroomDriftBuffer.from_file(checkpoints / "global_step_5" / "replay" / "group_buffer.pt")
    assert set(final.groups_by_id) == set(admitted) - evicted and final.next_group_id == len(admitted)
    rows = killed_audit + read_audit(audit)
    fresh_prompts = {(row.global_step, row.tokens[0]) for row in rows if row.source == FRESH}
    assert len({prompt for _, prompt in fresh_prompts}) == len(fresh_prompts) == 5 * 4

    check_group_replay_run(run_dir, metrics, rows, dump, k_rep=2, steps=5)
    check_clean_run(run_dir)  # the resumed run: no hidden error, no lost rollout
    accepted = [m["replay/accepted"] for m in metrics]
    assert accepted[0] == 0 and sum(accepted) > 0  # TAU=10 accepts every scanned group
    hf_model = checkpoints / "global_step_5" / "actor" / "huggingface"
    assert (hf_model / "config.json").is_file()
    evaluation = run.command("eval")
    assert flag(evaluation, "--model") == str(hf_model) and flag(evaluation, "--backend") == "hf"
    _check_eval(run_dir / "eval", "tiny_math")


@pytest.mark.e2e
def test_tiny_elite_recipe_runs_every_stage(tmp_path) -> None:
    from clean_run import check_clean_run

    run = run_recipe("elite_replay_qwen4b.sh", _tiny_env(tmp_path), timeout=1200)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    project = tmp_path / "out" / "elite_replay_sql"
    archive = project / "archive" / "elite_archive.parquet"
    manifest = json.loads(Path(f"{archive}.manifest.json").read_text())
    assert archive.is_file() and manifest["num_entries"] >= 1 and manifest["domain"] == "sql"
    assert all(override in run.command("train") for override in TINY_SPLIT)
    run_dir = project / "elite_q4x4"
    metrics = _metrics(run_dir)
    check_clean_run(run_dir)  # no hidden error, no lost rollout
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:  # every global step carried ELITE_BATCH_SIZE=4 archive entries into the NLL term
        assert m["data"]["replay/elite/examples"] == 4 and m["data"]["replay/elite/archive_entries"] >= 1
    hf_model = run_dir / "checkpoints" / "global_step_3" / "actor" / "huggingface"
    assert (hf_model / "config.json").is_file()
    _check_eval(run_dir / "eval", "tiny_sql")


# ============================================================================ the GPU stack


def test_dry_run_shows_the_gpu_hosts_attention_whatever_is_installed(dry) -> None:
    """ATTN_IMPL=auto is flash_attention_2 with packing even here (no silent sdpa): the preflight on
    the GPU host checks flash-attn."""
    auto = dry["hd"].config["actor_rollout_ref"]
    assert auto["model"]["override_config"]["attn_implementation"] == "flash_attention_2"
    assert auto["model"]["use_remove_padding"] is True
    # packed: the entropy runs in chunks, so the log-prob micro-batch takes max(one sequence, 32K) tokens
    assert auto["rollout"]["log_prob_max_token_len_per_gpu"] == 32768
    elite = dry["elite"].config["actor_rollout_ref"]
    assert elite["actor"]["ppo_max_token_len_per_gpu"] == 20480
    assert elite["rollout"]["log_prob_max_token_len_per_gpu"] == 32768
    flash = dry["hd_flash"].config["actor_rollout_ref"]
    assert flash["model"]["override_config"]["attn_implementation"] == "flash_attention_2"
    assert flash["model"]["use_remove_padding"] is True
    # ACTOR_OFFLOAD offloads the optimizer only: separate_async's pi_old snapshot needs GPU parameters
    assert flash["actor"]["fsdp_config"]["optimizer_offload"] is True
    assert flash["actor"]["fsdp_config"]["param_offload"] is False


def test_gpu_profile_memory_settings_reach_the_recipes(dry) -> None:
    arr = dry["elite"].config["actor_rollout_ref"]
    assert arr["actor"]["entropy_from_logits_with_chunking"] is True
    assert arr["actor"]["fsdp_config"]["entropy_checkpointing"] is True
    assert arr["model"]["enable_gradient_checkpointing"] is True
    assert arr["rollout"]["enable_prefix_caching"] is False


def _readme_table(name: str) -> str:
    text = (RECIPES / "README.md").read_text(encoding="utf-8")
    start, end = f"<!-- memory-table:{name}:start -->", f"<!-- memory-table:{name}:end -->"
    assert start in text and end in text, f"recipes/README.md has no {start} block"
    return text.split(start, 1)[1].split(end, 1)[0].strip()


@pytest.mark.parametrize(
    ("case", "block"), [("elite_table", "elite"), ("hd_table", "math"), ("elite_sdpa_table", "elite-sdpa")]
)
def test_readme_memory_tables_are_the_recipes_budgets(dry, case, block) -> None:
    """recipes/README.md shows what `DRY_RUN=1 PREFLIGHT=table bash recipes/...` prints, verbatim."""
    printed = dry[case].stdout.strip()
    assert printed.startswith("Model shape from the Qwen3.5-4B shape")
    assert DRY_RUN_OK not in dry[case].stdout  # PREFLIGHT=table stops before the training command
    assert _readme_table(block) == printed


def test_recipes_refuse_parameter_offload_with_several_rounds(inputs) -> None:
    run = run_recipe("headroom_drift_math.sh", {**inputs, "DRY_RUN": "1", "ACTOR_PARAM_OFFLOAD": "True"})
    assert run.returncode == 2 and "save_model_to_cpu" in run.stderr and "ACTOR_OFFLOAD=True" in run.stderr
    run = run_recipe("headroom_drift_math.sh", {**inputs, "DRY_RUN": "1", "ATTN_IMPL": "xformers"})
    assert run.returncode == 2 and "ATTN_IMPL must be one of" in run.stderr


def test_preflight_runs_before_the_first_stage(inputs, tmp_path) -> None:
    """Without DRY_RUN the recipe checks the stack before any stage; this CPU venv fails it."""
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this interpreter has the GPU stack")
    run = run_recipe(
        "headroom_drift_math.sh", {**inputs, "OUTPUT_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}, timeout=300
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert "[preflight] FAIL  torch" in run.stdout and "preflight failed" in run.stderr
    assert "] train:" not in run.stderr  # the training command never started
    skipped = run_recipe(
        "headroom_drift_math.sh",
        {**inputs, "DRY_RUN": "1", "PREFLIGHT": "0", "STAGES": "eval", "EVAL_MODEL": inputs["MODEL_PATH"]},
    )
    assert skipped.returncode == 0 and "[preflight]" not in skipped.stdout


def test_preflight_only_reports_every_missing_input_and_still_checks_the_stack(tmp_path) -> None:
    """On a new host PREFLIGHT=only lists every missing input (data sets of all stages, the model)
    with where the data sets come from, after the stack checks it could still run."""
    data = tmp_path / "nodata"
    run = run_recipe(
        "headroom_drift_math.sh",
        {
            "PREFLIGHT": "only",
            "DATA_DIR": str(data),
            "MODEL_PATH": str(tmp_path / "nomodel"),
            "OUTPUT_DIR": str(tmp_path / "out"),
            "OMP_NUM_THREADS": "1",
        },
        timeout=300,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "] error: " in line]
    assert errors[:-1] == [
        f"[headroom_drift_math] error: evaluation set (EVAL_FILES) not found: {data}/math_{name}.parquet"
        for name in ("math500", "aime24", "aime25", "amc23", "minerva", "olympiadbench")
    ] + [
        f"[headroom_drift_math] error: math training set (TRAIN_FILES) not found: {data}/math_train.parquet",
        f"[headroom_drift_math] error: validation set (VAL_FILES) not found: {data}/math_math500.parquet",
        f"[headroom_drift_math] error: model directory not found: {tmp_path}/nomodel (set MODEL_PATH)",
    ]
    assert errors[-1].startswith("[headroom_drift_math] error: 9 input(s) missing and the preflight failed")
    assert f"python -m verl_replay.data prepare math --input DOWNLOAD --output {data}" in run.stderr
    assert "[preflight] FAIL  model" in run.stdout and "[preflight] FAIL  gpus" in run.stdout  # the stack checks ran
    # the attention choice is the recipe's line, not a preflight result; the settings name VAL_FILES
    assert "[preflight] attention" not in run.stdout + run.stderr
    assert "[headroom_drift_math] attention: flash_attention_2" in run.stderr
    assert f" VAL_FILES={data}/math_math500.parquet " in run.stderr
    assert "] train:" not in run.stderr
