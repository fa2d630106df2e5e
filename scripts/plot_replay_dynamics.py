#!/usr/bin/env python
"""Plot replay dynamics from a Headroom-Drift event log.

    python scripts/plot_replay_dynamics.py --events outputs/verl_replay/RUN/replay_events.jsonl --out-dir plots/

Writes three PNGs and the tables behind them (``tables.json``). Titles carry the run's strategy,
tau and K_rep, read from the ``config.yaml`` next to the event log (the run dir) unless given
with ``--tau`` / ``--k-rep``; every bin shows how many groups or scans it holds.

(a) ``replay_by_headroom_decile.png``: mean lifetime replay count and P(replayed at least
    once) per initial-Headroom decile. Deciles are equal-count: groups sorted by initial
    Headroom (ties by group_id), the i-th of N (0-based) is in decile floor(10 i / N).
    A group's replay count is the number of its accepted scans in the log. By default every
    ingressed group counts (groups still buffered at the end are censored: they may be
    replayed later); ``--completed-only`` keeps only evicted groups, whose lifetime is over.
(b) ``acceptance_by_age.png``: acceptance rate of scanned groups vs age at scan time, one
    point per integer age. Ages count weight versions since the policy that generated the group
    (``(step - 1) - generated_version``; in synchronous training, steps since admission); the
    fresh groups' ages (``fresh`` records) are marked: a buffered group is always older.
(c) ``scan_depth_over_steps.png``: scan depth and accepted count per step, from the
    ``step`` summaries.
(d) ``drift_vs_tau.png``: per step, every scanned group's drift (accepted / rejected) against
    tau and the drift floor, the median and 90th percentile of the fresh groups' drift (the
    gate's statistic over groups that were never buffered: the rollout engine's log-probs
    against the trainer's). Not drawn for the naive baseline, which measures no drift.
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
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from verl_replay.headroom_drift.events import read_events  # noqa: E402

PLOTS = {
    "deciles": "replay_by_headroom_decile.png",
    "age": "acceptance_by_age.png",
    "steps": "scan_depth_over_steps.png",
    "drift": "drift_vs_tau.png",
}


def decile_table(events: Sequence[dict[str, Any]], completed_only: bool = False) -> list[dict]:
    """Rows (one per non-empty decile): decile, groups, headroom_min/max, mean_replays,
    p_replayed."""
    initial = {e["group_id"]: float(e["initial_headroom"]) for e in events if e["event"] == "ingress"}
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
        rows.append(
            {
                "decile": d + 1,
                "groups": len(gids),
                "headroom_min": min(initial[g] for g in gids),
                "headroom_max": max(initial[g] for g in gids),
                "mean_replays": sum(counts) / len(counts),
                "p_replayed": sum(c > 0 for c in counts) / len(counts),
            }
        )
    return rows


def age_table(events: Sequence[dict[str, Any]]) -> list[dict]:
    """Rows per age at scan time: age, scans, accepted, acceptance_rate."""
    scans: Counter[int] = Counter()
    acc: Counter[int] = Counter()
    for e in events:
        if e["event"] == "scan":
            scans[int(e["age"])] += 1
            acc[int(e["age"])] += bool(e["accepted"])
    return [
        {"age": a, "scans": scans[a], "accepted": acc[a], "acceptance_rate": acc[a] / scans[a]} for a in sorted(scans)
    ]


def fresh_age_table(events: Sequence[dict[str, Any]]) -> list[dict]:
    """Rows per age of the fresh groups (``fresh`` records, the last one of each step): age, groups."""
    by_step = {int(e["step"]): e for e in events if e["event"] == "fresh"}
    ages: Counter[int] = Counter(int(a) for e in by_step.values() for a in e["age"])
    return [{"age": a, "groups": ages[a]} for a in sorted(ages)]


def _quantile(values: Sequence[float], q: float) -> float:
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] if v[lo] == v[hi] else v[lo] + (v[hi] - v[lo]) * (pos - lo)


def drift_table(events: Sequence[dict[str, Any]]) -> list[dict]:
    """Rows per step that measured drift: step, scanned and accepted drifts (lists), and the drift
    floor of its fresh groups (floor_p50, floor_p90; None without a ``fresh`` record with drifts)."""
    scans: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e["event"] == "scan" and e["drift"] is not None:
            scans[int(e["step"])].append(e)
    floors = {int(e["step"]): e["drift"] for e in events if e["event"] == "fresh" and e.get("drift")}
    rows = []
    for step in sorted(set(scans) | set(floors)):
        fresh = floors.get(step)
        rows.append(
            {
                "step": step,
                "drift_accepted": [float(e["drift"]) for e in scans[step] if e["accepted"]],
                "drift_rejected": [float(e["drift"]) for e in scans[step] if not e["accepted"]],
                "floor_p50": _quantile(fresh, 0.5) if fresh else None,
                "floor_p90": _quantile(fresh, 0.9) if fresh else None,
            }
        )
    return rows


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
    return {
        "deciles": decile_table(events, completed_only),
        "age": age_table(events),
        "fresh_age": fresh_age_table(events),
        "steps": steps_table(events),
        "drift": drift_table(events),
    }


def run_settings(events_path: Path, tau: float | None = None, k_rep: int | None = None) -> dict[str, Any]:
    """strategy / tau / k_rep of the run: the flags, else the run dir's ``config.yaml``."""
    settings: dict[str, Any] = {"strategy": None, "tau": None, "k_rep": None}
    config_file = Path(events_path).parent / "config.yaml"
    if config_file.is_file():
        try:
            config = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as error:
            raise ValueError(f"{config_file}: not a YAML config ({type(error).__name__})") from None
        replay = (config.get("replay") if isinstance(config, dict) else None) or {}
        if isinstance(replay, dict):
            settings.update({key: replay.get(key) for key in settings})
    if tau is not None:
        settings["tau"] = tau
    if k_rep is not None:
        settings["k_rep"] = k_rep
    return settings


