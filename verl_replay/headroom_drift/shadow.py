"""Shadow report of scan-skipping rules over one run's event log (same trajectory, no second run).

    python -m verl_replay.headroom_drift.shadow RUN_DIR/replay_events.jsonl --tau 0.0632456

For every ``scan`` record of the log (every group the scan forwarded, in step and rank order) each
candidate rule (:class:`~verl_replay.headroom_drift.scan_skip.CooldownRule` over a grid of margins
and skip lengths) decides from the group's history whether it would have skipped that scan. On the
paper's scan (``replay.scan_skip=none``) that is exact for the trajectory the run took: *scans
saved* are the scans the rule would have skipped, *accepted lost* the skipped scans the gate
accepted. (A run that skips goes deeper into the buffer with the scans it saves and can accept
groups the paper's scan never reached: that is not counted here.) Scan records that carry the live
shadow (``would_skip``, the configured rule's) are checked against the recomputation.

Also printed: how drift grows with age for rejected groups, and how often a group rejected by a
margin comes back under tau. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from verl_replay.headroom_drift.events import read_events
from verl_replay.headroom_drift.scan_skip import CooldownRule, History

__all__ = ["ShadowCount", "shadow_count", "drift_by_age", "comebacks", "report", "main"]

DEFAULT_MARGINS = (1.0, 1.25, 1.5, 2.0, 3.0)
DEFAULT_VERSIONS: tuple[int | None, ...] = (2, 4, 8, 16, None)
DEFAULT_GROWTHS: tuple[float, ...] = (0.0,)
AGE_BINS = ((0, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 10**9))
RATIO_BINS = ((1.0, 1.25), (1.25, 1.5), (1.5, 2.0), (2.0, 3.0), (3.0, math.inf))


@dataclass(frozen=True)
class ShadowCount:
    """One rule over one trajectory."""

    rule: str
    scans: int  # scan records of the run
    skipped: int  # of them, the ones the rule would have skipped (scans saved)
    accepted: int  # scan records the gate accepted
    accepted_lost: int  # accepted scans the rule would have skipped

    @property
    def saved_share(self) -> float:
        return self.skipped / self.scans if self.scans else 0.0

    @property
    def kept_share(self) -> float:
        return (self.accepted - self.accepted_lost) / self.accepted if self.accepted else 1.0


def _ordered(scans: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted((s for s in scans if s.get("drift") is not None), key=lambda s: (int(s["step"]), int(s["rank"])))


def shadow_flags(scans: Iterable[Mapping[str, Any]], rule: CooldownRule) -> list[tuple[Mapping[str, Any], bool]]:
    """Each scan record (step, rank order) with whether ``rule`` would have skipped it. The rule's
    history of a group is updated only by the scans it would itself have made."""
    history: dict[int, History] = {}
    out = []
    for scan in _ordered(scans):
        gid, step = int(scan["group_id"]), int(scan["step"])
        skip = rule.skips(history.get(gid), step, int(scan.get("generated_version", -1)))
        if not skip:
            history[gid] = (step, float(scan["drift"]))
        out.append((scan, skip))
    return out


def shadow_count(scans: Iterable[Mapping[str, Any]], rule: CooldownRule) -> ShadowCount:
    flags = shadow_flags(scans, rule)
    return ShadowCount(
        rule=rule.label(),
        scans=len(flags),
        skipped=sum(skip for _, skip in flags),
        accepted=sum(bool(s["accepted"]) for s, _ in flags),
        accepted_lost=sum(bool(s["accepted"]) and skip for s, skip in flags),
    )


def drift_by_age(scans: Iterable[Mapping[str, Any]], tau: float) -> list[dict[str, Any]]:
    """Per age bin (weight versions since generation): scans, accepted, and the rejected scans'
    drift over tau (p50, p90)."""
    rows = []
    ordered = _ordered(scans)
    for lo, hi in AGE_BINS:
        inside = [s for s in ordered if lo <= int(s["age"]) <= hi]
        if not inside:
            continue
        ratios = sorted(float(s["drift"]) / tau for s in inside if not s["accepted"])
        rows.append(
            {
                "ages": f"{lo}-{hi}" if hi < 10**9 else f"{lo}+",
                "scans": len(inside),
                "accepted": sum(bool(s["accepted"]) for s in inside),
                "rejected_drift_over_tau_p50": _quantile(ratios, 0.5),
                "rejected_drift_over_tau_p90": _quantile(ratios, 0.9),
            }
        )
    return rows


def comebacks(scans: Iterable[Mapping[str, Any]], tau: float) -> list[dict[str, Any]]:
    """Consecutive scans of one group whose first was rejected, by how far above tau it was: how
    many such pairs, the share whose drift grew, and how many of the second scans were accepted."""
    last: dict[int, float] = {}
    pairs: list[tuple[float, float, bool]] = []
    for scan in _ordered(scans):
        gid, drift = int(scan["group_id"]), float(scan["drift"])
        if gid in last and last[gid] > tau:
            pairs.append((last[gid], drift, bool(scan["accepted"])))
        last[gid] = drift
    rows = []
    for lo, hi in RATIO_BINS:
        inside = [p for p in pairs if lo * tau < p[0] <= hi * tau]
        if inside:
            rows.append(
                {
                    "previous_drift_over_tau": f"{lo:g}-{hi:g}",
                    "pairs": len(inside),
                    "drift_grew": sum(b > a for a, b, _ in inside) / len(inside),
                    "accepted_next": sum(ok for _, _, ok in inside),
                }
            )
    return rows


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return (
        float(statistics.quantiles(sorted_values, n=100, method="inclusive")[int(q * 100) - 1])
        if len(sorted_values) > 1
        else float(sorted_values[0])
    )


def _check_live(scans: Sequence[Mapping[str, Any]], rule: CooldownRule) -> str | None:
    """None if the live ``would_skip`` flags (when recorded) equal the recomputation."""
    if not any("would_skip" in s for s in scans):
        return None
    bad = [s for s, skip in shadow_flags(scans, rule) if bool(s.get("would_skip")) != skip]
    return None if not bad else f"{len(bad)} scan records disagree with the recomputed {rule.label()}"


def report(
    events: Sequence[Mapping[str, Any]],
    *,
    tau: float,
    drift_norm: str = "l2",
    margins: Sequence[float] = DEFAULT_MARGINS,
    versions: Sequence[int | None] = DEFAULT_VERSIONS,
    growths: Sequence[float] = DEFAULT_GROWTHS,
    live_rule: CooldownRule | None = None,
) -> dict[str, Any]:
    """Everything the CLI prints, as plain data."""
    scans = [e for e in events if e["event"] == "scan"]
    steps = [e for e in events if e["event"] == "step"]
    forward_s = sum(float(s["stats"].get("scan_forward_seconds", 0.0)) for s in steps)
    scanned = sum(float(s["stats"].get("scanned", 0.0)) for s in steps)
    counts = [
        shadow_count(scans, CooldownRule(tau=tau, margin=m, versions=k, drift_norm=drift_norm, growth=g))
        for m in margins
        for k in versions
        for g in (growths if k is not None else (0.0,))
    ]
    out: dict[str, Any] = {
        "tau": tau,
        "drift_norm": drift_norm,
        "steps": len(steps),
        "scans": len([s for s in scans if s.get("drift") is not None]),
        "accepted": sum(bool(s["accepted"]) for s in scans),
        "skipped_live": sum(len(e.get("group_ids", ())) for e in events if e["event"] == "skip"),
        "scan_forward_seconds": forward_s,
        "scan_forward_seconds_per_scanned_group": forward_s / scanned if scanned else 0.0,
        "rules": [{**asdict(c), "saved_share": c.saved_share, "kept_share": c.kept_share} for c in counts],
        "drift_by_age": drift_by_age(scans, tau),
        "comebacks": comebacks(scans, tau),
    }
    if live_rule is not None:
        out["live_check"] = _check_live(scans, live_rule) or "ok"
    return out


def _print(rep: Mapping[str, Any], file: Any = None) -> None:
    file = file or sys.stdout
    p = lambda *a: print(*a, file=file)  # noqa: E731
    sec = rep["scan_forward_seconds_per_scanned_group"]
    p(
        f"tau {rep['tau']:g} ({rep['drift_norm']}), {rep['steps']} steps, {rep['scans']} scans, "
        f"{rep['accepted']} accepted, {rep['skipped_live']} skipped live, "
        f"scan forward {rep['scan_forward_seconds']:.1f} s "
        f"({1e3 * sec:.2f} ms a scanned group)"
    )
    steps, accepted = max(rep["steps"], 1), max(rep["accepted"], 1)
    p(
        f"per global step: {rep['scans'] / steps:.1f} scanned, {rep['skipped_live'] / steps:.1f} skipped, "
        f"{rep['accepted'] / steps:.2f} accepted, scan forward {rep['scan_forward_seconds'] / steps:.2f} s; "
        f"{rep['scan_forward_seconds'] / accepted:.2f} s of scan forward per accepted group"
    )
    p("\nrule                            scans saved (share)   accepted lost / accepted  kept  est. forward s saved")
    for r in rep["rules"]:
        p(
            f"{r['rule']:<32}{r['skipped']:>7} ({r['saved_share']:6.1%})   {r['accepted_lost']:>6} / {r['accepted']:<6}"
            f"      {r['kept_share']:6.1%}  {r['skipped'] * sec:8.1f}"
        )
    p("\nages    scans  accepted  rejected drift/tau p50  p90")
    for r in rep["drift_by_age"]:
        p(
            f"{r['ages']:<8}{r['scans']:>5}  {r['accepted']:>8}  {r['rejected_drift_over_tau_p50']:>21.2f}"
            f"  {r['rejected_drift_over_tau_p90']:.2f}"
        )
    p("\nrejected at drift/tau   next scans  drift grew  accepted next")
    for r in rep["comebacks"]:
        p(f"{r['previous_drift_over_tau']:<24}{r['pairs']:>10}  {r['drift_grew']:>10.1%}  {r['accepted_next']:>13}")
    if "live_check" in rep:
        p(f"\nlive would_skip flags: {rep['live_check']}")


def _versions(text: str) -> list[int | None]:
    return [None if v.strip() in ("never", "none", "inf") else int(v) for v in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verl_replay.headroom_drift.shadow", description=__doc__.split("\n")[0]
    )
    parser.add_argument("events", help="replay_events.jsonl of a Headroom-Drift run")
    parser.add_argument("--tau", type=float, required=True, help="the run's replay.tau")
    parser.add_argument(
        "--drift-norm", default="l2", choices=("l2", "l1", "mean_sq"), help="the run's replay.drift_norm"
    )
    parser.add_argument("--margins", default=",".join(f"{m:g}" for m in DEFAULT_MARGINS))
    parser.add_argument(
        "--versions", default="2,4,8,16,never", help="skip lengths in weight versions; never = for good"
    )
    parser.add_argument(
        "--growths", default="0", help="skip growths: a skip lasts at least growth x the group's age (0 = off)"
    )
    parser.add_argument(
        "--live", default=None, help="MARGIN,VERSIONS[,GROWTH] of the run's rule: check its would_skip flags"
    )
    parser.add_argument("--json", default=None, help="also write the report as JSON to this path")
    args = parser.parse_args(argv)
    live = None
    if args.live:
        m, k, *g = args.live.split(",")
        live = CooldownRule(
            tau=args.tau,
            margin=float(m),
            versions=_versions(k)[0],
            drift_norm=args.drift_norm,
            growth=float(g[0]) if g else 0.0,
        )
    rep = report(
        read_events(args.events),
        tau=args.tau,
        drift_norm=args.drift_norm,
        margins=[float(m) for m in args.margins.split(",")],
        versions=_versions(args.versions),
        growths=[float(g) for g in args.growths.split(",")],
        live_rule=live,
    )
    _print(rep)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rep, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
