"""Execution-based text-to-SQL verification against a SQLite database.

``verify_sql`` runs the gold query and the (untrusted) predicted query against the question's
database and compares their results with the official BIRD or Spider semantics
(:mod:`verl_replay.verifiers.compare`). It never raises for bad predicted SQL: every failure
is a :class:`SQLVerification` with ``correct=False`` and a short machine-friendly ``reason``.
``docs/verifiers.md`` describes the whole design; the essentials:

Read-only strategy (defence in depth; each layer alone blocks writes):

1. The file is opened through a ``file:...?mode=ro`` URI, i.e. ``O_RDONLY`` at the VFS level:
   SQLite cannot write the file or create a ``-journal`` next to it. We do **not** add
   ``immutable=1``: it tells SQLite the file can never change, which disables locking and
   change detection -- if the database is rewritten while we read (data preparation, a
   copy in progress) or is a WAL database with un-checkpointed frames, an immutable reader
   silently returns stale or torn data. ``mode=ro`` keeps normal shared locks, so a reader
   sees consistent snapshots. (Cost: a WAL-mode database may need its ``-shm`` file; the
   BIRD/Spider databases are rollback-journal files.)
2. ``PRAGMA query_only=ON`` makes every writing statement fail inside SQLite.
3. An authorizer (``set_authorizer``) that *allows* only SELECT/READ/recursive CTEs,
   functions other than ``load_extension``/``fts3_tokenizer`` and a few read-only
   introspection pragmas; it denies everything else (writes, DDL, ATTACH/DETACH -- which is
   also how ``VACUUM INTO`` would create a file --, transactions, pragma writes). Denials
   are recorded so the reason says what was attempted.
4. ``SQLITE_LIMIT_ATTACHED=0``, extension loading disabled, ``trusted_schema=OFF``.
5. A cheap first-keyword check refuses obvious non-queries before SQLite sees them.

Hard limits (every verification returns within its deadline + :data:`KILL_GRACE_S` and in
bounded memory, whatever the query does):

- The deadline is enforced *inside* SQLite by a progress handler that interrupts the running
  statement every :data:`_PROGRESS_OPS` VM instructions.
- Per-connection SQLite limits bound what one instruction can build: value length
  (:data:`MAX_VALUE_BYTES`), result/table columns (:data:`MAX_COLUMNS`), expression depth,
  compound SELECT terms, LIKE pattern length, SQL length, no attached databases, no sorter
  threads. ``printf``/``format`` are wrapped: a format whose widths and precisions add up to
  more than the value-length limit is refused before SQLite spends one character on it (its
  output could not be returned anyway).
- Rows are produced one at a time and counted in rows (``max_rows``) and estimated bytes
  (``max_bytes``) *as they are produced*, so a result never grows past one row over its cap.
- What SQLite cannot interrupt -- one long VM instruction (``instr``/``replace`` on
  multi-MB strings are quadratic; a sort happens in one instruction) -- is stopped by the
  process sandbox (:mod:`verl_replay.verifiers.sandbox`): with ``isolation="process"`` (the
  default of :func:`verify_sql`) each query runs in a persistent worker process that is
  killed at its deadline + :data:`KILL_GRACE_S` and replaced; the worker also caps its
  address space and SQLite's heap.

Value normalisation is what the official scripts do implicitly and nothing more: Python
equality on the values SQLite returns, so ``1 == 1.0`` (INTEGER vs REAL) match, ``'1'`` vs
``1`` (TEXT vs INTEGER) and ``b'a'`` vs ``'a'`` do not, NULL equals NULL, and floats are
compared exactly (no rounding). Text that is not valid UTF-8 is decoded with
``surrogateescape`` (lossless, so two different byte strings never compare equal).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from verl_replay.verifiers.compare import SEMANTICS, CompareTimeout, normalize_for_semantics, results_match
from verl_replay.verifiers.sqlite_exec import (
    DEFAULT_MAX_BYTES,
    KILL_GRACE_S,
    QueryResult,
    _check_sql_text,
    _execute_inline,
    _value_size,
)

__all__ = [
    "KILL_GRACE_S",
    "REASONS",
    "QueryResult",
    "SQLVerification",
    "clear_gold_cache",
    "execute_readonly",
    "gold_cache_info",
    "has_top_level_order_by",
    "sql_failure",
    "verify_sql",
]

Semantics = Literal["bird", "spider", "spider_keep_distinct"]
Isolation = Literal["process", "inline"]

#: Every reason code ``verify_sql`` can return, with its meaning.
REASONS: dict[str, str] = {
    "ok": "results match",
    "mismatch": "both queries ran; results differ",
    "no_sql": "no SQL was given (extraction found none)",
    "empty_sql": "the SQL is empty or only whitespace/comments",
    "not_utf8": "the SQL is not valid UTF-8 text",
    "nul_byte": "the SQL contains a NUL character",
    "too_long": "the SQL is longer than MAX_SQL_CHARS",
    "multiple_statements": "more than one statement",
    "not_a_query": "a statement that does not return rows (transaction control, EXPLAIN, ...)",
    "write_attempt": "an attempt to modify a database (DML, DDL, VACUUM, REINDEX, ...)",
    "attach_refused": "ATTACH/DETACH (or VACUUM INTO, which attaches its target)",
    "extension_refused": "load_extension() or another extension hook",
    "pragma_refused": "a PRAGMA other than read-only schema introspection",
    "syntax_error": "SQLite could not parse the query",
    "exec_error": "the query failed at prepare/run time (no such table/column, a SQLite limit, ...)",
    "timeout": "the deadline passed: SQLite interrupted the statement, or the sandbox killed its worker",
    "row_cap": "the result has more than max_rows rows",
    "byte_cap": "the result (or one value) is larger than max_bytes",
    "out_of_memory": "SQLite or Python ran out of memory (the sandbox caps both)",
    "db_missing": "the database file does not exist",
    "db_error": "the database could not be opened/read (corrupt, not a database, locked, too wide)",
    "gold_error": "the gold query failed; the sample cannot be judged (not the model's fault)",
    "internal_error": "an unexpected error in the verifier itself",
    "worker_crashed": "the process running the query died (sandbox or pool)",
    "worker_timeout": "the worker exceeded the pool's hard deadline and was killed (VerifierPool only)",
}


@dataclass(frozen=True)
class SQLVerification:
    """Outcome of one verification. ``reason`` is a key of :data:`REASONS`."""

    correct: bool
    reason: str
    detail: str = ""
    elapsed_s: float = 0.0
    semantics: str = "bird"
    predicted_rows: int | None = None
    gold_rows: int | None = None


def sql_failure(reason: str, detail: str) -> SQLVerification:
    """``on_failure`` factory for :class:`~verl_replay.verifiers.pool.VerifierPool`."""
    return SQLVerification(correct=False, reason=reason, detail=detail)


def execute_readonly(
    db_path: str | os.PathLike[str],
    sql: str,
    *,
    timeout_s: float = 5.0,
    max_rows: int = 100_000,
    max_bytes: int = DEFAULT_MAX_BYTES,
    isolation: Isolation = "inline",
) -> QueryResult:
    """Run one untrusted query read-only under a deadline and caps; never raises for bad SQL.

    ``isolation="inline"`` (default) runs it in this thread: SQLite's own deadline and limits
    only, so one long VM instruction can overrun ``timeout_s``. ``isolation="process"`` runs
    it in the process sandbox, which kills the worker at ``timeout_s + KILL_GRACE_S``.
    """
    if isolation not in ("inline", "process"):
        raise ValueError(f"isolation must be 'process' or 'inline', got {isolation!r}")
    start = time.monotonic()
    text, reason, detail = _check_sql_text(sql)
    if text is None:
        return QueryResult(None, reason, detail, time.monotonic() - start)
    path = os.fspath(db_path)
    if not os.path.isfile(path):
        return QueryResult(None, "db_missing", f"no database file at {path}", time.monotonic() - start)
    if isolation == "process":
        from verl_replay.verifiers.sandbox import get_sql_sandbox

        return get_sql_sandbox().execute(path, text, timeout_s=timeout_s, max_rows=max_rows, max_bytes=max_bytes)
    return _execute_inline(path, text, timeout_s, max_rows, max_bytes)


# ----------------------------------------------------------------------------- ordering


@lru_cache(maxsize=4096)
def has_top_level_order_by(sql: str) -> bool:
    """True iff the statement's *outermost* query has ORDER BY (so its row order is part of it).

    ORDER BY inside subqueries, CTEs, window specs or aggregate calls does not count. Uses
    sqlglot's AST (sqlite dialect); if sqlglot cannot parse the statement, falls back to
    sqlglot's tokenizer and looks for an ORDER BY token at parenthesis depth 0 outside any
    CTE body.
    """
    import sqlglot
    from sqlglot import exp

    try:
        node = sqlglot.parse_one(sql, read="sqlite")
    except Exception:  # noqa: BLE001 - sqlglot raises several error types
        return _order_by_from_tokens(sql)
    while node is not None:
        if node.args.get("order") is not None:
            return True
        if isinstance(node, (exp.Subquery, exp.Paren)):
            node = node.this  # a parenthesised top-level query: look inside
            continue
        return False
    return False


def _order_by_from_tokens(sql: str) -> bool:
    import sqlglot
    from sqlglot.tokens import TokenType

    try:
        tokens = sqlglot.Tokenizer().tokenize(sql)
    except Exception:  # noqa: BLE001
        return False
    depth = 0
    for token in tokens:
        if token.token_type == TokenType.L_PAREN:
            depth += 1
        elif token.token_type == TokenType.R_PAREN:
            depth -= 1
        elif token.token_type == TokenType.ORDER_BY and depth == 0:
            return True
    return False


# ----------------------------------------------------------------------------- gold cache


class _GoldCache:
    """Thread-safe LRU of gold results, bounded in entries and in estimated bytes."""

    def __init__(self, max_entries: int = 1024, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: collections.OrderedDict[tuple[Any, ...], tuple[list[tuple[Any, ...]], int]] = (
            collections.OrderedDict()
        )
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[Any, ...]) -> list[tuple[Any, ...]] | None:
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: tuple[Any, ...], rows: list[tuple[Any, ...]]) -> None:
        size = sum(16 + sum(map(_value_size, row)) for row in rows)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._data[key] = (rows, size)
            self._bytes += size
            while len(self._data) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, evicted) = self._data.popitem(last=False)
                self._bytes -= evicted

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0
            self.hits = self.misses = 0

    def info(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._data), "bytes": self._bytes, "hits": self.hits, "misses": self.misses}


_GOLD_CACHE = _GoldCache()


def clear_gold_cache() -> None:
    """Forget all cached gold results (and reset hit/miss counters)."""
    _GOLD_CACHE.clear()


def gold_cache_info() -> dict[str, int]:
    """``{"entries", "bytes", "hits", "misses"}`` of the gold-result cache in this process."""
    return _GOLD_CACHE.info()


def _gold_rows(
    db_path: str, gold_sql: str, timeout_s: float, max_rows: int, max_bytes: int, isolation: Isolation
) -> QueryResult:
    # The key includes the file's identity and version (device, inode, mtime, size): a
    # database rebuilt in place is a new key, never a stale hit.
    st = os.stat(db_path)
    key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, gold_sql, max_rows, max_bytes)
    rows = _GOLD_CACHE.get(key)
    if rows is not None:
        return QueryResult(rows, "ok", "cached")
    result = execute_readonly(
        db_path, gold_sql, timeout_s=timeout_s, max_rows=max_rows, max_bytes=max_bytes, isolation=isolation
    )
    if result.rows is not None:
        # Only successes are cached: a gold timeout may be load-dependent.
        _GOLD_CACHE.put(key, result.rows)
    return result


# ----------------------------------------------------------------------------- verify


def _comparison_mode(semantics: str, ordered: bool) -> str:
    if semantics == "bird":
        return "set"
    return ("ordered bag" if ordered else "bag") + " with column permutations"


def verify_sql(
    db_path: str | os.PathLike[str],
    predicted_sql: str | bytes | None,
    gold_sql: str,
    *,
    semantics: Semantics = "bird",
    timeout_s: float = 5.0,
    max_rows: int = 100_000,
    max_bytes: int = DEFAULT_MAX_BYTES,
    isolation: Isolation = "process",
) -> SQLVerification:
    """Execute ``predicted_sql`` and ``gold_sql`` on ``db_path`` (read-only) and compare.

    ``semantics`` (:mod:`verl_replay.verifiers.compare`):

    - ``"bird"``: the official BIRD evaluator, ``set(predicted) == set(gold)``; column order
      matters, duplicates and row order do not.
    - ``"spider"``: the official Spider test-suite evaluator's default
      (``exec_eval.eval_exec_match``): DISTINCT removed from both queries (also inside
      ``COUNT(DISTINCT ...)``, as the official token filter does), ``> =``/``< =``/``! =``
      closed up, ``YEAR(CURDATE())`` -> ``2020``; then bag equality of the rows under some
      permutation of the predicted columns, order-sensitive iff the gold query orders its
      result; two empty results always match.
    - ``"spider_keep_distinct"``: the same, DISTINCT kept (the official ``--keep_distinct``).

    Deliberate deviations from the official scripts (each with its reason):

    1. Writes always fail (``write_attempt``, ``attach_refused``, ``pragma_refused``, ...). The
       official BIRD script runs the prediction on a writable connection before the gold query,
       so a ``DELETE`` that empties the table scores as correct whenever the gold result is then
       empty too; the official Spider script can even commit DDL to the database.
    2. Spider's order test is a top-level ORDER BY of the gold query (sqlglot AST), not the
       official substring test ``'order by' in gold.lower()``, which also fires on ORDER BY in
       a subquery, a window, a string literal or a comment.
    3. Text is decoded losslessly (UTF-8, undecodable bytes kept with ``surrogateescape``). The
       official Spider script decodes with ``errors="ignore"`` (two different byte strings can
       compare equal); the official BIRD script fails on non-UTF-8 text.
    4. Hard limits: each query has a deadline (``timeout_s``; the official scripts use 30-60 s
       and cannot stop one long SQLite step), a row cap (``max_rows``), a result-size cap
       (``max_bytes``) and SQLite value/column/depth limits; a query past any of them is a
       failed verification, where the official scripts would wait or run out of memory.
    5. One database: the official Spider test-suite evaluator checks the pair on every
       ``*.sqlite`` file in the database's folder (the distilled test suites); we check it on
       ``db_path``. Run it once per test-suite database and require all to pass to reproduce
       test-suite accuracy.
    6. A failing gold query is ``gold_error`` (the official Spider script stops with an
       assertion; BIRD scores the pair as wrong).

    ``timeout_s`` is the deadline of *each* query: the predicted one, and the gold one when its
    result is not cached yet (gold results are cached per database file, so a call normally
    costs one predicted execution). With ``isolation="process"`` (default) every query runs in
    the process sandbox and a verification returns within ``timeout_s + KILL_GRACE_S`` per
    query it runs, whatever the query does; ``isolation="inline"`` runs the queries in this
    thread with SQLite's limits only (one long VM instruction can overrun the deadline).

    Returns ``correct=True`` only with ``reason="ok"``. Raises ``ValueError`` only for invalid
    arguments (``semantics``, ``isolation``, non-positive limits) and
    :class:`~verl_replay.verifiers.sandbox.SandboxError` when the sandbox cannot start a
    worker process (an environment problem), never for anything the predicted SQL does.
    """
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics must be one of {list(SEMANTICS)}, got {semantics!r}")
    if isolation not in ("process", "inline"):
        raise ValueError(f"isolation must be 'process' or 'inline', got {isolation!r}")
    if not timeout_s > 0 or max_rows < 0 or max_bytes < 1:
        raise ValueError(
            f"need timeout_s > 0, max_rows >= 0, max_bytes >= 1 (got {timeout_s}, {max_rows}, {max_bytes})"
        )
    start = time.monotonic()

    def result(
        correct: bool, reason: str, detail: str = "", pred_n: int | None = None, gold_n: int | None = None
    ) -> SQLVerification:
        return SQLVerification(correct, reason, detail, time.monotonic() - start, semantics, pred_n, gold_n)

    from verl_replay.verifiers.sandbox import SandboxError

    try:
        path = os.fspath(db_path)
        # Cheap input checks first: a malformed prediction should cost no database work.
        text, reason, detail = _check_sql_text(predicted_sql)
        if text is None:
            return result(False, reason, detail)
        if not os.path.isfile(path):
            return result(False, "db_missing", f"no database file at {path}")
        gold_text = normalize_for_semantics(gold_sql, semantics)
        gold = _gold_rows(path, gold_text, timeout_s, max_rows, max_bytes, isolation)
        if gold.rows is None:
            if gold.reason == "db_error":
                return result(False, "db_error", gold.detail)
            return result(False, "gold_error", f"gold query failed ({gold.reason}): {gold.detail}")
        pred_start = time.monotonic()
        pred = execute_readonly(
            path,
            normalize_for_semantics(text, semantics),
            timeout_s=timeout_s,
            max_rows=max_rows,
            max_bytes=max_bytes,
            isolation=isolation,
        )
        if pred.rows is None:
            return result(False, pred.reason, pred.detail, gold_n=len(gold.rows))
        ordered = semantics != "bird" and has_top_level_order_by(gold_text)
        try:
            # The prediction's deadline also bounds the comparison (a column-permutation
            # search over a wide result is the only part that could take long).
            match = results_match(pred.rows, gold.rows, semantics, ordered=ordered, deadline=pred_start + timeout_s)
        except CompareTimeout as exc:
            return result(False, "timeout", str(exc), len(pred.rows), len(gold.rows))
        if match:
            return result(True, "ok", "", len(pred.rows), len(gold.rows))
        return result(
            False,
            "mismatch",
            f"{_comparison_mode(semantics, ordered)} comparison: {len(pred.rows)} vs {len(gold.rows)} gold rows",
            len(pred.rows),
            len(gold.rows),
        )
    except SandboxError:
        raise  # the environment cannot run verifications at all: fail loudly, not as a 0 reward
    except Exception as exc:  # noqa: BLE001 - never raise for bad predicted SQL
        return result(False, "internal_error", f"{type(exc).__name__}: {exc}")
