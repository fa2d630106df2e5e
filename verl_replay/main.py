"""Entry point: ``python -m verl_replay.main [hydra overrides]``.

The config (``verl_replay/config/replay_trainer.yaml``) extends verl's ``ppo_trainer`` and adds
``replay:``. With no overrides it runs the embedded default, a tiny GRPO run on CPU.

A run, in order:

1. unknown ``replay.*`` keys on the command line are refused with a did-you-mean (before Hydra);
2. in the driver, before Ray starts: the replay section, the required keys, the data files,
   their SQLite databases, the model, the tokenizer, the EliteReplay archive and verl's own
   config checks; a bad one stops the run with one line naming the key and the path;
3. the run gets its folder (``run_dir``, see :mod:`verl_replay.runs`), its resolved
   ``config.yaml``, and -- unless ``verbose=true`` -- everything verl, Ray and the workers print
   goes to ``<run_dir>/verl.log`` while the console shows one line per step;
4. verl's GRPO loop runs with :class:`~verl_replay.integrations.verl.task_runner.ReplayTaskRunner`.

Exit codes: 0 done; 1 the training failed (reason on the last line, details in ``verl.log``);
2 a setting or an input is wrong (nothing was started); 130 interrupted.
"""

from __future__ import annotations

import atexit
import copy
import difflib
import functools
import importlib.util
import io
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from verl_replay.config import ReplayConfig, ReplayConfigError, check_override_keys
from verl_replay.console import Console, step_line
from verl_replay.input_checks import (
    PreflightError,
    check_archive_file,
    check_data_files,
    check_model_dir,
    check_sql_databases,
    check_tokenizer,
)
from verl_replay.resume import (
    ResumeError,
    adopt_saved_config,
    conflicting_overrides,
    describe_conflicts,
    load_saved_config,
)
from verl_replay.runs import (
    CONFIG_FILE,
    LOG_FILE,
    METRICS_FILE,
    RunDir,
    RunDirBusy,
    holds_content,
    lock_run_dir,
    open_run_dir,
    run_dir_name,
)

TINY_ASSET_RESOLVER = "tiny_asset"
REQUIRED_KEYS = ("data.train_files", "data.val_files", "actor_rollout_ref.model.path")
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
TINY_BUILD_NOTICE_S = 2.0
CONFIG_DIR = Path(__file__).resolve().parent / "config"


class StartupError(Exception):
    """A setting or an input that stops the run before anything starts; one line."""


_CONSOLE: Optional[Console] = None
_COMPOSED = False  # Hydra composed the config and called main()
_REAL_STDERR: Optional[Any] = None  # sys.stderr while Hydra composes (its errors are held until then)
_STARTED: Optional[float] = None  # when the command's own work started (cli): the done line's time


def console() -> Console:
    global _CONSOLE
    if _CONSOLE is None:
        _CONSOLE = Console()
    return _CONSOLE


# ---------------------------------------------------------------------------- tiny assets


@functools.lru_cache(maxsize=1)
def _tiny_assets() -> Any:
    from verl_replay.data.tiny_assets import build_tiny_assets

    # A cached build is checked in well under a second; say something only when it builds.
    notice = threading.Timer(
        TINY_BUILD_NOTICE_S,
        lambda: console().line(
            "verl_replay: building the tiny assets (tokenizer, models, data; once per machine, a few minutes) ..."
        ),
    )
    notice.daemon = True
    notice.start()
    try:
        return build_tiny_assets()
    finally:
        notice.cancel()


@functools.lru_cache(maxsize=2)
def _tiny_task(task: str) -> Any:
    from verl_replay.data.tiny_tasks import build_tiny_task

    notice = threading.Timer(
        TINY_BUILD_NOTICE_S,
        lambda: console().line(f"verl_replay: building the tiny {task} task (data and model; once per machine) ..."),
    )
    notice.daemon = True
    notice.start()
    try:
        return build_tiny_task(task, _tiny_assets())
    finally:
        notice.cancel()


# ${tiny_asset:<task>_<part>} of the tiny tasks of verl_replay.data.tiny_tasks (built only when named)
_TINY_TASK_PARTS = {"train": "train", "val": "val", "model": "model_dir", "tools": "tool_config", "corpus": "corpus"}


def _tiny_asset(name: str) -> Optional[str]:
    """``${tiny_asset:model}`` etc.: path of a tiny local asset, built and cached on first use."""
    task, _, part = name.partition("_")
    if part == "tools" and task in ("math", "sql", "image", "arith", "shapes"):
        return None  # tasks without tools: no tool config (and nothing is built)
    if task in ("search", "image", "arith", "shapes") and part in _TINY_TASK_PARTS:
        value = getattr(_tiny_task(task), _TINY_TASK_PARTS[part])
        if value is None:
            raise KeyError(f"tiny asset {name!r}: the {task} task has no {part}")
        return str(value)
    assets = _tiny_assets()
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


