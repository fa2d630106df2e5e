"""Result comparison of the official BIRD and Spider evaluators, re-implemented.

``verify_sql`` executes both queries and hands the rows to :func:`results_match`. What each
semantics means, as the official scripts define it:

- ``"bird"`` -- the BIRD evaluator (``evaluation.py``): ``set(predicted) == set(gold)``. Row
  order and duplicates are ignored; column order matters (rows are tuples).
- ``"spider"`` -- the Spider test-suite evaluator's default (``exec_eval.eval_exec_match``).
  Before execution both queries are rewritten as the official script does: ``> =``, ``< =``
  and ``! =`` lose their inner space, ``YEAR(CURDATE())`` becomes ``2020`` and every DISTINCT
  keyword is removed (``SELECT DISTINCT`` and ``COUNT(DISTINCT x)`` alike, exactly like the
  official token filter). The results then match iff both are empty, or they have the same
  number of rows and columns, pass the official "unordered row" quick check, and some
  permutation of the predicted columns makes the two equal as bags of rows (as lists of rows
  when the gold query orders its result).
- ``"spider_keep_distinct"`` -- the same with DISTINCT kept (the official ``--keep_distinct``).

The quick check is part of the semantics, not only a speed-up: it sorts each row's values by
``str(value) + str(type(value))`` and compares the sorted rows as a set (as a list when
ordered). For rows that mix INTEGER and REAL values this key can sort equal values
differently (``2`` and ``2.0`` have different keys), so the official evaluator rejects some
pairs that a column permutation would make equal; we reproduce that.

The permutation search is exact and cheap in practice: a predicted column can stand for a
gold column only if the two hold the same bag of values (the same list when ordered), and a
partial assignment is kept only while the projected rows still match as bags. Ordered results
need no search at all (each column must equal its counterpart as a list). An optional
``deadline`` (``time.monotonic()`` value) bounds the search; past it :class:`CompareTimeout`
is raised.
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Iterable, Sequence
from operator import itemgetter
from typing import Any

__all__ = [
    "SEMANTICS",
    "CompareTimeout",
    "bird_match",
    "normalize_for_semantics",
    "remove_distinct",
    "results_match",
    "spider_match",
]

SEMANTICS = ("bird", "spider", "spider_keep_distinct")

Row = tuple[Any, ...]

_CUR_YEAR_RE = re.compile(r"YEAR\s*\(\s*CURDATE\s*\(\s*\)\s*\)\s*", re.IGNORECASE)


class CompareTimeout(Exception):
    """The comparison passed its deadline."""


# ----------------------------------------------------------------------------- query rewrites


def remove_distinct(sql: str) -> str:
    """``sql`` with every DISTINCT keyword token removed (the official Spider default).

    Keywords are found with sqlglot's SQLite tokenizer, so ``'distinct'`` in a string literal,
    a quoted identifier or a comment stays. Text sqlglot cannot tokenize is returned unchanged
    (SQLite will refuse it anyway).
    """
    if "distinct" not in sql.lower():
        return sql
    from sqlglot.dialects.sqlite import SQLite
    from sqlglot.tokens import TokenType

    try:
        tokens = SQLite().tokenize(sql)
    except Exception:  # noqa: BLE001 - sqlglot raises several error types
        return sql
    pieces: list[str] = []
    last = 0
    for token in tokens:
        if token.token_type == TokenType.DISTINCT:
            pieces.append(sql[last : token.start])
            last = token.end + 1  # token.end is inclusive
    pieces.append(sql[last:])
    return "".join(pieces)


def normalize_for_semantics(sql: str, semantics: str) -> str:
    """The query as the official evaluator of ``semantics`` executes it (BIRD: unchanged)."""
    if semantics == "bird":
        return sql
    sql = sql.replace("> =", ">=").replace("< =", "<=").replace("! =", "!=")
    if semantics == "spider":
        sql = remove_distinct(sql)
    return _CUR_YEAR_RE.sub("2020", sql)


# ----------------------------------------------------------------------------- comparisons


def bird_match(pred: Sequence[Row], gold: Sequence[Row]) -> bool:
    """BIRD: set equality of the result rows."""
    return set(pred) == set(gold)


_TYPE_TEXT: dict[type, str] = {}


def _official_key(value: Any) -> str:
    """``str(value) + str(type(value))``, the official sort key (type names cached)."""
    cls = value.__class__
    text = _TYPE_TEXT.get(cls)
    if text is None:
        text = _TYPE_TEXT[cls] = str(cls)
    return str(value) + text


def _unordered_rows(rows: Sequence[Row], deadline: float | None) -> list[Row]:
    out = []
    for i, row in enumerate(rows):
        if deadline is not None and i % 1024 == 1023 and time.monotonic() > deadline:
            raise CompareTimeout(f"the unordered-row check passed its deadline at row {i + 1}")
        out.append(tuple(sorted(row, key=_official_key)))
    return out


def _has_real(rows: Sequence[Row]) -> bool:
    return any(value.__class__ is float for row in rows for value in row)


def _quick_check(pred: Sequence[Row], gold: Sequence[Row], ordered: bool, deadline: float | None) -> bool:
    """The official check on rows with their values sorted by ``str(v) + str(type(v))``.

    It can only reject a pair that the permutation test accepts where two values are equal
    but have different keys: a REAL equal to an INTEGER (``2.0 == 2``) or ``-0.0 == 0.0``.
    Without REAL values it is implied by the permutation test and skipped -- it costs seconds
    on a 100k-row result.
    """
    if not (_has_real(pred) or _has_real(gold)):
        return True
    pred_rows = _unordered_rows(pred, deadline)
    gold_rows = _unordered_rows(gold, deadline)
    if ordered:
        return pred_rows == gold_rows
    return set(pred_rows) == set(gold_rows)


def _same_bag(a: Iterable[Any], b: Iterable[Any]) -> bool:
    # dict equality runs in C; Counter.__eq__ loops in Python (10x slower on 100k rows). Counts
    # built from iterables are never zero, so the two agree.
    return dict.__eq__(collections.Counter(a), collections.Counter(b))


class _Search:
    """Backtracking over column assignments gold column -> predicted column (bag semantics)."""

    def __init__(self, pred: Sequence[Row], gold: Sequence[Row], deadline: float | None) -> None:
        self.pred = pred
        self.gold = gold
        self.deadline = deadline
        self.nodes = 0
        n = len(gold[0])
        self.pred_cols = [tuple(map(itemgetter(j), pred)) for j in range(n)]
        gold_cols = [tuple(map(itemgetter(i), gold)) for i in range(n)]
        pred_bags = [collections.Counter(c) for c in self.pred_cols]
        gold_bags = [collections.Counter(c) for c in gold_cols]
        # candidates[i]: predicted columns holding the same bag of values as gold column i
        # (necessary for any valid assignment, and cheap to check once).
        self.candidates = [[j for j in range(n) if dict.__eq__(pred_bags[j], gold_bags[i])] for i in range(n)]
        # Fewest options first: fails fast and keeps the tree narrow.
        self.order = sorted(range(n), key=lambda i: len(self.candidates[i]))

    def _check_deadline(self) -> None:
        # every node: a node costs a pass over the rows, the clock read is nothing beside it
        self.nodes += 1
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise CompareTimeout(f"column permutation search passed its deadline after {self.nodes} nodes")

    def _consistent(self, gold_idx: list[int], pred_idx: list[int]) -> bool:
        # itemgetter of several indices yields tuples: the rows projected on the assigned columns
        return _same_bag(map(itemgetter(*gold_idx), self.gold), map(itemgetter(*pred_idx), self.pred))

    def run(self) -> bool:
        if any(not options for options in self.candidates):
            return False
        return self._extend(0, [], [], set())

    def _extend(self, depth: int, gold_idx: list[int], pred_idx: list[int], used: set[int]) -> bool:
        if depth == len(self.order):
            return True
        i = self.order[depth]
        tried: set[tuple[Any, ...]] = set()
        for j in self.candidates[i]:
            if j in used or self.pred_cols[j] in tried:
                continue  # an identical unused column was already tried at this position
            tried.add(self.pred_cols[j])
            self._check_deadline()
            gold_idx.append(i)
            pred_idx.append(j)
            if depth == 0 or self._consistent(gold_idx, pred_idx):
                used.add(j)
                if self._extend(depth + 1, gold_idx, pred_idx, used):
                    return True
                used.discard(j)
            gold_idx.pop()
            pred_idx.pop()
        return False


def spider_match(pred: Sequence[Row], gold: Sequence[Row], *, ordered: bool, deadline: float | None = None) -> bool:
    """Spider test-suite equivalence of two results (see the module docstring)."""
    if not pred and not gold:
        return True
    if len(pred) != len(gold):
        return False
    n = len(gold[0])
    if len(pred[0]) != n:
        return False
    if not _quick_check(pred, gold, ordered, deadline):
        return False
    if ordered:
        # Row i of the permuted prediction must equal gold row i, so each gold column must
        # equal (as a list) the predicted column assigned to it: a bijection between equal
        # column vectors exists iff both sides have the same multiset of column vectors.
        return _same_bag(
            (tuple(map(itemgetter(j), pred)) for j in range(n)), (tuple(map(itemgetter(i), gold)) for i in range(n))
        )
    if _same_bag(pred, gold):
        return True  # the identity permutation
    if n == 1:
        return False
    return _Search(pred, gold, deadline).run()


def results_match(
    pred: Sequence[Row], gold: Sequence[Row], semantics: str, *, ordered: bool, deadline: float | None = None
) -> bool:
    """Do the predicted rows match the gold rows under ``semantics`` (see module docstring)?

    ``ordered`` (Spider only): the gold query orders its result, so row order counts.
    """
    if semantics == "bird":
        return bird_match(pred, gold)
    if semantics in ("spider", "spider_keep_distinct"):
        return spider_match(pred, gold, ordered=ordered, deadline=deadline)
    raise ValueError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
