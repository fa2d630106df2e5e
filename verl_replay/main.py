"""Entry point: ``python -m verl_replay.main [hydra overrides]``.

The config (``verl_replay/config/replay_trainer.yaml``) extends verl's ``ppo_trainer`` and adds
``replay:``. With no overrides it runs the embedded default, a tiny GRPO run on CPU. The
replay section is validated here, once, before Ray starts; a bad value stops the run with a
message naming the key.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from verl_replay.config import ReplayConfig, ReplayConfigError

TINY_ASSET_RESOLVER = "tiny_asset"
REQUIRED_KEYS = ("data.train_files", "data.val_files", "actor_rollout_ref.model.path")


def _tiny_asset(name: str) -> str:
    """``${tiny_asset:model}`` etc.: path of a tiny local asset, built and cached on first use."""
    from verl_replay.data.tiny_assets import build_tiny_assets

    assets = build_tiny_assets()
    paths = {
        "model": assets.model_dir,
        "math_model": assets.model_dir,
        "sql_model": assets.sql_model_dir,
        "tokenizer": assets.model_dir,
        "math_train": assets.math_train,
        "math_val": assets.math_val,
        "sql_train": assets.sql_train,
        "sql_val": assets.sql_val,
        "sql_db_root": assets.sql_db_root,
    }
    if name not in paths:
        raise KeyError(f"unknown tiny asset {name!r}; known: {', '.join(sorted(paths))}")
    return str(paths[name])


def _sum(*values: int) -> int:
    """``${vr_sum:a,b}``: integer sum (OmegaConf has no arithmetic)."""
    return sum(int(value) for value in values)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver(TINY_ASSET_RESOLVER):
        OmegaConf.register_new_resolver(TINY_ASSET_RESOLVER, _tiny_asset)
    if not OmegaConf.has_resolver("vr_sum"):
        OmegaConf.register_new_resolver("vr_sum", _sum)


def prepare_platform(config: DictConfig) -> None:
    """Select verl_replay's cpu platform in this process when the run asks for ``trainer.device=cpu``."""
    if config.trainer.device != "cpu":
        return
    os.environ["VERL_PLATFORM"] = "cpu"
    from verl.plugin.platform import get_platform, set_platform

    from verl_replay.integrations.verl.cpu_support import install_cpu_support
    from verl_replay.integrations.verl.platform_cpu import PlatformCPU

    install_cpu_support()
    if get_platform().device_name != "cpu":  # a verl import resolved the platform before us
        set_platform(PlatformCPU())


def keep_previous_metrics(metrics_path: Path) -> Optional[Path]:
    """verl's file logger truncates its file; a resumed run keeps the earlier segment aside."""
    if not metrics_path.exists() or metrics_path.stat().st_size == 0:
        return None
    index = 1
    while (kept := metrics_path.with_name(f"{metrics_path.stem}.{index}{metrics_path.suffix}")).exists():
        index += 1
    metrics_path.rename(kept)
    return kept


def prepare_run_dir(config: DictConfig) -> Path:
    run_dir = Path(config.run_dir).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    if "VERL_FILE_LOGGER_PATH" not in os.environ:
        kept = keep_previous_metrics(run_dir / "metrics.jsonl")
        if kept is not None:
            print(f"verl_replay: earlier metrics of this run dir kept in {kept}", flush=True)
    # verl's file logger reads this in the TaskRunner process (Ray inherits the driver's env)
    os.environ.setdefault("VERL_FILE_LOGGER_PATH", str(run_dir / "metrics.jsonl"))
    env_vars = OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars")
    if env_vars is not None:
        with open_dict(env_vars):
            env_vars["VERL_FILE_LOGGER_PATH"] = os.environ["VERL_FILE_LOGGER_PATH"]
    return run_dir


