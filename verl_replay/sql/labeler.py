"""Approach labelers: deterministic rules over the SQL AST (default) and an LLM labeler.

Both implement the :class:`Labeler` interface (``label(text) -> str``,
``label_batch(texts) -> list[str]``) and only ever return names of their vocabulary.

Rule-based primary approach. Every rule below that matches is a label (:meth:`all_labels`);
the *primary* label (:meth:`label`) is the first one in this precedence order:

1. ``cte``              WITH ... AS
2. ``set_operation``    UNION / INTERSECT / EXCEPT
3. ``window_function``  f(...) OVER (...)
4. ``exists``           EXISTS (SELECT ...)
5. ``scalar_subquery``  a subquery used as a value (comparison operand, projection, function
                        argument), i.e. not IN (...), not FROM/JOIN, not EXISTS
6. ``nested_subquery``  IN (SELECT ...) or a derived table FROM/JOIN (SELECT ...)
7. ``self_join``        one SELECT reads the same table twice (FROM + JOIN / comma join)
8. ``case_expression``  CASE ... END or IIF(...)
9. ``order_by_limit``   ORDER BY and LIMIT on the same query
10. ``group_by_having`` GROUP BY (HAVING optional)
11. ``join``            any JOIN, including comma joins and self joins
12. ``plain_select``    only when nothing above matches

Why this order: constructs that reshape the whole query (CTE, set operation, window) say the
most about the strategy; then the kind of subquery the author chose over a join; then local
choices (self join, conditional logic, top-k by sorting vs grouping). A plain join comes last
because it is usually dictated by where the columns live rather than chosen. Names of the
vocabulary that no rule knows can only come from the LLM labeler; rule names missing from the
vocabulary are skipped, and if nothing is left the vocabulary's ``default`` is returned.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from sqlglot import exp

from verl_replay.sql.skeleton import parse_query
from verl_replay.sql.vocabulary import Vocabulary, VocabularyError, load_vocabulary, strip_thinking

if TYPE_CHECKING:
    from verl_replay.generation.base import GenerationBackend

__all__ = [
    "SQL_RULE_PRECEDENCE",
    "LLMLabeler",
    "Labeler",
    "RuleBasedLabeler",
    "build_label_messages",
    "parse_label_answer",
    "sql_rule_labels",
]

SQL_RULE_PRECEDENCE: tuple[str, ...] = (
    "cte",
    "set_operation",
    "window_function",
    "exists",
    "scalar_subquery",
    "nested_subquery",
    "self_join",
    "case_expression",
    "order_by_limit",
    "group_by_having",
    "join",
    "plain_select",
)


@runtime_checkable
class Labeler(Protocol):
    """Maps a solution (SQL text, or math solution text) to one approach name of ``vocabulary``."""

    vocabulary: Vocabulary

    def label(self, text: str) -> str: ...

    def label_batch(self, texts: Sequence[str]) -> list[str]: ...


def sql_rule_labels(sql: str | exp.Expression) -> list[str]:
    """All rule names of :data:`SQL_RULE_PRECEDENCE` that match ``sql``, in precedence order.

    Raises :class:`verl_replay.sql.skeleton.SQLParseError` for text that is not one query.
    """
    tree = parse_query(sql) if isinstance(sql, str) else sql
    nodes = list(tree.walk())
    queries = [n for n in nodes if isinstance(n, exp.Query)]
    roles = {_subquery_role(n) for n in nodes if isinstance(n, exp.Subquery)}
    found = {
        "cte": any(isinstance(n, exp.CTE) for n in nodes),
        "set_operation": any(isinstance(n, exp.SetOperation) for n in nodes),
        "window_function": any(isinstance(n, exp.Window) for n in nodes),
        "exists": any(isinstance(n, exp.Exists) for n in nodes),
        "scalar_subquery": "scalar" in roles,
        "nested_subquery": bool(roles & {"in", "derived"}),
        "self_join": any(_reads_a_table_twice(n) for n in nodes if isinstance(n, exp.Select)),
        "case_expression": any(isinstance(n, (exp.Case, exp.If)) for n in nodes),
        "order_by_limit": any(q.args.get("order") and q.args.get("limit") for q in queries),
        "group_by_having": any(q.args.get("group") for q in queries),
        "join": any(isinstance(n, exp.Join) for n in nodes),
    }
    labels = [name for name in SQL_RULE_PRECEDENCE if found.get(name)]
    return labels or ["plain_select"]


def _subquery_role(sub: exp.Subquery) -> str | None:
    node, parent = sub, sub.parent
    while isinstance(parent, exp.Paren):  # ((SELECT ...)) plays the role of its outer position
        node, parent = parent, parent.parent
    if parent is None or isinstance(parent, (exp.SetOperation, exp.Exists, exp.Subquery)):
        return None  # the statement itself, a parenthesised set-operation branch, EXISTS body
    if isinstance(parent, (exp.From, exp.Join)):
        return "derived"
    if isinstance(parent, exp.In) and node.arg_key == "query":
        return "in"
    return "scalar"


def _reads_a_table_twice(select: exp.Select) -> bool:
    sources = []
    from_clause = select.args.get("from_") or select.args.get("from")
    if from_clause is not None:
        sources.append(from_clause.this)
    sources.extend(join.this for join in select.args.get("joins") or [])
    names = [s.name.lower() for s in sources if isinstance(s, exp.Table) and s.name]
    return len(names) != len(set(names))


class RuleBasedLabeler:
    """Deterministic SQL labeler (see the module docstring for rules and precedence)."""

    def __init__(self, vocabulary: Vocabulary | None = None) -> None:
        self.vocabulary = vocabulary if vocabulary is not None else load_vocabulary()
        self.known = tuple(name for name in SQL_RULE_PRECEDENCE if name in self.vocabulary)
        if not self.known:
            raise VocabularyError(
                "RuleBasedLabeler: the vocabulary shares no name with the SQL rules "
                f"{list(SQL_RULE_PRECEDENCE)}; rename approaches or pass another fallback labeler"
            )
        # Names the rules never produce (e.g. from an induced vocabulary): only an LLM labeler can.
        self.unlabelable = tuple(name for name in self.vocabulary.names if name not in SQL_RULE_PRECEDENCE)

    def all_labels(self, sql: str) -> list[str]:
        labels = [name for name in sql_rule_labels(sql) if name in self.known]
        return labels or [self.vocabulary.default]

    def label(self, sql: str) -> str:
        return self.all_labels(sql)[0]

    def label_batch(self, sqls: Sequence[str]) -> list[str]:
        return [self.label(sql) for sql in sqls]


def build_label_messages(text: str, vocabulary: Vocabulary) -> list[dict[str, str]]:
    """Chat messages asking the model to pick one approach name for ``text``."""
    what, fence = ("SQL query", "sql") if vocabulary.domain == "sql" else ("math solution", "")
    content = (
        f"Which approach does this {what} use? Choose exactly one name from the list: the "
        f"{what}'s main strategy.\n\nApproaches:\n{vocabulary.prompt_listing()}\n\n"
        f"{what[0].upper() + what[1:]}:\n```{fence}\n{text.strip()}\n```\n\n"
        "Answer with the approach name only."
    )
    return [{"role": "user", "content": content}]


def parse_label_answer(answer: str, vocabulary: Vocabulary) -> str | None:
    """The vocabulary name an answer picks, or None.

    In order: the answer's first line is exactly a name; the same ignoring case, surrounding
    quotes/markdown and spaces or hyphens instead of underscores; otherwise the vocabulary name
    mentioned first in the text (longest on a tie, so "self join" beats "join").
    ``<think>`` blocks are ignored.
    """
    text = strip_thinking(answer).strip()
    if not text:
        return None
    first_line = next(line for line in text.splitlines() if line.strip()).strip()
    if first_line in vocabulary:
        return first_line
    cleaned = re.sub(r"^(?:approach|answer)\s*:\s*", "", first_line.strip("`*\"' .:;!"), flags=re.IGNORECASE)
    key = re.sub(r"[\s\-]+", "_", cleaned.strip("`*\"' .:;!").lower())
    if key in vocabulary:
        return key
    best: tuple[int, int, str] | None = None
    for name in vocabulary.names:
        pattern = r"(?<![A-Za-z0-9_])" + r"[\s_\-]+".join(map(re.escape, name.split("_"))) + r"(?![A-Za-z0-9_])"
        match = re.search(pattern, text, flags=re.IGNORECASE)
        if match:
            candidate = (match.start(), -len(name), name)
            best = candidate if best is None or candidate < best else best
    return best[2] if best else None


class LLMLabeler:
    """Asks a frozen model (through a generation backend) to pick an approach from the vocabulary.

    Answers are parsed with :func:`parse_label_answer`; when an answer names nothing valid the
    ``fallback`` labeler decides (default: :class:`RuleBasedLabeler` for SQL vocabularies, the
    keyword labeler for math), and ``num_fallbacks`` counts it. Greedy decoding by default.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        vocabulary: Vocabulary | None = None,
        *,
        fallback: Labeler | None = None,
        batch_size: int = 64,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.backend = backend
        self.vocabulary = vocabulary if vocabulary is not None else load_vocabulary()
        self.fallback = fallback if fallback is not None else _default_fallback(self.vocabulary)
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.num_labeled = 0
        self.num_fallbacks = 0
        self.last_answers: list[str] = []  # raw model answers of the latest label_batch call

    @property
    def fallback_rate(self) -> float:
        return self.num_fallbacks / self.num_labeled if self.num_labeled else 0.0

    def label(self, text: str) -> str:
        return self.label_batch([text])[0]

    def label_batch(self, texts: Sequence[str]) -> list[str]:
        answers: list[str] = []
        for start in range(0, len(texts), self.batch_size):
            chunk = texts[start : start + self.batch_size]
            outputs = self.backend.generate(
                [build_label_messages(t, self.vocabulary) for t in chunk],
                n=1,
                temperature=self.temperature,
                top_p=self.top_p,
                max_new_tokens=self.max_new_tokens,
                seed=self.seed + start,
            )
            answers.extend(samples[0].text for samples in outputs)
        labels = [parse_label_answer(a, self.vocabulary) for a in answers]
        missing = [i for i, name in enumerate(labels) if name is None]
        if missing:
            fallback_labels = self.fallback.label_batch([texts[i] for i in missing])
            for i, name in zip(missing, fallback_labels, strict=True):
                labels[i] = name if name in self.vocabulary else self.vocabulary.default
        self.last_answers = answers
        self.num_labeled += len(texts)
        self.num_fallbacks += len(missing)
        return [name if name is not None else self.vocabulary.default for name in labels]


def _default_fallback(vocabulary: Vocabulary) -> Labeler:
    if vocabulary.domain == "math":
        from verl_replay.math.descriptor import MathKeywordLabeler

        return MathKeywordLabeler(vocabulary)
    return RuleBasedLabeler(vocabulary)
