"""A resumed run is the run it continues: its settings come from the run dir's ``config.yaml``.

Naming an existing run's folder (``run_dir=DIR``) resumes that run. The folder's ``config.yaml``
is the fully resolved config the run was started with, so the resumed run takes every setting from
it; a setting that is missing from the command line is *not* the default, it is the saved value.
Settings given on the command line must agree with the saved ones, or the resume is refused (a
changed strategy, tau or data set would silently turn the run into another one). A few settings
say *how* to resume, not what the run is, and may be given freely (:data:`RESUME_TIME_KEYS`).

Only omegaconf and Hydra's override parser are used here: this runs in the driver before verl,
torch or Ray are imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = [
    "RESUME_TIME_KEYS",
    "ResumeConflict",
    "ResumeError",
    "adopt_saved_config",
    "conflicting_overrides",
    "describe_conflicts",
    "load_saved_config",
]

# How to resume, not what the run is: where it ends, which checkpoint it starts from, whether an
# empty replay state is accepted, and what the console shows.
RESUME_TIME_KEYS = (
    "verbose",
    "dry_run",
    "trainer.total_training_steps",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "replay.allow_missing_state",
)
# The quiet console drops verl's console logger before the config is saved: trainer.logger is
# compared without it.
_CONSOLE_LOGGER = "console"


class ResumeError(ValueError):
    """The run dir's saved config cannot be read back; the message names the file."""


@dataclass(frozen=True)
class ResumeConflict:
    key: str
    saved: Any
    given: Any


def load_saved_config(run_dir: Path, file_name: str) -> Optional[DictConfig]:
    """The config a run dir was started with; None when it holds none (a run that never started)."""
    path = Path(run_dir) / file_name
    if not path.is_file():
        return None
    try:
        saved = OmegaConf.load(path)
    except (OSError, OmegaConfBaseException, ValueError, yaml.YAMLError) as error:
        raise ResumeError(f"{path} cannot be read ({_first_line(error)})") from None
    if not isinstance(saved, DictConfig) or "trainer" not in saved or "replay" not in saved:
        raise ResumeError(f"{path} is not a verl_replay run config (no trainer: or replay: section)")
    return saved


def _override_keys(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """``(key, value)`` of every command-line override (value None for ``~key``), Hydra's own
    (``hydra.*``) and ``run_dir`` left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if key == "hydra" or key.startswith("hydra.") or key == "run_dir":
            continue
        keys.append((key, None if override.is_delete() else override.value()))
    return keys


def _group_leaves(config_dir: Path, group: str, choice: Any) -> Optional[list[str]]:
    """The dotted keys a config group's chosen file sets (``platform=gpu``); None if not a group."""
    folder = Path(config_dir) / group
    if not folder.is_dir():
        return None
    path = folder / f"{choice}.yaml"
    return list(_leaf_keys(OmegaConf.load(path))) if path.is_file() else []


def _leaf_keys(node: Any, prefix: str = "") -> Iterable[str]:
    if isinstance(node, DictConfig):
        for key in node.keys():
            yield from _leaf_keys(node._get_node(key), f"{prefix}{key}.")
    else:
        yield prefix.rstrip(".")


def _plain(value: Any) -> Any:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


_MISSING = object()


def _select(config: DictConfig, key: str) -> Any:
    value = OmegaConf.select(config, key, default=_MISSING, throw_on_resolution_failure=True)
    return _plain(value)


def _comparable(key: str, value: Any) -> Any:
    if key == "trainer.logger" and isinstance(value, list):
        return sorted(name for name in value if name != _CONSOLE_LOGGER)
    return value


def conflicting_overrides(
    saved: DictConfig, composed: DictConfig, overrides: Sequence[str], *, config_dir: Path
) -> list[ResumeConflict]:
    """Each command-line setting whose value differs from the saved run's (resume-time keys aside).

    A config-group choice (``platform=gpu``) conflicts where any key its file sets differs.
    """
    conflicts = []
    for key, value in _override_keys(overrides):
        if key in RESUME_TIME_KEYS:
            continue
        group_keys = _group_leaves(config_dir, key, value)
        keys = group_keys if group_keys is not None else [key]
        for leaf in keys:
            saved_value = _comparable(leaf, _select(saved, leaf))
            given_value = _comparable(leaf, _select(composed, leaf))
            if saved_value != given_value:
                shown = key if group_keys is None else f"{key} ({leaf})"
                conflicts.append(ResumeConflict(shown, _shown_value(saved_value), _shown_value(given_value)))
    return conflicts


def _shown_value(value: Any) -> Any:
    return "(not set)" if value is _MISSING else value


def describe_conflicts(run_dir: Path, conflicts: Sequence[ResumeConflict]) -> str:
    """One line: what the run was saved with, what the command line gives, and what to do."""
    pairs = ", ".join(f"{c.key}={c.saved} (given {c.given})" for c in conflicts)
    return (
        f"run_dir {run_dir} resumes a run saved with {pairs}: a resumed run keeps the settings it was "
        f"started with; drop these overrides (run_dir={run_dir} alone resumes it), or start a new run "
        "(another run_dir, or none for a new folder)"
    )


def adopt_saved_config(saved: DictConfig, composed: DictConfig, run_dir: Path, overrides: Sequence[str]) -> DictConfig:
    """The resumed run's config: the saved one, with the resume-time settings this command line
    gives and its paths moved to where the run dir is now (a run dir copied elsewhere resumes there)."""
    adopted = OmegaConf.create(OmegaConf.to_container(saved, resolve=False))
    old_dir = str(saved.get("run_dir") or "")
    new_dir = str(Path(run_dir).absolute())
    if old_dir and old_dir != new_dir:
        _move_paths(adopted, old_dir.rstrip("/"), new_dir)
    given = {key for key, _ in _override_keys(overrides)}
    for key in RESUME_TIME_KEYS:
        if key not in given:
            continue
        value = OmegaConf.select(composed, key, default=_MISSING)
        if value is not _MISSING:
            OmegaConf.update(adopted, key, _plain(value), merge=False, force_add=True)
    adopted.run_dir = new_dir
    OmegaConf.set_struct(adopted, True)
    return adopted


def _move_paths(node: Any, old: str, new: str) -> None:
    """Every string under ``node`` that is ``old`` or a path under it now names ``new`` instead."""
    items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else enumerate(node)
    for key, value in list(items):
        if isinstance(value, (DictConfig, ListConfig)):
            _move_paths(value, old, new)
        elif isinstance(value, str) and (value == old or value.startswith(old + "/")):
            node[key] = new + value[len(old) :]


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
