"""Aggregate runs over seeds; write ``comparison.json``, ``table.md`` and ``curves.png``.

Seed noise: an arm's difference to the comparison's reference arm (its first arm, the matched
on-policy GRPO run) is called *within seed noise* when it is smaller than two standard errors
of the difference, ``2 * sqrt(s_a^2 / n_a + s_r^2 / n_r)`` (s: the sample standard deviation over
seeds). With 3 seeds this is a coarse screen, not a significance test.

Paired by seed (``verl_replay.compare.paired``): per seed ``arm - reference`` of the final value,
of the mean over all evaluations and of the value at the reference's fresh-response budget, with
the mean difference's 95% t interval over the seeds both arms finished.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from verl_replay._files import atomic_write_text
from verl_replay.compare.contrasts import CONTRASTS, contrast_result, primary_measure
from verl_replay.compare.paired import curve_auc, paired_difference, value_at_fresh_responses

__all__ = [
    "SCHEMA_VERSION",
    "mean_std",
    "noise_verdict",
    "aggregate",
    "gain_over_start",
    "reaggregate",
    "format_table",
    "format_contrasts",
    "format_cost",
    "run_cost",
    "plot_curves",
    "write_outputs",
]

SCHEMA_VERSION = 2  # 2: paired differences, the mean over evaluations, fresh responses per point

# what an arm of a comparison document carries besides its results
_ARM_META = ("name", "label", "recipe", "fresh_prompts_per_step")

# (key in a run's result, column title, formatter kind)
_HD_COLUMNS = [
    ("final_mean", "Mean@{n} (final)", "pct"),
    ("auc_mean", "Mean@{n} (all evaluations)", "pct"),
    ("final_best", "Best@{n} (final)", "pct"),
    ("fresh_responses", "fresh responses", "int"),
    ("step_time_s", "s / step", "sec"),
    ("replay_acceptance", "replay acceptance", "pct"),
    ("replay_token_share", "replay token share", "pct"),
    ("replay_kl_accepted", "replay KL (accepted)", "sci"),
]
_ELITE_COLUMNS = [
    ("final_mean", "val Mean@{n} (final)", "pct"),
    ("auc_mean", "val Mean@{n} (all evaluations)", "pct"),
    ("eval:pass@1", "pass@1", "pct"),
    ("eval:pass@{kmax}", "pass@{kmax}", "pct"),
    ("eval:distinct_strategies", "distinct correct strategies", "num"),
    ("fresh_responses", "fresh responses", "int"),
    ("step_time_s", "s / step", "sec"),
    ("elite_token_share", "elite token share", "pct"),
]


def mean_std(values: Sequence[float]) -> tuple[Optional[float], Optional[float], int]:
    """Mean, sample standard deviation (ddof 1; None for one value) and count of the finite values."""
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not finite:
        return None, None, 0
    mean = sum(finite) / len(finite)
    if len(finite) < 2:
        return mean, None, len(finite)
    var = sum((v - mean) ** 2 for v in finite) / (len(finite) - 1)
    return mean, math.sqrt(var), len(finite)


def noise_verdict(arm: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    """``higher`` / ``lower`` / ``within noise`` for the difference of two ``{"mean", "std", "n"}``
    (two standard errors; ``n/a`` without two seeds on both sides)."""
    if arm.get("mean") is None or ref.get("mean") is None:
        return "n/a"
    if (arm.get("n") or 0) < 2 or (ref.get("n") or 0) < 2:
        return "n/a"
    diff = arm["mean"] - ref["mean"]
    se = math.sqrt(arm["std"] ** 2 / arm["n"] + ref["std"] ** 2 / ref["n"])
    if se == 0.0:
        return "within noise" if diff == 0 else ("higher" if diff > 0 else "lower")
    if abs(diff) < 2.0 * se:
        return "within noise"
    return "higher" if diff > 0 else "lower"


def _value(result: Mapping[str, Any], key: str) -> Optional[float]:
    if key.startswith("eval:"):
        ev = result.get("eval") or {}
        value = ev.get(key[5:])
    else:
        value = result.get(key)
    return None if value is None else float(value)


def _curve_stats(curves: Sequence[Sequence[Mapping[str, float]]], field: str) -> list[dict[str, Any]]:
    by_step: dict[int, list[float]] = {}
    fresh: dict[int, Any] = {}
    for curve in curves:
        for point in curve:
            by_step.setdefault(int(point["step"]), []).append(float(point[field]))
            fresh.setdefault(int(point["step"]), point.get("fresh_responses"))
    out = []
    for step in sorted(by_step):
        mean, std, n = mean_std(by_step[step])
        out.append({"step": step, "fresh_responses": fresh[step], "mean": mean, "std": std, "n": n})
    return out


# (name in "paired", title in the table)
PAIRED_MEASURES = (
    ("final_mean", "final"),
    ("auc_mean", "all evaluations"),
    ("mean_at_reference_fresh", "at the reference's fresh responses"),
)


def eval_measures(kmax: Optional[int]) -> tuple[tuple[str, str, str], ...]:
    """(key, title, kind) of the last checkpoint's evaluation measures the elite arms are paired on."""
    if kmax is None:
        return ()
    return (
        ("eval:pass@1", "pass@1", "pct"),
        (f"eval:pass@{kmax}", f"pass@{kmax}", "pct"),
        ("eval:distinct_strategies", "distinct correct strategies", "num"),
    )


