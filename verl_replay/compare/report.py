"""Aggregate runs over seeds; write ``comparison.json``, ``table.md`` and ``curves.png``.

Every statement about two arms is paired by seed (``verl_replay.compare.paired``): per seed
``arm - reference`` of the final value, of the mean over the post-training evaluations (the one
before training is the same in every arm of a seed, so it is left out) and of the value at the
reference's fresh-response budget, with the mean difference's 95% t interval over the seeds both
arms finished. Verdicts come from those intervals only (``verl_replay.compare.contrasts``); the
per-arm mean ± std columns describe the arms, they do not compare them. Seeds that collapsed
are counted per arm.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from verl_replay._files import atomic_write_text
from verl_replay.compare.contrasts import CONTRASTS, collapsed, contrast_result, primary_measure, verdict
from verl_replay.compare.paired import (
    curve_auc,
    paired_difference,
    post_training_mean,
    value_at_fresh_responses,
)

__all__ = [
    "SCHEMA_VERSION",
    "mean_std",
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

# 2: paired differences, the mean over evaluations, fresh responses per point; 3: the primary metric,
# contrasts, post-training means, collapsed seeds, verdicts from paired intervals only
SCHEMA_VERSION = 3

# what an arm of a comparison document carries besides its results
_ARM_META = ("name", "label", "recipe", "fresh_prompts_per_step")

# (key in a run's result, column title, formatter kind)
_HD_COLUMNS = [
    ("final_exact", "exact accuracy (final)", "pct"),
    ("post_exact", "exact accuracy (post-training)", "pct"),
    ("final_mean", "Mean@{n} (final)", "pct"),
    ("post_mean", "Mean@{n} (post-training)", "pct"),
    ("final_best", "Best@{n} (final)", "pct"),
    ("fresh_responses", "fresh responses", "int"),
    ("step_time_s", "s / step", "sec"),
    ("replay_acceptance", "replay acceptance", "pct"),
    ("replay_token_share", "replay token share", "pct"),
    ("replay_kl_accepted", "replay KL (accepted)", "sci"),
]
_ELITE_COLUMNS = [
    ("final_mean", "val Mean@{n} (final)", "pct"),
    ("post_mean", "val Mean@{n} (post-training)", "pct"),
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
            if point.get(field) is None:  # the exact metric: only where a run computed it
                continue
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
    ("post_mean", "post-training evaluations"),
    ("mean_at_reference_fresh", "at the reference's fresh responses"),
)
# the exact metric, paired where the runs computed it
_EXACT_KEYS = ("final_exact", "post_exact")


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
    """Per measure (validation Mean@n final and over the post-training evaluations, the exact
    metric where the runs have it, then ``extra_keys``), ``arm - reference`` paired by seed
    (``paired_difference``) with its verdict."""
    out = {
        key: paired_difference(
            {s: _value(r, key) for s, r in arm_runs.items()}, {s: _value(r, key) for s, r in ref_runs.items()}
        )
        for key in ("final_mean", "post_mean", *_EXACT_KEYS, *extra_keys)
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
    for diff in out.values():
        diff["verdict"] = verdict(diff)
    return out


def gain_over_start(runs: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """Per seed, the final Mean@n minus the one before training (step 0), with its 95% t interval
    over seeds: whether an arm learns at all (a control arm should not)."""
    start = {}
    for seed, result in runs.items():
        curve = result.get("val_curve") or []
        first = curve[0] if curve else {}
        start[seed] = float(first["mean"]) if first.get("mean") is not None and int(first["step"]) == 0 else None
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
    curves' mean / std per step, the collapsed seeds and the differences to the first arm paired
    by seed; the primary metric and every contrast of the comparison whose two arms ran
    (``target_effect``: the effect, in the primary metric's units, the seeds are sized for)."""
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
                "curve_exact": _curve_stats([r["val_curve"] for r in results], "exact"),
                "runs": {str(s): dict(seeds[s]) for s in sorted(seeds)},
                "gain": gain_over_start(seeds),
                "collapsed_seeds": [s for s in sorted(seeds) if collapsed(seeds[s])],
            }
        )
    if out_arms:
        ref = out_arms[0]
        ref_runs = runs.get(ref["name"], {})
        extra = [key for key, _, _ in eval_measures(kmax)] if comparison == "elite" else []
        for arm in out_arms[1:]:
            arm["paired"] = paired_vs_reference(runs.get(arm["name"], {}), ref_runs, extra)
    val_ns = {int(r["val_n"]) for r in all_results}
    primary = primary_measure(all_results, comparison)
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
    """A stored run's result with what a document written before today's statistics lacks: each
    validation point's fresh responses (its step x the run's fresh responses per step), the mean
    over evaluations and the means over the post-training ones."""
    result = dict(result)
    per_step = float(result["fresh_responses"]) / max(1, int(result["steps"]))
    curve = [dict(p) for p in result.get("val_curve", [])]
    for point in curve:
        point.setdefault("fresh_responses", per_step * int(point["step"]))
    result["val_curve"] = curve
    if result.get("auc_mean") is None:
        result["auc_mean"] = curve_auc(curve)
    for key, field in (("post_mean", "mean"), ("post_exact", "exact")):
        if result.get(key) is None:
            result[key] = post_training_mean(curve, field)
    if result.get("final_exact") is None and curve:
        result["final_exact"] = curve[-1].get("exact")
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
        target = comp.get("target_effect", (document.get("settings") or {}).get("target_effect"))
        comparisons.append(aggregate(comp["comparison"], arms, runs, target_effect=target))
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
    scale, unit, spec = (100.0, " points", ".1f") if kind == "pct" else (1.0, "", ".2f")
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
        mde = "–" if c.get("mde") is None else format(scale * c["mde"], spec)
        needed = c.get("seeds_for_target")
        seeds = f"{c['n']} (needs {needed})" if needed is not None else str(c["n"])
        if needed is not None and c["n"] < 3:  # an SD from one degree of freedom sizes nothing
            seeds = f"{c['n']} (needs {needed}, from an SD of {c['n']} seeds: unreliable)"
        # a bimodal contrast is read from its counts of collapsed seeds (in the verdict)
        difference = "see counts" if c.get("bimodal") else _fmt_paired(c, kind).rsplit(" (", 1)[0]
        cells = [name, "yes" if c["main"] else "", difference, c["verdict"], mde, seeds]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _table_columns(comp: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(key, title, kind) of the table's columns: the comparison's, less those no arm has."""
    columns = _HD_COLUMNS if comp["comparison"] == "headroom_drift" else _ELITE_COLUMNS
    n, kmax = comp.get("val_n") or "n", comp.get("pass_k_max")
    cols = []
    for key, title, kind in columns:
        if "{kmax}" in key:
            if kmax is None:
                continue
            key, title = key.format(kmax=kmax), title.format(kmax=kmax)
        if not any((arm["summary"].get(key) or {}).get("n") for arm in comp["arms"]):
            continue
        cols.append((key, title.format(n=n, kmax=kmax), kind))
    return cols


def _collapsed_cell(arm: Mapping[str, Any]) -> str:
    return f"{len(arm.get('collapsed_seeds') or [])} of {len(arm['seeds'])}"


def _learning_line(arm: Mapping[str, Any]) -> str:
    """Final - before training; an arm whose seeds split into collapsed and learning runs is
    given as counts, not as a mean with an interval."""
    collapsed_seeds, n = arm.get("collapsed_seeds") or [], len(arm["seeds"])
    if 0 < len(collapsed_seeds) < n:
        return (
            f"- {arm['label']}: bimodal, {len(collapsed_seeds)} of {n} seeds collapsed "
            f"(seeds {', '.join(map(str, collapsed_seeds))}); no interval"
        )
    return f"- {arm['label']}: {_fmt_gain(arm.get('gain', {}))}"


def format_table(comp: Mapping[str, Any]) -> str:
    """Markdown: one row per arm (mean ± std over seeds, collapsed seeds), the contrasts, learning
    within each arm, and every arm against the reference paired by seed."""
    n, kmax = comp.get("val_n") or "n", comp.get("pass_k_max")
    cols = _table_columns(comp)
    head = ["arm", "seeds", *[title for _, title, _ in cols], "collapsed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(cols) + 1)]
    for arm in comp["arms"]:
        cells = [arm["label"], str(len(arm["seeds"]))] + [_fmt(arm["summary"].get(k, {}), kind) for k, _, kind in cols]
        lines.append("| " + " | ".join([*cells, _collapsed_cell(arm)]) + " |")
    lines.append("")
    lines.append(
        f"Mean ± std over seeds, to describe each arm (comparisons are paired, below); collapsed: seeds whose "
        f"final Mean@{n} is below their Mean@{n} before training."
    )
    lines.append("")
    lines.extend(format_contrasts(comp))
    lines.append(
        f"Learning within a run: final - before training of Mean@{n} in points, "
        "mean [95% t interval] over seeds (mean / standard error):"
    )
    lines.extend(_learning_line(arm) for arm in comp["arms"])
    ref = next((a for a in comp["arms"] if a["name"] == comp["reference_arm"]), None)
    if ref is not None and len(comp["arms"]) > 1:
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


# the figure is read at README width (~900 px): one row of three panels per comparison
_FIGURE_WIDTH_IN, _ROW_HEIGHT_IN, _DPI = 11.0, 3.4, 100
_MARKERS = "osD^vP*X"


def _curve_field(comp: Mapping[str, Any]) -> tuple[str, str]:
    """The curve the plots draw first: the exact metric where every arm has it, else Mean@n."""
    has_exact = all(arm.get("curve_exact") for arm in comp["arms"] if arm["seeds"])
    n = comp.get("val_n") or "n"
    return ("exact", "exact accuracy") if has_exact else ("mean", f"sampled Mean@{n}")


def _seed_curves(arm: Mapping[str, Any], field: str) -> dict[int, dict[int, float]]:
    """seed -> step -> value of ``field`` (points without it left out)."""
    return {
        int(seed): {int(p["step"]): float(p[field]) for p in result.get("val_curve", []) if p.get(field) is not None}
        for seed, result in (arm.get("runs") or {}).items()
    }


def _draw_arm_curves(
    ax: Any, comp: Mapping[str, Any], field: str, x_scale: Optional[Mapping[str, float]] = None
) -> None:
    """Per arm: every seed as a thin line, the mean over seeds bold (``x_scale``: arm name -> x
    units per step, e.g. its fresh responses per step; default the step itself)."""
    for i, arm in enumerate(comp["arms"]):
        seeds = _seed_curves(arm, field)
        color, per_step = f"C{i}", (x_scale or {}).get(arm["name"], 1.0)
        for values in seeds.values():
            steps = sorted(values)
            ax.plot([per_step * s for s in steps], [100 * values[s] for s in steps], color=color, lw=0.6, alpha=0.35)
        steps = sorted({s for values in seeds.values() for s in values})
        means = [mean_std([v[s] for v in seeds.values() if s in v])[0] for s in steps]
        xs = [per_step * s for s in steps]
        ax.plot(xs, [100 * m for m in means], color=color, lw=2.0, marker=_MARKERS[i % len(_MARKERS)], ms=4)


def _fresh_per_step(comp: Mapping[str, Any]) -> dict[str, float]:
    """Arm name -> fresh responses per global step (from its curve's last point)."""
    out = {}
    for arm in comp["arms"]:
        points = [p for p in arm.get("curve_mean", []) if p.get("fresh_responses") and p["step"]]
        if points:
            out[arm["name"]] = float(points[-1]["fresh_responses"]) / int(points[-1]["step"])
    return out


def _is_control(arm: Mapping[str, Any]) -> bool:
    return "control" in arm["name"] or str(arm.get("label", "")).startswith("control")


# the comparisons' names in plots
_COMPARISON_TITLES = {"headroom_drift": "Headroom-Drift Replay comparison", "elite": "EliteReplay comparison"}


def _draw_paired_differences(ax: Any, comp: Mapping[str, Any], field: str) -> None:
    """Per arm and evaluation step: arm - reference paired by seed, mean with its 95% interval.
    Controls are left out: they fall by tens of points and would flatten every other arm (the
    first panel shows them)."""
    ref = next((a for a in comp["arms"] if a["name"] == comp.get("reference_arm")), None)
    if ref is None:
        return
    ref_seeds = _seed_curves(ref, field)
    others = [(i, arm) for i, arm in enumerate(comp["arms"]) if arm is not ref and not _is_control(arm)]
    offset_step = 0.012 * max((s for v in ref_seeds.values() for s in v), default=1)
    for k, (i, arm) in enumerate(others):
        seeds = _seed_curves(arm, field)
        steps = sorted({s for v in seeds.values() for s in v if s > 0})
        xs, ys, lows, highs = [], [], [], []
        for step in steps:
            diff = paired_difference(
                {seed: v.get(step) for seed, v in seeds.items()}, {seed: v.get(step) for seed, v in ref_seeds.items()}
            )
            if diff["mean"] is None:
                continue
            xs.append(step + (k - (len(others) - 1) / 2) * offset_step)
            ys.append(100 * diff["mean"])
            lows.append(100 * (diff["mean"] - (diff["low"] if diff["low"] is not None else diff["mean"])))
            highs.append(100 * ((diff["high"] if diff["high"] is not None else diff["mean"]) - diff["mean"]))
        ax.errorbar(
            xs, ys, yerr=[lows, highs], color=f"C{i}", marker=_MARKERS[i % len(_MARKERS)], ms=4, lw=1.2, capsize=2
        )
    ax.axhline(0.0, color="black", lw=0.8)


def _draw_strategies(ax: Any, comp: Mapping[str, Any]) -> bool:
    """Distinct right query shapes per question at the last checkpoint: every seed a dot, the
    arm's mean a bar. False when no run was evaluated."""
    drawn = False
    for i, arm in enumerate(comp["arms"]):
        values = [
            float(r["eval"]["distinct_strategies"])
            for r in (arm.get("runs") or {}).values()
            if (r.get("eval") or {}).get("distinct_strategies") is not None
        ]
        if not values:
            continue
        drawn = True
        ax.bar(i, sum(values) / len(values), color=f"C{i}", alpha=0.35, width=0.6)
        ax.scatter([i] * len(values), values, color=f"C{i}", marker=_MARKERS[i % len(_MARKERS)], s=18, zorder=3)
    ax.set_xticks(range(len(comp["arms"])), [str(j + 1) for j in range(len(comp["arms"]))])
    ax.set_xlabel("arm (numbered as in the legend)")
    ax.set_ylabel("distinct right shapes / question")
    ax.set_title("Distinct right query shapes (last checkpoint)", fontsize=10)
    return drawn


def _eval_steps(comp: Mapping[str, Any]) -> list[int]:
    """Every step some arm evaluated at, sampled or exact (``sampled_val=ends`` samples at two)."""
    curves = ("curve_mean", "curve_exact")
    return sorted({int(p["step"]) for arm in comp["arms"] for key in curves for p in arm.get(key, [])})


def plot_curves(comparisons: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """One row per comparison: the primary curve by global step (thin lines: seeds; bold: their
    mean), every arm minus the reference paired by seed with 95% intervals, and the third
    panel: distinct right query shapes (elite) or sampled Mean@n (when the first is exact);
    one legend per row, outside the axes, ticks at the evaluation steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = max(1, len(comparisons))
    fig, axes = plt.subplots(rows, 3, figsize=(_FIGURE_WIDTH_IN, _ROW_HEIGHT_IN * rows + 0.9 * rows), squeeze=False)
    for row, comp in enumerate(comparisons):
        field, name = _curve_field(comp)
        steps = _eval_steps(comp)
        first, paired, third = axes[row]
        _draw_arm_curves(first, comp, field)
        first.set_title(f"{name} (thin: seeds)", fontsize=10)
        first.set_ylabel(f"{name} (%)")
        ref_label = next((a["label"] for a in comp["arms"] if a["name"] == comp.get("reference_arm")), "reference")
        _draw_paired_differences(paired, comp, field)
        paired.set_title(f"minus {ref_label.split(' (')[0]}, paired (95%; no controls)", fontsize=10)
        paired.set_ylabel("difference (points)")
        n = comp.get("val_n") or "n"
        by_step = [first, paired]
        if comp["comparison"] == "elite" and _draw_strategies(third, comp):
            pass
        elif field == "exact":
            _draw_arm_curves(third, comp, "mean")
            third.set_title(f"sampled Mean@{n} (thin: seeds)", fontsize=10)
            third.set_ylabel("accuracy (%)")
            by_step.append(third)
        else:
            _draw_arm_curves(third, comp, "mean", _fresh_per_step(comp))
            third.set_title(f"sampled Mean@{n} by fresh responses", fontsize=10)
            third.set_ylabel("accuracy (%)")
            third.set_xlabel("fresh responses")
        for ax in by_step:
            ax.set_xticks(steps)
            ax.set_xlabel("global step")
        for ax in (first, paired, third):
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=8)
        handles = [
            Line2D(
                [],
                [],
                color=f"C{i}",
                marker=_MARKERS[i % len(_MARKERS)],
                lw=2,
                label=f"{i + 1}. {arm['label']} ({len(arm['seeds'])} seeds)",
            )
            for i, arm in enumerate(comp["arms"])
        ]
        top = 1 - row / rows
        fig.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, top - 0.005),
            ncol=min(3, len(handles)),
            fontsize=8,
            frameon=False,
            title=_COMPARISON_TITLES.get(comp["comparison"], comp["comparison"]),
            title_fontsize=9,
        )
    fig.tight_layout(rect=(0, 0, 1, 1), h_pad=3.0)
    for row in range(rows):  # room above each row for its legend
        for ax in axes[row]:
            box = ax.get_position()
            ax.set_position([box.x0, box.y0, box.width, box.height * 0.78])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=_DPI)
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
