"""Execution-based text-to-SQL verification against a SQLite database (SPEC 2.4).

``verify_sql`` runs the gold query and the (untrusted) predicted query against the question's
database and compares their results. It never raises for bad predicted SQL: every failure is
a :class:`SQLVerification` with ``correct=False`` and a short machine-friendly ``reason``.

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

Resource limits: the deadline is enforced *inside* SQLite by a progress handler that
interrupts the running statement (no Python thread is left running a query); rows are
fetched with ``fetchmany`` and the result is capped in rows (``row_cap``) and in estimated
bytes (``byte_cap``). The progress handler only runs *between* VM instructions, so the cost
of a single instruction must be bounded too: ``SQLITE_LIMIT_LENGTH`` caps every string/blob
at :data:`MAX_VALUE_BYTES` (``zeroblob(1e9)`` fails at once), and ``printf``/``format`` --
whose padding SQLite 3.40 builds one character at a time even past that limit
(``printf('%.*c', 1e9, 'x')`` spends ~12 s in one instruction) -- are replaced by a wrapper
that refuses widths/precisions above :data:`MAX_PRINTF_WIDTH` and otherwise delegates to
SQLite's own printf. Anything still able to stall a single instruction is what
:class:`~verl_replay.verifiers.pool.VerifierPool`'s hard per-task deadline is for.

Comparison semantics (rows are tuples, so **column order always matters** in both modes):

- ``"bird"``: set equality, exactly BIRD's official ``set(predicted) == set(gold)``:
  duplicates and row order are ignored.
- ``"spider"``: bag (multiset) equality; order-sensitive iff the gold query has a top-level
  ORDER BY (found with sqlglot's AST, not a regex). Unlike Spider's test-suite evaluator we
  do not search over column permutations: the model's SELECT list order is part of its
  answer.

Value normalisation is what the official scripts do implicitly and nothing more: Python
equality on the values SQLite returns, so ``1 == 1.0`` (INTEGER vs REAL) match, ``'1'`` vs
``1`` (TEXT vs INTEGER) and ``b'a'`` vs ``'a'`` do not, NULL equals NULL, and floats are
compared exactly (no rounding). Text that is not valid UTF-8 is decoded with
``surrogateescape`` (lossless, so two different byte strings never compare equal).
"""

from __future__ import annotations

import collections
import os
import re
import sqlite3
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

__all__ = [
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

Semantics = Literal["bird", "spider"]

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
    "exec_error": "the query failed at prepare/run time (no such table/column, ...)",
    "timeout": "the deadline passed; SQLite interrupted the statement",
    "row_cap": "the result has more than max_rows rows",
    "byte_cap": "the result (or one value) is larger than max_bytes",
    "out_of_memory": "SQLite or Python ran out of memory",
    "db_missing": "the database file does not exist",
    "db_error": "the database could not be opened/read (corrupt, not a database, locked)",
    "gold_error": "the gold query failed; the sample cannot be judged (not the model's fault)",
    "internal_error": "an unexpected error in the verifier itself",
    "worker_crashed": "the worker process running the verification died (pool only)",
    "worker_timeout": "the worker exceeded the pool's hard deadline and was killed (pool only)",
}

MAX_SQL_CHARS = 100_000
#: Largest single string/blob value a query may build or return (SQLITE_LIMIT_LENGTH).
MAX_VALUE_BYTES = 16 * 1024 * 1024
#: Largest width/precision accepted in printf()/format() (see module docstring).
MAX_PRINTF_WIDTH = 100_000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
_FETCH_CHUNK = 1024
# Progress-handler period in SQLite VM instructions. Small on purpose: instructions are not
# equally cheap -- with multi-MB values (hex/replace of an 8 MB blob per row) 1000
# instructions take ~1 s, so a period of 1000 overshot a 1 s deadline by 0.8 s, while 100
# keeps it within ~10 ms. Cost: ~10% on a pure VM-bound scan, nothing on typical queries.
_PROGRESS_OPS = 100

# First keyword -> reason for statements that can never be a verifiable query.
_REFUSED_KEYWORDS: dict[str, str] = {
    **{k: "write_attempt" for k in ("INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "DROP", "ALTER",
                                    "VACUUM", "REINDEX", "ANALYZE", "UPSERT", "MERGE", "TRUNCATE")},
    "ATTACH": "attach_refused",
    "DETACH": "attach_refused",
    **{k: "not_a_query" for k in ("BEGIN", "COMMIT", "END", "ROLLBACK", "SAVEPOINT", "RELEASE", "EXPLAIN")},
}

_ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})
_EXTENSION_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer"})
# Pragmas that only report schema information (with or without an argument).
_READ_PRAGMAS = frozenset({
    "table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
    "foreign_key_list",
})
_ATTACH_ACTIONS = frozenset({sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH})
_TXN_ACTIONS = frozenset({sqlite3.SQLITE_TRANSACTION, sqlite3.SQLITE_SAVEPOINT})
_SYNTAX_MARKERS = ("syntax error", "incomplete input", "unrecognized token")


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


@dataclass(frozen=True)
class QueryResult:
    """Rows of one read-only execution, or why there are none (``rows is None``)."""

    rows: list[tuple[Any, ...]] | None
    reason: str  # "ok" or a key of REASONS
    detail: str = ""
    elapsed_s: float = 0.0


# ----------------------------------------------------------------------------- input checks


def _strip_leading_comments(sql: str) -> str:
    rest = sql.lstrip()
    while True:
        if rest.startswith("--"):
            newline = rest.find("\n")
            rest = "" if newline < 0 else rest[newline + 1 :].lstrip()
        elif rest.startswith("/*"):
            end = rest.find("*/")
            rest = "" if end < 0 else rest[end + 2 :].lstrip()
        else:
            return rest


def _check_sql_text(sql: Any) -> tuple[str | None, str, str]:
    """(sql as str or None, reason, detail): reason "ok" if the text may be executed."""
    if sql is None:
        return None, "no_sql", "no SQL given"
    if isinstance(sql, (bytes, bytearray, memoryview)):
        try:
            sql = bytes(sql).decode("utf-8")
        except UnicodeDecodeError as exc:
            return None, "not_utf8", f"SQL bytes are not UTF-8: {exc}"
    if not isinstance(sql, str):
        return None, "no_sql", f"SQL must be str, got {type(sql).__name__}"
    try:
        sql.encode("utf-8")  # lone surrogates (e.g. from surrogateescape) cannot reach SQLite
    except UnicodeEncodeError as exc:
        return None, "not_utf8", f"SQL is not encodable as UTF-8: {exc.reason}"
    if "\x00" in sql:
        return None, "nul_byte", "SQL contains a NUL character"
    if len(sql) > MAX_SQL_CHARS:
        return None, "too_long", f"SQL has {len(sql)} characters (limit {MAX_SQL_CHARS})"
    body = _strip_leading_comments(sql)
    if not body.strip().strip(";").strip():
        return None, "empty_sql", "SQL is empty"
    first = body.split(None, 1)[0].split("(", 1)[0].rstrip(";").upper()
    refused = _REFUSED_KEYWORDS.get(first)
    if refused is not None:
        return None, refused, f"statement starts with {first}"
    return sql, "ok", ""


# ----------------------------------------------------------------------------- execution


class _Guard:
    """Per-connection state shared with the authorizer and the progress handler."""

    __slots__ = ("deadline", "note", "reason", "timed_out")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.timed_out = False
        self.reason: str | None = None
        self.note = ""

    def progress(self) -> int:
        if time.monotonic() > self.deadline:
            self.timed_out = True
            return 1  # non-zero: SQLite interrupts the running statement
        return 0

    def authorize(self, action: int, arg1: str | None, arg2: str | None, _db: str | None, _src: str | None) -> int:
        if action in _ALLOWED_ACTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION:
            if (arg2 or "").lower() not in _EXTENSION_FUNCTIONS:
                return sqlite3.SQLITE_OK
            reason = "extension_refused"
        elif action == sqlite3.SQLITE_PRAGMA:
            if (arg1 or "").lower() in _READ_PRAGMAS:
                return sqlite3.SQLITE_OK
            reason = "pragma_refused"
        elif action in _ATTACH_ACTIONS:
            reason = "attach_refused"
        elif action in _TXN_ACTIONS:
            reason = "not_a_query"
        else:
            reason = "write_attempt"
        if self.reason is None:
            self.reason = reason
        return sqlite3.SQLITE_DENY


_PRINTF_SPEC_RE = re.compile(r"%([-+ 0#,!]*)(\*|\d+)?(?:\.(\*|\d+)?)?(?:ll|l)?(.)", re.DOTALL)
_printf_local = threading.local()


def _numeric(value: Any) -> float:
    try:
        return abs(float(value))
    except (TypeError, ValueError):
        return 0.0  # SQLite reads non-numeric text as 0


def _printf_is_bounded(fmt: Any, args: tuple[Any, ...]) -> bool:
    """False if any width/precision (literal or ``*`` argument) exceeds MAX_PRINTF_WIDTH."""
    if not isinstance(fmt, str):
        return True  # SQLite renders a non-text format as text; no padding possible
    next_arg = 0
    for match in _PRINTF_SPEC_RE.finditer(fmt):
        _flags, width, precision, conversion = match.groups()
        if conversion == "%":
            continue
        for part in (width, precision):
            if part == "*":
                size = _numeric(args[next_arg]) if next_arg < len(args) else 0.0
                next_arg += 1
            else:
                size = float(part) if part else 0.0
            if not size <= MAX_PRINTF_WIDTH:  # also catches inf
                return False
        next_arg += 1
    return True


