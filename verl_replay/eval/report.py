"""Evaluation outputs: ``results.json``, ``samples.jsonl``, ``table.md``, ``pass_at_k.png``.

Every file is written atomically (a temporary file in the same folder, then ``os.replace``), so
a reader never sees a half-written result and an interrupted run leaves the previous one intact.

The table and the plot are rendered from the ``results.json`` *document* (a plain dict), so
they can be re-made from a stored file: ``format_table(json.load(f))``.

``results.json`` (``schema_version`` 2; 2 added ``skipped`` and ``resume``)::

    {
      "schema_version": 2,
      "config": {EvalConfig fields},
      "ks": [k ...],                # pass@k values reported (requested and <= n)
      "k_skipped": [k ...],         # requested but > n
      "benchmarks": {
        "<name>": {
          "name", "task": "sql"|"math", "num_questions", "n",
          "metrics": {"pass@<k>", "mean@n", "best@n",             # fractions in [0, 1]
                      "distinct_strategies",                      # SQL: mean count per question
                      "ambiqt_coverage", "ambiqt_coverage@<k>"},  # AmbiQT only
          "reasons": {reason: #samples}, "verification_failures": int,
          "strategy_distribution": {"<#strategies>": #questions},  # SQL only
          "ambiqt": {"coverage", "interpretation_hit_rate": [r1, r2]}  # AmbiQT only
        }
      },
      "averages": {"macro": {metric: value}, "weighted": {metric: value},
                   "benchmarks": {metric: [benchmarks averaged]}},
      "questions": [{"row", "benchmark", "question_id", "data_source", "task", "n",
                     "num_correct", "pass_at_k": {"<k>": p},
                     "distinct_strategies", "skeletons" (SQL),
                     "interpretation_hits": [h1, h2], "covered",
                     "ambiqt_coverage_at_k": {"<k>": c} (AmbiQT)}],
      "skipped": {"over_long": {"count", "max_prompt_tokens", "by_benchmark": {name: count},
                                "questions": [{"row", "benchmark", "question_id", "prompt_tokens"}]}},
      "resume": {"sessions", "resumed_questions"},  # runs that wrote this folder, questions reused
      "timings": {"load_s", "model_load_s", "generate_s", "verify_wait_s", "aggregate_s",
                  "generated_tokens", "tokens_per_s", "total_s"},  # this session's
      "environment": {"verl_replay", "python", "platform"}
    }

``samples.jsonl``: one object per sample: ``row, benchmark, question_id, sample, text,
correct, reason, num_tokens, finish_reason`` (+ ``skeleton`` for SQL, ``interpretation_hits``
for AmbiQT, ``detail`` when verification failed in the pool). During an evaluation it grows one
committed chunk at a time (``verl_replay.eval.store``); the other files are written at the end.
Benchmark metrics cover the evaluated questions: skipped (over-long) prompts are not in them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

__all__ = [
    "SCHEMA_VERSION",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_writer",
    "format_table",
    "plot_pass_at_k",
    "results_document",
    "write_outputs",
]

SCHEMA_VERSION = 2
RESULTS_JSON = "results.json"
SAMPLES_JSONL = "samples.jsonl"
TABLE_MD = "table.md"
PASS_AT_K_PNG = "pass_at_k.png"


class EvalResultLike(Protocol):
    """What the writers read from :class:`verl_replay.eval.run.EvalResult`.

    A protocol, so that this module does not import ``run`` (``run`` imports it to write its
    outputs): the dependency goes one way only.
    """

    config: Any  # EvalConfig: to_dict(), ks_used, ks_skipped
    benchmarks: Mapping[str, Any]  # name -> BenchmarkResult (to_dict())
    averages: dict[str, Any]
    questions: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    timings: dict[str, float]


# --------------------------------------------------------------------------- atomic files


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temporary sibling of ``path`` for writing; on success fsync and rename it over
    ``path``; on error remove it and leave ``path`` untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    with atomic_writer(path, "w") as handle:
        handle.write(text)
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    with atomic_writer(path, "wb") as handle:
        handle.write(data)
    return Path(path)


# --------------------------------------------------------------------------- JSON


def _version() -> str:
    try:
        from verl_replay import __version__

        return str(__version__)
    except ImportError:  # pragma: no cover - the package is importable wherever this runs
        return "unknown"


def results_document(result: EvalResultLike) -> dict[str, Any]:
    """The ``results.json`` document (see the module docstring)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "config": result.config.to_dict(),
        "ks": list(result.config.ks_used),
        "k_skipped": list(result.config.ks_skipped),
        "benchmarks": {name: b.to_dict() for name, b in result.benchmarks.items()},
        "averages": result.averages,
        "questions": result.questions,
        "skipped": {"over_long": _over_long(result.skipped, result.max_prompt_tokens)},
        "resume": dict(result.resume),
        "timings": result.timings,
        "environment": {
            "verl_replay": _version(),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
        },
    }


def _over_long(skipped: Sequence[Mapping[str, Any]], limit: int | None) -> dict[str, Any]:
    by_benchmark: dict[str, int] = {}
    for item in skipped:
        by_benchmark[str(item["benchmark"])] = by_benchmark.get(str(item["benchmark"]), 0) + 1
    return {
        "count": len(skipped),
        "max_prompt_tokens": limit,
        "by_benchmark": by_benchmark,
        "questions": [dict(item) for item in skipped],
    }


