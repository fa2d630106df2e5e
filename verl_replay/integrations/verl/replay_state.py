"""What a checkpoint's replay state is, and whether a resumed run may continue from it.

Every verl checkpoint folder ``global_step_N/`` gets ``replay/`` with the streams' files (group
buffer, elite sampler) and ``replay_state.json``, written last and atomically: the global step,
the identity of the run the state belongs to (trainer mode, anchor field, tokenizer fingerprint),
the replay settings that decide what is replayed, and the sha256 of every file. On resume:

- a missing or incomplete state is an error (``replay.allow_missing_state=true`` starts empty);
- a file whose hash differs is an error (a torn or edited checkpoint);
- a different trainer mode, anchor field or tokenizer is refused (the stored anchors and token ids
  would mean something else);
- a replay setting that changes what is selected or admitted is refused, naming ``replay.<key>``;
  settings that cannot change a decision (chunk sizes, log paths, the NLL weight, ...) may differ.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional

from verl_replay.config import ReplayConfig

STATE_MANIFEST = "replay_state.json"
STATE_DIR = "replay"  # the replay state's folder inside verl's global_step_N/
STATE_FORMAT = 1
# Replay settings a resumed run must share with the state it continues (they change decisions).
DECISION_SETTINGS = (
    "strategy",
    "k_rep",
    "tau",
    "capacity",
    "weighting",
    "drift_norm",
    "max_scan_groups",
    "ingress",
    "scan_order",
    "scan_skip",
)
# The rule's parameters decide only under a live rule (under scan_skip=none they shape a shadow).
SCAN_SKIP_PARAMETERS = ("scan_skip_margin", "scan_skip_versions", "scan_skip_growth")
ELITE_DECISION_SETTINGS = ("batch_size", "seed")
# Decision settings newer than some saved states, with the value those states were saved under.
_SETTINGS_ADDED_LATER = {"scan_order": "headroom", "scan_skip": "none"}


class ReplayStateError(ValueError):
    """The checkpoint's replay state cannot be continued by this run; the message says why."""


def decision_settings(config: ReplayConfig) -> dict[str, Any]:
    settings = {key: getattr(config, key) for key in DECISION_SETTINGS}
    if config.scan_skip != "none":
        settings.update({key: getattr(config, key) for key in SCAN_SKIP_PARAMETERS})
    if config.uses_elite:
        settings.update({f"elite.{key}": getattr(config.elite, key) for key in ELITE_DECISION_SETTINGS})
    return settings


