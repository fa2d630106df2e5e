#!/usr/bin/env python
"""Plot replay dynamics from a Headroom-Drift event log (SPEC 1.5).

    python scripts/plot_replay_dynamics.py --events runs/x/replay_events.jsonl --out-dir DIR

Writes three PNGs and the tables behind them (``tables.json``):

(a) ``replay_by_headroom_decile.png``: mean lifetime replay count and P(replayed at least
    once) per initial-Headroom decile. Deciles are equal-count: groups sorted by initial
    Headroom (ties by group_id), the i-th of N (0-based) is in decile floor(10 i / N).
    A group's replay count is the number of its accepted scans in the log. By default every
    ingressed group counts (groups still buffered at the end are censored: they may be
    replayed later); ``--completed-only`` keeps only evicted groups, whose lifetime is over.
(b) ``acceptance_by_age.png``: acceptance rate of scanned groups vs age (steps since birth)
    at scan time, one point per integer age.
(c) ``scan_depth_over_steps.png``: scan depth and accepted count per step, from the
    ``step`` summaries.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from verl_replay.headroom_drift.events import read_events  # noqa: E402

PLOTS = {
    "deciles": "replay_by_headroom_decile.png",
    "age": "acceptance_by_age.png",
    "steps": "scan_depth_over_steps.png",
}


def decile_table(events: Sequence[dict[str, Any]], completed_only: bool = False) -> list[dict]:
    """Rows (one per non-empty decile): decile, groups, headroom_min/max, mean_replays,
    p_replayed."""
    initial = {e["group_id"]: float(e["initial_headroom"]) for e in events
               if e["event"] == "ingress"}
    replays = Counter(e["group_id"] for e in events if e["event"] == "scan" and e["accepted"])
    if completed_only:
        ended = {e["group_id"] for e in events if e["event"] == "evict"}
        initial = {g: h for g, h in initial.items() if g in ended}
    order = sorted(initial, key=lambda g: (initial[g], g))
    n = len(order)
    bins: dict[int, list[int]] = defaultdict(list)
    for i, gid in enumerate(order):
        bins[(10 * i) // n].append(gid)
    rows = []
    for d in sorted(bins):
        gids = bins[d]
        counts = [replays[g] for g in gids]
        rows.append({
            "decile": d + 1,
            "groups": len(gids),
            "headroom_min": min(initial[g] for g in gids),
            "headroom_max": max(initial[g] for g in gids),
            "mean_replays": sum(counts) / len(counts),
            "p_replayed": sum(c > 0 for c in counts) / len(counts),
        })
    return rows


def age_table(events: Sequence[dict[str, Any]]) -> list[dict]:
    """Rows per age at scan time: age, scans, accepted, acceptance_rate."""
    scans: Counter[int] = Counter()
    acc: Counter[int] = Counter()
    for e in events:
        if e["event"] == "scan":
            scans[int(e["age"])] += 1
            acc[int(e["age"])] += bool(e["accepted"])
    return [{"age": a, "scans": scans[a], "accepted": acc[a],
             "acceptance_rate": acc[a] / scans[a]} for a in sorted(scans)]


def steps_table(events: Sequence[dict[str, Any]]) -> list[dict]:
    """Rows per step summary: step, scan_depth, accepted, scanned (later records of a step
    replace earlier ones, e.g. after a resume without truncation)."""
    by_step: dict[int, dict] = {}
    for e in events:
        if e["event"] == "step":
            s = e["stats"]
            by_step[int(e["step"])] = {
                "step": int(e["step"]),
                "scan_depth": float(s.get("scan_depth", 0.0)),
                "accepted": float(s.get("accepted", 0.0)),
                "scanned": float(s.get("scanned", 0.0)),
            }
    return [by_step[k] for k in sorted(by_step)]


def compute_tables(events: Sequence[dict[str, Any]], completed_only: bool = False) -> dict:
    return {"deciles": decile_table(events, completed_only), "age": age_table(events),
            "steps": steps_table(events)}


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in the log", ha="center", va="center", transform=ax.transAxes)


def plot_deciles(rows: list[dict], path: Path, completed_only: bool) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    if rows:
        x = [r["decile"] for r in rows]
        ax.bar(x, [r["mean_replays"] for r in rows], color="tab:blue", alpha=0.7,
               label="mean lifetime replays")
        ax.set_ylabel("mean lifetime replay count")
        ax2 = ax.twinx()
        ax2.plot(x, [r["p_replayed"] for r in rows], "o-", color="tab:red",
                 label="P(replayed >= 1)")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("P(replayed at least once)")
        ax.set_xticks(x)
        fig.legend(loc="upper left", bbox_to_anchor=(0.1, 0.9))
    else:
        _empty(ax, "ingressed groups")
    ax.set_xlabel("initial Headroom decile (1 = lowest)")
    ax.set_title("Replay vs initial Headroom" + (" (evicted groups)" if completed_only else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_age(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    if rows:
        ax.plot([r["age"] for r in rows], [r["acceptance_rate"] for r in rows], "o-")
        ax.set_ylim(-0.02, 1.02)
    else:
        _empty(ax, "scans")
    ax.set_xlabel("age at scan (steps since birth)")
    ax.set_ylabel("acceptance rate")
    ax.set_title("Drift-gate acceptance vs age")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_steps(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    if rows:
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["scan_depth"] for r in rows], label="scan depth")
        ax.plot(steps, [r["accepted"] for r in rows], label="accepted")
        ax.legend()
    else:
        _empty(ax, "step summaries")
    ax.set_xlabel("step")
    ax.set_ylabel("groups")
    ax.set_title("Scan depth and accepted replay groups")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", required=True, help="replay_events.jsonl written by ReplayEventLog")
    ap.add_argument("--out-dir", required=True, help="directory for the PNGs and tables.json")
    ap.add_argument("--completed-only", action="store_true",
                    help="decile plot: only groups whose eviction is in the log")
    args = ap.parse_args(argv)
    events = read_events(args.events)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = compute_tables(events, args.completed_only)
    plot_deciles(tables["deciles"], out / PLOTS["deciles"], args.completed_only)
    plot_age(tables["age"], out / PLOTS["age"])
    plot_steps(tables["steps"], out / PLOTS["steps"])
    (out / "tables.json").write_text(json.dumps(_json_safe(tables), indent=1) + "\n")
    for name in PLOTS.values():
        print(out / name)
    return tables


if __name__ == "__main__":
    main(sys.argv[1:])
