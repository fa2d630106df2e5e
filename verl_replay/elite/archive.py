"""EliteArchive: the MAP-Elites archive of verified solutions and its frozen form.

The archive maps question -> cell -> elite, where a cell is the ``(approach, descriptor)`` of
the solution *as achieved* (computed by the injected ``describer``; the approach the generator
was asked for is only recorded). :meth:`EliteArchive.insert` calls the injected ``verifier``
itself; a caller's "correct" flag (e.g. in candidate metadata) is never looked at.

Insertion order of checks (documented choice): **complete, then verify, then describe**.

0. the generation did not finish (``candidate.finish_reason`` is set and is not ``"stop"``:
   ``"length"`` -- cut off by the token limit --, ``"abort"``, ...) => ``TRUNCATED``, without
   calling the verifier: a cut-off answer can still verify (an unclosed ```sql block is
   extracted), and replaying it would teach the policy to stop mid-answer;
1. ``verifier(question, text)`` -> ``.correct is False``  => ``REJECTED`` (verification failure);
2. ``describer(question, text)`` raises ``ValueError``, returns ``None``, or returns an approach
   outside the vocabulary => ``PARSE_FAILED`` (parse failure);
3. otherwise the achieved cell is known: ``NEW`` (empty cell), ``IMPROVED`` (strictly fewer
   tokens than the incumbent) or ``NOT_ADDED`` (ties keep the incumbent).

Why verification first: the verifier is the authority on correctness and its failure rate over
*all* attempts is the number the search reports; the describer (possibly an LLM labeler) then
only runs on verified solutions, and a parse failure means "a verified solution we could not
place in a cell" (a describer gap worth monitoring), not "an unparseable wrong answer". As a
consequence an *approach miss* (a requested approach that differs from the achieved one) is
only known, and only counted, for verified and parsed candidates.

Every attempt lands in exactly one outcome, so for every counter scope
``attempts == truncated + parse_failures + verification_failures + not_added + new + improved`` and
``insertions == new + improved``. Counters are kept in total, per question, per requested
approach (seeds, which request no approach, under :data:`SEED_KEY`) and per
(question, requested approach); the latter drives :meth:`EliteArchive.choose_target`.

The archive owns a seeded ``numpy.random.Generator`` (never the global RNG);
:meth:`EliteArchive.state_dict` includes its state, so a resumed search makes the same choices.

:class:`FrozenArchive` is the immutable, deterministically ordered form used for training
(built by :meth:`EliteArchive.freeze` or loaded by
:func:`verl_replay.elite.archive_io.load_frozen_archive`); nothing mutates it.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import json
import operator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

__all__ = [
    "SEED_KEY",
    "CellKey",
    "Question",
    "Candidate",
    "Elite",
    "InsertStatus",
    "InsertResult",
    "Counts",
    "EliteArchive",
    "FrozenEntry",
    "FrozenArchive",
    "freeze_json",
    "thaw_json",
]

# Counter key for attempts that requested no approach (seed samples). Angle brackets keep it
# apart from any vocabulary name; the constructor refuses a vocabulary that contains it.
SEED_KEY = "<seed>"

_STATE_FORMAT = "verl_replay.EliteArchive"
# 2: counters gained ``truncated`` (version-1 states may hold elites of cut-off generations).
_STATE_VERSION = 2


class CellKey(NamedTuple):
    """Archive cell of one question: the achieved approach and the structural descriptor."""

    approach: str
    descriptor: str


def _as_cell(value: Any) -> CellKey | None:
    if value is None:
        return None
    approach, descriptor = value  # accepts CellKey, tuple or a JSON list
    if not isinstance(approach, str) or not isinstance(descriptor, str):
        raise TypeError(f"a cell key is (approach: str, descriptor: str), got {value!r}")
    return CellKey(approach, descriptor)


def _normalize_prompt(prompt: Any) -> str | tuple[dict[str, Any], ...]:
    # Chat messages are stored as a tuple of plain dicts so that a question compares equal
    # before and after a JSON round trip (lists come back from JSON, tuples go in).
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        raise TypeError("Question.prompt is a string or a sequence of chat messages, got a mapping")
    messages = tuple(dict(m) for m in prompt)
    return messages


@dataclass(frozen=True)
class Question:
    """One training question: id, prompt (text or chat messages), ground truth, metadata.

    ``metadata`` carries what verifiers and describers need (e.g. ``db_path`` for SQL).
    """

    id: str
    prompt: str | tuple[dict[str, Any], ...]
    ground_truth: Any
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise TypeError(f"Question.id must be a non-empty str, got {self.id!r}")
        object.__setattr__(self, "prompt", _normalize_prompt(self.prompt))
        object.__setattr__(self, "metadata", dict(self.metadata))

    def to_dict(self) -> dict[str, Any]:
        prompt = self.prompt if isinstance(self.prompt, str) else [dict(m) for m in self.prompt]
        return {
            "id": self.id,
            "prompt": copy.deepcopy(prompt),
            "ground_truth": copy.deepcopy(self.ground_truth),
            "metadata": copy.deepcopy(dict(self.metadata)),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Question:
        return cls(id=d["id"], prompt=d["prompt"], ground_truth=d["ground_truth"], metadata=d["metadata"])


@dataclass(frozen=True)
class Candidate:
    """A generated solution offered to the archive.

    ``requested_approach`` is the target the generator was asked for (``None`` for seed
    samples); ``parent`` is the cell of the elite the mutation started from (``None`` if
    none); ``metadata`` is free-form generation metadata (sampling params, round, ...). Any
    correctness claim in it is ignored: the archive verifies. ``finish_reason`` is the
    generator's (``"stop"``: it ended the answer itself; ``"length"``: cut off by the token
    limit; ``None``: unknown); anything but ``None``/``"stop"`` is never inserted.
    """

    question_id: str
    text: str
    requested_approach: str | None = None
    parent: CellKey | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Candidate.text must be a str, got {type(self.text).__name__}")
        if self.finish_reason is not None and not isinstance(self.finish_reason, str):
            raise TypeError(f"Candidate.finish_reason must be a str or None, got {type(self.finish_reason).__name__}")

    @property
    def truncated(self) -> bool:
        """The generation did not end by itself (cut off by its length limit, aborted, ...)."""
        return self.finish_reason is not None and self.finish_reason != "stop"
        object.__setattr__(self, "parent", _as_cell(self.parent))
        object.__setattr__(self, "metadata", dict(self.metadata))


@dataclass(frozen=True)
class Elite:
    """The stored (shortest verified) solution of one cell of one question."""

    question_id: str
    cell: CellKey
    text: str
    num_tokens: int
    requested_approach: str | None
    parent: CellKey | None
    insertion_round: int
    verification_reason: str
    generation_metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def approach(self) -> str:
        """The achieved approach (``cell.approach``)."""
        return self.cell.approach

    achieved_approach = approach

    @property
    def descriptor(self) -> str:
        return self.cell.descriptor

    @property
    def approach_miss(self) -> bool:
        return self.requested_approach is not None and self.requested_approach != self.cell.approach

    def to_dict(self) -> dict[str, Any]:
        return {
            "question_id": self.question_id,
            "cell": list(self.cell),
            "text": self.text,
            "num_tokens": self.num_tokens,
            "requested_approach": self.requested_approach,
            "parent": None if self.parent is None else list(self.parent),
            "insertion_round": self.insertion_round,
            "verification_reason": self.verification_reason,
            "generation_metadata": copy.deepcopy(dict(self.generation_metadata)),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Elite:
        return cls(
            question_id=d["question_id"],
            cell=_as_cell(d["cell"]),  # type: ignore[arg-type]
            text=d["text"],
            num_tokens=int(d["num_tokens"]),
            requested_approach=d["requested_approach"],
            parent=_as_cell(d["parent"]),
            insertion_round=int(d["insertion_round"]),
            verification_reason=d["verification_reason"],
            generation_metadata=dict(d["generation_metadata"]),
        )


class InsertStatus(str, enum.Enum):
    TRUNCATED = "truncated"  # the generation did not finish (never verified, never inserted)
    REJECTED = "rejected"  # the verifier said the solution is wrong
    PARSE_FAILED = "parse_failed"  # verified, but the describer could not place it in a cell
    NOT_ADDED = "not_added"  # verified and placed, but the incumbent is shorter or equally long
    NEW = "new"  # verified, placed, the cell was empty
    IMPROVED = "improved"  # verified, placed, strictly shorter than the incumbent


@dataclass(frozen=True)
class InsertResult:
    status: InsertStatus
    cell: CellKey | None  # achieved cell; None when truncated, rejected or not parsed
    reason: str  # verifier reason, parse error, or why it was not added
    num_tokens: int | None = None
    approach_miss: bool = False

    @property
    def inserted(self) -> bool:
        return self.status in (InsertStatus.NEW, InsertStatus.IMPROVED)


_COUNT_FIELDS = (
    "attempts",
    "truncated",
    "parse_failures",
    "verification_failures",
    "approach_misses",
    "not_added",
    "new",
    "improved",
)


@dataclass
class Counts:
    """Outcome counters of one scope (total, a question, an approach, ...)."""

    attempts: int = 0
    truncated: int = 0
    parse_failures: int = 0
    verification_failures: int = 0
    approach_misses: int = 0
    not_added: int = 0
    new: int = 0
    improved: int = 0

    @property
    def insertions(self) -> int:
        return self.new + self.improved

    def record(self, status: InsertStatus, approach_miss: bool) -> None:
        self.attempts += 1
        self.approach_misses += int(approach_miss)
        if status is InsertStatus.TRUNCATED:
            self.truncated += 1
        elif status is InsertStatus.REJECTED:
            self.verification_failures += 1
        elif status is InsertStatus.PARSE_FAILED:
            self.parse_failures += 1
        elif status is InsertStatus.NOT_ADDED:
            self.not_added += 1
        elif status is InsertStatus.NEW:
            self.new += 1
        else:
            self.improved += 1

    def as_dict(self) -> dict[str, int]:
        d = {name: getattr(self, name) for name in _COUNT_FIELDS}
        d["insertions"] = self.insertions
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, int]) -> Counts:
        return cls(**{name: int(d[name]) for name in _COUNT_FIELDS})


def _check_token_count(value: Any, text: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("token_counter must return an int, got a bool")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"token_counter must return an int, got {type(value).__name__}") from None
    if n < 1:
        raise ValueError(f"token_counter returned {n} for a verified solution ({text[:60]!r}); it must be >= 1")
    return n


class EliteArchive:
    """MAP-Elites archive: question -> (approach, descriptor) cell -> shortest verified solution.

    Args (keyword-only):
        verifier: ``verifier(question, solution_text)`` -> object with ``.correct: bool`` and
            ``.reason: str``.
        describer: ``describer(question, solution_text)`` -> ``(approach, descriptor)``; raise
            ``ValueError`` or return ``None`` when the solution cannot be parsed.
        token_counter: ``token_counter(text)`` -> number of tokens (``>= 1``).
        approaches: the approach vocabulary (distinct names, order kept for reporting).
        seed: seed of the archive's own ``numpy.random.Generator`` (tie-breaks, parent choice).
    """

    def __init__(
        self,
        *,
        verifier: Callable[[Question, str], Any],
        describer: Callable[[Question, str], tuple[str, str] | None],
        token_counter: Callable[[str], int],
        approaches: Sequence[str],
        seed: int,
    ) -> None:
        for name, fn in (("verifier", verifier), ("describer", describer), ("token_counter", token_counter)):
            if not callable(fn):
                raise TypeError(f"EliteArchive({name}=...) must be callable")
        vocab = list(approaches)
        if not vocab:
            raise ValueError("EliteArchive(approaches=...) is empty; give the approach vocabulary")
        if any(not isinstance(a, str) or not a for a in vocab):
            raise TypeError("EliteArchive(approaches=...) must be non-empty strings")
        if len(set(vocab)) != len(vocab):
            raise ValueError(f"EliteArchive(approaches=...) has duplicates: {vocab}")
        if SEED_KEY in vocab:
            raise ValueError(f"EliteArchive(approaches=...) may not contain the reserved name {SEED_KEY!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"EliteArchive(seed=...) must be a non-negative int, got {seed!r}")
        self._verifier = verifier
        self._describer = describer
        self._token_counter = token_counter
        self._approaches: tuple[str, ...] = tuple(vocab)
        self._vocab_set = frozenset(vocab)
        self._rng = np.random.default_rng(int(seed))
        self._reset()

    def _reset(self) -> None:
        self._questions: dict[str, Question] = {}
        self._elites: dict[str, dict[CellKey, Elite]] = {}
        self._totals = Counts()
        self._per_question: dict[str, Counts] = {}
        self._per_approach: dict[str, Counts] = {}
        self._per_question_approach: dict[str, dict[str, Counts]] = {}
        # approach -> number of questions holding >= 1 elite of that achieved approach
        self._approach_questions: dict[str, int] = {a: 0 for a in self._approaches}
        self._size = 0

    # ------------------------------------------------------------------ questions

    @property
    def approaches(self) -> tuple[str, ...]:
        return self._approaches

    def register(self, question: Question) -> None:
        """Make a question known (counts towards coverage) before any attempt on it.

        Registering the same id again is a no-op if the question is identical, an error otherwise.
        """
        if not isinstance(question, Question):
            raise TypeError(f"expected a Question, got {type(question).__name__}")
        known = self._questions.get(question.id)
        if known is None:
            self._questions[question.id] = question
        elif known != question:
            raise ValueError(f"question {question.id!r} is already registered with different content")

    def question(self, question_id: str) -> Question:
        try:
            return self._questions[question_id]
        except KeyError:
            raise KeyError(f"unknown question id {question_id!r}") from None

    def questions(self) -> tuple[Question, ...]:
        """All registered questions (including those without elites), sorted by id."""
        return tuple(self._questions[q] for q in sorted(self._questions))

    # ------------------------------------------------------------------ insertion

    def insert(self, question: Question, candidate: Candidate, *, round: int = 0) -> InsertResult:  # noqa: A002
        """Verify, describe and (maybe) store one candidate; see the module docstring.

        ``round`` is the search round, recorded on the stored elite. The injected callables'
        exceptions other than the describer's ``ValueError`` propagate and leave the archive
        unchanged (they are bugs, not outcomes).
        """
        if not isinstance(candidate, Candidate):
            raise TypeError(f"expected a Candidate, got {type(candidate).__name__}")
        if candidate.question_id != question.id:
            raise ValueError(f"candidate is for question {candidate.question_id!r}, not {question.id!r}")
        requested = candidate.requested_approach
        if requested is not None and requested not in self._vocab_set:
            raise ValueError(f"requested approach {requested!r} is not in the vocabulary {list(self._approaches)}")
        round_ = operator.index(round)
        known = self._questions.get(question.id)
        if known is not None and known != question:
            raise ValueError(f"question {question.id!r} is already registered with different content")

        result = self._evaluate(question, candidate)
        self.register(question)  # only after the callables returned: a raising one changes nothing
        if result.inserted:
            assert result.cell is not None and result.num_tokens is not None
            self._store(
                Elite(
                    question_id=question.id,
                    cell=result.cell,
                    text=candidate.text,
                    num_tokens=result.num_tokens,
                    requested_approach=requested,
                    parent=candidate.parent,
                    insertion_round=round_,
                    verification_reason=result.reason,
                    generation_metadata=dict(candidate.metadata),
                )
            )
        self._count(question.id, requested, result)
        return result

    def _evaluate(self, question: Question, candidate: Candidate) -> InsertResult:
        text = candidate.text
        if candidate.truncated:
            return InsertResult(
                InsertStatus.TRUNCATED,
                None,
                f"the generation did not finish (finish_reason={candidate.finish_reason!r}); a cut-off answer is never "
                "inserted",
            )
        verdict = self._verifier(question, text)
        correct = getattr(verdict, "correct", None)
        if not isinstance(correct, (bool, np.bool_)):
            raise TypeError(f"verifier must return an object with a bool .correct, got {verdict!r}")
        reason = str(getattr(verdict, "reason", ""))
        if not correct:
            return InsertResult(InsertStatus.REJECTED, None, reason)

        try:
            described = self._describer(question, text)
        except ValueError as exc:
            return InsertResult(InsertStatus.PARSE_FAILED, None, f"describer could not parse the solution: {exc}")
        if described is None:
            return InsertResult(
                InsertStatus.PARSE_FAILED, None, "describer could not parse the solution (returned None)"
            )
        cell = _as_cell(described)
        assert cell is not None
        if cell.approach not in self._vocab_set:
            return InsertResult(
                InsertStatus.PARSE_FAILED, None, f"describer returned approach {cell.approach!r}, not in the vocabulary"
            )

        num_tokens = _check_token_count(self._token_counter(text), text)
        miss = candidate.requested_approach is not None and candidate.requested_approach != cell.approach
        incumbent = self._elites.get(question.id, {}).get(cell)
        if incumbent is None:
            status, why = InsertStatus.NEW, reason
        elif num_tokens < incumbent.num_tokens:
            status, why = InsertStatus.IMPROVED, reason
        else:
            status = InsertStatus.NOT_ADDED
            why = f"incumbent has {incumbent.num_tokens} tokens, candidate {num_tokens} (ties keep the incumbent)"
        return InsertResult(status, cell, why, num_tokens, miss)

    def _store(self, elite: Elite) -> None:
        cells = self._elites.setdefault(elite.question_id, {})
        if elite.cell not in cells:
            self._size += 1
            if not any(c.approach == elite.approach for c in cells):
                self._approach_questions[elite.approach] += 1
        cells[elite.cell] = elite

    def _count(self, question_id: str, requested: str | None, result: InsertResult) -> None:
        key = SEED_KEY if requested is None else requested
        scopes = (
            self._totals,
            self._per_question.setdefault(question_id, Counts()),
            self._per_approach.setdefault(key, Counts()),
            self._per_question_approach.setdefault(question_id, {}).setdefault(key, Counts()),
        )
        for scope in scopes:
            scope.record(result.status, result.approach_miss)

    # ------------------------------------------------------------------ search policy

    def _attempts_at(self, question_id: str, approach: str) -> int:
        counts = self._per_question_approach.get(question_id, {}).get(approach)
        return 0 if counts is None else counts.attempts

    def rank_targets(self, question_id: str) -> list[str]:
        """All approaches, best target first.

        Order: uncovered for this question first, then fewer attempts at (question, approach)
        (attempts = candidates that requested it), then fewer questions covering the approach
        across the archive; remaining ties are broken by a seeded random permutation.
        Consumes the archive's RNG.
        """
        covered = {cell.approach for cell in self._elites.get(question_id, {})}
        shuffled = [self._approaches[i] for i in self._rng.permutation(len(self._approaches))]
        # sorted() is stable, so equal keys keep the seeded random order
        return sorted(
            shuffled,
            key=lambda a: (a in covered, self._attempts_at(question_id, a), self._approach_questions[a]),
        )

    def choose_target(self, question_id: str) -> str:
        """The approach to request next for ``question_id`` (first of :meth:`rank_targets`)."""
        return self.rank_targets(question_id)[0]

    def choose_parent(self, question_id: str, target_approach: str) -> Elite | None:
        """Parent elite for a mutation towards ``target_approach``.

        Prefers an elite of the same question whose achieved approach differs from the target
        (seeded uniform choice). Middle case (documented choice): if every elite of the question
        already has the target approach, one of those is returned (a parent of the same approach
        still steers towards a new descriptor). ``None`` only when the question has no elite.
        Parents never come from other questions.
        """
        if target_approach not in self._vocab_set:
            raise ValueError(f"target approach {target_approach!r} is not in the vocabulary")
        cells = self._elites.get(question_id)
        if not cells:
            return None
        ordered = sorted(cells)
        preferred = [c for c in ordered if c.approach != target_approach]
        pool = preferred or ordered
        return cells[pool[int(self._rng.integers(len(pool)))]]

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return self._size

    def elites(self, question_id: str | None = None) -> list[Elite]:
        """Elites sorted by (question id, cell); all questions when ``question_id`` is None."""
        qids = sorted(self._elites) if question_id is None else [question_id]
        return [self._elites[q][c] for q in qids for c in sorted(self._elites.get(q, {}))]

    def elite(self, question_id: str, cell: tuple[str, str]) -> Elite | None:
        return self._elites.get(question_id, {}).get(_as_cell(cell))  # type: ignore[arg-type]

    def cells(self, question_id: str) -> list[CellKey]:
        return sorted(self._elites.get(question_id, {}))

    def coverage(self) -> dict[str, Any]:
        """Cells per question; ``mean_cells`` averages over all registered questions."""
        per_q = {q: len(self._elites.get(q, {})) for q in sorted(self._questions)}
        n_q = len(per_q)
        return {
            "questions": n_q,
            "questions_covered": sum(1 for n in per_q.values() if n > 0),
            "cells": self._size,
            "mean_cells": (self._size / n_q) if n_q else 0.0,
            "cells_per_question": per_q,
            "questions_per_approach": dict(self._approach_questions),
        }

    def counts(self) -> dict[str, Any]:
        """JSON-ready counters: ``totals``, ``per_question``, ``per_approach`` (by requested
        approach, seeds under :data:`SEED_KEY`) and ``per_question_approach``. In every scope
        ``attempts == truncated + parse_failures + verification_failures + not_added + new + improved``.
        """
        return {
            "totals": self._totals.as_dict(),
            "per_question": {q: self._per_question[q].as_dict() for q in sorted(self._per_question)},
            "per_approach": {a: self._per_approach[a].as_dict() for a in sorted(self._per_approach)},
            "per_question_approach": {
                q: {a: c.as_dict() for a, c in sorted(self._per_question_approach[q].items())}
                for q in sorted(self._per_question_approach)
            },
        }

    # ------------------------------------------------------------------ freeze / state

    def freeze(self, manifest: Mapping[str, Any] | None = None) -> FrozenArchive:
        """An immutable snapshot of the elites (with their questions) for training."""
        entries = []
        for elite in self.elites():
            q = self._questions[elite.question_id]
            entries.append(FrozenEntry.from_elite(elite, q))
        return FrozenArchive(entries, manifest=manifest)

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready full state (questions, elites, counters, RNG); callables are not included."""
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "approaches": list(self._approaches),
            "questions": [q.to_dict() for q in self.questions()],
            "elites": [e.to_dict() for e in self.elites()],
            "counters": {
                "totals": self._totals.as_dict(),
                "per_question": {q: c.as_dict() for q, c in self._per_question.items()},
                "per_approach": {a: c.as_dict() for a, c in self._per_approach.items()},
                "per_question_approach": {
                    q: {a: c.as_dict() for a, c in d.items()} for q, d in self._per_question_approach.items()
                },
            },
            "rng": copy.deepcopy(self._rng.bit_generator.state),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` into this archive (same vocabulary required)."""
        if state.get("format") == _STATE_FORMAT and state.get("version") == 1:
            raise ValueError(
                "the state was saved by an older version of the archive, which did not refuse generations cut off "
                "by their length limit (its elites may include them); start the search over (--overwrite)"
            )
        if state.get("format") != _STATE_FORMAT or state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"not an EliteArchive state (format {state.get('format')!r} version {state.get('version')!r}; "
                f"expected {_STATE_FORMAT!r} version {_STATE_VERSION})"
            )
        if tuple(state["approaches"]) != self._approaches:
            raise ValueError(
                f"state was saved with approaches {list(state['approaches'])}, "
                f"this archive has {list(self._approaches)}"
            )
        questions = [Question.from_dict(d) for d in state["questions"]]
        elites = [Elite.from_dict(d) for d in state["elites"]]
        counters = state["counters"]
        rng = np.random.default_rng()
        rng.bit_generator.state = copy.deepcopy(state["rng"])
        # validate everything before touching self, so a bad state leaves the archive as it was
        qids = [q.id for q in questions]
        qid_set = set(qids)
        if len(qid_set) != len(qids):
            raise ValueError("state lists a question twice")
        seen: set[tuple[str, CellKey]] = set()
        for e in elites:
            if e.question_id not in qid_set:
                raise ValueError(f"state has an elite for unregistered question {e.question_id!r}")
            if e.approach not in self._vocab_set:
                raise ValueError(f"state has an elite with approach {e.approach!r} outside the vocabulary")
            if (e.question_id, e.cell) in seen:
                raise ValueError(f"state has two elites for question {e.question_id!r} cell {tuple(e.cell)}")
            seen.add((e.question_id, e.cell))

        self._reset()
        for q in questions:
            self.register(q)
        for e in elites:
            self._store(e)
        self._totals = Counts.from_dict(counters["totals"])
        self._per_question = {q: Counts.from_dict(c) for q, c in counters["per_question"].items()}
        self._per_approach = {a: Counts.from_dict(c) for a, c in counters["per_approach"].items()}
        self._per_question_approach = {
            q: {a: Counts.from_dict(c) for a, c in d.items()} for q, d in counters["per_question_approach"].items()
        }
        self._rng = rng


# ====================================================================== frozen form


def freeze_json(value: Any) -> Any:
    """Deep read-only copy of a JSON-like value: dicts -> MappingProxyType, lists -> tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze_json(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze_json(v) for v in value)
    return value


def thaw_json(value: Any) -> Any:
    """Inverse of :func:`freeze_json`: a fresh mutable copy (mappings -> dict, tuples -> list)."""
    if isinstance(value, Mapping):
        return {k: thaw_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw_json(v) for v in value]
    return value


@dataclass(frozen=True)
class FrozenEntry:
    """One replayable elite with everything needed to build its training row."""

    question_id: str
    approach: str
    descriptor: str
    text: str
    num_tokens: int
    requested_approach: str | None
    parent: CellKey | None
    insertion_round: int
    verification_reason: str
    prompt: Any  # str, or a tuple of read-only chat-message mappings
    ground_truth: Any
    question_metadata: Mapping[str, Any]
    generation_metadata: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "parent", _as_cell(self.parent))
        object.__setattr__(self, "prompt", freeze_json(self.prompt))
        object.__setattr__(self, "ground_truth", freeze_json(self.ground_truth))
        object.__setattr__(self, "question_metadata", freeze_json(dict(self.question_metadata)))
        object.__setattr__(self, "generation_metadata", freeze_json(dict(self.generation_metadata)))

    @property
    def cell(self) -> CellKey:
        return CellKey(self.approach, self.descriptor)

    def __hash__(self) -> int:  # the mapping fields are unhashable; identity + content suffices
        return hash((self.question_id, self.approach, self.descriptor, self.text))

    @classmethod
    def from_elite(cls, elite: Elite, question: Question) -> FrozenEntry:
        if elite.question_id != question.id:
            raise ValueError(f"elite is for question {elite.question_id!r}, not {question.id!r}")
        return cls(
            question_id=elite.question_id,
            approach=elite.approach,
            descriptor=elite.descriptor,
            text=elite.text,
            num_tokens=elite.num_tokens,
            requested_approach=elite.requested_approach,
            parent=elite.parent,
            insertion_round=elite.insertion_round,
            verification_reason=elite.verification_reason,
            prompt=question.to_dict()["prompt"],
            ground_truth=question.ground_truth,
            question_metadata=question.metadata,
            generation_metadata=elite.generation_metadata,
        )

    def to_dict(self) -> dict[str, Any]:
        """A fresh, mutable, JSON-ready copy (e.g. ``to_dict()["prompt"]`` for a chat template)."""
        return {
            "question_id": self.question_id,
            "approach": self.approach,
            "descriptor": self.descriptor,
            "text": self.text,
            "num_tokens": self.num_tokens,
            "requested_approach": self.requested_approach,
            "parent": None if self.parent is None else list(self.parent),
            "insertion_round": self.insertion_round,
            "verification_reason": self.verification_reason,
            "prompt": thaw_json(self.prompt),
            "ground_truth": thaw_json(self.ground_truth),
            "question_metadata": thaw_json(self.question_metadata),
            "generation_metadata": thaw_json(self.generation_metadata),
        }


class FrozenArchive:
    """Immutable archive for training: entries grouped question -> cell -> entry.

    Entries are sorted by (question id, approach, descriptor); question ``i`` owns the entries
    ``entries[offsets[i]:offsets[i + 1]]`` (``offsets`` is a read-only int64 array), which is
    the index layout the samplers use. Attributes cannot be reassigned; mappings are read-only
    views and sequences are tuples.
    """

    __slots__ = ("_entries", "_question_ids", "_offsets", "_groups", "_manifest", "_fingerprint")

    def __init__(self, entries: Iterable[FrozenEntry], *, manifest: Mapping[str, Any] | None = None) -> None:
        ordered = sorted(entries, key=lambda e: (e.question_id, e.approach, e.descriptor))
        for e in ordered:
            if not isinstance(e, FrozenEntry):
                raise TypeError(f"FrozenArchive holds FrozenEntry objects, got {type(e).__name__}")
        groups: dict[str, dict[CellKey, FrozenEntry]] = {}
        qids: list[str] = []
        offsets = [0]
        for i, e in enumerate(ordered):
            if not qids or qids[-1] != e.question_id:
                if qids:
                    offsets.append(i)
                qids.append(e.question_id)
                groups[e.question_id] = {}
            if e.cell in groups[e.question_id]:
                raise ValueError(f"two entries for question {e.question_id!r} cell {tuple(e.cell)}")
            groups[e.question_id][e.cell] = e
        if ordered:
            offsets.append(len(ordered))
        offs = np.asarray(offsets, dtype=np.int64)
        offs.setflags(write=False)
        set_ = object.__setattr__
        set_(self, "_entries", tuple(ordered))
        set_(self, "_question_ids", tuple(qids))
        set_(self, "_offsets", offs)
        set_(self, "_groups", MappingProxyType({q: MappingProxyType(g) for q, g in groups.items()}))
        set_(self, "_manifest", freeze_json(dict(manifest or {})))
        set_(self, "_fingerprint", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenArchive is immutable")

    __delattr__ = __setattr__  # type: ignore[assignment]

    @property
    def entries(self) -> tuple[FrozenEntry, ...]:
        return self._entries

    @property
    def question_ids(self) -> tuple[str, ...]:
        return self._question_ids

    @property
    def offsets(self) -> np.ndarray:
        return self._offsets

    @property
    def groups(self) -> Mapping[str, Mapping[CellKey, FrozenEntry]]:
        return self._groups

    @property
    def manifest(self) -> Mapping[str, Any]:
        return self._manifest

    @property
    def num_questions(self) -> int:
        return len(self._question_ids)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[FrozenEntry]:
        return iter(self._entries)

    def cells(self, question_id: str) -> tuple[CellKey, ...]:
        return tuple(self._groups[question_id])

    def entries_for(self, question_id: str) -> tuple[FrozenEntry, ...]:
        return tuple(self._groups[question_id].values())

    @property
    def fingerprint(self) -> str:
        """sha256 of the entries' identity and content (question, cell, tokens, text); it ties
        sampler checkpoints to the archive they index into."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for e in self._entries:
                h.update(json.dumps([e.question_id, e.approach, e.descriptor, e.num_tokens, e.text]).encode())
                h.update(b"\n")
            object.__setattr__(self, "_fingerprint", h.hexdigest())
        return self._fingerprint  # type: ignore[return-value]
