"""Scan skipping beyond the paper: stop paying, step after step, for groups the gate keeps rejecting.

The paper's scan forwards every candidate it reaches, every step. Under a policy that moves fast
most of those candidates are old groups whose drift was far above tau at their last scan and only
grows with age (``python -m verl_replay.headroom_drift.shadow`` measures it on a run's event log).

Rule ``cooldown`` (margin ``m``, ``k`` weight versions): a group whose last scan measured a drift
above ``m * tau`` is not scanned at the next ``k`` global steps (weight versions) after that scan
(``k = None``: never again while it is buffered); it is scanned again ``k + 1`` versions later.
With ``growth`` ``g > 0`` the skip lasts ``max(k, ceil(g * a))`` versions, ``a`` the group's age at
that scan (weight versions since it was generated): an old group, whose acceptances are rare, is
rescanned at ages growing geometrically, a young one as often as ``k`` allows.
"Above m * tau" is read in root-mean-square units whatever the norm: under ``mean_sq`` (squared
units) the bound is ``m**2 * tau``, so ``mean_sq`` with ``tau_sq = tau_rms**2`` skips exactly what
``l2`` with ``tau_rms`` skips.

The rule's *history* of a group is its last scan the rule itself would have made: ``(step,
drift)``. A scan the rule would have skipped does not update it, so the same history serves as
the live rule (``replay.scan_skip=cooldown``: skipped groups are not scanned at all) and as its
shadow over the paper's scan (``replay.scan_skip=none``: every group is scanned and each scan
records whether the rule would have skipped it). Pure Python: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SCAN_SKIPS", "CooldownRule", "History"]

# none: the paper's scan (every candidate reached is forwarded); cooldown: the rule above.
SCAN_SKIPS: tuple[str, ...] = ("none", "cooldown")

# (global step of the rule's last scan of the group, the drift it measured)
History = tuple[int, float]


@dataclass(frozen=True)
class CooldownRule:
    """Skip a group whose last scan was more than ``margin`` (rms units) above tau, at the
    ``versions`` global steps after that scan (``None``: for good)."""

    tau: float  # the gate, in the drift norm's units
    margin: float  # >= 1, a ratio of root-mean-square drifts
    versions: int | None  # weight versions a skip lasts (at least); None = never rescanned
    drift_norm: str = "l2"  # "mean_sq" holds squared units: the margin is squared with it
    growth: float = 0.0  # a skip lasts at least growth x the group's age at the scan

    def __post_init__(self) -> None:
        if not (isinstance(self.margin, (int, float)) and math.isfinite(self.margin) and self.margin >= 1.0):
            raise ValueError(f"margin must be a finite number >= 1, got {self.margin!r}")
        if self.versions is not None and (
            isinstance(self.versions, bool) or not isinstance(self.versions, int) or self.versions < 1
        ):
            raise ValueError(f"versions must be a positive integer or None, got {self.versions!r}")
        if not (isinstance(self.growth, (int, float)) and math.isfinite(self.growth) and self.growth >= 0.0):
            raise ValueError(f"growth must be a finite number >= 0, got {self.growth!r}")

    @property
    def bound(self) -> float:
        """The drift above which a scan starts a skip, in the norm's units."""
        scale = self.margin * self.margin if self.drift_norm == "mean_sq" else self.margin
        return scale * self.tau

    def far_above(self, drift: float) -> bool:
        return drift > self.bound  # NaN never; +inf always

    def skips(self, history: History | None, step: int, generated_version: int = -1) -> bool:
        """Would the rule skip a group at global ``step`` given its history (None: never scanned)?
        ``generated_version``: the weight version that generated the group (-1: unknown, age 0)."""
        if history is None:
            return False
        last_step, last_drift = history
        if not self.far_above(last_drift):
            return False
        return self.versions is None or step - last_step <= self.window(last_step, generated_version)

    def window(self, last_step: int, generated_version: int = -1) -> int:
        """Weight versions a skip started by a scan at global ``last_step`` lasts."""
        assert self.versions is not None
        if self.growth == 0.0 or generated_version < 0:
            return self.versions
        age = max(0, (last_step - 1) - generated_version)  # versions between generation and the scan
        return max(self.versions, math.ceil(self.growth * age))

    def label(self) -> str:
        versions = "never" if self.versions is None else f"{self.versions}"
        growth = f" g={self.growth:g}" if self.growth else ""
        return f"cooldown m={self.margin:g} k={versions}{growth}"
