"""verl custom reward functions for text-to-SQL and math.

Point verl at this module::

    reward.custom_reward_function.path=<site-packages>/verl_replay/rewards.py
    reward.custom_reward_function.name=compute_score

``compute_score`` returns ``{"score", "acc", "reason"}``; verl logs the extra keys as
reward metrics. ``acc`` is always pure answer correctness (the bit the replay buffers store
and the archive admits), ``score`` may add a ``format_bonus``.

Hard limits and thread safety: verl's reward loop calls this from executor threads. Each
SQL query runs in the process sandbox (:mod:`verl_replay.verifiers.sandbox`): a persistent
worker per concurrent caller, killed at the query's deadline + 0.25 s if one SQLite step runs
long, with its memory capped; the calling thread only waits on a socket, so no thread or
process is left running after a timeout. An SQL call therefore returns within
``sql_timeout_s + 0.5`` s per query it runs (the predicted query, plus each gold query the
first time it is seen). Math uses ``verify_math``: answer extraction is linear in the
response length, and the guarded path runs in a sandbox process pool with a kill at
``math_timeout_s + 0.5`` s, never relying on signals in the calling thread. This module
imports no verl/ray/torch.
"""

from __future__ import annotations

import hashlib
import os
import re
import string
from typing import Any

from verl_replay.verifiers.extract import extract_sql

__all__ = [
    "compute_score",
    "control_reward",
    "exact_answer_match",
    "is_exact_answer_source",
    "is_math_source",
    "is_search_source",
    "is_sql_source",
    "search_exact_match",
]

_SQL_SOURCES = frozenset({"bird", "spider", "ambiqt", "tiny_sql", "tiny_sql_shapes"})
# Substrings that identify math datasets as they appear in verl data_source fields
# (e.g. "openai/gsm8k", "lighteval/MATH", "HuggingFaceH4/MATH-500", "math_dapo", "aime24").
_MATH_MARKERS = ("math", "gsm8k", "aime", "amc", "minerva", "olympiad", "numina", "deepscaler", "dapo")


# Search-R1's seven QA sets (its data_source names) and the tiny search task.
_SEARCH_SOURCES = frozenset(
    {"tiny_search", "nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"}
)
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Tasks whose whole response is the answer (the tiny addition task: "579" and eos).
_EXACT_ANSWER_SOURCES = frozenset({"tiny_arith"})


def is_exact_answer_source(data_source: str) -> bool:
    return data_source.lower() in _EXACT_ANSWER_SOURCES


def exact_answer_match(solution_str: str, ground_truth: Any) -> dict[str, Any]:
    """The whole response, stripped of surrounding whitespace, equals a gold answer; ``acc`` equals ``score``."""
    answer = (solution_str or "").strip()
    if not answer:
        return {"score": 0.0, "acc": 0.0, "reason": "no_answer"}
    correct = answer in {str(g).strip() for g in _as_list(ground_truth)}
    return {"score": float(correct), "acc": float(correct), "reason": "correct" if correct else "mismatch"}


def is_search_source(data_source: str) -> bool:
    name = data_source.lower()
    return name in _SEARCH_SOURCES or name.startswith("search")


