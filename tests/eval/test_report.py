"""Report outputs: table layout, PNG plot, atomic writes, results document from aggregated verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_replay.eval.report import (
    atomic_write_text,
    atomic_writer,
    format_table,
    plot_pass_at_k,
    write_outputs,
)
from verl_replay.eval.run import EvalConfig, EvalResult, Question, SampleVerdict, aggregate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _doc() -> dict:
    return {
        "ks": [1, 4],
        "k_skipped": [32],
        "benchmarks": {
            "math500": {
                "name": "math500",
                "task": "math",
                "num_questions": 500,
                "n": 4,
                "metrics": {"pass@1": 0.5, "pass@4": 0.8125, "mean@n": 0.5, "best@n": 0.8125},
            },
            "ambiqt": {
                "name": "ambiqt",
                "task": "sql",
                "num_questions": 12,
                "n": 4,
                "metrics": {
                    "pass@1": 0.25,
                    "pass@4": 0.5,
                    "mean@n": 0.25,
                    "best@n": 0.5,
                    "distinct_strategies": 1.5,
                    "ambiqt_coverage": 1 / 3,
                },
            },
        },
        "averages": {
            "macro": {
                "pass@1": 0.375,
                "pass@4": 0.65625,
                "mean@n": 0.375,
                "best@n": 0.65625,
                "distinct_strategies": 1.5,
                "ambiqt_coverage": 1 / 3,
            },
            "weighted": {
                "pass@1": 0.494,
                "pass@4": 0.8052,
                "mean@n": 0.494,
                "best@n": 0.8052,
                "distinct_strategies": 1.5,
                "ambiqt_coverage": 1 / 3,
            },
        },
    }


def test_table_is_aligned_markdown_with_percentages_and_averages() -> None:
    text = format_table(_doc())
    lines = text.splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 2 + 2 + 2  # header, rule, 2 benchmarks, 2 averages
    assert len({len(line) for line in table}) == 1  # every row padded to the same width
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == [
        "benchmark",
        "task",
        "questions",
        "n",
        "pass@1",
        "pass@4",
        "Mean@n",
        "Best@n",
        "strategies",
        "AmbiQT cov",
    ]
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in table[2:]}
    assert cells["math500"] == ["math500", "math", "500", "4", "50.0", "81.2", "50.0", "81.2", "-", "-"]
    assert cells["ambiqt"][4:] == ["25.0", "50.0", "25.0", "50.0", "1.50", "33.3"]
    assert cells["Avg (macro)"][2:6] == ["512", "", "37.5", "65.6"]
    assert cells["Avg (weighted)"][4] == "49.4"
    assert table[1].startswith("|---") and table[1].rstrip("|").endswith(":")  # numbers right-aligned
    assert "k=[32] > n" in text


def test_table_without_sql_has_no_strategy_or_coverage_columns() -> None:
    doc = _doc()
    del doc["benchmarks"]["ambiqt"]
    header = format_table(doc).splitlines()[0]
    assert "strategies" not in header and "AmbiQT" not in header


@pytest.mark.parametrize("ks", [[1, 4], [8]])
def test_plot_writes_a_valid_png(tmp_path: Path, ks: list[int]) -> None:
    from matplotlib.image import imread

    doc = _doc()
    doc["ks"] = ks
    for b in [*doc["benchmarks"].values(), {"metrics": doc["averages"]["macro"]}]:
        b["metrics"].update({f"pass@{k}": 0.7 for k in ks})
    path = plot_pass_at_k(doc, tmp_path / "plot.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4) and min(image.shape[:2]) > 200
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_atomic_write_keeps_the_old_file_on_error(tmp_path: Path) -> None:
    target = atomic_write_text(tmp_path / "results.json", "old\n")
    with pytest.raises(RuntimeError):
        with atomic_writer(target) as handle:
            handle.write("half written")
            raise RuntimeError("interrupted")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def _question(row: int, benchmark: str, task: str, interpretations: tuple[str, ...] = ()) -> Question:
    return Question(
        row=row,
        source_file="x.parquet",
        benchmark=benchmark,
        data_source=benchmark,
        task=task,
        question_id=f"{benchmark}-{row}",
        prompt="p",
        ground_truth="g",
        extra_info={},
        interpretations=interpretations,
    )


def test_write_outputs_from_aggregated_verdicts(tmp_path: Path) -> None:
    ok, bad = SampleVerdict(True, "ok", "SELECT col FROM tbl"), SampleVerdict(False, "mismatch")
    other = SampleVerdict(True, "ok", "SELECT COUNT(*) FROM tbl")
    questions = [_question(0, "sqlb", "sql"), _question(1, "sqlb", "sql"), _question(2, "mathb", "math")]
    verdicts = [[ok, other], [bad, ok], [SampleVerdict(True, "ok"), SampleVerdict(False, "worker_timeout")]]
    config = EvalConfig(data=("x.parquet",), n=2, k=(1, 2, 4))
    benchmarks, averages, records = aggregate(questions, verdicts, config.ks_used)
    samples = [
        {"row": q.row, "sample": j, "text": "t", "correct": v.correct, "reason": v.reason}
        for q, row in zip(questions, verdicts, strict=True)
        for j, v in enumerate(row)
    ]
    result = EvalResult(config, benchmarks, averages, records, samples, {"total_s": 1.0})
    files = write_outputs(result, tmp_path / "out")

    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "pass_at_k.png",
        "results.json",
        "samples.jsonl",
        "table.md",
    ]
    doc = json.loads(files["results"].read_text())
    assert doc["schema_version"] == 2 and doc["ks"] == [1, 2] and doc["k_skipped"] == [4]
    assert doc["skipped"]["over_long"] == {"count": 0, "max_prompt_tokens": None, "by_benchmark": {}, "questions": []}
    assert doc["config"]["n"] == 2 and doc["config"]["data"] == ["x.parquet"]
    sqlb = doc["benchmarks"]["sqlb"]
    assert sqlb["metrics"] == {"pass@1": 0.75, "pass@2": 1.0, "mean@n": 0.75, "best@n": 1.0, "distinct_strategies": 1.5}
    assert sqlb["strategy_distribution"] == {"1": 1, "2": 1}
    assert doc["benchmarks"]["mathb"]["verification_failures"] == 1
    assert doc["benchmarks"]["mathb"]["reasons"] == {"ok": 1, "worker_timeout": 1}
    assert "strategy_distribution" not in doc["benchmarks"]["mathb"] and "ambiqt" not in sqlb
    assert doc["averages"]["macro"]["mean@n"] == pytest.approx((0.75 + 0.5) / 2)
    assert doc["averages"]["weighted"]["mean@n"] == pytest.approx((0.75 * 2 + 0.5) / 3)
    assert doc["questions"][0]["skeletons"] == ["SELECT COUNT(*) FROM tbl", "SELECT col FROM tbl"]
    assert [json.loads(line)["reason"] for line in files["samples"].read_text().splitlines()] == [
        "ok",
        "ok",
        "mismatch",
        "ok",
        "ok",
        "worker_timeout",
    ]
    assert files["table"].read_text() == format_table(doc)
    assert files["plot"].read_bytes()[:8] == PNG_MAGIC
