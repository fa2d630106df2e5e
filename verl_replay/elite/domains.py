"""Domain adapters for the MAP-Elites search: what the archive calls per domain.

A :class:`Domain` bundles, for one task family (text-to-SQL or math):

* how a verl RL parquet row becomes a :class:`~verl_replay.elite.archive.Question`;
* the verification *task* of a candidate text -- a picklable top-level function plus its
  arguments, so the same call runs inline or in a :class:`~verl_replay.verifiers.VerifierPool`
  worker;
* the describer: ``(approach label, structural descriptor)`` of a verified solution, raising
  ``ValueError`` when the solution cannot be parsed (the archive counts a parse failure);
* prompt parts for mutation prompts (how a parent solution is shown, the format instruction).

SQL: the query is taken from the response with :func:`~verl_replay.verifiers.extract_sql`,
executed read-only against the question's database (``extra_info.db_path``) with its
``semantics`` and checked against every gold query (``reward_model.ground_truth`` plus
``extra_info.gold_sqls``; correct if any matches -- the same rule as
:func:`verl_replay.rewards.compute_score`, so the archive admits what the training reward
rewards). Approach = the labeler over the *extracted SQL*; descriptor =
:func:`~verl_replay.sql.structural_descriptor`; a response without an extractable, parseable
query is a parse failure.

Math: :func:`~verl_replay.verifiers.verify_math` against each ground truth; approach = the
labeler over the solution text (:class:`~verl_replay.math.descriptor.MathKeywordLabeler` by
default); descriptor = :func:`~verl_replay.math.descriptor.math_descriptor` of the answer
found by :func:`~verl_replay.verifiers.extract_math_answer` and the solution's token count;
no extractable answer is a parse failure.

The archive's ``insert`` calls its verifier and describer itself. :class:`PooledVerifier` and
:class:`CachedDescriber` are those callables for a search: the search *prefetches* a batch
(verification tasks submitted to the pool, LLM labels computed in one batched call) and
``insert`` then looks up the result computed for *exactly* its ``(question, text)`` -- keyed
by the verification task's own arguments, so a cached verdict can only be the verdict of
that call. Anything not prefetched is verified/labeled on the spot (counted as ``inline``).
Nothing here ever reads a "correct" flag from a caller.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from verl_replay.elite.archive import Question
from verl_replay.elite.archive_io import hf_tokenizer_fingerprint, tokenizer_fingerprint  # noqa: F401  (re-exported)
from verl_replay.sql.vocabulary import Vocabulary, VocabularyError
from verl_replay.verifiers.compare import SEMANTICS
from verl_replay.verifiers.extract import extract_math_answer, extract_sql, strip_think
from verl_replay.verifiers.math import MathVerification, verify_math
from verl_replay.verifiers.sql import KILL_GRACE_S, SQLVerification, sql_failure, verify_sql

__all__ = [
    "DOMAINS",
    "CachedDescriber",
    "DataError",
    "Domain",
    "MathDomain",
    "PooledVerifier",
    "SQLDomain",
    "TokenCounter",
    "detect_domain",
    "hf_tokenizer_fingerprint",
    "make_domain",
    "math_failure",
    "warm_math_worker",
    "verify_math_solution",
    "verify_sql_solution",
]

DOMAINS = ("sql", "math")

# Seconds the pool allows on top of the verifier's own deadlines before it kills a worker
# (process start-up of a replacement worker and result pickling are not the query's fault).
_POOL_GRACE_S = 2.0


class DataError(ValueError):
    """A dataset row that cannot become a search question; the message names row and field."""


# ============================================================================ tokenizer


class TokenCounter:
    """Number of tokens of a solution text as it is trained: the assistant response text,
    tokenized without added special tokens (the chat template adds the turn markers around
    it in training, identically for every response, so they do not change which is shorter).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])