def _normalize_answer(text: str) -> str:
    """Search-R1's (SQuAD's) answer normalisation: lower case, no punctuation, articles or extra spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def search_exact_match(solution_str: str, ground_truth: Any) -> dict[str, Any]:
    """Exact match of the last ``<answer>...</answer>`` (Search-R1's format) or, failing that, the
    last ``\\boxed{...}`` against any gold answer; ``acc`` equals ``score``."""
    from verl_replay.verifiers.extract import extract_boxed

    tagged = _ANSWER_TAG_RE.findall(solution_str or "")
    answer = tagged[-1] if tagged else extract_boxed(solution_str)
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "reason": "no_answer"}
    golds = [str(g) for g in _as_list(ground_truth)]
    if isinstance(ground_truth, dict) and "target" in ground_truth:  # Search-R1's {"target": [...]}
        golds = [str(g) for g in _as_list(ground_truth["target"])]
    correct = _normalize_answer(answer) in {_normalize_answer(g) for g in golds}
    return {"score": float(correct), "acc": float(correct), "reason": "correct" if correct else "mismatch"}


def is_sql_source(data_source: str) -> bool:
    name = data_source.lower()
    return name.startswith("sql") or name in _SQL_SOURCES


def is_math_source(data_source: str) -> bool:
    name = data_source.lower()
    return any(marker in name for marker in _MATH_MARKERS)


def _as_list(ground_truth: Any) -> list[Any]:
    """Gold answers as a list: AmbiQT-style rows carry several gold queries."""
    if hasattr(ground_truth, "tolist"):  # numpy arrays from parquet
        ground_truth = ground_truth.tolist()
    if isinstance(ground_truth, (list, tuple)):
        return list(ground_truth)
    return [ground_truth]


def _result(correct: bool, well_formed: bool, reason: str, format_bonus: float) -> dict[str, Any]:
    score = 1.0 if correct else (float(format_bonus) if well_formed else 0.0)
    return {"score": score, "acc": 1.0 if correct else 0.0, "reason": reason}


def _sql_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None,
    format_bonus: float,
    timeout_s: float,
    isolation: str,
) -> dict[str, Any]:
    from verl_replay.verifiers.sql import verify_sql

    info = dict(extra_info or {})
    if "db_path" not in info:
        raise ValueError(
            f"data_source {data_source!r} needs extra_info['db_path'] (the question's SQLite file, "
            "absolute or relative to extra_info['db_root'])"
        )
    db_path = os.fspath(info["db_path"])
    if not os.path.isabs(db_path) and info.get("db_root"):
        db_path = os.path.join(os.fspath(info["db_root"]), db_path)
    default_semantics = "spider" if data_source.lower() == "spider" else "bird"
    semantics = info.get("semantics") or default_semantics
    predicted = extract_sql(solution_str)
    if predicted is None:
        return _result(False, False, "no_sql", format_bonus)
    golds = _as_list(ground_truth)
    # verl_replay.data rows also list every gold interpretation (AmbiQT has two).
    extra_golds = info.get("gold_sqls")
    # parquet rows can hand over a numpy array, whose truth value is ambiguous
    for extra_gold in [] if extra_golds is None else _as_list(extra_golds):
        if extra_gold not in golds:
            golds.append(extra_gold)
    reasons = ["gold_error"]
    for gold in golds:  # correct if it matches any gold interpretation
        outcome = verify_sql(
            db_path,
            predicted,
            str(gold),
            semantics=semantics,
            timeout_s=timeout_s,
            isolation=isolation,  # type: ignore[arg-type]
        )
        if outcome.correct:
            return _result(True, True, outcome.reason, format_bonus)
        reasons.append(outcome.reason)
        if outcome.reason not in ("mismatch", "gold_error"):
            break  # the prediction itself failed; other golds cannot change that
    reason = "mismatch" if "mismatch" in reasons else reasons[-1]
    # Well-formed: the prediction executed and returned rows, just not the right ones.
    return _result(False, reason == "mismatch", reason, format_bonus)


def _math_score(solution_str: str, ground_truth: Any, format_bonus: float, timeout_s: float) -> dict[str, Any]:
    from verl_replay.verifiers.math import verify_math

    reasons = ["gold_error"]
    for gold in _as_list(ground_truth):
        outcome = verify_math(solution_str, gold, timeout_s=timeout_s)
        if outcome.correct:
            return _result(True, True, outcome.reason, format_bonus)
        reasons.append(outcome.reason)
        if outcome.reason == "no_answer":
            break
    reason = "mismatch" if "mismatch" in reasons else reasons[-1]
    return _result(False, reason == "mismatch", reason, format_bonus)


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """verl reward: ``{"score": float, "acc": 0.0/1.0, "reason": str}``.

    SQL sources (name starts with ``sql`` or is one of bird/spider/ambiqt/tiny_sql/tiny_sql_shapes): the SQL
    is extracted from ``solution_str`` and executed against ``extra_info["db_path"]``;
    ``ground_truth`` is the gold SQL (or a list: correct if any matches; golds in
    ``extra_info["gold_sqls"]`` count too); semantics from
    ``extra_info["semantics"]`` (``bird``, ``spider`` or ``spider_keep_distinct``; default
    ``"spider"`` for spider, else ``"bird"``; see :func:`~verl_replay.verifiers.verify_sql`).
    Math sources (gsm8k, MATH, AIME, AMC, Minerva, OlympiadBench, ...): ``verify_math``.
    Search sources (Search-R1's nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, musique,
    bamboogle, names starting with ``search``, and tiny_search): ``search_exact_match``.
    Whole-response answers (tiny_arith): ``exact_answer_match``.
    Any other name is dispatched by the row's ``extra_info``: ``db_path`` -> SQL,
    ``benchmark`` -> math (``verl_replay.data`` writes math training rows as ``"train"``).

    Keyword options: ``format_bonus`` (default 0.0) is the score of a well-formed but wrong
    answer (an SQL query that ran, a math answer that parsed); ``sql_timeout_s`` (5.0) and
    ``math_timeout_s`` (5.0); ``sql_isolation`` (``"process"``, the sandbox with its hard
    kill; ``"inline"`` runs SQL in the calling thread with SQLite's limits only). Unknown
    sources raise ``ValueError`` (a configuration error, not a model error); so does an SQL
    row without ``extra_info["db_path"]``.

    ``control_reward_rate`` (a probability; default unset) turns the reward of *training* rows
    (``extra_info["split"] == "train"``) into a control that carries no information about the
    answer: score and acc are 1 with that probability, drawn from a hash of the row and the
    response (the same response to the same row always gets the same reward); ``task_acc`` keeps
    the real correctness. Validation rows are scored as usual, so a control run's validation
    still measures the task.
    """
    info = extra_info if isinstance(extra_info, dict) else {}
    result = _task_score(data_source, solution_str, ground_truth, extra_info, info, kwargs)
    rate = kwargs.get("control_reward_rate")
    if rate is not None and info.get("split") == "train":
        return control_reward(data_source, solution_str, ground_truth, info, float(rate), result["acc"])
    return result


def control_reward(
    data_source: str, solution_str: str, ground_truth: Any, info: dict[str, Any], rate: float, task_acc: float
) -> dict[str, Any]:
    """A reward independent of the answer's correctness: 1 with probability ``rate``, from a hash."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"control_reward_rate must be a probability in [0, 1], got {rate}")
    key = "\0".join(str(part) for part in (data_source, ground_truth, info.get("index"), solution_str))
    draw = int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:8], "big") / 2.0**64
    rewarded = float(draw < rate)
    return {"score": rewarded, "acc": rewarded, "reason": "control", "task_acc": float(task_acc)}


