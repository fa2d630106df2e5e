"""``python -m verl_replay.compare``: the papers' strategy comparisons with one command.

    python -m verl_replay.compare                                   # tiny profile, both comparisons, seeds 1,2,3
    python -m verl_replay.compare --comparison headroom_drift --seeds 1,2,3,4,5
    python -m verl_replay.compare --profile arith --jobs 2          # the learnable addition task, 2 runs at once
    python -m verl_replay.compare --profile shapes --jobs 2         # SQL with several right query shapes (elite)
    python -m verl_replay.compare --profile arith,shapes --jobs 2   # both papers' learnable comparisons, one queue
    python -m verl_replay.compare --profile paper --dry-run         # print every arm's command (GPU cluster)
    DRY_RUN=1 python -m verl_replay.compare --profile paper         # the same

Each arm and seed is one recipe run (``recipes/*.sh`` -> ``python -m verl_replay.main``) into
``OUT/runs/<comparison>/<arm>/seed<S>`` with its output in ``OUT/logs/``; the elite arms share one
archive built once (``OUT/archive``). Finished runs are skipped when the command is repeated, so
an interrupted comparison continues where it stopped. Then ``OUT/comparison.json``,
``OUT/table.md`` and ``OUT/curves.png`` are written (also with ``--report-only``, from the runs
that finished). Exit status 1 if a run failed, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from verl_replay.compare.plan import (
    COMPARISONS,
    PROFILES,
    TARGET_REPLAY_KL,
    Plan,
    arith_profile,
    build_plan,
    paper_profile,
    shapes_profile,
    tau_rule,
    tiny_profile,
)


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _seeds(text: str) -> list[int]:
    try:
        return [int(part) for part in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _profiles(text: str) -> list[str]:
    names = _csv(text)
    unknown = [name for name in names if name not in PROFILES]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct names of {', '.join(PROFILES)}, got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m verl_replay.compare",
        description="Run the papers' strategy comparisons through the recipes and report them.",
    )
    p.add_argument(
        "--comparison",
        type=_csv,
        default=None,
        help=f"comma-separated: {', '.join(COMPARISONS)} "
        "(default: every one the profile has; arith: headroom_drift; shapes: elite)",
    )
    p.add_argument(
        "--profile",
        type=_profiles,
        default=["tiny"],
        help="tiny: CPU, minutes (default); arith: CPU, the learnable addition task (GRPO learns); "
        "shapes: CPU, SQL questions with three right query shapes (GRPO vs archive replay); "
        "paper: the recipes' paper-scale settings (GPU cluster). Comma-separated for several in one "
        "queue (arith,shapes: both papers' learnable comparisons), each into OUT/<profile>",
    )
    p.add_argument("--seeds", type=_seeds, default=[1, 2, 3], help="comma-separated seeds (default: 1,2,3)")
    p.add_argument(
        "--other-seeds",
        type=_seeds,
        default=None,
        help="seeds (some of --seeds) for the arms no main contrast reads: the larger on-policy batch, "
        "the ablations, the controls (default: every seed)",
    )
    p.add_argument(
        "--arms",
        type=_csv,
        default=None,
        help="only these arms (grpo_matched, grpo_larger, naive, headroom_drift, headroom_only, drift_only, "
        "grpo_control [arith]; grpo, elite_iid, elite, elite_mu0 [shapes])",
    )
    p.add_argument("--out", default=None, help="output folder (default: outputs/compare_<profile>)")
    p.add_argument("--steps", type=int, default=None, help="global training steps per run (tiny: 6, paper: 500)")
    p.add_argument("--test-freq", type=int, default=None, help="validation every N global steps (tiny: 2, paper: 50)")
    p.add_argument("--val-n", type=int, default=None, help="validation samples per question (tiny: 2, paper: 32)")
    p.add_argument(
        "--tau",
        type=float,
        default=None,
        help=f"Policy Drift gate (default: the documented rule sqrt(2 x {TARGET_REPLAY_KL}) = {tau_rule():.4f})",
    )
    p.add_argument("--recipes-dir", default=None, help="the recipes/ folder (default: the one next to the package)")
    p.add_argument("--python", default=sys.executable, help="interpreter the recipes run (default: this one)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (every command) and exit; also DRY_RUN=1")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no run that would likely end past this many seconds (repeat the command to continue)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs side by side (default 1; 2 on a 2-core machine overlaps one run's start-up with another's steps)",
    )
    p.add_argument("--report-only", action="store_true", help="write the report from the finished runs, run nothing")
    p.add_argument(
        "--from-json",
        default=None,
        metavar="PATH",
        help="report again from a stored comparison.json (its runs, today's statistics) into --out "
        "(default: next to it); runs nothing",
    )
    return p


def _recipes_dir(given: Optional[str]) -> Path:
    path = Path(given) if given else Path(__file__).resolve().parents[2] / "recipes"
    if not (path / "headroom_drift_math.sh").is_file():
        raise SystemExit(
            f"python -m verl_replay.compare: no recipes in {path} "
            "(run from a source checkout, or pass --recipes-dir PATH/recipes)"
        )
    return path


def _dry_run_env() -> bool:
    return os.environ.get("DRY_RUN", "0").strip().lower() in ("1", "true", "yes")


MAKE_PROFILE = {"tiny": tiny_profile, "arith": arith_profile, "shapes": shapes_profile, "paper": paper_profile}


def make_plans(args: argparse.Namespace) -> list[Plan]:
    """One plan per ``--profile``; several profiles write into ``OUT/<profile>``."""
    for name in ("steps", "test_freq", "val_n", "jobs"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.tau is not None and not args.tau > 0:
        raise ValueError(f"--tau must be > 0, got {args.tau}")
    names = args.profile if isinstance(args.profile, list) else [args.profile]
    several = len(names) > 1
    if several and (args.comparison is not None or args.arms):
        raise ValueError("--comparison and --arms choose within one profile; run several profiles whole")
    out = Path(args.out or f"outputs/compare_{'_'.join(names)}")
    plans = []
    for name in names:
        profile = MAKE_PROFILE[name](args.steps, args.test_freq, args.val_n)
        plans.append(
            build_plan(
                comparisons=args.comparison if args.comparison is not None else list(profile.comparisons),
                profile=profile,
                seeds=args.seeds,
                out_dir=out / name if several else out,
                recipes_dir=_recipes_dir(args.recipes_dir),
                python=args.python,
                arms=args.arms,
                tau=args.tau,
                other_seeds=getattr(args, "other_seeds", None),
            )
        )
    return plans


def print_plan(plan: Plan) -> None:
    print(
        f"# profile {plan.profile.name}: global steps {plan.profile.steps}, validation every "
        f"{plan.profile.test_freq} steps with val_kwargs.n={plan.profile.val_n} (sampled); tau={plan.tau:.6g} "
        f"(rule: sqrt(2 x {TARGET_REPLAY_KL}))"
    )
    if plan.search is not None:
        print(f"# archive search (once, shared by the elite arms)\n{plan.search.shell()}")
    for run in plan.runs:
        print(f"# {run.key}: {run.arm.label}\n{run.shell()}")


def collect_document(plan: Plan, records: dict[str, dict[str, Any]], wall_s: Optional[float]) -> dict[str, Any]:
    from verl_replay.compare.collect import RunResultError, borrow_step0, collect_run
    from verl_replay.compare.report import SCHEMA_VERSION, aggregate
    from verl_replay.compare.runner import read_done

    comparisons, problems = [], []
    for comparison in plan.comparisons:
        arms = plan.arms(comparison)
        runs: dict[str, dict[int, dict[str, Any]]] = {}
        for spec in plan.runs:
            if spec.arm.comparison != comparison:
                continue
            done = read_done(spec.run_dir)
            if done is None:
                problems.append(f"{spec.key}: not finished")
                continue
            try:
                result = collect_run(spec.run_dir, expected_steps=plan.profile.steps[comparison])
            except RunResultError as exc:
                problems.append(f"{spec.key}: {exc}")
                continue
            result["wall_s"] = done["wall_s"]
            result["command"] = done["command"]
            runs.setdefault(spec.arm.name, {})[spec.seed] = result
        for spec in plan.runs:  # the seed's one evaluation before training, where a run shares it
            result = runs.get(spec.arm.name, {}).get(spec.seed)
            source = runs.get(spec.step0_from or "", {}).get(spec.seed)
            if spec.arm.comparison == comparison and result is not None and source is not None:
                borrow_step0(result, source, spec.step0_from)
        arm_meta = [
            {"name": a.name, "label": a.label, "recipe": a.recipe, "fresh_prompts_per_step": a.fresh_prompts}
            for a in arms
        ]
        comparisons.append(aggregate(comparison, arm_meta, runs, target_effect=plan.profile.target_effect))
    run_walls = [r.get("wall_s", 0.0) for r in records.values()] if records else []
    return {
        "schema_version": SCHEMA_VERSION,
        "profile": plan.profile.name,
        "settings": {k: v for k, v in vars(plan.profile).items()},
        "steps": dict(plan.profile.steps),
        "seeds": sorted({r.seed for r in plan.runs}),
        "tau": plan.tau,
        "tau_rule": f"sqrt(2 x {TARGET_REPLAY_KL}) (docs/headroom_drift.md, 'Choosing tau')",
        "archive": str(plan.archive) if plan.archive else None,
        "wall_time_s": wall_s,
        "runs_wall_time_s": sum(run_walls) if run_walls else None,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "problems": problems,
        "comparisons": comparisons,
        "runs": _run_points(comparisons),
        "models": _starting_models(comparisons),
    }


def _starting_models(comparisons: list[dict[str, Any]]) -> list[dict[str, Optional[str]]]:
    """The distinct models the runs started from (one, unless the arms were given different ones)."""
    seen: dict[tuple, dict[str, Optional[str]]] = {}
    for comp in comparisons:
        for arm in comp["arms"]:
            for result in arm["runs"].values():
                model = result.get("model") or {}
                if model.get("path"):
                    seen.setdefault((model["path"], model.get("sha256")), model)
    return [seen[key] for key in sorted(seen, key=str)]


def _run_points(comparisons: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every finished run as ``{"arm", "seed", "points": [{"step", "fresh_responses", ...}]}``."""
    out = []
    for comp in comparisons:
        for arm in comp["arms"]:
            for seed, result in arm["runs"].items():
                points = [
                    {
                        "step": p["step"],
                        "fresh_responses": p.get("fresh_responses"),
                        "mean": p["mean"],
                        "best": p["best"],
                        "exact": p.get("exact"),
                    }
                    for p in result.get("val_curve", [])
                ]
                out.append({"comparison": comp["comparison"], "arm": arm["name"], "seed": int(seed), "points": points})
    return out