# ============================================================================ verification tasks
# Top-level functions: they are pickled by reference into VerifierPool workers.


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if hasattr(value, "tolist"):  # numpy arrays from pandas
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def verify_sql_solution(
    text: str, db_path: str, golds: Sequence[str], semantics: str, timeout_s: float
) -> SQLVerification:
    """Extract the SQL of a response and check it against each gold query (any match wins).

    Mirrors :func:`verl_replay.rewards.compute_score` for SQL: after a failure that is the
    prediction's own (syntax, timeout, write attempt, ...) other golds cannot help; a
    mismatch against one gold is retried against the next (AmbiQT has two interpretations).
    """
    sql = extract_sql(text)
    if sql is None:
        return SQLVerification(False, "no_sql", "no SQL query found in the response", semantics=semantics)
    if not golds:
        return SQLVerification(False, "gold_error", "the question has no gold query", semantics=semantics)
    outcomes = []
    for gold in golds:
        outcome = verify_sql(db_path, sql, str(gold), semantics=semantics, timeout_s=timeout_s)  # type: ignore[arg-type]
        if outcome.correct:
            return outcome
        outcomes.append(outcome)
        if outcome.reason not in ("mismatch", "gold_error"):
            break
    mismatches = [o for o in outcomes if o.reason == "mismatch"]
    return mismatches[0] if mismatches else outcomes[-1]


def verify_math_solution(text: str, golds: Sequence[str], timeout_s: float) -> MathVerification:
    """``verify_math`` against each ground truth (any match wins)."""
    if not golds:
        return MathVerification(False, "gold_error", "the question has no ground truth")
    outcomes = []
    for gold in golds:
        outcome = verify_math(text, gold, timeout_s=timeout_s)
        if outcome.correct:
            return outcome
        outcomes.append(outcome)
        if outcome.reason == "no_answer":
            break
    mismatches = [o for o in outcomes if o.reason == "mismatch"]
    return mismatches[0] if mismatches else outcomes[-1]


def math_failure(reason: str, detail: str) -> MathVerification:
    """Pool ``on_failure`` for math tasks."""
    if reason == "worker_timeout":
        reason = "timeout"
    elif reason != "worker_crashed":
        reason, detail = "internal_error", f"{reason}: {detail}"
    return MathVerification(False, reason, detail)


def warm_math_worker() -> None:
    """Pool initializer for math: import math-verify/sympy and run one guarded comparison,
    so the first task's deadline does not pay for lazy imports (seconds)."""
    verify_math("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", timeout_s=30.0, fast_path=False)


# ============================================================================ domains


