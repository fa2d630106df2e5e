"""Aggregate runs over seeds; write ``comparison.json``, ``table.md`` and ``curves.png``.

Seed noise: an arm's difference to the comparison's reference arm (its first arm, the matched
on-policy GRPO run) is called *within seed noise* when it is smaller than two standard errors
of the difference, ``2 * sqrt(s_a^2 / n_a + s_r^2 / n_r)`` (s: the sample standard deviation over
seeds). With 3 seeds this is a coarse screen, not a significance test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from verl_replay._files import atomic_write_text

__all__ = ["SCHEMA_VERSION", "mean_std", "noise_verdict", "aggregate", "format_table", "plot_curves", "write_outputs"]

SCHEMA_VERSION = 1

# (key in a run's result, column title, formatter kind)
_HD_COLUMNS = [
    ("final_mean", "Mean@{n} (final)", "pct"),
    ("final_best", "Best@{n} (final)", "pct"),
    ("fresh_responses", "fresh responses", "int"),
    ("step_time_s", "s / step", "sec"),
    ("replay_acceptance", "replay acceptance", "pct"),
    ("replay_token_share", "replay token share", "pct"),
    ("replay_kl_accepted", "replay KL (accepted)", "sci"),
]
_ELITE_COLUMNS = [
    ("final_mean", "val Mean@{n} (final)", "pct"),
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
    for curve in curves:
        for point in curve:
            by_step.setdefault(int(point["step"]), []).append(float(point[field]))
    out = []
    for step in sorted(by_step):
        mean, std, n = mean_std(by_step[step])
        out.append({"step": step, "mean": mean, "std": std, "n": n})
    return out


def _kmax(results: Sequence[Mapping[str, Any]]) -> Optional[int]:
    ks = {int(k.split("@")[1]) for r in results for k in (r.get("eval") or {}) if k.startswith("pass@")}
    return max(ks) if ks else None


def aggregate(
    comparison: str, arms: Sequence[Mapping[str, Any]], runs: Mapping[str, Mapping[int, Mapping[str, Any]]]
) -> dict[str, Any]:
    """One comparison: per arm the per-seed results, mean / std / n per column, the validation
    curves' mean / std per step, and the noise verdict against the first arm."""
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
            }
        )
    if out_arms:
        ref = out_arms[0]
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
    return {
        "comparison": comparison,
        "reference_arm": out_arms[0]["name"] if out_arms else None,
        "val_n": val_ns.pop() if len(val_ns) == 1 else None,
        "pass_k_max": kmax,
        "arms": out_arms,
    }


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


def format_table(comp: Mapping[str, Any]) -> str:
    """Markdown: one row per arm, mean ± std over seeds, then the noise verdicts."""
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
    ref = next((a for a in comp["arms"] if a["name"] == comp["reference_arm"]), None)
    if ref is not None and len(comp["arms"]) > 1:
        lines.append("")
        lines.append(f"Against {ref['label']} (difference vs 2 standard errors over seeds):")
        for arm in comp["arms"][1:]:
            verdicts = ", ".join(
                f"{dict((k, t) for k, t, _ in cols).get(k, k)}: {v}" for k, v in arm.get("vs_reference", {}).items()
            )
            lines.append(f"- {arm['label']}: {verdicts}")
    return "\n".join(lines) + "\n"


def plot_curves(comparisons: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Validation Mean@n and Best@n over global steps, one line per arm (mean over seeds, band:
    ± one standard deviation); one row of two panels per comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = max(1, len(comparisons))
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.8 * rows), squeeze=False)
    for row, comp in enumerate(comparisons):
        n = comp.get("val_n") or "n"
        for col, (field, name) in enumerate((("curve_mean", f"Mean@{n}"), ("curve_best", f"Best@{n}"))):
            ax = axes[row][col]
            for arm in comp["arms"]:
                pts = [p for p in arm[field] if p["mean"] is not None]
                if not pts:
                    continue
                xs = [p["step"] for p in pts]
                ys = [100.0 * p["mean"] for p in pts]
                (line,) = ax.plot(xs, ys, marker="o", label=f"{arm['label']} ({len(arm['seeds'])} seeds)")
                lo = [100.0 * (p["mean"] - (p["std"] or 0.0)) for p in pts]
                hi = [100.0 * (p["mean"] + (p["std"] or 0.0)) for p in pts]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
            ax.set_title(f"{comp['comparison']}: validation {name}")
            ax.set_xlabel("global step")
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
    paths = {
        "json": atomic_write_text(out_dir / "comparison.json", json.dumps(document, indent=2, sort_keys=True) + "\n"),
        "table": atomic_write_text(out_dir / "table.md", header + "\n".join(tables)),
        "png": plot_curves(document["comparisons"], out_dir / "curves.png"),
    }
    return paths