def report_from_json(path: Path, out_dir: Optional[Path]) -> int:
    from verl_replay.compare.report import format_table, reaggregate, write_outputs

    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        document = reaggregate(stored)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"python -m verl_replay.compare: --from-json {path}: not a comparison document ({exc})", file=sys.stderr)
        return 2
    document["runs"] = _run_points(document["comparisons"])
    paths = write_outputs(out_dir or path.parent, document)
    for comp in document["comparisons"]:
        print(f"\n## {comp['comparison']}\n")
        print(format_table(comp))
    print(f"[compare] wrote {paths['json']}, {paths['table']}, {paths['png']}", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json:
        return report_from_json(Path(args.from_json), Path(args.out) if args.out else None)
    dry_run = args.dry_run or _dry_run_env()
    try:
        plans = make_plans(args)
    except ValueError as exc:
        print(f"python -m verl_replay.compare: {exc}", file=sys.stderr)
        return 2
    if dry_run:
        for plan in plans:
            print_plan(plan)
        return 0
    from verl_replay.compare.report import format_table, write_outputs
    from verl_replay.compare.runner import run_plans

    start = time.monotonic()
    all_records: list[dict[str, dict[str, Any]]] = [{} for _ in plans]
    if not args.report_only:
        all_records = run_plans(plans, time_budget_s=args.time_budget, jobs=args.jobs)
    wall = None if args.report_only else time.monotonic() - start
    problems = failed = False
    for plan, records in zip(plans, all_records, strict=True):
        document = collect_document(plan, records, wall)
        if len(plans) > 1:  # the wall time is the whole command's, every profile's runs included
            document["command_profiles"] = [p.profile.name for p in plans]
        paths = write_outputs(plan.out_dir, document)
        for comp in document["comparisons"]:
            print(f"\n## {comp['comparison']}" + (f" ({plan.profile.name})" if len(plans) > 1 else "") + "\n")
            print(format_table(comp))
        for problem in document["problems"]:
            print(f"[compare] missing: {problem}", file=sys.stderr)
        print(f"[compare] wrote {paths['json']}, {paths['table']}, {paths['png']}", file=sys.stderr)
        problems = problems or bool(document["problems"])
        failed = failed or any(r.get("returncode") not in (0,) for r in records.values())
    if wall is not None:
        print(f"[compare] wall time {wall:.0f}s", file=sys.stderr)
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