def settings_label(settings: dict[str, Any]) -> str:
    """`` (headroom_drift, tau=0.05, K_rep=2)``; the naive baseline has no gate, so no tau."""
    parts = []
    if settings.get("strategy"):
        parts.append(str(settings["strategy"]))
    if settings.get("tau") is not None and settings.get("strategy") != "naive":
        parts.append(f"tau={settings['tau']:g}")
    if settings.get("k_rep") is not None:
        parts.append(f"K_rep={settings['k_rep']}")
    return f" ({', '.join(parts)})" if parts else ""


def _integer_axis(axis: Any) -> None:
    axis.set_major_locator(MaxNLocator(integer=True))


def _save(fig: Any, path: Path) -> Any:
    """Write the PNG and release pyplot's hold on the figure (returned for inspection)."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in the log", ha="center", va="center", transform=ax.transAxes)


def plot_deciles(rows: list[dict], path: Path, completed_only: bool, label: str = "") -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    if rows:
        x = [r["decile"] for r in rows]
        bars = ax.bar(x, [r["mean_replays"] for r in rows], color="tab:blue", alpha=0.7, label="mean lifetime replays")
        ax.bar_label(bars, labels=[f"n={r['groups']}" for r in rows], fontsize=7, padding=2)
        ax.set_ylabel("mean lifetime replay count")
        ax.set_ylim(0, max(r["mean_replays"] for r in rows) * 1.15 or 1)
        ax2 = ax.twinx()
        ax2.plot(x, [r["p_replayed"] for r in rows], "o-", color="tab:red", label="P(replayed >= 1)")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("P(replayed at least once)")
        ax.set_xticks(x)
        fig.legend(loc="upper left", bbox_to_anchor=(0.1, 0.9))
    else:
        _empty(ax, "ingressed groups")
    ax.set_xlabel("initial Headroom decile (1 = lowest; n = groups in the decile)")
    ax.set_title("Replay vs initial Headroom" + (" (evicted groups)" if completed_only else "") + label)
    return _save(fig, path)


def plot_age(rows: list[dict], path: Path, label: str = "", fresh: Sequence[dict] = ()) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(fresh):  # where fresh data sits: replayed groups are older
        ax.axvspan(
            r["age"] - 0.4, r["age"] + 0.4, color="tab:green", alpha=0.15, label="fresh groups" if not i else None
        )
    if rows:
        ages = [r["age"] for r in rows]
        counts = ax.twinx()  # scans per age: how much each point of the rate rests on
        counts.bar(ages, [r["scans"] for r in rows], color="0.85", width=0.8, label="scans")
        counts.set_ylabel("scans at this age")
        _integer_axis(counts.yaxis)
        ax.set_zorder(counts.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.plot(ages, [r["acceptance_rate"] for r in rows], "o-", label="acceptance rate")
        ax.set_ylim(-0.02, 1.02)
        if fresh:
            ax.legend(loc="lower left")
    else:
        _empty(ax, "scans")
    _integer_axis(ax.xaxis)
    ax.set_xlabel("age at scan (weight versions since generation)")
    ax.set_ylabel("acceptance rate")
    ax.set_title("Drift-gate acceptance vs age" + label)
    return _save(fig, path)


def plot_steps(rows: list[dict], path: Path, label: str = "", k_rep: int | None = None) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    if rows:
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["scan_depth"] for r in rows], label="scan depth")
        ax.plot(steps, [r["accepted"] for r in rows], label="accepted")
        if k_rep is not None:
            ax.axhline(k_rep, color="0.5", linestyle=":", label=f"K_rep = {k_rep}")
        ax.legend()
    else:
        _empty(ax, "step summaries")
    _integer_axis(ax.xaxis)
    _integer_axis(ax.yaxis)
    ax.set_xlabel("step")
    ax.set_ylabel("groups")
    ax.set_title("Scan depth and accepted groups" + label)
    return _save(fig, path)


def drift_title(tau: bool, floor: bool) -> str:
    """The drift plot's title names only what it draws: tau's line, the fresh groups' floor."""
    drawn = [name for name, shown in (("tau", tau), ("the drift floor", floor)) if shown]
    return "Policy Drift of the scanned groups" + (f" against {' and '.join(drawn)}" if drawn else "")