# ---------------------------------------------------------------------------- verl set-up


# Ray starts its worker processes at niceness 15 (its ``worker_niceness``) unless this variable says
# otherwise. On CPU those workers do all of the run's work (training, rollout, rewards), so at 15
# any other busy process on the machine takes ~97% of a core from them.
RAY_WORKER_NICENESS_VAR = "RAY_worker_niceness"


def prepare_platform(config: DictConfig) -> None:
    """Select verl_replay's cpu platform in this process when the run asks for ``trainer.device=cpu``,
    and have the Ray cluster it starts run its workers at this process's priority (a value the
    user set is kept)."""
    if config.trainer.device != "cpu":
        return
    os.environ.setdefault(RAY_WORKER_NICENESS_VAR, "0")
    os.environ["VERL_PLATFORM"] = "cpu"
    from verl.plugin.platform import get_platform, set_platform

    from verl_replay.integrations.verl.cpu_support import install_cpu_support
    from verl_replay.integrations.verl.platform_cpu import PlatformCPU

    install_cpu_support()
    if get_platform().device_name != "cpu":  # a verl import resolved the platform before us
        set_platform(PlatformCPU())


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


def check_verl_config(config: DictConfig) -> None:
    """verl's own start-up checks (its ``validate_config``) plus the trainer-mode ones."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    try:
        check_trainer_mode(config)
        validate_config(
            config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
        )
    except (ValueError, AssertionError, KeyError, TypeError) as error:
        raise StartupError(f"verl refuses the config: {_first_line(error)}") from None


# the domain of a tiny task's answers, where the task is not named after it
_TINY_TASK_DOMAIN = {"shapes": "sql"}


def check_archive_task(config: DictConfig, archive: str) -> None:
    """A tiny run (``tiny_task``) with an archive of the other domain: the fix is the task, not a
    new archive. The archive's manifest records its domain (sql / math)."""
    import json

    from verl_replay.elite.archive_io import manifest_path

    task = OmegaConf.select(config, "tiny_task")
    try:
        domain = json.loads(manifest_path(archive).read_text(encoding="utf-8")).get("domain")
    except (OSError, ValueError):
        return  # the archive's own checks report an unreadable manifest
    if task and domain and domain != _TINY_TASK_DOMAIN.get(task, task):
        raise StartupError(
            f"replay.elite.archive: {archive} is a {domain} archive and this run trains tiny_task={task}; "
            f"add tiny_task={domain} (or give an archive built for the {task} task)"
        )


def preflight_elite_archive(config: DictConfig, replay_config: ReplayConfig, tokenizer: Any = None) -> None:
    from verl_replay.integrations.verl.elite_replay import preflight_archive

    check_archive_file("replay.elite.archive", replay_config.elite.archive)
    check_archive_task(config, replay_config.elite.archive)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    try:
        preflight_archive(replay_config, tokenizer=tokenizer, train_files=_as_list(config.data.train_files))
    except (ValueError, FileNotFoundError) as error:
        raise StartupError(f"replay.elite.archive cannot be used for this run: {_first_line(error)}") from None


# ---------------------------------------------------------------------------- start-up checks


def check_inputs(config: DictConfig, replay_config: ReplayConfig) -> None:
    """Data files, their databases, the model, its tokenizer and the archive, in the driver."""
    prompt_key = OmegaConf.select(config, "data.prompt_key", default="prompt")
    for key in ("data.train_files", "data.val_files"):
        files = check_data_files(key, OmegaConf.select(config, key), prompt_key=prompt_key)
        check_sql_databases(key, files)
    model = config.actor_rollout_ref.model
    check_model_dir("actor_rollout_ref.model.path", model.path)
    tokenizer_key = (
        "actor_rollout_ref.model.tokenizer_path" if model.get("tokenizer_path") else "actor_rollout_ref.model.path"
    )
    tokenizer = check_tokenizer(
        tokenizer_key,
        model.get("tokenizer_path") or model.path,
        trust_remote_code=bool(model.get("trust_remote_code", False)),
    )
    if replay_config.uses_elite:
        preflight_elite_archive(config, replay_config, tokenizer)


def check_required(config: DictConfig) -> None:
    missing = [key for key in REQUIRED_KEYS if OmegaConf.select(config, key) in (None, "", [])]
    if missing:
        raise StartupError(f"these settings are required and have no value: {', '.join(missing)}")


def explicit_run_dir(config: DictConfig) -> Optional[Path]:
    return Path(str(config.run_dir)).expanduser().absolute() if config.get("run_dir") else None


