from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_replay.data.math_benchmarks import (
    find_benchmark_files,
    last_boxed,
    load_math_benchmark,
    load_math_file,
    read_records,
)


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\fbox{x+1}", "x+1"),
        ("$\\boxed 7$ done", "7"),
        ("no answer here", None),
        ("\\boxed{unbalanced", None),
        ("\\boxed{ 3 } and \\fbox{9}", "9"),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_math500_style_jsonl(tmp_path):
    path = _jsonl(
        tmp_path / "math500.jsonl",
        [
            {"problem": "What is $1+1$?", "solution": "It is \\boxed{2}.", "answer": "2", "unique_id": "test/a/1.json"},
            {
                "problem": "Half of 1?",
                "solution": "\\boxed{\\frac{1}{2}}",
                "answer": "\\frac{1}{2}",
                "unique_id": "test/a/2.json",
            },
        ],
    )
    examples = load_math_file(path, benchmark="math500")
    assert [(e.question_id, e.answer) for e in examples] == [("test/a/1.json", "2"), ("test/a/2.json", "\\frac{1}{2}")]
    assert examples[0].problem == "What is $1+1$?" and examples[0].solution == "It is \\boxed{2}."
    assert len(load_math_file(path, benchmark="math500", limit=1)) == 1


def test_answer_normalisation_and_solution_fallback(tmp_path):
    amc = tmp_path / "amc.json"
    amc.write_text(json.dumps([{"question": "Q1", "answer": 27.0, "id": 3}, {"question": "Q2", "answer": 0.5}]))
    assert [(e.question_id, e.answer) for e in load_math_file(amc, benchmark="amc23")] == [
        ("3", "27"),
        ("amc23-1", "0.5"),
    ]
    olympiad = _jsonl(
        tmp_path / "ob.jsonl",
        [{"question": "Q", "final_answer": ["$\\sqrt{2}$"]}, {"question": "Q", "final_answer": ["$1$", "$2$"]}],
    )
    assert [e.answer for e in load_math_file(olympiad, benchmark="olympiadbench")] == ["\\sqrt{2}", "1, 2"]
    minerva = _jsonl(tmp_path / "minerva.jsonl", [{"problem": "P", "solution": "Thus \\boxed{3 \\times 10^8}."}])
    assert load_math_file(minerva, benchmark="minerva")[0].answer == "3 \\times 10^8"


def test_explicit_field_names_and_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt_text": ["What is 2 + 2?"], "label": ["4"], "uid": ["x7"]}), path)
    examples = load_math_file(
        path, benchmark="train", problem_field="prompt_text", answer_field="label", id_field="uid"
    )
    assert [(e.question_id, e.problem, e.answer) for e in examples] == [("x7", "What is 2 + 2?", "4")]
    with pytest.raises(KeyError, match="problem column 'question' not found in .*train.parquet \\(record 0"):
        load_math_file(path, benchmark="train", problem_field="question")
    with pytest.raises(KeyError, match="id column 'idx' not found"):
        load_math_file(path, benchmark="train", problem_field="prompt_text", answer_field="label", id_field="idx")


def test_missing_problem_or_answer_is_reported(tmp_path):
    no_problem = _jsonl(tmp_path / "a.jsonl", [{"text": "x", "answer": "1"}])
    with pytest.raises(KeyError, match="problem column 'problem / question / Problem / Question' not found .*'text'"):
        load_math_file(no_problem, benchmark="aime24")
    no_answer = _jsonl(tmp_path / "b.jsonl", [{"problem": "x"}])
    with pytest.raises(KeyError, match="answer column .* not found in .*b.jsonl"):
        load_math_file(no_answer, benchmark="aime24")
    unboxed = _jsonl(tmp_path / "c.jsonl", [{"problem": "x", "solution": "the answer is 5"}])
    with pytest.raises(ValueError, match="no answer column and no \\\\boxed\\{...\\} in column 'solution'"):
        load_math_file(unboxed, benchmark="minerva")


def test_read_records_formats_and_errors(tmp_path):
    wrapped = tmp_path / "w.json"
    wrapped.write_text(json.dumps({"data": [{"problem": "p", "answer": "1"}]}))
    assert read_records(wrapped) == [{"problem": "p", "answer": "1"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "p"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 is not valid JSON"):
        read_records(bad)
    with pytest.raises(ValueError, match="unsupported data file .*x.csv"):
        (tmp_path / "x.csv").write_text("a,b\n")
        read_records(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError, match="data file not found"):
        read_records(tmp_path / "missing.jsonl")


def test_find_benchmark_files_by_alias(tmp_path):
    record = [{"problem": "p", "answer": "1"}]
    _jsonl(tmp_path / "MATH-500" / "test.jsonl", record)
    _jsonl(tmp_path / "aime_2024.jsonl", record)
    _jsonl(tmp_path / "AIME25.jsonl", record)
    (tmp_path / "amc23.json").write_text(json.dumps([{"question": "q", "answer": 3.0}]))
    _jsonl(tmp_path / "minerva_math" / "test.jsonl", record)
    _jsonl(tmp_path / "olympiad_bench.jsonl", record)
    _jsonl(tmp_path / "notes.jsonl", record)  # not a benchmark name: ignored
    found = find_benchmark_files(tmp_path)
    assert sorted(found) == ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]
    assert found["math500"] == tmp_path / "MATH-500" / "test.jsonl"
    assert load_math_benchmark(tmp_path, "AMC-23")[0].answer == "3"
    with pytest.raises(FileNotFoundError, match="no file for math benchmark 'train' under .*train.jsonl"):
        load_math_benchmark(tmp_path, "train")
    with pytest.raises(ValueError, match="unknown math benchmark 'gsm8k'"):
        load_math_benchmark(tmp_path, "gsm8k")
    _jsonl(tmp_path / "aime2024" / "test.jsonl", record)
    with pytest.raises(ValueError, match="two files for math benchmark 'aime24'"):
        find_benchmark_files(tmp_path)