def paired_vs_reference(
    arm_runs: Mapping[int, Mapping[str, Any]],
    ref_runs: Mapping[int, Mapping[str, Any]],
    extra_keys: Sequence[str] = (),
) -> dict[str, dict[str, Any]]:
    """Per measure (validation Mean@n final and over all evaluations, then ``extra_keys``),
    ``arm - reference`` paired by seed (``paired_difference``)."""
    out = {
        key: paired_difference(
            {s: _value(r, key) for s, r in arm_runs.items()}, {s: _value(r, key) for s, r in ref_runs.items()}
        )
        for key in ("final_mean", "auc_mean", *extra_keys)
    }
    at_budget = {}
    for seed, result in arm_runs.items():
        ref = ref_runs.get(seed)
        if ref is None or not ref.get("val_curve") or ref["val_curve"][-1].get("fresh_responses") is None:
            continue
        at_budget[seed] = value_at_fresh_responses(result["val_curve"], ref["val_curve"][-1]["fresh_responses"])
    out["mean_at_reference_fresh"] = paired_difference(
        at_budget, {s: _value(r, "final_mean") for s, r in ref_runs.items()}
    )
    return out


def gain_over_start(runs: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """Per seed, the final Mean@n minus the one before training (step 0), with its 95% t interval
    over seeds: whether an arm learns at all (a control arm should not)."""
    start = {}
    for seed, result in runs.items():
        curve = result.get("val_curve") or []
        start[seed] = float(curve[0]["mean"]) if curve and int(curve[0]["step"]) == 0 else None
    return paired_difference({s: _value(r, "final_mean") for s, r in runs.items()}, start)


def _kmax(results: Sequence[Mapping[str, Any]]) -> Optional[int]:
    ks = {int(k.split("@")[1]) for r in results for k in (r.get("eval") or {}) if k.startswith("pass@")}
    return max(ks) if ks else None


def aggregate(
    comparison: str,
    arms: Sequence[Mapping[str, Any]],
    runs: Mapping[str, Mapping[int, Mapping[str, Any]]],
    *,
    target_effect: Optional[float] = None,
) -> dict[str, Any]:
    """One comparison: per arm the per-seed results, mean / std / n per column, the validation
    curves' mean / std per step, and the noise verdict against the first arm; the primary
    metric and every contrast of the comparison whose two arms ran (``target_effect``: the
    effect, in the primary metric's units, the seeds are sized for)."""
    columns = _HD_COLUMNS if comparison == "headroom_drift" else _ELITE_COLUMNS
    all_results = [r for arm in arms for r in runs.get(arm["name"], {}).values()]
    kmax = _kmax(all_results)
    out_arms = []
    for arm in arms:
        seeds = runs.get(arm["name"], {})
        results = [seeds[s] for s in sorted(seeds)]
        summary: dict[str, Any] = {}
        for key, _, _ in columns:
            if "{kmax}" in key:
                if kmax is None:
                    continue
                key = key.format(kmax=kmax)
            mean, std, n = mean_std([v for v in (_value(r, key) for r in results) if v is not None])
            summary[key] = {"mean": mean, "std": std, "n": n}
        out_arms.append(
            {
                **dict(arm),
                "seeds": sorted(seeds),
                "summary": summary,
                "curve_mean": _curve_stats([r["val_curve"] for r in results], "mean"),
                "curve_best": _curve_stats([r["val_curve"] for r in results], "best"),
                "runs": {str(s): dict(seeds[s]) for s in sorted(seeds)},
                "gain": gain_over_start(seeds),
            }
        )
    if out_arms:
        ref = out_arms[0]
        ref_runs = runs.get(ref["name"], {})
        extra = [key for key, _, _ in eval_measures(kmax)] if comparison == "elite" else []
        for arm in out_arms[1:]:
            arm["paired"] = paired_vs_reference(runs.get(arm["name"], {}), ref_runs, extra)
        for arm in out_arms:
            arm["vs_reference"] = {
                key: noise_verdict(arm["summary"][key], ref["summary"][key])
                for key in ("final_mean", "final_best")
                if key in arm["summary"]
            }
            if kmax is not None and f"eval:pass@{kmax}" in arm["summary"]:
                for key in ("eval:pass@1", f"eval:pass@{kmax}", "eval:distinct_strategies"):
                    arm["vs_reference"][key] = noise_verdict(arm["summary"][key], ref["summary"][key])
    val_ns = {int(r["val_n"]) for r in all_results}
    primary = primary_measure(all_results)
    names = {arm["name"] for arm in arms}
    contrasts = [
        contrast_result(c, runs.get(c.arm, {}), runs.get(c.reference, {}), primary[0], target_effect)
        for c in CONTRASTS
        if c.comparison == comparison and c.arm in names and c.reference in names
    ]
    return {
        "comparison": comparison,
        "primary_metric": {"key": primary[0], "title": primary[1], "kind": primary[2]},
        "contrasts": contrasts,
        "target_effect": target_effect,
        "reference_arm": out_arms[0]["name"] if out_arms else None,
        "val_n": val_ns.pop() if len(val_ns) == 1 else None,
        "pass_k_max": kmax,
        "arms": out_arms,
    }


def _with_fresh_responses(result: Mapping[str, Any]) -> dict[str, Any]:
    """A stored run's result with what a document written before paired statistics lacks: each
    validation point's fresh responses (its step x the run's fresh responses per step) and the
    mean over evaluations."""
    result = dict(result)
    per_step = float(result["fresh_responses"]) / max(1, int(result["steps"]))
    curve = [dict(p) for p in result.get("val_curve", [])]
    for point in curve:
        point.setdefault("fresh_responses", per_step * int(point["step"]))
    result["val_curve"] = curve
    if result.get("auc_mean") is None:
        result["auc_mean"] = curve_auc(curve)
    return result


def reaggregate(document: Mapping[str, Any]) -> dict[str, Any]:
    """The comparisons of a stored ``comparison.json`` aggregated again from the runs it holds
    (today's statistics over the same runs; nothing is rerun)."""
    out = dict(document)
    comparisons = []
    for comp in document["comparisons"]:
        arms = [{k: v for k, v in arm.items() if k in _ARM_META} for arm in comp["arms"]]
        runs = {
            arm["name"]: {int(seed): _with_fresh_responses(result) for seed, result in arm["runs"].items()}
            for arm in comp["arms"]
        }
        comparisons.append(aggregate(comp["comparison"], arms, runs, target_effect=comp.get("target_effect")))
    out["comparisons"] = comparisons
    out["schema_version"] = SCHEMA_VERSION
    return out


def _fmt(stat: Mapping[str, Any], kind: str) -> str:
    mean, std = stat.get("mean"), stat.get("std")
    if mean is None:
        return "–"
    scale, spec = {
        "pct": (100.0, ".1f"),
        "int": (1.0, ".0f"),
        "sec": (1.0, ".2f"),
        "num": (1.0, ".2f"),
        "sci": (1.0, ".2e"),
    }[kind]
    text = format(mean * scale, spec)
    if std is not None:
        text += " ± " + format(std * scale, spec)
    return text


def format_contrasts(comp: Mapping[str, Any]) -> list[str]:
    """Markdown lines: every contrast on the primary metric, paired by seed, with its minimum
    detectable effect and the seeds its observed SD needs for the target effect."""
    contrasts, primary = comp.get("contrasts") or [], comp.get("primary_metric")
    if not contrasts or not primary:
        return []
    labels = {arm["name"]: arm["label"] for arm in comp["arms"]}
    kind, target = primary["kind"], comp.get("target_effect")
    scale, unit = (100.0, " points") if kind == "pct" else (1.0, "")
    needs = f"; seeds: how many the observed SD needs for an MDE of {scale * target:g}{unit}" if target else ""
    lines = [
        f"Contrasts on the primary metric ({primary['title']}): arm - reference{unit}, paired by seed, "
        "mean [95% t interval]; MDE: the smallest true difference these seeds detect with 80% power "
        f"(two-sided 5%){needs}:",
        "",
        "| contrast | main | difference | verdict | MDE | seeds |",
        "|---|---|---:|---|---:|---:|",
    ]
    for c in contrasts:
        name = f"{labels.get(c['arm'], c['arm'])} - {labels.get(c['reference'], c['reference'])}"
        mde = "–" if c.get("mde") is None else format(scale * c["mde"], ".1f")
        needed = c.get("seeds_for_target")
        seeds = f"{c['n']} (needs {needed})" if needed is not None else str(c["n"])
        cells = [name, "yes" if c["main"] else "", _fmt_paired(c, kind).rsplit(" (", 1)[0], c["verdict"], mde, seeds]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def format_table(comp: Mapping[str, Any]) -> str:
    """Markdown: one row per arm, mean ± std over seeds, then the contrasts and the noise verdicts."""
    columns = _HD_COLUMNS if comp["comparison"] == "headroom_drift" else _ELITE_COLUMNS
    n, kmax = comp.get("val_n") or "n", comp.get("pass_k_max")
    cols = []
    for key, title, kind in columns:
        if "{kmax}" in key:
            if kmax is None:
                continue
            key, title = key.format(kmax=kmax), title.format(kmax=kmax)
        cols.append((key, title.format(n=n, kmax=kmax), kind))
    head = ["arm", "seeds"] + [title for _, title, _ in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * len(cols)]
    for arm in comp["arms"]:
        cells = [arm["label"], str(len(arm["seeds"]))] + [_fmt(arm["summary"].get(k, {}), kind) for k, _, kind in cols]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.extend(format_contrasts(comp))
    lines.append(
        f"Learning within a run: final - before training of Mean@{n} in points, "
        "mean [95% t interval] over seeds (mean / standard error):"
    )
    for arm in comp["arms"]:
        lines.append(f"- {arm['label']}: {_fmt_gain(arm.get('gain', {}))}")
    ref = next((a for a in comp["arms"] if a["name"] == comp["reference_arm"]), None)
    if ref is not None and len(comp["arms"]) > 1:
        lines.append("")
        lines.append(f"Against {ref['label']} (difference vs 2 standard errors over seeds):")
        for arm in comp["arms"][1:]:
            verdicts = ", ".join(
                f"{dict((k, t) for k, t, _ in cols).get(k, k)}: {v}" for k, v in arm.get("vs_reference", {}).items()
            )
            lines.append(f"- {arm['label']}: {verdicts}")
        lines.append("")
        lines.append(
            f"Paired by seed ({ref['label']} as reference): arm - reference of Mean@{n} in points, "
            "mean [95% t interval] over the seeds both finished:"
        )
        for arm in comp["arms"][1:]:
            parts = [f"{title} {_fmt_paired(arm.get('paired', {}).get(key, {}))}" for key, title in PAIRED_MEASURES]
            lines.append(f"- {arm['label']}: " + "; ".join(parts))
        measures = eval_measures(kmax) if comp["comparison"] == "elite" else ()
        if measures:
            lines.append("")
            lines.append(
                f"Paired by seed, the last checkpoint's evaluation (arm - {ref['label']}; pass@k in points, "
                "strategies per question), mean [95% t interval] over the seeds both finished:"
            )
            for arm in comp["arms"][1:]:
                paired = arm.get("paired", {})
                parts = [f"{title} {_fmt_paired(paired.get(key, {}), kind)}" for key, title, kind in measures]
                lines.append(f"- {arm['label']}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


_COST_PARTS = ("validation_s", "steps_s", "scan_s")


def run_cost(result: Mapping[str, Any]) -> Optional[dict[str, Optional[float]]]:
    """A run's wall time split (seconds): validation, training steps (of which the replay scan)
    and the rest (start-up, the evaluation stage, shutdown). None for a run stored without it."""
    split, wall = result.get("time"), result.get("wall_s")
    if not split or wall is None:
        return None
    cost = {"wall_s": float(wall), **{k: split.get(k) for k in _COST_PARTS}}
    cost["rest_s"] = float(wall) - (cost["validation_s"] or 0.0) - (cost["steps_s"] or 0.0)
    return cost


def format_cost(comparisons: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: where the runs' wall time went, per arm (mean over seeds), and the totals over
    every run with and without validation. Empty for a document stored without time splits."""
    keys = ("wall_s", "validation_s", "steps_s", "scan_s", "rest_s")
    rows, totals, runs = [], dict.fromkeys(keys, 0.0), 0
    for comp in comparisons:
        for arm in comp["arms"]:
            costs = [c for c in (run_cost(r) for r in arm.get("runs", {}).values()) if c is not None]
            if not costs:
                continue
            runs += len(costs)
            cells = []
            for key in keys:
                values = [c[key] for c in costs if c[key] is not None]
                totals[key] += sum(values)
                cells.append(f"{sum(values) / len(values):.0f}" if values else "–")
            rows.append(f"| {arm['label']} | {len(costs)} | " + " | ".join(cells) + " |")
    if not rows:
        return ""
    lines = [
        "## Where the time went",
        "",
        "Seconds per run, mean over seeds: the run's wall time; verl's validations (the one before "
        "training, which verl does not time, counted at the mean of the others); the training steps, "
        "of which the Headroom-Drift scan; the rest (Ray and verl start-up, the evaluation stage, "
        "shutdown).",
        "",
        "| arm | runs | wall | validation | training steps | of which scan | rest |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"All {runs} runs: {totals['wall_s']:.0f} s of run wall time, {totals['validation_s']:.0f} s of it "
        f"validation; without validation {totals['wall_s'] - totals['validation_s']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def _fmt_paired(diff: Mapping[str, Any], kind: str = "pct") -> str:
    """A paired difference: points for a rate (``pct``), the value itself for a count (``num``)."""
    if diff.get("mean") is None:
        return "–"
    scale, spec = (100.0, "+.1f") if kind == "pct" else (1.0, "+.2f")
    text = format(scale * diff["mean"], spec)
    if diff.get("low") is not None:
        text += f" [{format(scale * diff['low'], spec)}, {format(scale * diff['high'], spec)}]"
    return text + f" ({diff['n']} seeds)"


def _fmt_gain(gain: Mapping[str, Any]) -> str:
    text = _fmt_paired(gain)
    if gain.get("se"):
        text += f", {gain['mean'] / gain['se']:.1f} SE"
    return text


def plot_curves(comparisons: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Validation Mean@n and Best@n over global steps and Mean@n over fresh responses, one line per
    arm (mean over seeds, band: ± one standard deviation); one row of three panels per comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = max(1, len(comparisons))
    fig, axes = plt.subplots(rows, 3, figsize=(16, 3.8 * rows), squeeze=False)
    for row, comp in enumerate(comparisons):
        n = comp.get("val_n") or "n"
        panels = (
            ("curve_mean", f"Mean@{n}", "step"),
            ("curve_best", f"Best@{n}", "step"),
            ("curve_mean", f"Mean@{n}", "fresh_responses"),
        )
        for col, (field, name, x_key) in enumerate(panels):
            ax = axes[row][col]
            for arm in comp["arms"]:
                pts = [p for p in arm[field] if p["mean"] is not None and p.get(x_key) is not None]
                if not pts:
                    continue
                xs = [p[x_key] for p in pts]
                ys = [100.0 * p["mean"] for p in pts]
                (line,) = ax.plot(xs, ys, marker="o", label=f"{arm['label']} ({len(arm['seeds'])} seeds)")
                lo = [100.0 * (p["mean"] - (p["std"] or 0.0)) for p in pts]
                hi = [100.0 * (p["mean"] + (p["std"] or 0.0)) for p in pts]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
            by = "global step" if x_key == "step" else "fresh responses"
            ax.set_title(f"{comp['comparison']}: validation {name} by {by}")
            ax.set_xlabel(by)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(f"{name} (%)")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "no finished runs", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def write_outputs(out_dir: Path, document: Mapping[str, Any]) -> dict[str, Path]:
    """``comparison.json``, ``table.md`` and ``curves.png`` in ``out_dir``."""
    out_dir = Path(out_dir)
    tables = [f"## {comp['comparison']}\n\n" + format_table(comp) for comp in document["comparisons"]]
    steps = document.get("steps") or {}
    shown = ", ".join(
        f"{c['comparison']} {steps[c['comparison']]}" for c in document["comparisons"] if c["comparison"] in steps
    )
    header = (
        f"# Strategy comparison ({document['profile']} profile)\n\n"
        f"Mean ± std over seeds; final = the last validation, at the last step (global steps: {shown}). "
        "Mean@n / Best@n: verl's val-core metrics (Best@n: mean of bootstrapped best-of-n). "
        "fresh responses: per run, over all steps. s / step: timing_s/step averaged over steps.\n\n"
    )
    models = [
        f"`{m['path']}`" + (f" (weights sha256 {m['sha256'][:12]})" if m.get("sha256") else "")
        for m in document.get("models") or []
    ]
    if models:
        header += "Starting model: " + "; ".join(models) + ".\n\n"
    cost = format_cost(document["comparisons"])
    paths = {
        "json": atomic_write_text(out_dir / "comparison.json", json.dumps(document, indent=2, sort_keys=True) + "\n"),
        "table": atomic_write_text(out_dir / "table.md", header + "\n".join(tables + ([cost] if cost else []))),
        "png": plot_curves(document["comparisons"], out_dir / "curves.png"),
    }
    return paths