def lock_existing_run_dir(config: DictConfig) -> None:
    """An existing ``run_dir`` is locked first: a second run on it is refused in seconds, before
    it builds, checks or writes anything (a new folder is locked as it is created)."""
    path = explicit_run_dir(config)
    if path is None or not path.is_dir():
        return
    try:
        lock_run_dir(path)
    except RunDirBusy as error:
        raise StartupError(str(error)) from None
    except OSError as error:
        raise StartupError(f"run_dir: cannot lock {path} ({error.strerror}); choose a writable run_dir") from None


def _unwritable(path: Path) -> Optional[str]:
    """Why no run folder can be made at ``path`` (None: it can). Probes with a folder it removes."""
    existing = path
    try:
        if path.exists() and not path.is_dir():
            return "is a file, not a folder"
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            return f"lies under {existing}, which is a file"
        os.rmdir(tempfile.mkdtemp(prefix=".verl_replay-probe-", dir=existing))
    except OSError as error:
        return f"cannot be written ({existing}: {error.strerror})"
    return None


def check_output_location(config: DictConfig) -> None:
    """``run_dir`` or ``output_root`` must be a folder this process can write: checked first, before
    the other checks and Ray (a dry run skips it: its paths may name another machine)."""
    if config.get("dry_run", False):
        return
    explicit = explicit_run_dir(config)
    if explicit is not None:
        key, path = "run_dir", explicit
    else:
        key, path = "output_root", Path(str(config.output_root)).expanduser().absolute()
    problem = _unwritable(path)
    if problem:
        raise StartupError(f"{key}: {path} {problem}; set {key}= to a writable folder")


def check_resume(config: DictConfig, probe: DictConfig, replay_config: ReplayConfig) -> None:
    """What the trainer checks when it loads the checkpoint of a resumed run, checked here, before
    Ray starts and before anything in the run dir changes: every file of the replay state against its
    recorded sha256, the replay settings that decide what is replayed, the trainer mode and the
    replay state's presence."""
    from verl_replay.integrations.verl.replay_state import (
        STATE_DIR,
        ReplayStateError,
        changed_settings,
        decision_settings,
    )

    run_dir = explicit_run_dir(config)
    if (
        run_dir is None
        or not holds_content(run_dir)
        or not (replay_config.uses_group_buffer or replay_config.uses_elite)
    ):
        return
    trainer = probe.trainer
    if trainer.resume_mode == "disable":
        return
    if trainer.resume_mode == "resume_path":
        checkpoint = Path(str(trainer.resume_from_path))
    else:
        tracker = Path(str(trainer.default_local_dir)) / "latest_checkpointed_iteration.txt"
        if not tracker.is_file():
            return  # nothing to resume from: the run starts at step 1 in the same folder
        checkpoint = Path(str(trainer.default_local_dir)) / f"global_step_{int(tracker.read_text().strip())}"
    mode = str(probe.trainer.v1.trainer_mode)
    anchor = ("old_log_probs" if mode == "sync" else "rollout_log_probs") if replay_config.uses_group_buffer else None
    new_run = "or start a new run (another run_dir, or none for a new folder)"
    check_checkpoint_intact(run_dir, checkpoint)
    try:
        changed = changed_settings(
            checkpoint / STATE_DIR,
            identity={"trainer_mode": mode, "anchor_field": anchor},
            settings=decision_settings(replay_config),
        )
    except ReplayStateError as error:
        raise StartupError(f"run_dir {run_dir} cannot be resumed: {error}; {new_run}") from None
    if changed is None:
        if not replay_config.allow_missing_state:
            raise StartupError(
                f"run_dir {run_dir} resumes from {checkpoint}, which holds no replay state (buffer, sampler): "
                f"replay would restart empty; set replay.allow_missing_state=true to accept that, {new_run}"
            )
        return
    if changed:
        was = ", ".join(f"{key}={saved} (now {now})" for key, saved, now in changed)
        keep = " ".join(f"{key}={saved}" for key, saved, _ in changed)
        raise StartupError(
            f"run_dir {run_dir} resumes a run saved with {was}: these decide what is replayed, so a resumed run "
            f"keeps them; resume with {keep}, {new_run}"
        )