def _task_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None,
    info: dict[str, Any],
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    format_bonus = float(kwargs.get("format_bonus", 0.0))
    if is_search_source(data_source):
        return search_exact_match(solution_str, ground_truth)
    if is_exact_answer_source(data_source):
        return exact_answer_match(solution_str, ground_truth)
    # Name first; then the row's own schema (verl_replay.data.prepare): SQL rows carry
    # extra_info["db_path"], math rows extra_info["benchmark"] -- math training sets are
    # written with data_source="train", which names no task.
    sql = is_sql_source(data_source) or (not is_math_source(data_source) and "db_path" in info)
    if sql:
        timeout_s = float(kwargs.get("sql_timeout_s", 5.0))
        isolation = str(kwargs.get("sql_isolation", "process"))
        return _sql_score(data_source, solution_str, ground_truth, extra_info, format_bonus, timeout_s, isolation)
    if is_math_source(data_source) or "benchmark" in info:
        timeout_s = float(kwargs.get("math_timeout_s", 5.0))
        return _math_score(solution_str, ground_truth, format_bonus, timeout_s)
    raise ValueError(
        f"compute_score: unknown data_source {data_source!r}; SQL sources start with 'sql' or are one of "
        f"{sorted(_SQL_SOURCES)}, math sources contain one of {list(_MATH_MARKERS)}; otherwise "
        "extra_info must carry 'db_path' (SQL) or 'benchmark' (math)"
    )