def _builtin_printf(args: tuple[Any, ...]) -> Any:
    conn = getattr(_printf_local, "conn", None)
    if conn is None:
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        if hasattr(conn, "setlimit"):
            conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        conn.text_factory = _decode_text
        _printf_local.conn = conn
    placeholders = ",".join("?" * len(args))
    return conn.execute(f"SELECT printf({placeholders})", args).fetchone()[0]


def _decode_text(raw: bytes) -> str:
    # Lossless for non-UTF-8 bytes (latin-1 databases exist in BIRD), unlike errors="replace",
    # which would make different byte strings compare equal.
    return raw.decode("utf-8", "surrogateescape")


def _open_readonly(db_path: str, guard: _Guard, max_bytes: int) -> sqlite3.Connection:
    uri = Path(db_path).resolve().as_uri() + "?mode=ro"
    busy_s = max(0.0, guard.deadline - time.monotonic())
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=busy_s, cached_statements=0)
    try:
        conn.execute("PRAGMA query_only=ON")
        conn.execute("PRAGMA trusted_schema=OFF")
        if hasattr(conn, "enable_load_extension"):
            conn.enable_load_extension(False)
        if hasattr(conn, "setlimit"):
            conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
            conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max(1024, min(max_bytes, MAX_VALUE_BYTES)))
            conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 4 * MAX_SQL_CHARS)
        if hasattr(conn, "setconfig"):  # Python >= 3.12
            conn.setconfig(sqlite3.SQLITE_DBCONFIG_DEFENSIVE, True)
        conn.text_factory = _decode_text

        def guarded_printf(*args: Any) -> Any:
            if args and not _printf_is_bounded(args[0], args[1:]):
                guard.reason = "byte_cap"
                guard.note = f"printf width/precision above {MAX_PRINTF_WIDTH}"
                raise ValueError(f"printf width/precision above {MAX_PRINTF_WIDTH}")
            return _builtin_printf(args)

        for name in ("printf", "format"):
            conn.create_function(name, -1, guarded_printf, deterministic=True)
        conn.set_authorizer(guard.authorize)
        conn.set_progress_handler(guard.progress, _PROGRESS_OPS)
    except BaseException:
        conn.close()
        raise
    return conn


def _value_size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes)) else 8


def _classify(exc: BaseException, guard: _Guard) -> tuple[str, str]:
    message = str(exc)
    if guard.reason is not None:
        return guard.reason, guard.note or message
    if guard.timed_out or "interrupted" in message:
        return "timeout", message
    if "one statement at a time" in message:
        return "multiple_statements", message
    if isinstance(exc, MemoryError) or "out of memory" in message:
        return "out_of_memory", message
    if "too big" in message:
        return "byte_cap", message
    if "readonly" in message or "read-only" in message:
        return "write_attempt", message
    if "not authorized" in message:
        return "write_attempt", message
    if any(marker in message for marker in _SYNTAX_MARKERS):
        return "syntax_error", message
    if isinstance(exc, sqlite3.DatabaseError) and (
        "file is not a database" in message or "malformed" in message or "unable to open" in message
    ):
        return "db_error", message
    return "exec_error", message


