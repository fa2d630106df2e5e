"""The paper's scan and a scan-skip rule side by side: what each spends on the scan per global
step, what it accepts, and the held-out metric paired by seed.

    python -m verl_replay.compare.scan_cost --exact RUN [RUN ...] --skip RUN [RUN ...]

Each ``--exact`` run (``replay.scan_skip=none``) is paired with the ``--skip`` run of the same
position (the same seed, run at the same time so both carry the same machine load). Per run it
reads the step records of ``replay_events.jsonl`` and the validations of ``metrics.jsonl``.

Scan cost is given three ways: wall seconds inside the scan's forward passes (on the CPU test bed
they also carry the rollout's work, which shares the cores and runs during the scan), the actor
worker's CPU seconds in them (the forward's own compute), and forward rows. The share of the
paper's acceptances a rule keeps comes from the shadow of the exact run
(``python -m verl_replay.headroom_drift.shadow``), not from here: a skip run's own acceptances
follow a different trajectory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from verl_replay.compare.collect import collect_run
from verl_replay.compare.contrasts import Contrast, contrast_result

__all__ = ["STEP_FIELDS", "scan_cost", "side_by_side", "main"]

# (step stat, name in the report)
STEP_FIELDS = (
    ("scanned", "scanned"),
    ("scan_skipped", "skipped"),
    ("accepted", "accepted"),
    ("scan_forward_rows", "rows"),
    ("scan_forward_calls", "calls"),
    ("scan_forward_seconds", "wall_s"),
    ("scan_forward_cpu_seconds", "cpu_s"),
)
_SKIP_VS_EXACT = Contrast("headroom_drift", "skip", "exact", True, "scan skipping vs the paper's scan")


def scan_cost(run_dir: Path) -> dict[str, Any]:
    """Per-global-step means of the scan's step stats over the steps that had a buffer to scan."""
    steps = []
    for line in (Path(run_dir) / "replay_events.jsonl").read_text().splitlines():
        record = json.loads(line) if line.strip() else None
        if record and record.get("event") == "step" and float(record["stats"].get("candidates", 0)) > 0:
            steps.append(record["stats"])
    if not steps:
        raise ValueError(f"{run_dir}/replay_events.jsonl: no step with a buffer to scan")
    out: dict[str, Any] = {"steps": len(steps)}
    for stat, name in STEP_FIELDS:
        values = [float(s[stat]) for s in steps if stat in s]
        out[name] = sum(values) / len(steps) if len(values) == len(steps) else None
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def side_by_side(exact_runs: Sequence[Path], skip_runs: Sequence[Path]) -> dict[str, Any]:
    if len(exact_runs) != len(skip_runs) or not exact_runs:
        raise ValueError("give one --skip run for each --exact run (the same seed, run side by side)")
    pairs = []
    exact_results, skip_results = {}, {}
    for seed, (exact, skip) in enumerate(zip(exact_runs, skip_runs, strict=True), start=1):
        e, s = scan_cost(exact), scan_cost(skip)
        ratios = {name: _ratio(s[name], e[name]) for name in ("rows", "calls", "wall_s", "cpu_s")}
        pairs.append({"exact": str(exact), "skip": str(skip), "exact_cost": e, "skip_cost": s, "ratios": ratios})
        exact_results[seed], skip_results[seed] = collect_run(exact), collect_run(skip)
    measure = (
        "post_exact"
        if all(r.get("post_exact") is not None for r in [*exact_results.values(), *skip_results.values()])
        else "post_mean"
    )
    return {
        "pairs": pairs,
        "metric": contrast_result(_SKIP_VS_EXACT, skip_results, exact_results, measure, None),
        "per_seed": {
            seed: {"exact": exact_results[seed].get(measure), "skip": skip_results[seed].get(measure)}
            for seed in exact_results
        },
    }


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def render(report: Mapping[str, Any]) -> str:
    lines = ["per global step (mean over steps with a buffer): exact -> skip (skip / exact)"]
    for k, pair in enumerate(report["pairs"], start=1):
        e, s, r = pair["exact_cost"], pair["skip_cost"], pair["ratios"]
        lines.append(f"pair {k}: {pair['exact']}  vs  {pair['skip']}  ({e['steps']} / {s['steps']} steps)")
        for name, spec in (
            ("scanned", ".1f"),
            ("skipped", ".1f"),
            ("accepted", ".2f"),
            ("rows", ".0f"),
            ("calls", ".2f"),
            ("wall_s", ".2f"),
            ("cpu_s", ".2f"),
        ):
            ratio = r.get(name)
            lines.append(
                f"  {name:<9}{_fmt(e[name], spec):>9} -> {_fmt(s[name], spec):>9}"
                + (f"   ({ratio:.2f}x)" if ratio is not None else "")
            )
    m = report["metric"]
    lines.append(
        f"held-out {m['measure']} per seed (exact, skip): "
        + ", ".join(f"{_fmt(v['exact'], '.4f')} / {_fmt(v['skip'], '.4f')}" for v in report["per_seed"].values())
    )
    if m.get("mean") is not None:
        interval = "" if m.get("low") is None else f" [{100 * m['low']:+.1f}, {100 * m['high']:+.1f}]"
        mde = "" if m.get("mde") is None else f", MDE {100 * m['mde']:.1f} points"
        lines.append(f"skip - exact: {100 * m['mean']:+.1f} points{interval} ({m['n']} seeds{mde}): {m['verdict']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verl_replay.compare.scan_cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--exact", nargs="+", type=Path, required=True, help="runs with replay.scan_skip=none")
    parser.add_argument("--skip", nargs="+", type=Path, required=True, help="the same seeds with a skip rule")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    try:
        report = side_by_side(args.exact, args.skip)
    except (OSError, ValueError) as error:
        print(f"scan_cost: {error}", file=sys.stderr)
        return 2
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
