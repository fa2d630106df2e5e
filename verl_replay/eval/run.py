"""Evaluation run: sample ``n`` responses per question, verify them, aggregate metrics.

Pipeline of :func:`evaluate`:

1. :func:`load_questions` reads verl RL parquet files (``data_source``, ``prompt``,
   ``reward_model.ground_truth``, ``extra_info``) and groups rows into benchmarks;
2. prompts that leave no room for one generated token (longer than ``max_model_len - 1`` tokens)
   are skipped and counted, never fatal (vLLM rejects a whole ``generate`` call for one of them);
   the rest are sampled in chunks of ``chunk_questions`` questions, ``n`` completions each, chunk
   ``i`` under the seed ``chunk_seed(seed, i)``;
3. :func:`verify_generations` checks every sample with the verl reward function
   (:func:`verl_replay.rewards.compute_score`, its ``acc`` bit: correctness, never the shaped
   score) inside a :class:`~verl_replay.verifiers.pool.VerifierPool`, so a sample whose
   verification crashes or hangs costs exactly that sample (counted incorrect, with the pool's
   reason) and never the run. AmbiQT rows are verified once per gold interpretation; a sample is
   correct when it matches either (what ``compute_score`` does with both golds), and the
   per-interpretation hits give the dual-interpretation coverage;
4. :func:`aggregate` computes per-benchmark pass@k, Mean@n, Best@n, distinct correct SQL
   strategies (canonical AST skeletons of correct samples) and AmbiQT coverage, then macro and
   question-weighted averages over benchmarks;
5. :mod:`verl_replay.eval.report` writes ``results.json``, ``table.md`` and ``pass_at_k.png``.

Steps 2-3 are pipelined: while the backend samples chunk ``i + 1``, the verifier processes check
chunk ``i``; each verified chunk is appended to ``samples.jsonl`` at once and committed in
``eval_state.json`` (:mod:`verl_replay.eval.store`), so results stream to disk as they complete
and a rerun with the same settings resumes after the last committed chunk. A progress bar (on a
terminal) and one log line per chunk show questions and samples done with their rate.

This module imports neither torch nor transformers; the generation backend is built lazily.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from verl_replay.eval import metrics
from verl_replay.generation.base import derive_seed

__all__ = [
    "BenchmarkResult",
    "EvalConfig",
    "EvalResult",
    "POOL_FAILURE_REASONS",
    "Question",
    "SampleVerdict",
    "SampleFile",
    "aggregate",
    "ambiqt_coverage_at_k",
    "chunk_seed",
    "evaluate",
    "find_over_long",
    "is_ambiqt_source",
    "load_questions",
    "verify_generations",
    "verify_one",
]

logger = logging.getLogger(__name__)

BACKEND_CHOICES = ("hf", "transformers", "vllm")
# Failure reasons of VerifierPool (the sample's verification itself did not complete).
POOL_FAILURE_REASONS = frozenset(
    {"worker_crashed", "worker_timeout", "task_error", "pool_closed", "worker_start_failed"}
)
# Reasons that mean the pool itself is unusable (workers cannot start): abort the evaluation.
_POOL_BROKEN_REASONS = frozenset({"worker_start_failed", "pool_closed"})
# Grace added to the pool's hard per-task deadline on top of the verifier's own deadlines
# (SQLite progress handler / math alarm): process scheduling and gold-query caching.
_HARD_DEADLINE_GRACE_S = 5.0
REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")


# --------------------------------------------------------------------------- configuration


def _positive_int(value: Any, name: str, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class EvalConfig:
    """Everything that decides an evaluation; ``to_dict`` is stored in ``results.json``.

    ``data``: parquet paths. ``model``: model directory or hub id (required unless a backend is
    passed to :func:`evaluate`). ``out``: output folder (``None``: write nothing). ``k``: the
    pass@k values; those above ``n`` are skipped (reported as ``k_skipped``). ``limit``: first
    ``limit`` questions of *each benchmark*, in file order. ``benchmark_key``: ``auto`` (math
    rows with ``extra_info.benchmark`` use it, every other row its ``data_source``),
    ``data_source``, or ``extra_info.<field>``. ``verify_timeout_s``: deadline of each SQL query
    / math comparison inside the verifier; ``verify_hard_timeout_s``: the pool's kill deadline
    per verification task (default: derived from ``verify_timeout_s`` and the number of golds).
    ``max_model_len``: context of the model (vLLM: the engine's; default: the model's own);
    prompts of ``max_model_len`` tokens or more are skipped and counted. ``chunk_questions``:
    questions per ``generate`` call and per committed chunk of ``samples.jsonl``.
    """

    data: tuple[str, ...]
    model: str | None = None
    out: str | None = None
    backend: str = "hf"
    n: int = 32
    k: tuple[int, ...] = (1, 8, 32)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int = 0
    limit: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    hf_batch_size: int = 32
    verify_workers: int = 2
    verify_timeout_s: float = 5.0
    verify_hard_timeout_s: float | None = None
    benchmark_key: str = "auto"
    chunk_questions: int = 256

    def __post_init__(self) -> None:
        data = (self.data,) if isinstance(self.data, (str, os.PathLike)) else tuple(self.data)
        data = tuple(os.fspath(p) for p in data)
        if not data:
            raise ValueError("data: give at least one parquet file (--data)")
        object.__setattr__(self, "data", data)
        if self.model is not None:
            object.__setattr__(self, "model", os.fspath(self.model))
        if self.out is not None:
            object.__setattr__(self, "out", os.fspath(self.out))
        if str(self.backend).lower() not in BACKEND_CHOICES:
            raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {self.backend!r}")
        object.__setattr__(self, "backend", str(self.backend).lower())
        for name in (
            "n",
            "max_new_tokens",
            "tensor_parallel_size",
            "hf_batch_size",
            "verify_workers",
            "chunk_questions",
        ):
            _positive_int(getattr(self, name), name)
        _positive_int(self.limit, "limit", allow_none=True)
        _positive_int(self.max_model_len, "max_model_len", allow_none=True)
        ks = (self.k,) if isinstance(self.k, (int, np.integer)) else tuple(self.k)
        if not ks:
            raise ValueError("k: give at least one k for pass@k (--k 1,8,32)")
        ks = tuple(sorted({_positive_int(k, "k") for k in ks}))  # type: ignore[type-var]
        if ks[0] > self.n:
            raise ValueError(f"k: every requested k {list(ks)} exceeds n={self.n}; pass@k needs k <= n")
        object.__setattr__(self, "k", ks)
        if not self.temperature >= 0 or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not self.verify_timeout_s > 0:
            raise ValueError(f"verify_timeout_s must be > 0, got {self.verify_timeout_s!r}")
        if self.verify_hard_timeout_s is not None and not self.verify_hard_timeout_s > 0:
            raise ValueError(f"verify_hard_timeout_s must be > 0, got {self.verify_hard_timeout_s!r}")
        key = str(self.benchmark_key)
        if key not in ("auto", "data_source") and not (key.startswith("extra_info.") and len(key) > 11):
            raise ValueError(
                f"benchmark_key must be 'auto', 'data_source' or 'extra_info.<field>', got {self.benchmark_key!r}"
            )

    @property
    def ks_used(self) -> tuple[int, ...]:
        """The requested k that are <= n (pass@k is undefined above n)."""
        return tuple(k for k in self.k if k <= self.n)

    @property
    def ks_skipped(self) -> tuple[int, ...]:
        return tuple(k for k in self.k if k > self.n)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["data"] = list(self.data)
        out["k"] = list(self.k)
        return out


# --------------------------------------------------------------------------- data


def is_ambiqt_source(data_source: str) -> bool:
    """AmbiQT rows (two gold interpretations) are recognised by their data_source name."""
    return "ambiqt" in str(data_source).lower()


@dataclass(frozen=True)
class Question:
    """One evaluation question (one parquet row)."""

    row: int  # index over all rows of all data files, in order
    source_file: str
    benchmark: str
    data_source: str
    task: str  # "sql" | "math"
    question_id: str
    prompt: Any  # chat messages (list of {"role", "content"}) or a plain string
    ground_truth: Any
    extra_info: dict[str, Any]
    # AmbiQT: the two gold interpretations, verified separately; () for every other row.
    interpretations: tuple[str, ...] = ()


def _plain(value: Any) -> Any:
    """numpy arrays (pandas-written parquet) -> lists, recursively; everything else unchanged."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _task_of(data_source: str, info: Mapping[str, Any], where: str) -> str:
    # Same dispatch as verl_replay.rewards.compute_score, decided up front so that a dataset the
    # reward cannot score fails before any sampling.
    from verl_replay.rewards import is_math_source, is_sql_source

    if is_sql_source(data_source) or (not is_math_source(data_source) and "db_path" in info):
        return "sql"
    if is_math_source(data_source) or "benchmark" in info:
        return "math"
    raise ValueError(
        f"{where}: cannot tell whether data_source {data_source!r} is SQL or math; SQL rows need "
        "extra_info.db_path, math rows extra_info.benchmark (or a recognised data_source name)"
    )


