"""The ``replay:`` section of the training config: one typed dataclass, validated once.

Every replay setting a run can take is declared here. :func:`ReplayConfig.from_mapping` turns the
Hydra/OmegaConf ``replay`` node (or any mapping) into a :class:`ReplayConfig` and raises
:class:`ReplayConfigError` naming the offending key (``replay.tau``) and what to change. The
trainer calls it once at start-up, in the driver, before any Ray worker starts.
:func:`check_override_keys` refuses a misspelled ``replay.*`` key on the command line before
Hydra composes (with a did-you-mean, whether it was given as ``replay.x=`` or ``+replay.x=``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

STRATEGIES = ("none", "headroom_drift", "naive", "elite", "elite_iid", "headroom_drift+elite")
WEIGHTINGS = ("sign", "advantage")
DRIFT_NORMS = ("l2", "l1", "mean_sq")
INGRESS_CRITERIA = ("answer_disagree", "nonzero_advantage")
SCAN_ORDERS = ("headroom", "recency")
SCAN_SKIPS = ("none", "cooldown")


class ReplayConfigError(ValueError):
    """An invalid ``replay.*`` setting; the message names the key and the accepted values."""


@dataclass(frozen=True)
class EliteConfig:
    """EliteReplay settings (``replay.elite.*``)."""

    archive: Optional[str] = None
    mu: float = 0.05
    batch_size: int = 8
    seed: int = 0


@dataclass(frozen=True)
class ReplayConfig:
    """Replay settings (``replay.*``). Headroom-Drift keys are flat, EliteReplay keys nested."""

    strategy: str = "none"
    k_rep: int = 16
    tau: float = 0.05
    capacity: int = 1024
    weighting: str = "sign"
    drift_norm: str = "l2"
    scan_chunk_groups: int = 16
    max_scan_groups: Optional[int] = None
    ingress: str = "answer_disagree"
    # Order of the Headroom-Drift scan: "headroom" (the method) or "recency" (the Policy-Drift-only ablation).
    scan_order: str = "headroom"
    # Beyond the paper: "none" forwards every candidate the scan reaches (the paper's scan);
    # "cooldown" skips a group whose last scan measured drift > scan_skip_margin x tau (in rms
    # units) for scan_skip_versions weight versions (null: for good), or scan_skip_growth x the
    # group's age if longer. Under "none" the same rule is a shadow: scan events and
    # replay/scan_skip_shadow* say what it would have skipped.
    scan_skip: str = "none"
    scan_skip_margin: float = 3.0
    scan_skip_versions: Optional[int] = 4
    scan_skip_growth: float = 2.0
    # GRPO groups per optimiser step of updates that carry replay (None: actor.ppo_mini_batch_size).
    ppo_mini_batch_size: Optional[int] = None
    event_log: Optional[str] = None
    # Debugging/verification: record what each actor micro-batch trained on for replayed rows.
    audit_dir: Optional[str] = None
    # Debugging/verification: also run the old/ref log-prob forwards over replayed and elite rows
    # (their results are then overwritten; the default skips them).
    recompute_replayed_log_probs: bool = False
    # Resume from a checkpoint that has no replay state (the streams restart empty) instead of failing.
    allow_missing_state: bool = False
    elite: EliteConfig = field(default_factory=EliteConfig)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_mapping(cls, node: Optional[Mapping[str, Any]]) -> ReplayConfig:
        """Build and validate from the ``replay`` config node (None means all defaults)."""
        raw = _to_plain_dict(node)
        elite_raw = raw.pop("elite", None)
        _reject_unknown(raw, cls, prefix="replay")
        elite_dict = _to_plain_dict(elite_raw)
        _reject_unknown(elite_dict, EliteConfig, prefix="replay.elite")
        try:
            config = cls(**raw, elite=EliteConfig(**elite_dict))
        except TypeError as error:  # pragma: no cover - unknown keys are rejected above
            raise ReplayConfigError(str(error)) from error
        config.validate()
        return config

    # ------------------------------------------------------------------ queries

    @property
    def uses_headroom_drift(self) -> bool:
        return self.strategy in ("headroom_drift", "headroom_drift+elite")

    @property
    def uses_group_buffer(self) -> bool:
        """Strategies that keep a FIFO buffer of GRPO groups (Headroom-Drift or its naive baseline)."""
        return self.strategy in ("headroom_drift", "naive", "headroom_drift+elite")

    @property
    def uses_elite(self) -> bool:
        return self.strategy in ("elite", "elite_iid", "headroom_drift+elite")

    @property
    def elite_sampler(self) -> str:
        return "iid" if self.strategy == "elite_iid" else "balanced"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ validation

    def validate(self) -> None:
        _choice("replay.strategy", self.strategy, STRATEGIES)
        _choice("replay.weighting", self.weighting, WEIGHTINGS)
        _choice("replay.drift_norm", self.drift_norm, DRIFT_NORMS)
        _choice("replay.ingress", self.ingress, INGRESS_CRITERIA)
        _choice("replay.scan_order", self.scan_order, SCAN_ORDERS)
        _choice("replay.scan_skip", self.scan_skip, SCAN_SKIPS)
        margin = self.scan_skip_margin
        if not _is_number(margin) or not math.isfinite(margin) or margin < 1:
            raise ReplayConfigError(
                f"replay.scan_skip_margin must be a finite number >= 1 (a group is skipped once its drift "
                f"exceeds this many times tau, in rms units), got {margin!r}"
            )
        growth = self.scan_skip_growth
        if not _is_number(growth) or not math.isfinite(growth) or growth < 0:
            raise ReplayConfigError(
                f"replay.scan_skip_growth must be a finite number >= 0 (a skip lasts at least this many "
                f"times the group's age in weight versions; 0 = scan_skip_versions only), got {growth!r}"
            )
        if self.scan_skip_versions is not None:
            _positive_int(
                "replay.scan_skip_versions", self.scan_skip_versions, hint="or null: a skipped group is never rescanned"
            )
        _positive_int("replay.k_rep", self.k_rep)
        _positive_int("replay.capacity", self.capacity)
        _positive_int("replay.scan_chunk_groups", self.scan_chunk_groups)
        if self.max_scan_groups is not None:
            _positive_int("replay.max_scan_groups", self.max_scan_groups, hint="or null for no scan budget")
        for key in ("recompute_replayed_log_probs", "allow_missing_state"):
            if not isinstance(getattr(self, key), bool):
                raise ReplayConfigError(f"replay.{key} must be true or false, got {getattr(self, key)!r}")
        if self.ppo_mini_batch_size is not None:
            _positive_int(
                "replay.ppo_mini_batch_size",
                self.ppo_mini_batch_size,
                hint="or null for actor_rollout_ref.actor.ppo_mini_batch_size",
            )
        if not _is_number(self.tau) or not math.isfinite(self.tau) or self.tau < 0:
            raise ReplayConfigError(
                f"replay.tau must be a finite number >= 0 (the Policy Drift gate), got {self.tau!r}"
            )
        if self.uses_group_buffer and self.k_rep > self.capacity:
            raise ReplayConfigError(
                f"replay.k_rep ({self.k_rep}) cannot exceed replay.capacity ({self.capacity}); "
                "lower replay.k_rep or raise replay.capacity"
            )
        elite = self.elite
        if not _is_number(elite.mu) or not 0.0 <= elite.mu <= 1.0:
            raise ReplayConfigError(f"replay.elite.mu must be a number in [0, 1], got {elite.mu!r}")
        _positive_int("replay.elite.batch_size", elite.batch_size)
        if not isinstance(elite.seed, int) or isinstance(elite.seed, bool):
            raise ReplayConfigError(f"replay.elite.seed must be an integer, got {elite.seed!r}")
        if self.uses_elite and not elite.archive:
            raise ReplayConfigError(
                f"replay.strategy={self.strategy} needs a frozen archive: set replay.elite.archive=PATH "
                "(build one with `python -m verl_replay.elite.search`)"
            )


def _to_plain_dict(node: Any) -> dict[str, Any]:
    if node is None:
        return {}
    try:  # OmegaConf nodes: resolve interpolations into plain python values
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            return dict(OmegaConf.to_container(node, resolve=True))
    except ImportError:  # pragma: no cover - omegaconf always ships with verl
        pass
    if isinstance(node, Mapping):
        return dict(node)
    raise ReplayConfigError(f"the replay config must be a mapping, got {type(node).__name__}")


def _known_keys(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _did_you_mean(prefix: str, key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {prefix}.{close[0]}?)" if close else ""


def _unknown_key_error(prefix: str, unknown: Sequence[str], known: set[str]) -> ReplayConfigError:
    names = ", ".join(f"{prefix}.{k}{_did_you_mean(prefix, k, known)}" for k in unknown)
    return ReplayConfigError(f"unknown setting(s) {names}; valid keys under {prefix} are: {', '.join(sorted(known))}")


def _reject_unknown(raw: Mapping[str, Any], cls: type, prefix: str) -> None:
    known = _known_keys(cls)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise _unknown_key_error(prefix, unknown, known)


# `replay.k_rep=2`, `+replay.k_rep=2`, `++replay.elite.mu=0.1`, `~replay.tau`: the key part of a
# Hydra override of the replay section.
_REPLAY_OVERRIDE = re.compile(r"^(?:\+\+|\+|~)?replay\.(?P<key>[^=~+]+?)(?:=|$)")


def check_override_keys(overrides: Sequence[str]) -> None:
    """Refuse a command-line override of an unknown ``replay.*`` key, with a did-you-mean.

    Runs on the raw arguments before Hydra composes the config: Hydra's own message for
    ``replay.k_repp=2`` suggests ``+replay.k_repp=2``, which only leads to a second error.
    """
    for override in overrides:
        match = _REPLAY_OVERRIDE.match(override)
        if match is None:
            continue
        parts = match.group("key").split(".")
        if parts[0] == "elite" and len(parts) > 1:
            prefix, cls, key = "replay.elite", EliteConfig, ".".join(parts[1:])
        else:
            prefix, cls, key = "replay", ReplayConfig, ".".join(parts)
        known = _known_keys(cls)  # includes "elite": the whole node, e.g. replay.elite={archive:x}
        if key not in known:
            raise _unknown_key_error(prefix, [key], known)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ReplayConfigError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")


def _positive_int(key: str, value: Any, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        suffix = f" ({hint})" if hint else ""
        raise ReplayConfigError(f"{key} must be a positive integer{suffix}, got {value!r}")