def execute_readonly(
    db_path: str | os.PathLike[str],
    sql: str,
    *,
    timeout_s: float = 5.0,
    max_rows: int = 100_000,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> QueryResult:
    """Run one untrusted query read-only under a deadline and caps; never raises for bad SQL."""
    start = time.monotonic()

    def done(rows: list[tuple[Any, ...]] | None, reason: str, detail: str = "") -> QueryResult:
        return QueryResult(rows, reason, detail, time.monotonic() - start)

    text, reason, detail = _check_sql_text(sql)
    if text is None:
        return done(None, reason, detail)
    path = os.fspath(db_path)
    if not os.path.isfile(path):
        return done(None, "db_missing", f"no database file at {path}")
    guard = _Guard(start + timeout_s)
    try:
        conn = _open_readonly(path, guard, max_bytes)
    except sqlite3.Error as exc:
        return done(None, "db_error", f"cannot open {path}: {exc}")
    try:
        cursor = conn.execute(text)
        rows: list[tuple[Any, ...]] = []
        size = 0
        while True:
            # Ask for at most one row past the cap: that row proves the cap is exceeded.
            chunk = cursor.fetchmany(min(_FETCH_CHUNK, max_rows + 1 - len(rows)))
            if not chunk:
                return done(rows, "ok")
            rows.extend(chunk)
            if len(rows) > max_rows:
                return done(None, "row_cap", f"more than {max_rows} rows")
            size += sum(16 + sum(map(_value_size, row)) for row in chunk)
            if size > max_bytes:
                return done(None, "byte_cap", f"result larger than {max_bytes} bytes")
            if time.monotonic() > guard.deadline:  # time spent in Python between steps
                return done(None, "timeout", f"exceeded {timeout_s:g}s while fetching")
    except (sqlite3.Error, sqlite3.Warning, MemoryError) as exc:
        reason, detail = _classify(exc, guard)
        return done(None, reason, detail)
    except Exception as exc:  # noqa: BLE001 - the contract is "never raises for bad SQL"
        return done(None, "internal_error", f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


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
    db_path: str, gold_sql: str, timeout_s: float, max_rows: int, max_bytes: int
) -> QueryResult:
    # The key includes the file's identity and version: a database rebuilt in place (new
    # mtime or size) is a new key, never a stale hit.
    stat = os.stat(db_path)
    key = (os.path.realpath(db_path), stat.st_mtime_ns, stat.st_size, gold_sql, max_rows, max_bytes)
    rows = _GOLD_CACHE.get(key)
    if rows is not None:
        return QueryResult(rows, "ok", "cached")
    result = execute_readonly(db_path, gold_sql, timeout_s=timeout_s, max_rows=max_rows, max_bytes=max_bytes)
    if result.rows is not None:
        # Only successes are cached: a gold timeout may be load-dependent.
        _GOLD_CACHE.put(key, result.rows)
    return result


# ----------------------------------------------------------------------------- verify


def _results_match(pred: list[tuple[Any, ...]], gold: list[tuple[Any, ...]], semantics: str, ordered: bool) -> bool:
    if semantics == "bird":
        return set(pred) == set(gold)
    if ordered:
        return pred == gold
    return collections.Counter(pred) == collections.Counter(gold)


def verify_sql(
    db_path: str | os.PathLike[str],
    predicted_sql: str | bytes | None,
    gold_sql: str,
    *,
    semantics: Semantics = "bird",
    timeout_s: float = 5.0,
    max_rows: int = 100_000,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> SQLVerification:
    """Execute ``predicted_sql`` and ``gold_sql`` on ``db_path`` (read-only) and compare.

    ``timeout_s`` is the deadline of *each* query (the gold result is usually cached, so a
    call normally costs one predicted execution). Returns ``correct=True`` only with
    ``reason="ok"``. Raises ``ValueError`` only for invalid arguments (``semantics``,
    non-positive limits), never for anything the predicted SQL does.
    """
    if semantics not in ("bird", "spider"):
        raise ValueError(f"semantics must be 'bird' or 'spider', got {semantics!r}")
    if not timeout_s > 0 or max_rows < 0 or max_bytes < 1:
        raise ValueError(f"need timeout_s > 0, max_rows >= 0, max_bytes >= 1 (got {timeout_s}, {max_rows}, {max_bytes})")
    start = time.monotonic()

    def result(correct: bool, reason: str, detail: str = "", pred_n: int | None = None, gold_n: int | None = None) -> SQLVerification:
        return SQLVerification(correct, reason, detail, time.monotonic() - start, semantics, pred_n, gold_n)

    try:
        path = os.fspath(db_path)
        # Cheap input checks first: a malformed prediction should cost no database work.
        text, reason, detail = _check_sql_text(predicted_sql)
        if text is None:
            return result(False, reason, detail)
        if not os.path.isfile(path):
            return result(False, "db_missing", f"no database file at {path}")
        gold = _gold_rows(path, gold_sql, timeout_s, max_rows, max_bytes)
        if gold.rows is None:
            if gold.reason == "db_error":
                return result(False, "db_error", gold.detail)
            return result(False, "gold_error", f"gold query failed ({gold.reason}): {gold.detail}")
        pred = execute_readonly(path, text, timeout_s=timeout_s, max_rows=max_rows, max_bytes=max_bytes)
        if pred.rows is None:
            return result(False, pred.reason, pred.detail, gold_n=len(gold.rows))
        ordered = semantics == "spider" and has_top_level_order_by(gold_sql)
        if _results_match(pred.rows, gold.rows, semantics, ordered):
            return result(True, "ok", "", len(pred.rows), len(gold.rows))
        mode = "set" if semantics == "bird" else ("ordered bag" if ordered else "bag")
        return result(
            False, "mismatch", f"{mode} comparison: {len(pred.rows)} vs {len(gold.rows)} gold rows",
            len(pred.rows), len(gold.rows),
        )
    except Exception as exc:  # noqa: BLE001 - never raise for bad predicted SQL
        return result(False, "internal_error", f"{type(exc).__name__}: {exc}")
