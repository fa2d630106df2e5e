"""Readers for math benchmarks and math training sets from a user's local files.

Accepted input: one file per benchmark, ``.jsonl`` (one object per line), ``.json`` (a list of
objects, or an object whose ``data``/``examples``/``test``/``train`` key holds that list) or
``.parquet``. Each record needs a problem and either an answer or a solution whose last
``\\boxed{...}`` is the answer. Field names are detected from common spellings (below) or given
explicitly. Known benchmarks and the file names found for them in a directory:

=============  ===================================================================
canonical      file stems (case, ``-`` and ``_`` ignored) or ``<stem>/test.*``
=============  ===================================================================
math500        math500, MATH-500
aime24         aime24, aime2024, aime_2024
aime25         aime25, aime2025
amc23          amc23, amc2023
minerva        minerva, minerva_math
olympiadbench  olympiadbench, olympiad_bench
train          train (any training set; or pass its file with ``benchmark="train"``)
=============  ===================================================================
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROBLEM_FIELDS = ("problem", "question", "Problem", "Question")
ANSWER_FIELDS = ("answer", "final_answer", "Answer", "expected_answer", "gt_answer", "ground_truth")
SOLUTION_FIELDS = ("solution", "Solution", "solutions")
ID_FIELDS = ("unique_id", "id", "question_id", "problem_id", "ID", "idx")

BENCHMARK_ALIASES: dict[str, tuple[str, ...]] = {
    "math500": ("math500",),
    "aime24": ("aime24", "aime2024"),
    "aime25": ("aime25", "aime2025"),
    "amc23": ("amc23", "amc2023"),
    "minerva": ("minerva", "minervamath"),
    "olympiadbench": ("olympiadbench",),
    "train": ("train",),
}
EVAL_BENCHMARKS = ("math500", "aime24", "aime25", "amc23", "minerva", "olympiadbench")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
# A file with one of these stems is named after its folder: MATH-500/test.jsonl -> math500.
_GENERIC_STEMS = {"test", "data", "validation", "val", "dev"}


@dataclass(frozen=True)
class MathExample:
    """One math problem with its reference final answer (the string the verifier compares)."""

    question_id: str
    problem: str
    answer: str
    benchmark: str
    solution: str = ""


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces kept), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if i < len(text) and text[i] == " ":  # "\boxed 5" form: the answer runs to the next "$"
        return text[i + 1 :].split("$", 1)[0].strip() or None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unbalanced braces: no usable answer


def _answer_to_str(value: Any) -> str:
    if isinstance(value, list | tuple):
        value = value[0] if len(value) == 1 else ", ".join(_answer_to_str(v) for v in value)
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # AMC23 stores 27.0 for "27"
    text = str(value).strip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()  # OlympiadBench final answers come wrapped in $...$
    return text


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of a .jsonl / .json / .parquet file (see module docstring for the layouts)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suffix == ".jsonl":
        records = []
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{line_no} is not valid JSON: {exc}") from exc
        return records
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            for key in ("data", "examples", "test", "train"):
                if isinstance(data.get(key), list):
                    return data[key]
            raise ValueError(f"{path} holds a JSON object without a list under data/examples/test/train")
        if not isinstance(data, list):
            raise ValueError(f"{path} must hold a JSON list of records, got {type(data).__name__}")
        return data
    raise ValueError(f"unsupported data file {path}: expected one of {', '.join(_DATA_SUFFIXES)}")


def _pick_field(record: dict[str, Any], explicit: str | None, candidates: tuple[str, ...]) -> str | None:
    if explicit is not None:
        return explicit if explicit in record else None
    return next((name for name in candidates if record.get(name) not in (None, "", [])), None)


def load_math_file(
    path: str | Path,
    *,
    benchmark: str,
    problem_field: str | None = None,
    answer_field: str | None = None,
    solution_field: str | None = None,
    id_field: str | None = None,
    limit: int | None = None,
) -> list[MathExample]:
    """Math examples of one file; explicit field names override the detected ones."""
    path = Path(path)
    records = read_records(path)
    if not records:
        raise ValueError(f"{path} has no records")
    examples: list[MathExample] = []
    for index, record in enumerate(records):
        if limit is not None and len(examples) >= limit:
            break
        if not isinstance(record, dict):
            raise ValueError(f"{path} record {index} is a {type(record).__name__}, expected an object")
        where = f"{path} (record {index}; fields: {sorted(record)})"
        p_field = _pick_field(record, problem_field, PROBLEM_FIELDS)
        if p_field is None:
            wanted = problem_field or " / ".join(PROBLEM_FIELDS)
            raise KeyError(f"problem column '{wanted}' not found in {where}; pass problem_field=...")
        a_field = _pick_field(record, answer_field, ANSWER_FIELDS)
        s_field = _pick_field(record, solution_field, SOLUTION_FIELDS)
        solution = _answer_to_str(record[s_field]) if s_field else ""
        if a_field is not None and record[a_field] not in (None, ""):
            answer = _answer_to_str(record[a_field])
        elif s_field is not None:
            boxed = last_boxed(solution)
            if boxed is None:
                raise ValueError(f"no answer column and no \\boxed{{...}} in column '{s_field}' of {where}")
            answer = boxed
        else:
            wanted = answer_field or " / ".join(ANSWER_FIELDS + SOLUTION_FIELDS)
            raise KeyError(
                f"answer column '{wanted}' not found in {where}; pass answer_field=... or solution_field=..."
            )
        i_field = _pick_field(record, id_field, ID_FIELDS)
        if id_field is not None and i_field is None:
            raise KeyError(f"id column '{id_field}' not found in {where}")
        question_id = str(record[i_field]) if i_field else f"{benchmark}-{index}"
        examples.append(
            MathExample(
                question_id=question_id,
                problem=str(record[p_field]).strip(),
                answer=answer,
                benchmark=benchmark,
                solution=solution,
            )
        )
    return examples


def _normalise_name(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", name.lower())


def _canonical_benchmark(name: str) -> str | None:
    norm = _normalise_name(name)
    return next((canon for canon, aliases in BENCHMARK_ALIASES.items() if norm in aliases), None)


def find_benchmark_files(root: str | Path) -> dict[str, Path]:
    """Canonical benchmark name -> data file, for files directly in ``root`` or one folder down."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"math input directory not found: {root}")
    found: dict[str, Path] = {}
    candidates = sorted(p for p in root.glob("*") if p.suffix.lower() in _DATA_SUFFIXES)
    candidates += sorted(p for p in root.glob("*/*") if p.suffix.lower() in _DATA_SUFFIXES)
    for path in candidates:
        stem = path.stem
        if _normalise_name(stem) in _GENERIC_STEMS and path.parent != root:
            stem = path.parent.name
        canon = _canonical_benchmark(stem)
        if canon is None:
            continue
        if canon in found:
            raise ValueError(f"two files for math benchmark '{canon}': {found[canon]} and {path}; keep one")
        found[canon] = path
    return found


def load_math_benchmark(root: str | Path, benchmark: str, **kwargs: Any) -> list[MathExample]:
    """Examples of one known benchmark found under ``root`` (keyword args as load_math_file)."""
    canon = _canonical_benchmark(benchmark)
    if canon is None:
        raise ValueError(f"unknown math benchmark '{benchmark}'; known: {', '.join(BENCHMARK_ALIASES)}")
    files = find_benchmark_files(root)
    if canon not in files:
        names = ", ".join(f"{a}{s}" for a in BENCHMARK_ALIASES[canon] for s in _DATA_SUFFIXES)
        raise FileNotFoundError(
            f"no file for math benchmark '{canon}' under {Path(root)}; expected one of {names} "
            f"(or <name>/test.jsonl etc.)"
        )
    return load_math_file(files[canon], benchmark=canon, **kwargs)