def check_checkpoint_intact(run_dir: Path, checkpoint: Path) -> None:
    """The checkpoint a resume starts from exists and every file of its replay state matches its
    recorded sha256; a damaged one is refused naming the file and the newest intact checkpoint."""
    from verl_replay.integrations.verl.replay_state import (
        STATE_DIR,
        ReplayStateError,
        newest_intact_checkpoint,
        verify_state,
    )

    try:
        if not checkpoint.is_dir():
            raise ReplayStateError(f"{checkpoint} does not exist")
        verify_state(checkpoint / STATE_DIR)
        return
    except ReplayStateError as error:
        problem = str(error)
    step = checkpoint.name.rpartition("_")[2]
    intact = newest_intact_checkpoint(checkpoint.parent, STATE_DIR, int(step) if step.isdigit() else 1 << 62)
    if intact is None:
        advice = "no earlier checkpoint of this run is intact; start a new run (another run_dir, or none)"
    else:
        advice = (
            f"the newest intact checkpoint is {intact}: resume from it with run_dir={run_dir} "
            f"trainer.resume_mode=resume_path trainer.resume_from_path={intact}"
        )
    raise StartupError(f"run_dir {run_dir} cannot be resumed from {checkpoint.name}: {problem}; {advice}")


def planned_run_dir(config: DictConfig, now: datetime) -> Path:
    """The folder this run will use; a new one is only created after every check passed."""
    if config.get("run_dir"):
        return Path(str(config.run_dir)).expanduser().absolute()
    name = run_dir_name(str(config.trainer.experiment_name), now)
    return (Path(str(config.output_root)) / str(config.trainer.project_name) / name).absolute()


def check_replay_settings(config: DictConfig, replay_config: ReplayConfig) -> None:
    """verl settings that would mix replayed rows into the fresh rows' numbers."""
    from verl_replay.integrations.verl.guards import ReplayIncompatibleSetting, check_replay_compatible

    try:
        check_replay_compatible(config, replay_config.strategy)
    except ReplayIncompatibleSetting as error:
        raise StartupError(str(error)) from None


def check_exact_eval(config: DictConfig) -> None:
    """``exact_eval`` is auto / true / false; true needs plain sampled validation and at least one
    validation row scored by exact match."""
    from verl_replay.eval.sampling import EXACT_EVAL_MODES, sampling_is_plain

    mode = str(config.get("exact_eval", "auto")).lower()
    if mode not in EXACT_EVAL_MODES:
        raise StartupError(f"exact_eval={config.get('exact_eval')} is not one of {', '.join(EXACT_EVAL_MODES)}")
    if mode != "true":
        return
    why = sampling_is_plain(config.actor_rollout_ref.rollout.val_kwargs)
    if why is not None:
        raise StartupError(
            f"exact_eval=true needs validation that samples at its temperature, but {why}: "
            "set exact_eval=auto (off in this case) or sample plainly"
        )


def check_sampled_val(config: DictConfig) -> None:
    """``sampled_val`` is every / ends; ends without an exact metric (exact_eval=false) would leave
    the evaluations between the ends empty."""
    from verl_replay.eval.sampling import SAMPLED_VAL_MODES

    mode = str(config.get("sampled_val", "every")).lower()
    if mode not in SAMPLED_VAL_MODES:
        raise StartupError(f"sampled_val={config.get('sampled_val')} is not one of {', '.join(SAMPLED_VAL_MODES)}")
    if mode == "ends" and str(config.get("exact_eval", "auto")).lower() == "false":
        raise StartupError(
            "sampled_val=ends measures only the exact metric between the first and the last validation, "
            "but exact_eval=false turns it off: set sampled_val=every or exact_eval=auto"
        )


def check_tiny_task(config: DictConfig) -> None:
    """``tiny_task`` (platform=cpu_tiny) names one of the tiny tasks; the config picks its files by it."""
    task = config.get("tiny_task")
    lengths = config.get("tiny_response_length")
    if task is None or not isinstance(lengths, DictConfig) or task in lengths:
        return
    raise StartupError(f"tiny_task={task} is not a tiny task; use one of: {', '.join(str(k) for k in lengths)}")


def startup_checks(config: DictConfig, now: datetime) -> tuple[ReplayConfig, DictConfig]:
    """Every check that needs no Ray, on a resolved copy of the config (the probe).

    The copy points ``run_dir`` at the planned folder, which is created only afterwards, so a
    run that fails here leaves nothing behind.
    """
    probe = copy.deepcopy(config)
    with open_dict(probe):
        probe.run_dir = str(planned_run_dir(config, now))
    try:
        replay_config = ReplayConfig.from_mapping(probe.get("replay"))
    except ReplayConfigError as error:
        raise StartupError(f"invalid config: {error}") from None
    check_tiny_task(probe)
    try:
        OmegaConf.resolve(probe)  # tiny assets are built here, in the driver, once
    except OmegaConfBaseException as error:
        raise StartupError(f"the config does not resolve: {_first_line(error)}") from None
    check_required(probe)
    check_exact_eval(probe)
    check_sampled_val(probe)
    check_replay_settings(probe, replay_config)
    if probe.get("dry_run", False):  # composes and validates only: paths may name another machine
        check_verl_config(probe)
        return replay_config, probe
    check_resume(config, probe, replay_config)  # reads the run dir only: before the slower checks
    try:
        check_inputs(probe, replay_config)
    except PreflightError as error:
        raise StartupError(str(error)) from None
    prepare_platform(probe)
    from verl.utils.device import auto_set_device

    auto_set_device(probe)
    check_verl_config(probe)
    return replay_config, probe