# --------------------------------------------------------------------------- table


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(doc: Mapping[str, Any]) -> str:
    """A Markdown table, padded so that it also reads aligned as plain text.

    One row per benchmark, then ``Avg (macro)`` (unweighted mean over benchmarks, the papers'
    Avg) and ``Avg (weighted)`` (by question count). pass@k, Mean@n, Best@n and AmbiQT
    coverage are percentages; ``strategies`` is the mean number of distinct correct SQL
    skeletons per question. ``-``: not defined for that benchmark.
    """
    benchmarks: Mapping[str, Mapping[str, Any]] = doc["benchmarks"]
    ks: Sequence[int] = doc["ks"]
    has_sql = any("distinct_strategies" in b["metrics"] for b in benchmarks.values())
    has_ambiqt = any("ambiqt_coverage" in b["metrics"] for b in benchmarks.values())
    columns: list[tuple[str, str, Any]] = [(f"pass@{k}", f"pass@{k}", _percent) for k in ks]
    columns += [("mean@n", "Mean@n", _percent), ("best@n", "Best@n", _percent)]
    if has_sql:
        columns.append(("distinct_strategies", "strategies", _count))
    if has_ambiqt:
        columns.append(("ambiqt_coverage", "AmbiQT cov", _percent))

    header = ["benchmark", "task", "questions", "n"] + [title for _, title, _ in columns]
    rows: list[list[str]] = []
    for name, b in benchmarks.items():
        values = b["metrics"]
        rows.append(
            [name, b["task"], str(b["num_questions"]), str(b["n"])] + [fmt(values.get(key)) for key, _, fmt in columns]
        )
    total = sum(int(b["num_questions"]) for b in benchmarks.values())
    averages = doc["averages"]
    for label, kind in (("Avg (macro)", "macro"), ("Avg (weighted)", "weighted")):
        values = averages[kind]
        rows.append([label, "", str(total), ""] + [fmt(values.get(key)) for key, _, fmt in columns])

    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
    left = {0, 1}  # text columns; numbers are right-aligned

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(widths[i]) if i in left else c.rjust(widths[i]) for i, c in enumerate(cells)]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(("-" * (widths[i] + 2)) if i in left else ("-" * (widths[i] + 1) + ":") for i in range(len(header)))
        + "|"
    )
    notes = [
        "",
        "pass@k, Mean@n, Best@n"
        + (", AmbiQT cov" if has_ambiqt else "")
        + ": % of questions (pass@k: unbiased estimator).",
    ]
    if has_sql:
        notes.append("strategies: mean number of distinct correct SQL skeletons per question.")
    if doc.get("k_skipped"):
        notes.append(f"pass@k not reported for k={list(doc['k_skipped'])} > n.")
    over_long = doc.get("skipped", {}).get("over_long", {})
    if over_long.get("count"):
        per = ", ".join(f"{name}: {count}" for name, count in over_long["by_benchmark"].items())
        notes.append(
            f"{over_long['count']} question(s) skipped, prompt longer than {over_long['max_prompt_tokens']} "
            f"tokens ({per}); not in the metrics above."
        )
    return "\n".join([line(header), rule, *(line(r) for r in rows), *notes]) + "\n"


# --------------------------------------------------------------------------- plot


def plot_pass_at_k(doc: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """pass@k (%) vs k per benchmark on a log-2 x axis (+ the macro average for several
    benchmarks). Uses matplotlib's Agg canvas directly: no pyplot, no global backend change."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ks = list(doc["ks"])
    n = {b["n"] for b in doc["benchmarks"].values()}
    fig = Figure(figsize=(6.4, 4.4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, b in doc["benchmarks"].items():
        ax.plot(ks, [100.0 * b["metrics"][f"pass@{k}"] for k in ks], marker="o", label=name)
    if len(doc["benchmarks"]) > 1:
        macro = doc["averages"]["macro"]
        ax.plot(ks, [100.0 * macro[f"pass@{k}"] for k in ks], "k--", marker="s", label="Avg (macro)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks)
    ax.set_xticklabels([str(k) for k in ks])
    ax.minorticks_off()
    if len(ks) == 1:  # a log axis needs some span around a single point
        ax.set_xlim(ks[0] / 1.5, ks[0] * 1.5)
    ax.set_ylim(-2, 102)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (%)")
    ax.set_title("pass@k" + (f" (n = {n.pop()} samples per question)" if len(n) == 1 else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return atomic_write_bytes(path, buffer.getvalue())


# --------------------------------------------------------------------------- all outputs


def write_outputs(result: EvalResultLike, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write the four output files into ``out_dir``; return their paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = results_document(result)
    files = {
        "results": atomic_write_text(out / RESULTS_JSON, json.dumps(doc, indent=2, allow_nan=False) + "\n"),
    }
    streamed = getattr(result.samples, "path", None)
    if streamed is None or Path(streamed).resolve() != (out / SAMPLES_JSONL).resolve():
        with atomic_writer(out / SAMPLES_JSONL) as handle:
            for record in result.samples:
                handle.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
    files["samples"] = out / SAMPLES_JSONL  # evaluate() streams it there chunk by chunk
    files["table"] = atomic_write_text(out / TABLE_MD, format_table(doc))
    files["plot"] = plot_pass_at_k(doc, out / PASS_AT_K_PNG)
    return files
