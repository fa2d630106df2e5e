"""Turn loaded examples into verl RL parquet files.

Row layout (what ``verl.utils.dataset.rl_dataset.RLHFDataset`` and reward functions read):

- ``data_source``: ``bird`` / ``spider`` / ``ambiqt`` / ``tiny_sql`` for SQL; the benchmark
  name (``math500``, ``aime24``, ..., ``train``) or ``tiny_math`` for math.
- ``prompt``: chat messages ``[{"role", "content"}]`` (see ``prompts.py``).
- ``ability``: ``sql`` or ``math`` (verifier dispatch should key on this).
- ``reward_model``: ``{"style": "rule", "ground_truth": <gold SQL | final answer>}``.
- ``extra_info`` (SQL): ``split, index, question_id, db_id, db_path`` (absolute),
  ``semantics`` (``bird`` = set equality, ``spider`` = bag / ordered), ``question, evidence,
  gold_sqls`` (every accepted gold query; AmbiQT: both interpretations).
- ``extra_info`` (math): ``split, index, question_id, benchmark, question``.

All SQL files share one Arrow schema and all math files another, so files of the same task can
be concatenated by verl (``datasets.concatenate_datasets`` needs identical features).
Files are written atomically (tmp file + ``os.replace``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from verl_replay.data.math_benchmarks import (
    EVAL_BENCHMARKS,
    MathExample,
    find_benchmark_files,
    load_math_file,
)
from verl_replay.data.prompts import MATH_INSTRUCTION, SQL_INSTRUCTION, build_math_messages, build_sql_messages
from verl_replay.data.schema import SQLExample, schema_text

_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
_REWARD_MODEL = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
SQL_EXTRA_INFO = pa.struct(
    [
        ("split", pa.string()),
        ("index", pa.int64()),
        ("question_id", pa.string()),
        ("db_id", pa.string()),
        ("db_path", pa.string()),
        ("semantics", pa.string()),
        ("question", pa.string()),
        ("evidence", pa.string()),
        ("gold_sqls", pa.list_(pa.string())),
    ]
)
MATH_EXTRA_INFO = pa.struct(
    [
        ("split", pa.string()),
        ("index", pa.int64()),
        ("question_id", pa.string()),
        ("benchmark", pa.string()),
        ("question", pa.string()),
    ]
)


def _rl_schema(extra_info: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", _MESSAGES),
            ("ability", pa.string()),
            ("reward_model", _REWARD_MODEL),
            ("extra_info", extra_info),
        ]
    )


SQL_RL_SCHEMA = _rl_schema(SQL_EXTRA_INFO)
MATH_RL_SCHEMA = _rl_schema(MATH_EXTRA_INFO)
SEMANTICS = ("bird", "spider")


@dataclass(frozen=True)
class PreparedFile:
    """One written parquet file and what it holds."""

    path: Path
    rows: int
    data_source: str
    split: str


def sql_rows(
    examples: Iterable[SQLExample],
    *,
    data_source: str,
    split: str,
    semantics: str,
    with_sample_rows: int = 0,
    system_prompt: str | None = None,
    instruction: str = SQL_INSTRUCTION,
) -> list[dict[str, Any]]:
    """RL rows for SQL examples; the prompt shows the database's CREATE TABLE statements."""
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    schema_cache: dict[Path, str] = {}
    rows = []
    for index, ex in enumerate(examples):
        db_path = Path(ex.db_path).absolute()
        if db_path not in schema_cache:
            schema_cache[db_path] = schema_text(db_path, with_sample_rows=with_sample_rows)
        rows.append(
            {
                "data_source": data_source,
                "prompt": build_sql_messages(
                    schema_cache[db_path],
                    ex.question,
                    ex.evidence,
                    system_prompt=system_prompt,
                    instruction=instruction,
                ),
                "ability": "sql",
                "reward_model": {"style": "rule", "ground_truth": ex.gold_sql},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "question_id": str(ex.question_id),
                    "db_id": ex.db_id,
                    "db_path": str(db_path),
                    "semantics": semantics,
                    "question": ex.question,
                    "evidence": ex.evidence,
                    "gold_sqls": list(ex.gold_sqls),
                },
            }
        )
    return rows