# ---------------------------------------------------------------------------- the run


def resumed_run_config(config: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """An existing run's folder (``run_dir``) resumes that run with the settings it was saved with
    (its ``config.yaml``): command-line settings must agree with them, resume-time ones aside."""
    run_dir = explicit_run_dir(config)
    if run_dir is None or not holds_content(run_dir):
        return config
    try:
        saved = load_saved_config(run_dir, CONFIG_FILE)
        if saved is None:
            return config  # the earlier run stopped before it saved its config: nothing to keep
        conflicts = conflicting_overrides(saved, config, overrides, config_dir=CONFIG_DIR)
    except ResumeError as error:
        raise StartupError(f"run_dir {run_dir} cannot be resumed: {error}; start a new run") from None
    except OmegaConfBaseException as error:
        raise StartupError(f"the config does not resolve: {_first_line(error)}") from None
    if conflicts:
        raise StartupError(describe_conflicts(run_dir, conflicts))
    return adopt_saved_config(saved, config, run_dir, overrides)


def _command_line_overrides() -> list[str]:
    """The overrides Hydra composed this run from (none outside a Hydra app, as in tests)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def run(config: DictConfig, overrides: Optional[Sequence[str]] = None) -> int:
    """Check, set up and train; returns the exit code. Leaves fds 1 and 2 on ``verl.log``
    (unless verbose), so what Ray and the interpreter print at exit goes there too."""
    out = console()
    quiet = not bool(config.get("verbose", False))
    startup_log = _temporary_log() if quiet else None
    try:
        if startup_log is not None:
            out.redirect_to(startup_log)
        check_output_location(config)
        lock_existing_run_dir(config)
        config = resumed_run_config(config, _command_line_overrides() if overrides is None else overrides)
        replay_config, probe = startup_checks(config, datetime.now())
        if probe.get("dry_run", False):
            return dry_run_report(probe, replay_config)
        run_dir = claim_run_dir(config)
        if startup_log is not None:
            out.redirect_to(run_dir.path / LOG_FILE, carry_over=[startup_log])
    except StartupError as error:
        out.error(f"verl_replay: {error}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        out.error("verl_replay: interrupted before the run started")
        return EXIT_INTERRUPTED
    except Exception:
        return _startup_crash(out, startup_log)
    finally:
        if startup_log is not None:
            startup_log.unlink(missing_ok=True)
    return train(config, replay_config, run_dir, quiet)


def _temporary_log() -> Path:
    """Where fds 1 and 2 point until the run dir exists (its text then moves into verl.log)."""
    handle, name = tempfile.mkstemp(prefix="verl_replay-startup-", suffix=".log")
    os.close(handle)
    return Path(name)


def _startup_crash(out: Console, startup_log: Optional[Path]) -> int:
    """An unexpected error before the run dir exists: show everything (a bug, not a setting)."""
    details = traceback.format_exc()
    out.restore()
    if startup_log is not None and startup_log.exists():
        out.err.write(startup_log.read_text(errors="replace"))
    out.error(details.rstrip())
    return EXIT_FAILED


def claim_run_dir(config: DictConfig) -> RunDir:
    explicit = str(config.run_dir) if config.get("run_dir") else None
    root = Path(str(config.output_root)) / str(config.trainer.project_name)
    try:
        return open_run_dir(explicit, root, str(config.trainer.experiment_name))
    except (FileExistsError, PermissionError, RunDirBusy) as error:
        raise StartupError(str(error)) from None


def dry_run_report(config: DictConfig, replay_config: ReplayConfig) -> int:
    out = console()
    out.line(OmegaConf.to_yaml(config).rstrip("\n"))
    out.line(
        f"verl_replay: dry run OK (strategy={replay_config.strategy}, trainer_mode={config.trainer.v1.trainer_mode})"
    )
    return EXIT_OK


def prepare_run(config: DictConfig, run_dir: RunDir, quiet: bool) -> Path:
    """Resolve the config into the run dir, select the platform, route verl's output; write config.yaml."""
    from verl.utils.device import auto_set_device

    from verl_replay._files import atomic_write_text
    from verl_replay.integrations.verl.console import quiet_logger_backends, quiet_ray_environment

    with open_dict(config):
        config.run_dir = str(run_dir.path)
    OmegaConf.resolve(config)
    prepare_platform(config)
    auto_set_device(config)
    metrics_path = run_dir.path / METRICS_FILE
    # verl's file logger reads this in the TaskRunner process (Ray passes it on in env_vars)
    os.environ["VERL_FILE_LOGGER_PATH"] = str(metrics_path)
    env_vars = OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars")
    if env_vars is not None:
        with open_dict(env_vars):
            env_vars["VERL_FILE_LOGGER_PATH"] = str(metrics_path)
    if quiet:
        quiet_logger_backends(config)
        quiet_ray_environment()
    text = OmegaConf.to_yaml(config)
    saved = run_dir.path / CONFIG_FILE
    if not (saved.is_file() and saved.read_text(encoding="utf-8") == text):  # a resumed run keeps its file
        atomic_write_text(saved, text)
    return metrics_path


def train(config: DictConfig, replay_config: ReplayConfig, run_dir: RunDir, quiet: bool) -> int:
    from verl_replay.integrations.verl.console import describe_failure

    out = console()
    follower = None
    started = _STARTED if _STARTED is not None else time.monotonic()  # the done line: the run's wall time
    try:
        metrics_path = prepare_run(config, run_dir, quiet)
        announce_start(config, replay_config, run_dir, quiet)
        follower = follow_steps(config, replay_config, metrics_path, run_dir.path / LOG_FILE) if quiet else None
        _run_ppo(config)
    except KeyboardInterrupt:
        _stop(follower, out)
        out.error(f"verl_replay: interrupted; resume with run_dir={_shown(run_dir.path)}")
        return EXIT_INTERRUPTED
    except Exception as error:
        traceback.print_exc()  # into verl.log when quiet
        _stop(follower, out)
        where = f" (traceback in {_shown(run_dir.path / LOG_FILE)})" if quiet else ""
        out.error(f"verl_replay: training failed: {describe_failure(error)}{where}")
        return EXIT_FAILED
    _shutdown_ray()  # before the done line: what follows it is only the interpreter's exit
    _stop(follower, out)
    announce_done(run_dir.path, time.monotonic() - started, len(follower.steps) if follower is not None else None)
    return EXIT_OK


STATUS_LINE_S = 60.0  # without a bar: a line when the first step is this long in coming, then as often


def follow_steps(config: DictConfig, replay_config: ReplayConfig, metrics_path: Path, log_path: Path) -> Any:
    """The progress bar and one console line per step, read back from verl's metrics file; until
    the first step, what the run waits for (Ray, the trainer, the workers) and for how long."""
    from verl_replay.integrations.verl.console import (
        DriftFloorWatch,
        StartupWatch,
        StepFollower,
        resumed_step,
        step_fields,
    )

    out = console()
    done_before = resumed_step(config.trainer) or 0  # a resumed run starts after its checkpoint's step
    total = OmegaConf.select(config, "trainer.total_training_steps")
    split = OmegaConf.select(config, "trainer.v1.trainer_mode") != "sync"
    budget = OmegaConf.select(config, "actor_rollout_ref.rollout.response_length")
    max_response_length = int(budget) if budget is not None else None
    floor = DriftFloorWatch(replay_config.tau)
    watch = StartupWatch(log_path, first_step=done_before + 1)
    waiting_since = time.monotonic()
    last_status = [waiting_since]

    def on_step(step: int, data: dict) -> None:
        first = not follower.steps[:-1]
        out.advance(step, step_seconds=data.get("timing_s/step"))  # the bar's ETA: step times only
        if first:
            out.status(None)
        out.line(
            step_line(
                step, total, step_fields(data, replay_config, split=split, max_response_length=max_response_length)
            )
        )
        warning = floor.update(data) if replay_config.uses_headroom_drift else None
        if warning:
            out.line(warning)

    def on_idle() -> None:
        if not follower.steps:
            now = time.monotonic()
            text = f"{watch.poll()} ({_duration(now - waiting_since)})"
            if out.has_bar:
                out.status(text)
            elif now - last_status[0] >= STATUS_LINE_S:
                last_status[0] = now
                out.line(f"verl_replay: {text} ...")
        out.refresh()

    follower = StepFollower(metrics_path, on_step, on_idle=on_idle)
    out.start_progress(total, initial=min(done_before, total) if total else done_before)
    follower.start()
    return follower


def _run_ppo(config: DictConfig) -> None:
    from verl.trainer.main_ppo import run_ppo

    from verl_replay.integrations.verl.task_runner import ReplayTaskRunner

    run_ppo(config, task_runner_class=ReplayTaskRunner)


def _shutdown_ray() -> None:
    """Stop the Ray cluster this run started (its workers, raylet, GCS) now rather than in Ray's
    exit handler, which would keep the process alive for seconds after the done line. What Ray
    prints while it stops goes to verl.log, as before."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _stop(follower: Any, out: Console) -> None:
    if follower is not None:
        follower.stop()
    out.close_progress()


# ---------------------------------------------------------------------------- console lines


def announce_start(config: DictConfig, replay_config: ReplayConfig, run_dir: RunDir, quiet: bool) -> None:
    out = console()
    task = OmegaConf.select(config, "tiny_task")
    parts = [f"strategy={replay_config.strategy}"]
    if task:
        parts.append(f"task={task}")
    if replay_config.uses_group_buffer:
        parts.append(f"k_rep={replay_config.k_rep}")
    if replay_config.uses_headroom_drift:
        parts.append(f"tau={replay_config.tau}")
    if replay_config.uses_elite:
        parts.append(f"mu={replay_config.elite.mu}")
    steps = OmegaConf.select(config, "trainer.total_training_steps")
    if steps:
        parts.append(f"steps={steps}")
    verb = "resuming" if run_dir.resumed else "run dir"
    out.line(f"verl_replay: {' '.join(parts)}; {verb} {_shown(run_dir.path)}")
    if run_dir.kept_metrics is not None:
        out.line(f"verl_replay: the earlier metrics of this run dir are kept in {run_dir.kept_metrics.name}")
    if quiet:
        out.line(
            f"verl_replay: verl's own output goes to {_shown(run_dir.path / LOG_FILE)} "
            "(verbose=true prints it here); starting Ray and the workers ..."
        )


def announce_done(run_dir: Path, seconds: float, steps: Optional[int]) -> None:
    names = [name for name in (METRICS_FILE, CONFIG_FILE, LOG_FILE, "replay_events.jsonl") if (run_dir / name).exists()]
    if (run_dir / "checkpoints").is_dir():
        names.append("checkpoints/")
    counted = f"{_count(steps, 'step')}, " if steps is not None else ""
    console().line(f"verl_replay: done ({counted}{_duration(seconds)}): {_shown(run_dir)}/ {{{', '.join(names)}}}")


def _count(number: int, noun: str) -> str:
    """``1 step``, ``2 steps``, ``0 steps``."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _duration(seconds: float) -> str:
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{rest}s"


def _shown(path: Path) -> str:
    """The path relative to the working directory when it lies inside it (shorter lines).

    As a Ray job the working directory is Ray's unpacked copy of the job's files, which Ray may
    delete while the run ends: then the path is shown whole."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except (ValueError, OSError):
        return str(path)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _as_list(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


# ---------------------------------------------------------------------------- command line


# An absolute path: relative to the module, Hydra would look for the package verl_replay.config,
# which is config.py, whenever this runs other than as ``python -m verl_replay.main``.
@hydra.main(config_path=str(CONFIG_DIR), config_name="replay_trainer", version_base=None)
def main(config: DictConfig) -> None:
    global _COMPOSED
    _COMPOSED = True
    _release_stderr()
    exit_now(run(config))  # not after the interpreter's teardown


def exit_now(code: int) -> None:
    """End the process with ``code`` once everything is written, skipping the interpreter's teardown.

    After the done line a normal exit kept the process alive 4-33 s: Ray's exit handler stopping
    the cluster (now done before the done line, :func:`_shutdown_ray`), then the finalisation of
    torch's and Ray's native state. The exit handlers still run (Ray's, logging's, the run dir's
    lock file; what they print goes to verl.log), then Python's and the console's streams are
    flushed and the process exits with ``code``. Threads still running are not waited for: the
    run's files are written by the Ray workers (stopped by now) and by this thread."""
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_handlers is None:  # not CPython: exit the usual way
        if code != EXIT_OK:
            raise SystemExit(code)
        return
    try:
        run_exit_handlers()
    finally:
        for stream in (sys.stdout, sys.stderr, console().out, console().err):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def lock_named_run_dir(args: list[str]) -> None:
    """``run_dir=DIR`` on the command line naming an existing folder: its lock is taken before Hydra
    composes anything, so a second run on a live run's folder is refused within seconds (the
    composed config's run_dir is locked again, a no-op, in :func:`lock_existing_run_dir`)."""
    for arg in args:
        key, sep, value = arg.lstrip("+").partition("=")
        if key == "run_dir" and sep and value and "${" not in value and value.lower() not in ("null", "none"):
            path = Path(value.strip("'\"")).expanduser().absolute()
            if path.is_dir():
                try:
                    lock_run_dir(path)
                except RunDirBusy as error:
                    raise StartupError(str(error)) from None
                except OSError:
                    return  # the composed config's checks name the problem


def _process_started() -> float:
    """``time.monotonic()`` when the command's own work starts (:func:`cli`): the done line's time.

    Not the process's creation time: under ``bash -c 'pip install ... && python -m verl_replay.main'``
    bash execs Python in its own process, created before the install ran."""
    return time.monotonic()


def verl_config_searchpath() -> Optional[str]:
    """``hydra.searchpath`` naming verl's config folder as a ``file://`` path.

    The YAML's ``pkg://verl.trainer.config`` makes Hydra import verl (and torch) to find the
    folder: 5-15 s before the first check can run. ``find_spec`` locates it without importing.
    """
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "trainer" / "config"
    return f"hydra.searchpath=[file://{folder}]" if (folder / "ppo_trainer.yaml").is_file() else None


def cli(argv: Optional[list[str]] = None) -> None:
    """``python -m verl_replay.main``: refuses unknown ``replay.*`` keys before Hydra composes."""
    global _STARTED
    _STARTED = _process_started()
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        check_override_keys(args)
        lock_named_run_dir(args)
    except ReplayConfigError as error:
        console().error(f"verl_replay: {error}")
        raise SystemExit(EXIT_USAGE) from None
    except StartupError as error:
        console().error(f"verl_replay: {error}")
        raise SystemExit(EXIT_USAGE) from None
    searchpath = verl_config_searchpath()
    if searchpath is not None and not any(arg.lstrip("+").startswith("hydra.searchpath") for arg in args):
        args.append(searchpath)
    sys.argv[1:] = args
    register_resolvers()
    # Hydra reports an override it cannot apply on stderr before main() runs: held until we know
    # whether it is a misspelled key (then our one line replaces its advice to add the key with +)
    global _REAL_STDERR
    _REAL_STDERR, sys.stderr = sys.stderr, io.StringIO()
    try:
        main()
    except SystemExit as exit_:
        # Hydra exits 1 after printing why an override cannot apply: a setting error, like ours
        if not _COMPOSED and exit_.code not in (0, None):
            message = unknown_key_message(_release_stderr(forward=False), args)
            if message is not None:
                console().error(f"verl_replay: {message}")
            raise SystemExit(EXIT_USAGE) from None
        raise
    finally:
        _release_stderr()


def _release_stderr(*, forward: bool = True) -> str:
    """Point sys.stderr back at the real stream; returns what was held (and passes it on)."""
    global _REAL_STDERR
    if _REAL_STDERR is None:
        return ""
    held, sys.stderr, _REAL_STDERR = sys.stderr, _REAL_STDERR, None
    text = held.getvalue() if isinstance(held, io.StringIO) else ""
    if forward or unknown_key_message(text, []) is None:
        sys.stderr.write(text)
        sys.stderr.flush()
    return text


_NOT_OVERRIDABLE = re.compile(r"Could not override '(?P<key>[^']+)'")
_FULL_KEY = re.compile(r"full_key: (?P<key>\S+)")


def unknown_key_message(hydra_error: str, args: list[str]) -> Optional[str]:
    """Our line for Hydra's "Could not override 'a.b'" (a key the config does not have): the
    closest existing key at the level that went wrong; None for any other Hydra error."""
    match = _NOT_OVERRIDABLE.search(hydra_error)
    if match is None or "is not in struct" not in hydra_error:
        return None
    key = match["key"]
    missing = _FULL_KEY.search(hydra_error)
    missing_key = missing["key"] if missing else key  # the first part of the path that does not exist
    parent, _, leaf = missing_key.rpartition(".")
    others = [arg for arg in args if not arg.lstrip("+~").startswith(f"{key}=")]
    node = _composed_node(others, parent)
    siblings = [str(name) for name in node] if node is not None else []
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    where = f" under {parent}" if parent else ""
    if close:
        hint = f"did you mean {'.'.join(filter(None, (parent, close[0])))}?"
    else:
        hint = f"no setting{where} is close; dry_run=true prints every setting"
    return f"unknown setting {key} ({hint})"


def _composed_node(overrides: list[str], dotted: str) -> Optional[DictConfig]:
    """The node ``dotted`` of the composed config (with the other overrides, else without any)."""
    from hydra import compose, initialize_config_dir

    for attempt in (overrides, [arg for arg in overrides if arg.startswith("hydra.searchpath")]):
        try:
            with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
                config = compose(config_name="replay_trainer", overrides=attempt)
        except Exception:  # noqa: BLE001 - only a suggestion: any failure leaves it out
            continue
        node = OmegaConf.select(config, dotted) if dotted else config
        return node if isinstance(node, DictConfig) else None
    return None


if __name__ == "__main__":
    cli()