def _saved_settings(manifest: Mapping[str, Any]) -> dict[str, Any]:
    saved = dict(manifest.get("settings", {}))
    if "strategy" in saved:  # a manifest with settings: those added since it was written had their defaults
        for key, default in _SETTINGS_ADDED_LATER.items():
            saved.setdefault(key, default)
        if saved["scan_skip"] != "none":  # a live rule saved before growth existed had none
            saved.setdefault("scan_skip_growth", 0.0)
    return saved


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write_json(path: Path, payload: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_state_manifest(
    folder: str | os.PathLike, *, step: int, identity: Mapping[str, Any], settings: Mapping[str, Any]
) -> None:
    """Record the files the streams wrote into ``folder`` (call after they are all written)."""
    root = Path(folder)
    files = {
        p.name: _sha256(p)
        for p in sorted(root.iterdir())
        if p.is_file() and p.name != STATE_MANIFEST and not p.name.startswith(".")
    }
    _atomic_write_json(
        root / STATE_MANIFEST,
        {
            "format": STATE_FORMAT,
            "global_step": int(step),
            "identity": dict(identity),
            "settings": dict(settings),
            "files": files,
        },
    )


def check_state_manifest(
    folder: str | os.PathLike, *, step: int, identity: Mapping[str, Any], settings: Mapping[str, Any]
) -> bool:
    """True if ``folder`` holds a complete state this run may continue; False if it holds none.

    Raises :class:`ReplayStateError` for a state that exists but must not be continued.
    """
    root = Path(folder)
    manifest_path = root / STATE_MANIFEST
    if not manifest_path.is_file():
        return False
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ReplayStateError(f"{manifest_path} is corrupted ({error})") from None
    if manifest.get("format") != STATE_FORMAT:
        raise ReplayStateError(
            f"{manifest_path}: replay state format {manifest.get('format')!r}, this version reads {STATE_FORMAT}"
        )
    if manifest.get("global_step") != step:
        raise ReplayStateError(f"{manifest_path} belongs to global step {manifest.get('global_step')}, not {step}")
    _check_files(root, manifest)
    for key, saved in manifest.get("identity", {}).items():
        if identity.get(key) != saved:
            raise ReplayStateError(
                f"the replay state in {root} was saved with {key}={saved!r}, this run has {identity.get(key)!r}: "
                "its stored groups would not mean the same thing here; resume with the setting it was saved under"
            )
    saved_settings = _saved_settings(manifest)
    for key in sorted(set(saved_settings) | set(settings)):
        if saved_settings.get(key) != settings.get(key):
            raise ReplayStateError(
                f"replay.{key} was {saved_settings.get(key)!r} when the replay state in {root} was saved and is "
                f"{settings.get(key)!r} now; it changes what is replayed, so a resumed run must keep it "
                f"(set replay.{key}={saved_settings.get(key)!r}, or start a new run)"
            )
    return True


def _check_files(root: Path, manifest: Mapping[str, Any]) -> None:
    for name, digest in manifest.get("files", {}).items():
        path = root / name
        if not path.is_file() or _sha256(path) != digest:
            raise ReplayStateError(
                f"{path} is missing or does not match its recorded sha256 (torn or edited checkpoint)"
            )


def _read_manifest(manifest_path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ReplayStateError(f"{manifest_path} is corrupted ({error})") from None
    if not isinstance(manifest, dict):
        raise ReplayStateError(f"{manifest_path} is corrupted (not a JSON object)")
    return manifest


def verify_state(folder: str | os.PathLike) -> bool:
    """Every file of the replay state in ``folder`` is there and matches its recorded sha256, and the
    manifest is readable and of this format; False when ``folder`` holds no state. Raises
    :class:`ReplayStateError` naming the damaged file. The driver calls it before anything starts."""
    root = Path(folder)
    manifest_path = root / STATE_MANIFEST
    if not manifest_path.is_file():
        return False
    manifest = _read_manifest(manifest_path)
    if manifest.get("format") != STATE_FORMAT:
        raise ReplayStateError(
            f"{manifest_path}: replay state format {manifest.get('format')!r}, this version reads {STATE_FORMAT}"
        )
    _check_files(root, manifest)
    return True


def newest_intact_checkpoint(checkpoint_root: str | os.PathLike, state_dir: str, before_step: int) -> Optional[Path]:
    """The newest ``global_step_N`` (N < ``before_step``) under ``checkpoint_root`` whose replay state
    verifies and whose model state verl saved (``actor/``); None if there is none."""
    steps = []
    for step_dir in Path(checkpoint_root).glob("global_step_*"):
        suffix = step_dir.name.rpartition("_")[2]
        if suffix.isdigit() and int(suffix) < before_step:
            steps.append((int(suffix), step_dir))
    for _, step_dir in sorted(steps, reverse=True):
        try:
            if (step_dir / "actor").is_dir() and verify_state(step_dir / state_dir):
                return step_dir
        except ReplayStateError:
            continue
    return None


def changed_settings(
    folder: str | os.PathLike, *, identity: Mapping[str, Any], settings: Mapping[str, Any]
) -> Optional[list[tuple[str, Any, Any]]]:
    """``(key, saved, now)`` for every identity key and ``replay.<key>`` setting the state in
    ``folder`` was saved with and this run changes; None when ``folder`` holds no state. Reads the
    manifest only: the driver calls it before anything starts (the trainer checks the files too)."""
    manifest_path = Path(folder) / STATE_MANIFEST
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ReplayStateError(f"{manifest_path} is corrupted ({error})") from None
    changed = [
        (key, saved, identity.get(key))
        for key, saved in sorted(manifest.get("identity", {}).items())
        if key in identity and identity[key] != saved
    ]
    saved_settings = _saved_settings(manifest)
    changed += [
        (f"replay.{key}", saved_settings.get(key), settings.get(key))
        for key in sorted(set(saved_settings) | set(settings))
        if saved_settings.get(key) != settings.get(key)
    ]
    return changed


def prune_orphaned_states(
    checkpoint_root: str | os.PathLike, state_dir: str, keep_step: Optional[int] = None
) -> list[Path]:
    """Remove the replay states of checkpoints verl has pruned (their ``actor/`` folder is gone)."""
    removed = []
    root = Path(checkpoint_root)
    if not root.is_dir():
        return removed
    for step_dir in sorted(root.glob("global_step_*")):
        state = step_dir / state_dir
        if not state.is_dir() or step_dir.name == f"global_step_{keep_step}":
            continue
        if not (step_dir / "actor").exists():
            shutil.rmtree(state, ignore_errors=True)
            removed.append(state)
    return removed