def math_rows(
    examples: Iterable[MathExample],
    *,
    split: str,
    data_source: str | None = None,
    system_prompt: str | None = None,
    instruction: str = MATH_INSTRUCTION,
) -> list[dict[str, Any]]:
    """RL rows for math examples; ``data_source`` defaults to each example's benchmark."""
    return [
        {
            "data_source": data_source or ex.benchmark,
            "prompt": build_math_messages(ex.problem, system_prompt=system_prompt, instruction=instruction),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ex.answer},
            "extra_info": {
                "split": split,
                "index": index,
                "question_id": str(ex.question_id),
                "benchmark": ex.benchmark,
                "question": ex.problem,
            },
        }
        for index, ex in enumerate(examples)
    ]


def write_rl_parquet(rows: Sequence[dict[str, Any]], path: str | Path, schema: pa.Schema) -> Path:
    """Write rows with an explicit Arrow schema, atomically; refuse an empty file."""
    if not rows:
        raise ValueError(f"refusing to write an empty RL parquet file to {path}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(list(rows), schema=schema)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _write(
    rows: list[dict[str, Any]], output_dir: Path, name: str, schema: pa.Schema, source: str, split: str
) -> PreparedFile:
    path = write_rl_parquet(rows, Path(output_dir) / f"{name}.parquet", schema)
    return PreparedFile(path=path.absolute(), rows=len(rows), data_source=source, split=split)


def _prepare_sql_benchmark(
    name: str,
    load: Any,
    input_dir: str | Path,
    output_dir: str | Path,
    *,
    split: str,
    limit: int | None,
    databases_dir: str | Path | None,
    with_sample_rows: int,
    system_prompt: str | None,
) -> list[PreparedFile]:
    """BIRD and Spider: ``load(input_dir, split, ...)`` examples -> ``<name>_<split>.parquet``
    (the benchmark's own comparison semantics: BIRD set equality, Spider bag/order)."""
    examples = load(input_dir, split, databases_dir=databases_dir, limit=limit)
    rows = sql_rows(
        examples,
        data_source=name,
        split=split,
        semantics=name,
        with_sample_rows=with_sample_rows,
        system_prompt=system_prompt,
    )
    return [_write(rows, Path(output_dir), f"{name}_{split}", SQL_RL_SCHEMA, name, split)]


def prepare_bird(
    input_dir: str | Path,
    output_dir: str | Path,
    *,
    split: str = "dev",
    limit: int | None = None,
    databases_dir: str | Path | None = None,
    with_sample_rows: int = 0,
    system_prompt: str | None = None,
) -> list[PreparedFile]:
    from verl_replay.data.bird import load_bird

    return _prepare_sql_benchmark(
        "bird",
        load_bird,
        input_dir,
        output_dir,
        split=split,
        limit=limit,
        databases_dir=databases_dir,
        with_sample_rows=with_sample_rows,
        system_prompt=system_prompt,
    )


def prepare_spider(
    input_dir: str | Path,
    output_dir: str | Path,
    *,
    split: str = "dev",
    limit: int | None = None,
    databases_dir: str | Path | None = None,
    with_sample_rows: int = 0,
    system_prompt: str | None = None,
) -> list[PreparedFile]:
    from verl_replay.data.spider import load_spider

    return _prepare_sql_benchmark(
        "spider",
        load_spider,
        input_dir,
        output_dir,
        split=split,
        limit=limit,
        databases_dir=databases_dir,
        with_sample_rows=with_sample_rows,
        system_prompt=system_prompt,
    )


def prepare_ambiqt(
    input_path: str | Path,
    output_dir: str | Path,
    *,
    databases_dir: str | Path,
    split: str = "validation",
    limit: int | None = None,
    check_executable: bool = True,
    with_sample_rows: int = 0,
    system_prompt: str | None = None,
) -> tuple[list[PreparedFile], list[tuple[str, str]]]:
    """Returns the written files and the skipped ``(question_id, reason)`` pairs."""
    from verl_replay.data.ambiqt import load_ambiqt

    loaded = load_ambiqt(input_path, databases_dir, split=split, limit=limit, check_executable=check_executable)
    if not loaded.examples:
        reasons = "; ".join(f"{q}: {r}" for q, r in loaded.skipped[:3])
        raise ValueError(f"no usable AmbiQT examples in {input_path} (first skips: {reasons})")
    rows = sql_rows(
        loaded.examples,
        data_source="ambiqt",
        split=split,
        semantics="spider",
        with_sample_rows=with_sample_rows,
        system_prompt=system_prompt,
    )
    return [_write(rows, Path(output_dir), f"ambiqt_{split}", SQL_RL_SCHEMA, "ambiqt", split)], loaded.skipped