def _benchmark_of(key: str, task: str, data_source: str, info: Mapping[str, Any], where: str) -> str:
    if key == "data_source":
        return data_source
    if key == "auto":
        bench = info.get("benchmark") if task == "math" else None
        return str(bench) if bench else data_source
    field_name = key.split(".", 1)[1]
    value = info.get(field_name)
    if value is None or value == "":
        raise ValueError(f"{where}: --benchmark-key {key} but the row has no extra_info.{field_name}")
    return str(value)


def _db_file(info: Mapping[str, Any]) -> str:
    db_path = os.fspath(info["db_path"])
    if not os.path.isabs(db_path) and info.get("db_root"):
        db_path = os.path.join(os.fspath(info["db_root"]), db_path)
    return db_path


def _read_rows(path: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data: no such parquet file: {path}")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - turn any reader error into one clear message
        raise ValueError(f"--data: cannot read {path} as parquet ({type(exc).__name__}: {exc})") from exc
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(
            f"--data: {path} lacks column(s) {missing}; an RL parquet file needs {list(REQUIRED_COLUMNS)} "
            f"(+ extra_info), it has {table.column_names}"
        )
    return table.to_pylist()


def load_questions(paths: Sequence[str], *, benchmark_key: str = "auto", limit: int | None = None) -> list[Question]:
    """Read RL parquet files into questions; ``limit`` keeps the first questions of each benchmark.

    Raises ``FileNotFoundError`` for a missing data file or SQLite database, ``ValueError`` for
    a missing column, ground truth, or an AmbiQT row without exactly two interpretations.
    """
    questions: list[Question] = []
    per_benchmark: Counter[str] = Counter()
    row_index = 0
    missing_dbs: list[str] = []
    for path in paths:
        rows = _read_rows(os.fspath(path))
        for file_row, raw in enumerate(rows):
            where = f"{path} row {file_row}"
            row_index += 1
            data_source = raw.get("data_source")
            if not data_source:
                raise ValueError(f"{where}: empty data_source")
            data_source = str(data_source)
            info = _plain(raw.get("extra_info")) or {}
            if not isinstance(info, dict):
                raise ValueError(f"{where}: extra_info must be a struct/dict, got {type(info).__name__}")
            reward_model = _plain(raw.get("reward_model")) or {}
            ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
            if ground_truth is None or ground_truth == "" or ground_truth == []:
                raise ValueError(f"{where}: reward_model.ground_truth is missing")
            prompt = _plain(raw.get("prompt"))
            if isinstance(prompt, list):
                if not prompt or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
                    raise ValueError(f"{where}: prompt must be chat messages [{{'role', 'content'}}, ...] or a string")
                prompt = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
            elif not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{where}: prompt must be chat messages or a non-empty string")
            task = _task_of(data_source, info, where)
            benchmark = _benchmark_of(benchmark_key, task, data_source, info, where)
            if limit is not None and per_benchmark[benchmark] >= limit:
                continue
            per_benchmark[benchmark] += 1
            interpretations: tuple[str, ...] = ()
            if task == "sql":
                if "db_path" not in info:
                    raise ValueError(f"{where}: SQL row without extra_info.db_path")
                if not os.path.isfile(_db_file(info)):
                    missing_dbs.append(_db_file(info))
                if is_ambiqt_source(data_source):
                    interpretations = _interpretations(ground_truth, info, where)
            question_id = info.get("question_id")
            questions.append(
                Question(
                    row=row_index - 1,
                    source_file=os.fspath(path),
                    benchmark=benchmark,
                    data_source=data_source,
                    task=task,
                    question_id=str(question_id) if question_id not in (None, "") else f"{benchmark}-{file_row}",
                    prompt=prompt,
                    ground_truth=ground_truth,
                    extra_info=info,
                    interpretations=interpretations,
                )
            )
    if missing_dbs:
        unique = sorted(set(missing_dbs))
        raise FileNotFoundError(
            f"{len(unique)} SQLite database(s) named by extra_info.db_path do not exist, e.g. {unique[:3]}"
        )
    if not questions:
        raise ValueError(f"--data: no rows in {list(paths)}")
    return questions


def _interpretations(ground_truth: Any, info: Mapping[str, Any], where: str) -> tuple[str, ...]:
    golds = ground_truth if isinstance(ground_truth, list) else [ground_truth]
    golds = list(golds) + list(info.get("gold_sqls") or [])
    distinct = tuple(dict.fromkeys(str(g).strip() for g in golds if str(g).strip()))
    if len(distinct) != 2:
        raise ValueError(
            f"{where}: an AmbiQT row needs exactly two distinct gold interpretations "
            f"(ground_truth + extra_info.gold_sqls), got {len(distinct)}"
        )
    return distinct


# --------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class SampleVerdict:
    """Verification outcome of one sample."""

    correct: bool
    reason: str
    skeleton: str | None = None  # canonical skeleton of a correct SQL sample (None: unparseable)
    interpretation_hits: tuple[bool, ...] = ()  # AmbiQT: whether it matches each interpretation
    detail: str = ""


def verify_one(
    data_source: str,
    solution: str,
    ground_truth: Any,
    extra_info: dict[str, Any],
    timeout_s: float,
    want_skeleton: bool,
) -> dict[str, Any]:
    """Pool task: the reward function's correctness bit (+ the skeleton of a correct SQL sample).

    Runs in a VerifierPool worker; the skeleton is computed here too because sqlglot parsing
    untrusted text belongs under the same hard deadline as executing it.
    """
    from verl_replay.rewards import compute_score

    scored = compute_score(
        data_source, solution, ground_truth, extra_info, sql_timeout_s=timeout_s, math_timeout_s=timeout_s
    )
    correct = float(scored["acc"]) == 1.0
    skeleton = None
    if correct and want_skeleton:
        from verl_replay.sql.skeleton import SQLParseError, sql_skeleton
        from verl_replay.verifiers.extract import extract_sql

        sql = extract_sql(solution)
        try:
            skeleton = sql_skeleton(sql) if sql is not None else None
        except SQLParseError:
            skeleton = None  # executes in SQLite but sqlglot cannot parse it: no strategy identity
    return {"correct": correct, "reason": str(scored["reason"]), "skeleton": skeleton, "detail": ""}


def _failure(reason: str, detail: str) -> dict[str, Any]:
    """VerifierPool ``on_failure``: the task crashed, hung, raised or never ran -> incorrect."""
    return {"correct": False, "reason": reason, "skeleton": None, "detail": detail[:500]}


def _warm_math_worker() -> None:
    """Pool initializer: the first sympy simplification in a process costs ~1-2 s of lazy
    set-up, which must not count against the first sample's deadline."""
    from verl_replay.verifiers.math import verify_math

    verify_math("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", timeout_s=30.0, fast_path=False)


def _hard_deadline(ground_truth: Any, info: Mapping[str, Any], timeout_s: float) -> float:
    """Pool kill deadline of one task: compute_score may run every gold query and the
    prediction once per gold (each under ``timeout_s`` inside SQLite / the math alarm)."""
    golds = len(ground_truth) if isinstance(ground_truth, list) else 1
    golds += len(info.get("gold_sqls") or [])
    return timeout_s * (2 * golds + 1) + _HARD_DEADLINE_GRACE_S


def _combine_reasons(reasons: Sequence[str]) -> str:
    """One reason for an AmbiQT sample that matched no interpretation."""
    for reason in reasons:
        if reason in POOL_FAILURE_REASONS:
            return reason  # a failed verification must stay visible
    if "mismatch" in reasons:
        return "mismatch"  # it ran and returned rows; compute_score says the same
    return reasons[-1]


class _Verifier:
    """One VerifierPool for a whole evaluation: chunks are submitted as they are generated and
    collected later, so verification of chunk i overlaps generation of chunk i + 1."""

    def __init__(
        self,
        questions: Sequence[Question],
        *,
        workers: int,
        timeout_s: float,
        hard_timeout_s: float | None,
    ) -> None:
        from verl_replay.verifiers.pool import VerifierPool

        has_math = any(q.task == "math" for q in questions)
        preload = ["verl_replay.rewards", "verl_replay.verifiers.sql", "verl_replay.verifiers.extract"]
        if any(q.task == "sql" for q in questions):
            preload.append("verl_replay.sql.skeleton")
        if has_math:
            preload.append("verl_replay.verifiers.math")
        self.workers = workers
        self.timeout_s = timeout_s
        self.hard_timeout_s = hard_timeout_s
        self.pool = VerifierPool(
            num_workers=workers,
            task_timeout_s=hard_timeout_s or timeout_s * 3 + _HARD_DEADLINE_GRACE_S,  # each submit sets its own
            max_tasks_per_child=1000,
            preload=tuple(preload),
            memory_limit_mb=4096,
            initializer=_warm_math_worker if has_math else None,
            on_failure=_failure,
        )

    def submit(
        self, questions: Sequence[Question], texts: Sequence[Sequence[str]]
    ) -> dict[tuple[int, int, str], Future]:
        """Queue every distinct (question, gold, text) of a chunk; returns the futures by key."""
        if len(texts) != len(questions):
            raise ValueError(f"{len(texts)} sample lists for {len(questions)} questions")
        futures: dict[tuple[int, int, str], Future] = {}
        for qi, (question, samples) in enumerate(zip(questions, texts, strict=True)):
            golds = question.interpretations or (None,)
            for gi, gold in enumerate(golds):
                if gold is None:
                    ground_truth, info = question.ground_truth, question.extra_info
                else:  # one interpretation only: the other must not count here
                    ground_truth = gold
                    info = {k: v for k, v in question.extra_info.items() if k != "gold_sqls"}
                deadline = self.hard_timeout_s or _hard_deadline(ground_truth, info, self.timeout_s)
                for text in samples:
                    key = (qi, gi, text)
                    if key not in futures:
                        futures[key] = self.pool.submit(
                            verify_one,
                            question.data_source,
                            text,
                            ground_truth,
                            info,
                            self.timeout_s,
                            question.task == "sql",
                            timeout_s=deadline,
                        )
        return futures

    @staticmethod
    def collect(
        questions: Sequence[Question], texts: Sequence[Sequence[str]], futures: Mapping[tuple[int, int, str], Future]
    ) -> list[list[SampleVerdict]]:
        """Wait for a chunk's futures; verdicts in the shape of ``texts``."""
        for future in futures.values():  # the pool runs tasks in FIFO order
            outcome = future.result()
            if outcome["reason"] in _POOL_BROKEN_REASONS:
                # not one sample's fault: no verifier could run, every score would be a fake 0
                raise RuntimeError(f"verifier pool failed ({outcome['reason']}): {outcome['detail']}")
        verdicts: list[list[SampleVerdict]] = []
        for qi, (question, samples) in enumerate(zip(questions, texts, strict=True)):
            row = []
            for text in samples:
                outs = [futures[(qi, gi, text)].result() for gi in range(len(question.interpretations) or 1)]
                correct = any(o["correct"] for o in outs)
                skeleton = next((o["skeleton"] for o in outs if o["correct"] and o["skeleton"]), None)
                row.append(
                    SampleVerdict(
                        correct=correct,
                        reason="ok" if correct else _combine_reasons([o["reason"] for o in outs]),
                        skeleton=skeleton,
                        interpretation_hits=tuple(bool(o["correct"]) for o in outs) if question.interpretations else (),
                        detail="; ".join(o["detail"] for o in outs if o["detail"]),
                    )
                )
            verdicts.append(row)
        return verdicts

    def close(self) -> None:
        self.pool.close(wait=False)


def verify_generations(
    questions: Sequence[Question],
    texts: Sequence[Sequence[str]],
    *,
    workers: int = 2,
    timeout_s: float = 5.0,
    hard_timeout_s: float | None = None,
) -> list[list[SampleVerdict]]:
    """Verify ``texts[q][j]`` (sample j of question q) in a VerifierPool; same shape out.

    Identical texts of the same question are verified once. AmbiQT questions get one task per
    interpretation. ``hard_timeout_s`` is the pool's kill deadline per task (default: enough for
    every gold query and the prediction at ``timeout_s`` each, plus a grace).
    """
    if len(texts) != len(questions):
        raise ValueError(f"{len(texts)} sample lists for {len(questions)} questions")
    verifier = _Verifier(questions, workers=workers, timeout_s=timeout_s, hard_timeout_s=hard_timeout_s)
    try:
        futures = verifier.submit(questions, texts)
        logger.info("verifying %d distinct (sample, gold) pairs with %d workers", len(futures), workers)
        return verifier.collect(questions, texts, futures)
    finally:
        verifier.close()


# --------------------------------------------------------------------------- aggregation


def ambiqt_coverage_at_k(n: int, hits_1: int, hits_2: int, hits_either: int, k: int) -> float:
    """Unbiased P(a random k-subset of the n samples matches both interpretations).

    Inclusion-exclusion over "the subset misses interpretation i": with ``h_i`` samples matching
    interpretation i and ``h_e`` matching either, P(cover both) = pass@k(h_1) + pass@k(h_2) -
    pass@k(h_e). For ``k == n`` it is 1 iff both are matched, i.e. ``metrics.ambiqt_coverage``.
    """
    value = metrics.pass_at_k(n, hits_1, k) + metrics.pass_at_k(n, hits_2, k) - metrics.pass_at_k(n, hits_either, k)
    return min(1.0, max(0.0, value))  # clamp float round-off


@dataclass
class BenchmarkResult:
    """Per-benchmark metrics. ``metrics`` holds the flat, averaged keys (fractions in [0, 1],
    except ``distinct_strategies``, a count): ``pass@<k>``, ``mean@n``, ``best@n``, and for SQL
    ``distinct_strategies``, for AmbiQT ``ambiqt_coverage`` and ``ambiqt_coverage@<k>``."""

    name: str
    task: str
    num_questions: int
    n: int
    metrics: dict[str, float]
    reasons: dict[str, int]
    verification_failures: int
    strategy_distribution: dict[str, int] | None = None  # "#strategies" -> #questions
    ambiqt: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.strategy_distribution is None:
            out.pop("strategy_distribution")
        if self.ambiqt is None:
            out.pop("ambiqt")
        return out


def _benchmark(
    name: str, records: list[dict[str, Any]], verdicts: list[list[SampleVerdict]], ks: Sequence[int]
) -> BenchmarkResult:
    tasks = {r["task"] for r in records}
    if len(tasks) != 1:
        raise ValueError(f"benchmark {name!r} mixes SQL and math rows; separate them with --benchmark-key")
    task = tasks.pop()
    correct = [[v.correct for v in row] for row in verdicts]  # ragged [Q, n]
    ns = {len(row) for row in correct}
    values: dict[str, float] = {f"pass@{k}": metrics.mean_pass_at_k(correct, k) for k in ks}
    values["mean@n"] = metrics.mean_at_n(correct)
    values["best@n"] = metrics.best_at_n(correct)
    reasons = Counter(v.reason for row in verdicts for v in row)
    result = BenchmarkResult(
        name=name,
        task=task,
        num_questions=len(records),
        n=ns.pop() if len(ns) == 1 else -1,
        metrics=values,
        reasons=dict(sorted(reasons.items())),
        verification_failures=sum(c for r, c in reasons.items() if r in POOL_FAILURE_REASONS),
    )
    if task == "sql":
        counts = [r["distinct_strategies"] for r in records]
        values["distinct_strategies"] = float(np.mean(counts))
        distribution = Counter(counts)
        result.strategy_distribution = {str(c): distribution[c] for c in sorted(distribution)}
    ambi = [(r, row) for r, row in zip(records, verdicts, strict=True) if "interpretation_hits" in r]
    if ambi:
        if len(ambi) != len(records):
            raise ValueError(f"benchmark {name!r} mixes AmbiQT and other rows")
        first = [[v.interpretation_hits[0] for v in row] for _, row in ambi]
        second = [[v.interpretation_hits[1] for v in row] for _, row in ambi]
        values["ambiqt_coverage"] = metrics.ambiqt_coverage(first, second)
        for k in ks:
            values[f"ambiqt_coverage@{k}"] = float(np.mean([r["ambiqt_coverage_at_k"][str(k)] for r, _ in ambi]))
        result.ambiqt = {
            "coverage": values["ambiqt_coverage"],
            "interpretation_hit_rate": [
                metrics.best_at_n(first),
                metrics.best_at_n(second),
            ],
        }
    return result


def _question_record(question: Question, verdicts: Sequence[SampleVerdict], ks: Sequence[int]) -> dict[str, Any]:
    flags = [v.correct for v in verdicts]
    n, c = len(flags), int(sum(flags))
    record: dict[str, Any] = {
        "row": question.row,
        "benchmark": question.benchmark,
        "question_id": question.question_id,
        "data_source": question.data_source,
        "task": question.task,
        "n": n,
        "num_correct": c,
        "pass_at_k": {str(k): metrics.pass_at_k(n, c, k) for k in ks},
    }
    if question.task == "sql":
        skeletons = [v.skeleton for v in verdicts]
        record["distinct_strategies"] = metrics.distinct_correct_strategies(skeletons, flags)
        record["skeletons"] = sorted({s for s, ok in zip(skeletons, flags, strict=True) if ok and s is not None})
    if question.interpretations:
        hits_1 = sum(v.interpretation_hits[0] for v in verdicts)
        hits_2 = sum(v.interpretation_hits[1] for v in verdicts)
        either = sum(any(v.interpretation_hits) for v in verdicts)
        record["interpretation_hits"] = [int(hits_1), int(hits_2)]
        record["covered"] = bool(hits_1 and hits_2)
        record["ambiqt_coverage_at_k"] = {str(k): ambiqt_coverage_at_k(n, hits_1, hits_2, either, k) for k in ks}
    return record


def _averages(benchmarks: Mapping[str, BenchmarkResult]) -> dict[str, Any]:
    keys: list[str] = []
    for b in benchmarks.values():
        keys.extend(k for k in b.metrics if k not in keys)
    macro, weighted, members = {}, {}, {}
    for key in keys:
        have = {name: b for name, b in benchmarks.items() if key in b.metrics}
        scores = {name: b.metrics[key] for name, b in have.items()}
        macro[key] = metrics.macro_average(scores)
        weighted[key] = metrics.weighted_average(scores, {name: b.num_questions for name, b in have.items()})
        members[key] = sorted(have)
    return {"macro": macro, "weighted": weighted, "benchmarks": members}


def aggregate(
    questions: Sequence[Question], verdicts: Sequence[Sequence[SampleVerdict]], ks: Sequence[int]
) -> tuple[dict[str, BenchmarkResult], dict[str, Any], list[dict[str, Any]]]:
    """(per-benchmark results in first-seen order, averages, per-question records)."""
    if len(questions) != len(verdicts):
        raise ValueError(f"{len(verdicts)} verdict lists for {len(questions)} questions")
    records = [_question_record(q, v, ks) for q, v in zip(questions, verdicts, strict=True)]
    order = list(dict.fromkeys(q.benchmark for q in questions))
    benchmarks = {}
    for name in order:
        idx = [i for i, q in enumerate(questions) if q.benchmark == name]
        benchmarks[name] = _benchmark(name, [records[i] for i in idx], [list(verdicts[i]) for i in idx], ks)
    return benchmarks, _averages(benchmarks), records


# --------------------------------------------------------------------------- evaluate


class SampleFile(Sequence):
    """The sample records of a finished evaluation, read from ``samples.jsonl`` when first used
    (an evaluation at scale holds ~10^5-10^6 completions: they are not kept in memory)."""

    def __init__(self, path: str | os.PathLike[str], count: int) -> None:
        self.path = Path(path)
        self._count = int(count)
        self._cache: list[dict[str, Any]] | None = None

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._cache is not None:
            yield from self._cache
            return
        with open(self.path, encoding="utf-8") as handle:
            for number, line in enumerate(handle):
                if number >= self._count:
                    break
                yield json.loads(line)

    def __getitem__(self, index):  # type: ignore[override]
        if self._cache is None:
            self._cache = list(iter(self))
        return self._cache[index]


@dataclass
class EvalResult:
    """Outcome of :func:`evaluate`; ``files`` lists what was written under ``config.out``.

    ``samples``: one record per sample (a :class:`SampleFile` reading ``samples.jsonl`` lazily
    when the run wrote one). ``skipped``: the questions left out because their prompt does not
    fit the model's context (``row``, ``benchmark``, ``question_id``, ``prompt_tokens``).
    """

    config: EvalConfig
    benchmarks: dict[str, BenchmarkResult]
    averages: dict[str, Any]
    questions: list[dict[str, Any]]
    samples: Sequence[dict[str, Any]]
    timings: dict[str, float]
    files: dict[str, Path] = field(default_factory=dict)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    max_prompt_tokens: int | None = None
    resume: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The ``results.json`` document (see ``verl_replay.eval.report``)."""
        from verl_replay.eval.report import results_document

        return results_document(self)


def _make_backend(config: EvalConfig) -> Any:
    from verl_replay.generation import make_backend

    if not config.model:
        raise ValueError("model: give the model directory or hub id (--model)")
    model = os.path.expanduser(config.model)
    # "org/name" may be a hub id; something spelled as a path must exist (fail before loading)
    if config.model.startswith((".", "/", "~")) and not os.path.exists(model):
        raise FileNotFoundError(f"--model: no such model directory: {config.model}")
    if config.backend == "vllm":
        return make_backend(
            "vllm",
            model_path=model,
            tensor_parallel_size=config.tensor_parallel_size,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_model_len=config.max_model_len,
            seed=config.seed,
        )
    return make_backend(config.backend, model_path=model, batch_size=config.hf_batch_size)


def chunk_seed(seed: int, chunk_index: int) -> int:
    """The sampling seed of chunk ``chunk_index`` (chunks are fixed by ``chunk_questions``)."""
    return derive_seed(seed, chunk_index)


def _generate(backend: Any, questions: Sequence[Question], config: EvalConfig, seed: int) -> list[list[Any]]:
    outputs = backend.generate(
        [q.prompt for q in questions],
        n=config.n,
        temperature=config.temperature,
        top_p=config.top_p,
        max_new_tokens=config.max_new_tokens,
        seed=seed,
    )
    if len(outputs) != len(questions):
        raise RuntimeError(f"the backend returned {len(outputs)} sample lists for {len(questions)} prompts")
    for i, samples in enumerate(outputs):
        if len(samples) != config.n:
            raise RuntimeError(f"the backend returned {len(samples)} samples for prompt {i}, expected n={config.n}")
    return [list(s) for s in outputs]


def max_prompt_tokens(config: EvalConfig, backend: Any) -> int | None:
    """Longest prompt that still leaves room for one generated token (None: no known limit)."""
    limit = config.max_model_len or getattr(backend, "max_model_len", None)
    return None if limit is None else int(limit) - 1


def find_over_long(
    questions: Sequence[Question], backend: Any, limit: int | None, *, batch: int = 256
) -> list[dict[str, Any]]:
    """Questions whose encoded prompt exceeds ``limit`` tokens (tokenized as the backend does)."""
    if limit is None:
        return []
    skipped = []
    for start in range(0, len(questions), batch):
        part = questions[start : start + batch]
        for question, ids in zip(part, backend.encode([q.prompt for q in part]), strict=True):
            if len(ids) > limit:
                skipped.append(
                    {
                        "row": question.row,
                        "benchmark": question.benchmark,
                        "question_id": question.question_id,
                        "prompt_tokens": len(ids),
                    }
                )
    return skipped


def _file_digest(path: str) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# Settings that decide which samples a question gets and how they are verified: a resumed run
# must match them. Left out on purpose: out, k (re-aggregation only), verify_workers,
# gpu_memory_utilization and tensor_parallel_size (how fast, not what).
_FINGERPRINT_KEYS = (
    "backend",
    "model",
    "n",
    "temperature",
    "top_p",
    "max_new_tokens",
    "seed",
    "limit",
    "max_model_len",
    "hf_batch_size",
    "verify_timeout_s",
    "verify_hard_timeout_s",
    "benchmark_key",
    "chunk_questions",
)


def run_fingerprint(config: EvalConfig, questions: Sequence[Question]) -> dict[str, Any]:
    fingerprint: dict[str, Any] = {key: getattr(config, key) for key in _FINGERPRINT_KEYS}
    fingerprint["data"] = [{"path": os.path.abspath(p), "blake2b": _file_digest(p)} for p in config.data]
    ids = json.dumps([[q.row, q.benchmark, q.question_id] for q in questions]).encode("utf-8")
    fingerprint["questions"] = {"count": len(questions), "blake2b": hashlib.blake2b(ids, digest_size=16).hexdigest()}
    return fingerprint


class _Progress:
    """Questions and samples done, with their rate: a tqdm bar on a terminal, a log line per chunk."""

    def __init__(self, total: int, done: int, n: int, enabled: bool) -> None:
        self.total, self.done, self.n = total, done, n
        self.session_questions = 0
        self.session_tokens = 0
        self.started = time.monotonic()
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=done, unit="q", desc="eval", dynamic_ncols=True, disable=None)

    def advance(self, questions: int, tokens: int) -> None:
        self.done += questions
        self.session_questions += questions
        self.session_tokens += tokens
        elapsed = max(time.monotonic() - self.started, 1e-9)
        samples = self.session_questions * self.n
        line = (
            f"{self.done}/{self.total} questions, {self.done * self.n} samples done "
            f"({self.session_questions / elapsed:.2f} q/s, {samples / elapsed:.1f} samples/s, "
            f"{self.session_tokens / elapsed:.0f} tok/s)"
        )
        if self.bar is not None:
            self.bar.update(questions)
            self.bar.set_postfix_str(f"{self.done * self.n} samples, {samples / elapsed:.1f} samples/s")
        # the bar shows the same on a terminal: the console leaves this line to the log file then
        logger.info("eval: %s", line, extra={"progress_line": self.bar is not None and not self.bar.disable})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _chunks(questions: Sequence[Question], size: int) -> list[list[Question]]:
    return [list(questions[i : i + size]) for i in range(0, len(questions), size)]


def _verdict_of(record: Mapping[str, Any]) -> SampleVerdict:
    return SampleVerdict(
        correct=bool(record["correct"]),
        reason=str(record["reason"]),
        skeleton=record.get("skeleton"),
        interpretation_hits=tuple(bool(h) for h in record.get("interpretation_hits", ())),
        detail=str(record.get("detail", "")),
    )


def _read_verdicts(store: Any, n: int) -> tuple[dict[int, list[SampleVerdict]], int, int]:
    """(verdicts by question row, #samples, #generated tokens) of the committed samples."""
    by_row: dict[int, list[SampleVerdict]] = defaultdict(list)
    count = tokens = 0
    for record in store.iter_samples():
        by_row[int(record["row"])].append(_verdict_of(record))
        count += 1
        tokens += int(record.get("num_tokens") or 0)
    incomplete = [row for row, verdicts in by_row.items() if len(verdicts) != n]
    if incomplete:
        raise ValueError(f"{store.samples_path}: questions {incomplete[:5]} have a number of samples other than n={n}")
    return by_row, count, tokens


def evaluate(config: EvalConfig, backend: Any = None, *, overwrite: bool = False, progress: bool = True) -> EvalResult:
    """Sample, verify and aggregate in committed chunks; resume what ``config.out`` already holds.

    ``backend``: any object with the :class:`~verl_replay.generation.GenerationBackend`
    ``generate`` (and, to skip over-long prompts, ``encode``) methods; by default one is built
    from ``config`` (``hf`` / ``vllm``), and only when there is something left to sample.
    ``overwrite``: discard an earlier evaluation in ``config.out`` instead of resuming it
    (a different one is refused without it). ``progress``: show the progress bar on a terminal.
    """
    from verl_replay.eval.store import EvalStore

    start = time.monotonic()
    questions = load_questions(config.data, benchmark_key=config.benchmark_key, limit=config.limit)
    sizes = Counter(q.benchmark for q in questions)
    logger.info("%d questions (%s)", len(questions), ", ".join(f"{name} {count}" for name, count in sizes.items()))
    if config.ks_skipped:
        logger.warning("pass@k skipped for k=%s > n=%d", list(config.ks_skipped), config.n)
    scratch = tempfile.TemporaryDirectory(prefix="verl_replay_eval_") if config.out is None else None
    try:
        out_dir = Path(config.out) if config.out is not None else Path(scratch.name)  # type: ignore[union-attr]
        store = EvalStore.open(out_dir, run_fingerprint(config, questions), overwrite=overwrite or scratch is not None)
        resumed = len(store.done_rows)
        if resumed:
            logger.info(
                "resuming %s: %d of %d questions already done (session %d)",
                out_dir,
                resumed,
                len(questions),
                store.sessions,
            )
        t_load = time.monotonic()
        timings = {"load_s": t_load - start, "model_load_s": 0.0, "generate_s": 0.0, "verify_wait_s": 0.0}
        skipped_rows = {int(s["row"]) for s in store.skipped}
        todo = [q for q in questions if q.row not in store.done_rows and q.row not in skipped_rows]
        if todo:
            if backend is None:
                backend = _make_backend(config)
            timings["model_load_s"] = time.monotonic() - t_load
            limit = max_prompt_tokens(config, backend)
            fresh = find_over_long([q for q in questions if q.row not in store.done_rows], backend, limit)
            store.set_skipped(fresh, limit)
            _log_skipped(fresh, limit)
            _run_chunks(config, backend, questions, store, timings, progress)
        skipped = list(store.skipped)
        by_row, num_samples, num_tokens = _read_verdicts(store, config.n)
        done = [q for q in questions if q.row in by_row]
        if not done:
            raise ValueError(
                f"no question was evaluated: all {len(questions)} prompts are longer than "
                f"{store.max_prompt_tokens} tokens (the model context minus one); raise --max-model-len"
            )
        t_agg = time.monotonic()
        benchmarks, averages, records = aggregate(done, [by_row[q.row] for q in done], config.ks_used)
        for b in benchmarks.values():
            if b.verification_failures:
                logger.warning(
                    "%s: %d sample verification(s) crashed or timed out (counted incorrect): %s",
                    b.name,
                    b.verification_failures,
                    b.reasons,
                )
        timings.update(
            {
                "aggregate_s": time.monotonic() - t_agg,
                "generated_tokens": float(num_tokens),
                "tokens_per_s": num_tokens / max(timings["generate_s"], 1e-9) if timings["generate_s"] else 0.0,
            }
        )
        samples: Sequence[dict[str, Any]] = SampleFile(store.samples_path, num_samples)
        if scratch is not None:
            samples = list(samples)
        result = EvalResult(
            config,
            benchmarks,
            averages,
            records,
            samples,
            timings,
            skipped=skipped,
            max_prompt_tokens=store.max_prompt_tokens,
            resume={"sessions": store.sessions, "resumed_questions": resumed},
        )
        timings["total_s"] = time.monotonic() - start
        if config.out is not None:
            from verl_replay.eval.report import write_outputs

            result.files = write_outputs(result, config.out)
            store.mark_complete()
        return result
    finally:
        if scratch is not None:
            scratch.cleanup()


def _log_skipped(skipped: Sequence[Mapping[str, Any]], limit: int | None) -> None:
    if not skipped:
        return
    per_benchmark = Counter(s["benchmark"] for s in skipped)
    logger.warning(
        "%d prompt(s) longer than %s tokens skipped (not counted as wrong; listed in results.json): %s",
        len(skipped),
        limit,
        dict(per_benchmark),
    )


def _run_chunks(
    config: EvalConfig,
    backend: Any,
    questions: Sequence[Question],
    store: Any,
    timings: dict[str, float],
    progress: bool,
) -> None:
    """Generate chunk i + 1 while the verifier pool checks chunk i; commit each verified chunk."""
    skipped_rows = {int(s["row"]) for s in store.skipped}
    kept = [q for q in questions if q.row not in skipped_rows]
    chunks = _chunks(kept, config.chunk_questions)  # fixed by the kept list: stable across resumes
    done_rows = store.done_rows
    pending_chunks = [(i, c) for i, c in enumerate(chunks) if not all(q.row in done_rows for q in c)]
    bar = _Progress(len(kept), len(kept) - sum(len(c) for _, c in pending_chunks), config.n, progress)
    verifier = _Verifier(
        kept,
        workers=config.verify_workers,
        timeout_s=config.verify_timeout_s,
        hard_timeout_s=config.verify_hard_timeout_s,
    )
    try:
        pending: tuple[list[Question], list[list[Any]], dict] | None = None
        for index, chunk in pending_chunks:
            if any(q.row in done_rows for q in chunk):  # pragma: no cover - commits are whole chunks
                raise RuntimeError(f"chunk {index} is partly committed in {store.state_path}; pass --overwrite")
            t0 = time.monotonic()
            generations = _generate(backend, chunk, config, chunk_seed(config.seed, index))
            timings["generate_s"] += time.monotonic() - t0
            texts = [[str(g.text) for g in row] for row in generations]
            futures = verifier.submit(chunk, texts)
            if pending is not None:
                _commit(store, verifier, pending, timings, bar)
            pending = (chunk, generations, futures)
        if pending is not None:
            _commit(store, verifier, pending, timings, bar)
    finally:
        verifier.close()
        bar.close()


def _commit(store: Any, verifier: _Verifier, pending: tuple, timings: dict[str, float], bar: _Progress) -> None:
    chunk, generations, futures = pending
    t0 = time.monotonic()
    verdicts = verifier.collect(chunk, [[str(g.text) for g in row] for row in generations], futures)
    timings["verify_wait_s"] += time.monotonic() - t0
    records = [
        _sample_record(q, j, g, v)
        for q, row, vrow in zip(chunk, generations, verdicts, strict=True)
        for j, (g, v) in enumerate(zip(row, vrow, strict=True))
    ]
    store.commit([q.row for q in chunk], records)
    bar.advance(len(chunk), sum(int(r["num_tokens"]) for r in records))


def _sample_record(question: Question, index: int, generation: Any, verdict: SampleVerdict) -> dict[str, Any]:
    record: dict[str, Any] = {
        "row": question.row,
        "benchmark": question.benchmark,
        "question_id": question.question_id,
        "sample": index,
        "text": str(generation.text),
        "correct": verdict.correct,
        "reason": verdict.reason,
        "num_tokens": int(getattr(generation, "num_tokens", 0) or 0),
        "finish_reason": getattr(generation, "finish_reason", None),
    }
    if question.task == "sql":
        record["skeleton"] = verdict.skeleton
    if question.interpretations:
        record["interpretation_hits"] = list(verdict.interpretation_hits)
    if verdict.detail:
        record["detail"] = verdict.detail
    return record