class Domain(abc.ABC):
    """What the search needs to know about one task family (see the module docstring)."""

    name: str
    #: shown in mutation prompts: what a solution is
    solution_noun: str
    #: the last line of a mutation prompt: how to format the answer
    format_instruction: str
    #: modules a verification worker imports before taking tasks
    preload: tuple[str, ...] = ()
    #: pool initializer (picklable top-level callable) or None
    initializer: Callable[[], None] | None = None

    def __init__(
        self,
        vocabulary: Vocabulary,
        labeler: Any,
        token_counter: Callable[[str], int],
        *,
        verify_timeout_s: float = 5.0,
    ) -> None:
        if vocabulary.domain != self.name:
            raise VocabularyError(
                f"the approach vocabulary is for domain {vocabulary.domain!r}, but the data is {self.name!r}; "
                f"pass a {self.name} vocabulary (--vocabulary)"
            )
        if not verify_timeout_s > 0:
            raise ValueError(f"verify_timeout_s must be > 0, got {verify_timeout_s}")
        self.vocabulary = vocabulary
        self.labeler = labeler
        self.token_counter = token_counter
        self.verify_timeout_s = float(verify_timeout_s)

    # ---------------------------------------------------------------- questions

    @abc.abstractmethod
    def question_from_row(self, row: Mapping[str, Any], index: int) -> Question:
        """A question from one verl RL parquet row (``index``: row number, for messages)."""

    # ---------------------------------------------------------------- verification

    @abc.abstractmethod
    def verification_task(self, question: Question, text: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """``(fn, args)``: ``fn(*args)`` verifies ``text`` for ``question``. ``args`` are
        hashable and contain everything the verdict depends on (they key the cache)."""

    @abc.abstractmethod
    def failure(self, reason: str, detail: str) -> Any:
        """Verdict of a verification the pool could not complete (crash, hang)."""

    def hard_timeout_s(self, question: Question) -> float:
        """The pool's kill deadline for one task of ``question``: a backstop behind the SQL
        sandbox, which ends each of the task's queries (the prediction and the gold, per gold)
        by its deadline + KILL_GRACE_S."""
        return (self.verify_timeout_s + KILL_GRACE_S) * 2 * max(1, len(self._golds(question))) + _POOL_GRACE_S

    def verify(self, question: Question, text: str) -> Any:
        """Verify in this process (no isolation): tests and ``--verify-workers 0``."""
        fn, args = self.verification_task(question, text)
        return fn(*args)

    # ---------------------------------------------------------------- description

    @abc.abstractmethod
    def label_input(self, text: str) -> str:
        """What the labeler reads: the extracted SQL / the solution text. ``ValueError`` when
        there is nothing to label."""

    @abc.abstractmethod
    def descriptor(self, text: str) -> str:
        """Structural descriptor of a solution; ``ValueError`` when it cannot be parsed."""

    def describe(self, question: Question, text: str, *, approach: str | None = None) -> tuple[str, str]:
        """``(approach, descriptor)``; ``approach`` is labeled unless given (prefetched).

        The descriptor is computed first: it is the parser's verdict on the solution, so a
        parse failure does not depend on which labeler is used.
        """
        descriptor = self.descriptor(text)
        if approach is None:
            approach = self.labeler.label(self.label_input(text))
        return approach, descriptor

    # ---------------------------------------------------------------- prompts

    @abc.abstractmethod
    def parent_view(self, text: str) -> str:
        """How a parent solution is shown in a mutation prompt."""

    # ---------------------------------------------------------------- helpers

    @staticmethod
    def _golds(question: Question) -> list[Any]:
        return list(question.metadata.get("golds", []))


def _required(row: Mapping[str, Any], index: int, *path: str) -> Any:
    value: Any = row
    for i, key in enumerate(path):
        if not isinstance(value, Mapping) or key not in value or value[key] is None:
            where = ".".join(path[: i + 1])
            raise DataError(f"row {index}: missing {where!r} (verl RL parquet rows need {'.'.join(path)})")
        value = value[key]
    return value


def _messages(row: Mapping[str, Any], index: int) -> list[dict[str, str]] | str:
    prompt = _required(row, index, "prompt")
    if isinstance(prompt, str):
        return prompt
    messages = [dict(m) for m in _as_list(prompt)]
    if not messages or not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
        raise DataError(f"row {index}: 'prompt' must be chat messages [{{'role', 'content'}}, ...] or a string")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _question_id(row: Mapping[str, Any], index: int) -> str:
    info = row.get("extra_info") or {}
    qid = info.get("question_id") if isinstance(info, Mapping) else None
    if qid is None or str(qid) == "":
        return f"row-{index:06d}"
    return str(qid)


class SQLDomain(Domain):
    name = "sql"
    solution_noun = "SQLite query"
    format_instruction = "Answer with one SQLite query in a ```sql code block."
    # (preloading verl_replay.verifiers.sql makes each pool worker start its SQL sandbox -- the
    # hard per-query kill -- before it takes tasks)
    preload = ("sqlite3", "verl_replay.verifiers.sql", "verl_replay.elite.domains")

    def question_from_row(self, row: Mapping[str, Any], index: int) -> Question:
        info = _required(row, index, "extra_info")
        db_path = os.fspath(_required(row, index, "extra_info", "db_path"))
        if not os.path.isabs(db_path) and info.get("db_root"):
            db_path = os.path.join(os.fspath(info["db_root"]), db_path)
        if not Path(db_path).is_file():
            raise DataError(f"row {index}: database file {db_path} (extra_info.db_path) does not exist")
        data_source = str(row.get("data_source") or "")
        semantics = info.get("semantics") or ("spider" if data_source.lower() == "spider" else "bird")
        if semantics not in SEMANTICS:
            raise DataError(f"row {index}: extra_info.semantics must be one of {list(SEMANTICS)}, got {semantics!r}")
        golds: list[str] = []
        for gold in _as_list(_required(row, index, "reward_model", "ground_truth")) + _as_list(info.get("gold_sqls")):
            if str(gold) not in golds:
                golds.append(str(gold))
        ground_truth = _required(row, index, "reward_model", "ground_truth")
        return Question(
            id=_question_id(row, index),
            prompt=_messages(row, index),
            ground_truth=_as_list(ground_truth) if not isinstance(ground_truth, str) else ground_truth,
            metadata={
                "data_source": data_source,
                "row": index,
                "db_id": info.get("db_id"),
                "db_path": db_path,
                "semantics": semantics,
                "golds": golds,
                "question": info.get("question"),
            },
        )

    def verification_task(self, question: Question, text: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        meta = question.metadata
        golds = tuple(str(g) for g in meta.get("golds", ()))
        return verify_sql_solution, (text, str(meta["db_path"]), golds, str(meta["semantics"]), self.verify_timeout_s)

    def failure(self, reason: str, detail: str) -> SQLVerification:
        return sql_failure(reason, detail)

    def label_input(self, text: str) -> str:
        sql = extract_sql(text)
        if sql is None:
            raise ValueError("no SQL query found in the response")
        return sql

    def descriptor(self, text: str) -> str:
        from verl_replay.sql.descriptor import structural_descriptor

        return structural_descriptor(self.label_input(text))  # SQLParseError is a ValueError

    def parent_view(self, text: str) -> str:
        sql = extract_sql(text)
        return sql if sql is not None else text.strip()


class MathDomain(Domain):
    name = "math"
    solution_noun = "solution"
    format_instruction = "Put the final answer in \\boxed{}."
    preload = ("verl_replay.verifiers.math", "verl_replay.elite.domains")
    initializer = staticmethod(warm_math_worker)

    def question_from_row(self, row: Mapping[str, Any], index: int) -> Question:
        ground_truth = _required(row, index, "reward_model", "ground_truth")
        golds = [str(g) for g in _as_list(ground_truth) if str(g).strip()]
        if not golds:
            raise DataError(f"row {index}: reward_model.ground_truth is empty")
        info = row.get("extra_info") or {}
        return Question(
            id=_question_id(row, index),
            prompt=_messages(row, index),
            ground_truth=ground_truth if isinstance(ground_truth, str) else _as_list(ground_truth),
            metadata={
                "data_source": str(row.get("data_source") or ""),
                "row": index,
                "golds": golds,
                "question": info.get("question") if isinstance(info, Mapping) else None,
            },
        )

    def verification_task(self, question: Question, text: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        golds = tuple(str(g) for g in question.metadata.get("golds", ()))
        return verify_math_solution, (text, golds, self.verify_timeout_s)

    def failure(self, reason: str, detail: str) -> MathVerification:
        return math_failure(reason, detail)

    def hard_timeout_s(self, question: Question) -> float:
        # math-verify's own alarm fires at timeout_s per gold; the initializer already paid imports
        return self.verify_timeout_s * max(1, len(self._golds(question))) + _POOL_GRACE_S

    def label_input(self, text: str) -> str:
        body = strip_think(text)
        if body is None or not body.strip():
            raise ValueError("the solution is empty or cut off inside <think>")
        return body

    def descriptor(self, text: str) -> str:
        from verl_replay.math.descriptor import math_descriptor

        answer = extract_math_answer(text)
        if answer is None:
            raise ValueError("no final answer found in the solution")
        return math_descriptor(text, answer=answer, num_tokens=self.token_counter(text))

    def parent_view(self, text: str) -> str:
        body = strip_think(text)
        return (body if body is not None else text).strip()


def detect_domain(rows: Sequence[Mapping[str, Any]]) -> str:
    """``sql`` or ``math`` from the rows' ``ability`` (else their ``data_source`` / extra_info);
    refuses a file that mixes both."""
    from verl_replay.rewards import is_math_source, is_sql_source

    found: set[str] = set()
    for i, row in enumerate(rows):
        ability = str(row.get("ability") or "").lower()
        info = row.get("extra_info") if isinstance(row.get("extra_info"), Mapping) else {}
        source = str(row.get("data_source") or "")
        if ability in DOMAINS:
            found.add(ability)
        elif is_sql_source(source) or "db_path" in info:
            found.add("sql")
        elif is_math_source(source) or "benchmark" in info:
            found.add("math")
        else:
            raise DataError(
                f"row {i}: cannot tell whether it is SQL or math (ability={row.get('ability')!r}, "
                f"data_source={source!r}); set the 'ability' column or pass --domain"
            )
    if len(found) != 1:
        raise DataError(f"the data mixes domains {sorted(found)}; search one domain per file (or pass --domain)")
    return found.pop()


def make_domain(
    name: str,
    *,
    vocabulary: Vocabulary | None = None,
    labeler: str | Any = "rule",
    token_counter: Callable[[str], int],
    backend: Any = None,
    verify_timeout_s: float = 5.0,
    seed: int = 0,
) -> Domain:
    """Build a domain adapter.

    ``vocabulary``: default the packaged reviewed SQL vocabulary / the math vocabulary.
    ``labeler``: ``"rule"`` (deterministic: SQL AST rules / math keywords), ``"llm"`` (the
    frozen ``backend`` picks from the vocabulary, greedy; falls back to the rules when its
    answer names nothing valid) or a labeler object.
    """
    if name not in DOMAINS:
        raise ValueError(f"unknown domain {name!r}; choose one of {list(DOMAINS)}")
    if vocabulary is None:
        if name == "sql":
            from verl_replay.sql.vocabulary import load_vocabulary

            vocabulary = load_vocabulary()
        else:
            from verl_replay.math.descriptor import default_math_vocabulary

            vocabulary = default_math_vocabulary()
    if vocabulary.domain != name:
        raise VocabularyError(
            f"the approach vocabulary is for domain {vocabulary.domain!r}, but the data is {name!r}; "
            f"pass a {name} vocabulary (--vocabulary)"
        )
    if isinstance(labeler, str):
        if labeler == "rule":
            if name == "sql":
                from verl_replay.sql.labeler import RuleBasedLabeler

                labeler_obj: Any = RuleBasedLabeler(vocabulary)
            else:
                from verl_replay.math.descriptor import MathKeywordLabeler

                labeler_obj = MathKeywordLabeler(vocabulary)
        elif labeler == "llm":
            if backend is None:
                raise ValueError("labeler='llm' needs the generation backend of the frozen model")
            from verl_replay.sql.labeler import LLMLabeler

            labeler_obj = LLMLabeler(backend, vocabulary, seed=seed)
        else:
            raise ValueError(f"unknown labeler {labeler!r}; choose 'rule' or 'llm'")
    else:
        labeler_obj = labeler
    cls = SQLDomain if name == "sql" else MathDomain
    return cls(vocabulary, labeler_obj, token_counter, verify_timeout_s=verify_timeout_s)


# ============================================================================ archive callables


class PooledVerifier:
    """The archive's ``verifier(question, text)``, backed by verifications prefetched in a pool.

    :meth:`prefetch` submits the verification tasks of a batch to the pool (they run while the
    caller does other work, e.g. generates the next batch); ``__call__`` returns the verdict of
    exactly the task ``domain.verification_task(question, text)`` -- the cache key *is* that
    task's arguments -- waiting for it if it is still running. A pair that was not prefetched
    is verified on the spot (through the pool when there is one, so a crash or hang still
    costs one failed verdict) and counted in ``inline``. :meth:`clear` drops the cache (the
    search calls it after every round to bound memory).
    """

    def __init__(self, domain: Domain, pool: Any = None) -> None:
        self.domain = domain
        self.pool = pool
        self._cache: dict[tuple[Any, ...], Future | Any] = {}
        self.pooled = 0  # verdicts served from a prefetched task
        self.inline = 0  # verdicts computed on demand

    def _key(self, question: Question, text: str) -> tuple[tuple[Any, ...], Callable[..., Any], tuple[Any, ...]]:
        fn, args = self.domain.verification_task(question, text)
        return (fn.__module__, fn.__qualname__, *args), fn, args

    def _start(self, question: Question, fn: Callable[..., Any], args: tuple[Any, ...]) -> Future | Any:
        if self.pool is None:
            return fn(*args)
        return self.pool.submit(
            fn, *args, timeout_s=self.domain.hard_timeout_s(question), on_failure=self.domain.failure
        )

    def prefetch(self, pairs: Sequence[tuple[Question, str]]) -> None:
        """Start verifying every ``(question, text)`` not already cached (duplicates once)."""
        for question, text in pairs:
            key, fn, args = self._key(question, text)
            if key not in self._cache:
                self._cache[key] = self._start(question, fn, args)

    def _lookup(self, question: Question, text: str) -> tuple[Any, bool]:
        key, fn, args = self._key(question, text)
        entry = self._cache.get(key)
        computed = entry is None
        if computed:
            entry = self._start(question, fn, args)
            self._cache[key] = entry
        return (entry.result() if isinstance(entry, Future) else entry), computed

    def verdict(self, question: Question, text: str) -> Any:
        """The verdict without counting it (the search peeks to prefetch labels)."""
        return self._lookup(question, text)[0]

    def __call__(self, question: Question, text: str) -> Any:
        result, computed = self._lookup(question, text)
        if computed:
            self.inline += 1
        else:
            self.pooled += 1
        return result

    def clear(self) -> None:
        self._cache.clear()

    def stats(self) -> dict[str, int]:
        return {"pooled": self.pooled, "inline": self.inline}


class CachedDescriber:
    """The archive's ``describer(question, text)``; labels can be prefetched in one batch.

    :meth:`prefetch` labels the label inputs (extracted SQL / solution text) of the given
    texts with one ``labeler.label_batch`` call -- one batched generation for the LLM
    labeler instead of one per insert. ``__call__`` uses a prefetched label when there is
    one, else labels on the spot; the descriptor is always computed from the text.
    """

    def __init__(self, domain: Domain) -> None:
        self.domain = domain
        self._labels: dict[str, str] = {}

    def prefetch(self, texts: Sequence[str]) -> None:
        inputs: list[str] = []
        for text in texts:
            try:
                self.domain.descriptor(text)  # only parseable solutions are worth a label
                item = self.domain.label_input(text)
            except ValueError:
                continue
            if item not in self._labels and item not in inputs:
                inputs.append(item)
        if inputs:
            for item, label in zip(inputs, self.domain.labeler.label_batch(inputs), strict=True):
                self._labels[item] = label

    def __call__(self, question: Question, text: str) -> tuple[str, str]:
        item = self.domain.label_input(text)
        approach, descriptor = self.domain.describe(question, text, approach=self._labels.get(item))
        self._labels.setdefault(item, approach)
        return approach, descriptor

    def clear(self) -> None:
        self._labels.clear()