def prepare_math(
    input_path: str | Path,
    output_dir: str | Path,
    *,
    benchmarks: Sequence[str] | None = None,
    benchmark: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    instruction: str = MATH_INSTRUCTION,
    system_prompt: str | None = None,
    **field_names: str | None,
) -> list[PreparedFile]:
    """One parquet per benchmark: ``math_<benchmark>.parquet``.

    ``input_path`` is a file (then ``benchmark`` names it) or a directory searched with
    ``find_benchmark_files``; ``benchmarks`` restricts which are written. ``split`` defaults to
    ``train`` for the ``train`` benchmark and ``test`` otherwise. ``field_names`` are passed to
    ``load_math_file`` (``problem_field``, ``answer_field``, ``solution_field``, ``id_field``).
    """
    input_path = Path(input_path)
    if input_path.is_file():
        if not benchmark:
            raise ValueError(f"{input_path} is a file: pass benchmark=<name> (e.g. math500 or train)")
        files = {benchmark: input_path}
    else:
        files = find_benchmark_files(input_path)
        if benchmarks:
            missing = [b for b in benchmarks if b not in files]
            if missing:
                raise FileNotFoundError(
                    f"no file for math benchmark(s) {missing} under {input_path}; found {sorted(files) or 'none'}"
                )
            files = {b: files[b] for b in benchmarks}
        if not files:
            raise FileNotFoundError(
                f"no math benchmark files under {input_path}; expected names like "
                f"{', '.join(b + '.jsonl' for b in EVAL_BENCHMARKS)} or train.parquet"
            )
    prepared = []
    for name, path in files.items():
        examples = load_math_file(path, benchmark=name, limit=limit, **field_names)
        this_split = split or ("train" if name == "train" else "test")
        rows = math_rows(examples, split=this_split, instruction=instruction, system_prompt=system_prompt)
        prepared.append(_write(rows, Path(output_dir), f"math_{name}", MATH_RL_SCHEMA, name, this_split))
    return prepared


def _write_inferred(rows: list[dict[str, Any]], output_dir: Path, name: str, source: str, split: str) -> PreparedFile:
    """A file whose Arrow schema is read off its rows (search / multimodal rows: their own layouts)."""
    return _write(rows, output_dir, name, pa.Table.from_pylist(rows).schema, source, split)


def prepare_search(
    input_dir: str | Path,
    output_dir: str | Path,
    *,
    retrieval_url: str | None = None,
    corpus: str | None = None,
    topk: int = 3,
    limit: int | None = None,
) -> list[PreparedFile]:
    """Search-R1's data: ``search_train.parquet`` (NQ + HotpotQA train), ``search_test.parquet``
    (the seven QA sets' test, or dev, splits found under ``input_dir``) and ``search_tools.yaml``
    (verl's tool config: the retrieval server at ``retrieval_url`` or a local BM25 ``corpus``)."""
    from verl_replay.data.search_qa import (
        EVAL_DATASETS,
        TRAIN_DATASETS,
        find_split,
        load_qa_file,
        search_rows,
        search_tool_config,
    )

    root, out = Path(input_dir), Path(output_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder (FlashRAG layout: <dataset>/<split>.jsonl)")
    tools = search_tool_config(retrieval_url=retrieval_url, corpus=corpus, topk=topk)
    files = []
    for split, datasets, splits in (("train", TRAIN_DATASETS, ("train",)), ("test", EVAL_DATASETS, ("test", "dev"))):
        examples = []
        for dataset in datasets:
            path = find_split(root, dataset, splits)
            if path is not None:
                examples += load_qa_file(path, dataset)[:limit]
        if not examples:
            raise FileNotFoundError(
                f"{root}: none of {', '.join(f'{d}/{splits[0]}.jsonl' for d in datasets)} (FlashRAG's QA files)"
            )
        files.append(_write_inferred(search_rows(examples, split), out, f"search_{split}", "search", split))
    out.mkdir(parents=True, exist_ok=True)
    (out / "search_tools.yaml").write_text(tools, encoding="utf-8")
    return files


def prepare_geo3k(input_dir: str | Path, output_dir: str | Path, *, limit: int | None = None) -> list[PreparedFile]:
    """Geometry3K's train and test parquet files as verl multimodal RL rows (``geo3k_{train,test}``)."""
    from verl_replay.data.geo3k import GEO3K_SOURCE, find_geo3k_files, geo3k_rows

    return [
        _write_inferred(
            geo3k_rows(find_geo3k_files(input_dir, split), split, limit),
            Path(output_dir),
            f"geo3k_{split}",
            GEO3K_SOURCE,
            split,
        )
        for split in ("train", "test")
    ]