def check_trainer_mode(config: DictConfig) -> None:
    """What verl's v1 trainers assert in their constructors, checked before any GPU is touched."""
    from verl_replay.integrations.verl.trainer import replay_trainer_class

    mode = config.trainer.v1.trainer_mode
    replay_trainer_class(mode)
    if mode != "separate_async":
        return
    sync_steps = config.trainer.v1.separate_async.parameter_sync_step
    mini = config.actor_rollout_ref.actor.ppo_mini_batch_size
    if config.data.train_batch_size != sync_steps * mini:
        raise ValueError(
            f"separate_async needs data.train_batch_size == trainer.v1.separate_async.parameter_sync_step * "
            f"actor_rollout_ref.actor.ppo_mini_batch_size, got {config.data.train_batch_size} != {sync_steps} * {mini}"
        )
    rollout = config.actor_rollout_ref.rollout
    if rollout.nnodes <= 0 or rollout.n_gpus_per_node <= 0:
        raise ValueError("separate_async needs actor_rollout_ref.rollout.nnodes and n_gpus_per_node > 0")
    if rollout.checkpoint_engine.backend == "naive":
        raise ValueError("separate_async needs actor_rollout_ref.rollout.checkpoint_engine.backend=nccl (or nixl, ...)")


def check_replay_settings(config: DictConfig, replay_config: ReplayConfig) -> None:
    """verl settings that would mix replayed rows into the fresh rows' numbers (SPEC 1.7)."""
    from verl_replay.integrations.verl.guards import ReplayIncompatibleSetting, check_replay_compatible

    try:
        check_replay_compatible(config, replay_config.strategy)
    except ReplayIncompatibleSetting as error:
        raise SystemExit(f"verl_replay: {error}") from None


def preflight_elite_archive(config: DictConfig, replay_config: ReplayConfig) -> None:
    from transformers import AutoTokenizer

    from verl_replay.integrations.verl.elite_replay import preflight_archive

    train_files = config.data.train_files
    train_files = [train_files] if isinstance(train_files, str) else list(train_files)
    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    try:
        preflight_archive(replay_config, tokenizer=tokenizer, train_files=train_files)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"verl_replay: replay.elite.archive cannot be used for this run: {error}") from None


def run(config: DictConfig) -> None:
    try:
        replay_config = ReplayConfig.from_mapping(config.get("replay"))
    except ReplayConfigError as error:
        raise SystemExit(f"verl_replay: invalid config: {error}") from None
    # Absolute, so checkpoints and logs land in the same place whatever a Ray worker's cwd is.
    config.run_dir = str(Path(config.run_dir).absolute())
    OmegaConf.resolve(config)  # tiny assets are built here, in the driver, once
    missing = [key for key in REQUIRED_KEYS if OmegaConf.select(config, key) in (None, "", [])]
    if missing:
        raise SystemExit(f"verl_replay: these settings are required and have no value: {', '.join(missing)}")

    check_replay_settings(config, replay_config)

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    if config.get("dry_run", False):
        check_trainer_mode(config)
        validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
        print(OmegaConf.to_yaml(config), flush=True)
        print(f"verl_replay: dry run OK (strategy={replay_config.strategy}, trainer_mode={config.trainer.v1.trainer_mode})")
        return

    prepare_platform(config)
    if replay_config.uses_elite:
        preflight_elite_archive(config, replay_config)
    run_dir = prepare_run_dir(config)

    from verl.trainer.main_ppo import run_ppo
    from verl.utils.device import auto_set_device

    from verl_replay.integrations.verl.task_runner import ReplayTaskRunner

    auto_set_device(config)
    check_trainer_mode(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    print(f"verl_replay: strategy={replay_config.strategy} run_dir={run_dir}", flush=True)
    run_ppo(config, task_runner_class=ReplayTaskRunner)
    print(f"verl_replay: done. metrics: {os.environ['VERL_FILE_LOGGER_PATH']}  run dir: {run_dir}", flush=True)


@hydra.main(config_path="config", config_name="replay_trainer", version_base=None)
def main(config: DictConfig) -> None:
    run(config)


if __name__ == "__main__":
    register_resolvers()
    sys.exit(main())