def plot_drift(rows: list[dict], path: Path, label: str = "", tau: float | None = None) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn_floor = False
    if rows:
        for key, style, name in (
            ("drift_accepted", dict(color="tab:blue", marker="o"), "accepted"),
            ("drift_rejected", dict(color="tab:red", marker="x"), "rejected"),
        ):
            points = [(r["step"], d) for r in rows for d in r[key] if math.isfinite(d)]
            if points:
                ax.scatter(*zip(*points, strict=True), s=14, alpha=0.6, label=f"scanned, {name}", **style)
        floor = [r for r in rows if r["floor_p50"] is not None]
        drawn_floor = bool(floor)
        if floor:
            steps = [r["step"] for r in floor]
            ax.fill_between(
                steps,
                [r["floor_p50"] for r in floor],
                [r["floor_p90"] for r in floor],
                color="0.6",
                alpha=0.3,
                label="fresh groups p50-p90",
            )
            ax.plot(steps, [r["floor_p50"] for r in floor], color="0.3", label="drift floor (fresh p50)")
        if tau is not None:
            ax.axhline(tau, color="black", linestyle="--", label=f"tau = {tau:g}")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    else:
        _empty(ax, "drift measurements")
    _integer_axis(ax.xaxis)
    ax.set_xlabel("step")
    ax.set_ylabel("Policy Drift")
    ax.set_title(drift_title(tau is not None and bool(rows), drawn_floor) + label)
    return _save(fig, path)


def input_error(error: BaseException) -> str:
    """One line for an input the script cannot read (a missing or unreadable file, a folder where
    a file belongs, a line that is not an event record, a config.yaml that is not YAML)."""
    if isinstance(error, OSError) and error.filename is not None:
        reason = {
            FileNotFoundError: "not found",
            IsADirectoryError: "is a folder, not a file",
            NotADirectoryError: "lies under a file, not a folder",
            PermissionError: "cannot be read or written (permission denied)",
            FileExistsError: "exists and is not a folder",
        }.get(type(error), error.strerror or type(error).__name__)
        return f"{error.filename}: {reason}"
    if isinstance(error, UnicodeDecodeError):
        return f"not a text file ({error.reason} at byte {error.start}); --events takes a replay_events.jsonl"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


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
    ap.add_argument(
        "--completed-only", action="store_true", help="decile plot: only groups whose eviction is in the log"
    )
    ap.add_argument("--tau", type=float, default=None, help="the run's tau (default: from its config.yaml)")
    ap.add_argument("--k-rep", type=int, default=None, help="the run's K_rep (default: from its config.yaml)")
    args = ap.parse_args(argv)
    try:
        return plot(args)
    except (OSError, ValueError, UnicodeDecodeError) as error:
        ap.exit(2, f"plot_replay_dynamics: error: {input_error(error)}\n")


def plot(args: argparse.Namespace) -> dict:
    """Read the log and the run's settings, write the PNGs and tables.json; returns the tables."""
    events = read_events(args.events)
    settings = run_settings(Path(args.events), args.tau, args.k_rep)
    label = settings_label(settings)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = compute_tables(events, args.completed_only)
    plot_deciles(tables["deciles"], out / PLOTS["deciles"], args.completed_only, label)
    plot_age(tables["age"], out / PLOTS["age"], label, tables["fresh_age"])
    plot_steps(tables["steps"], out / PLOTS["steps"], label, settings["k_rep"])
    if settings.get("strategy") != "naive":
        plot_drift(tables["drift"], out / PLOTS["drift"], label, settings["tau"])
    document = {"settings": settings, **tables}
    (out / "tables.json").write_text(json.dumps(_json_safe(document), indent=1) + "\n")
    for name in PLOTS.values():
        if (out / name).exists():
            print(out / name)
    return tables


if __name__ == "__main__":
    main(sys.argv[1:])
