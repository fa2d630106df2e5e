"""Hardened read-only SQLite execution: limits, the authorizer guard, and the row fetcher.

The lowest layer of SQL verification (``docs/verifiers.md``): it opens a database read-only,
applies the per-connection limits and the authorizer, and runs one query under a deadline
with row and byte caps. :mod:`verl_replay.verifiers.sql` builds verification on it and
:mod:`verl_replay.verifiers.sandbox` runs it in a killable worker process; this module
imports neither, so the two depend on it one way.
"""

from __future__ import annotations

import collections
import math
import os
import re
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_SQL_CHARS = 100_000
#: Largest single string/blob value a query may build or return (SQLITE_LIMIT_LENGTH).
MAX_VALUE_BYTES = 16 * 1024 * 1024
#: Most columns of a table or a result (SQLITE_LIMIT_COLUMN). A database with a wider table
#: cannot be read at all (``db_error``); BIRD and Spider tables have well under 200.
MAX_COLUMNS = 1000
#: Deepest expression tree (SQLITE_LIMIT_EXPR_DEPTH; SQLite's default is 1000).
MAX_EXPR_DEPTH = 500
#: Most terms of one compound SELECT (SQLITE_LIMIT_COMPOUND_SELECT; default 500).
MAX_COMPOUND_SELECT = 100
#: Longest LIKE/GLOB pattern (SQLITE_LIMIT_LIKE_PATTERN_LENGTH; default 50000).
MAX_LIKE_PATTERN = 10_000
#: Seconds past its deadline after which the sandbox kills a query's worker process.
KILL_GRACE_S = 0.25
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
# Progress-handler period in SQLite VM instructions. Small on purpose: instructions are not
# equally cheap -- with multi-MB values (hex/replace of an 8 MB blob per row) 1000
# instructions take ~1 s, so a period of 1000 overshot a 1 s deadline by 0.8 s, while 100
# keeps it within ~10 ms. Cost: ~10% on a pure VM-bound scan, nothing on typical queries.
_PROGRESS_OPS = 100
# Rows between two deadline checks in Python while rows are fetched.
_DEADLINE_ROWS = 256

# First keyword -> reason for statements that can never be a verifiable query.
_REFUSED_KEYWORDS: dict[str, str] = {
    **{
        k: "write_attempt"
        for k in (
            "INSERT",
            "UPDATE",
            "DELETE",
            "REPLACE",
            "CREATE",
            "DROP",
            "ALTER",
            "VACUUM",
            "REINDEX",
            "ANALYZE",
            "UPSERT",
            "MERGE",
            "TRUNCATE",
        )
    },
    "ATTACH": "attach_refused",
    "DETACH": "attach_refused",
    **{k: "not_a_query" for k in ("BEGIN", "COMMIT", "END", "ROLLBACK", "SAVEPOINT", "RELEASE", "EXPLAIN")},
}

_ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})
_EXTENSION_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer"})
# Pragmas that only report schema information (with or without an argument).
_READ_PRAGMAS = frozenset(
    {
        "table_info",
        "table_xinfo",
        "table_list",
        "index_list",
        "index_info",
        "index_xinfo",
        "foreign_key_list",
    }
)
_ATTACH_ACTIONS = frozenset({sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH})
_TXN_ACTIONS = frozenset({sqlite3.SQLITE_TRANSACTION, sqlite3.SQLITE_SAVEPOINT})
_SYNTAX_MARKERS = ("syntax error", "incomplete input", "unrecognized token")


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
    """Per-connection state shared with the authorizer, the progress handler and printf."""

    __slots__ = ("deadline", "length_limit", "note", "reason", "timed_out")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.length_limit = MAX_VALUE_BYTES
        self.timed_out = False
        self.reason: str | None = None
        self.note = ""

    def reset(self, deadline: float) -> None:
        """Start a new statement on a reused connection."""
        self.deadline = deadline
        self.timed_out = False
        self.reason = None
        self.note = ""

    def expired(self) -> bool:
        if time.monotonic() > self.deadline:
            self.timed_out = True
            return True
        return False

    def progress(self) -> int:
        return 1 if self.expired() else 0  # non-zero: SQLite interrupts the running statement

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


# %[flags][width][.precision][l|ll]conversion, as SQLite's printf reads it.
_PRINTF_SPEC_RE = re.compile(r"%([-+ 0#,!]*)(\*|\d+)?(?:\.(\*|\d+)?)?(?:ll|l)?(.)", re.DOTALL)
# Conversions whose output is at least `precision` characters long (%c repeats its character,
# integer conversions zero-pad, %f/%e print that many decimals); for the others (%s, %q, %g,
# ...) the precision only truncates.
_PRECISION_SIZED = frozenset("cdiuxXofeE")
_INT_PREFIX_RE = re.compile(r"\s*([+-]?)(\d+)")
_INT64_MAX = 2**63 - 1
_INT32_MAX = 2**31 - 1
# Format specifiers between two deadline checks while a printf format is sized.
_PRINTF_CHECK_EVERY = 4096
_printf_local = threading.local()


def _sqlite_int64(value: Any) -> int:
    """``sqlite3_value_int64`` of a printf argument (TEXT: its leading integer, like SQLite)."""
    if isinstance(value, int):
        number = value
    elif isinstance(value, float):
        number = 0 if math.isnan(value) else int(max(-9.3e18, min(9.3e18, value)))
    elif isinstance(value, (str, bytes)):
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        match = _INT_PREFIX_RE.match(text)
        number = 0 if match is None else int(match.group(1) + match.group(2))
    else:
        number = 0
    return max(-_INT64_MAX - 1, min(_INT64_MAX, number))


def _c_int(value: int) -> int:
    """C's ``(int)`` of an int64: the low 32 bits, two's complement."""
    low = value & 0xFFFFFFFF
    return low - 2**32 if low > _INT32_MAX else low


def _printf_min_output(fmt: str, args: tuple[Any, ...], guard: _Guard) -> int:
    """A lower bound of the length of ``printf(fmt, *args)``: the sum over its conversions of
    their width and (where it sizes the output) precision, read the way SQLite reads them."""
    total = 0
    next_arg = 0
    for count, match in enumerate(_PRINTF_SPEC_RE.finditer(fmt)):
        if count % _PRINTF_CHECK_EVERY == _PRINTF_CHECK_EVERY - 1 and guard.expired():
            raise TimeoutError("the deadline passed while sizing a printf format")
        _flags, width_text, precision_text, conversion = match.groups()
        if conversion == "%":
            continue
        width = precision = 0
        if width_text == "*":
            star = _c_int(_sqlite_int64(args[next_arg]) if next_arg < len(args) else 0)
            next_arg += 1
            width = -star if -_INT32_MAX <= star < 0 else max(star, 0)
        elif width_text:
            width = int(width_text) & 0x7FFFFFFF  # SQLite accumulates in 32 bits and masks
        if precision_text == "*":
            star = _c_int(_sqlite_int64(args[next_arg]) if next_arg < len(args) else 0)
            next_arg += 1
            precision = -star if -_INT32_MAX <= star < 0 else max(star, 0)
        elif precision_text:
            precision = int(precision_text) & 0x7FFFFFFF
        next_arg += 1
        total += max(width, precision if conversion in _PRECISION_SIZED else 0)
        if total > guard.length_limit:
            break
    return total


def _builtin_printf(args: tuple[Any, ...]) -> Any:
    """SQLite's own printf, run on a private in-memory connection (no user tables)."""
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


def _value_limit(max_bytes: int) -> int:
    return max(1024, min(max_bytes, MAX_VALUE_BYTES))


def _set_value_limit(conn: sqlite3.Connection, guard: _Guard, max_bytes: int) -> None:
    guard.length_limit = _value_limit(max_bytes)
    if hasattr(conn, "setlimit"):
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, guard.length_limit)


def _harden(conn: sqlite3.Connection, guard: _Guard) -> None:
    """Install every read-only layer and limit on a freshly opened connection."""
    conn.execute("PRAGMA query_only=ON")
    conn.execute("PRAGMA trusted_schema=OFF")
    if hasattr(conn, "enable_load_extension"):
        conn.enable_load_extension(False)
    if hasattr(conn, "setlimit"):  # Python >= 3.11
        for limit, value in (
            (sqlite3.SQLITE_LIMIT_ATTACHED, 0),
            (sqlite3.SQLITE_LIMIT_SQL_LENGTH, 4 * MAX_SQL_CHARS),
            (sqlite3.SQLITE_LIMIT_COLUMN, MAX_COLUMNS),
            (sqlite3.SQLITE_LIMIT_EXPR_DEPTH, MAX_EXPR_DEPTH),
            (sqlite3.SQLITE_LIMIT_COMPOUND_SELECT, MAX_COMPOUND_SELECT),
            (sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, MAX_LIKE_PATTERN),
            (sqlite3.SQLITE_LIMIT_WORKER_THREADS, 0),  # sorts stay on this thread, interruptible
        ):
            conn.setlimit(limit, value)
    if hasattr(conn, "setconfig"):  # Python >= 3.12
        conn.setconfig(sqlite3.SQLITE_DBCONFIG_DEFENSIVE, True)
    conn.text_factory = _decode_text

    def guarded_printf(*args: Any) -> Any:
        # One call can take ~0.1 s (a 16 MB padding), and the progress handler may see only
        # one tick per ten calls: check the deadline here too.
        if guard.expired():
            raise TimeoutError("the deadline passed")
        if args and isinstance(args[0], str):
            size = _printf_min_output(args[0], args[1:], guard)
            if size > guard.length_limit:
                guard.reason = "byte_cap"
                guard.note = f"printf output of at least {size} characters (limit {guard.length_limit})"
                raise ValueError(guard.note)
        return _builtin_printf(args)

    for name in ("printf", "format"):
        conn.create_function(name, -1, guarded_printf, deterministic=True)
    conn.set_authorizer(guard.authorize)
    conn.set_progress_handler(guard.progress, _PROGRESS_OPS)


def _connect_readonly(db_path: str, busy_s: float) -> sqlite3.Connection:
    uri = Path(db_path).resolve().as_uri() + "?mode=ro"
    return sqlite3.connect(uri, uri=True, isolation_level=None, timeout=max(0.0, busy_s), cached_statements=0)


def _open_readonly(db_path: str, guard: _Guard, max_bytes: int) -> sqlite3.Connection:
    """A hardened read-only connection whose limits follow ``guard`` and ``max_bytes``."""
    conn = _connect_readonly(db_path, guard.deadline - time.monotonic())
    try:
        _harden(conn, guard)
        _set_value_limit(conn, guard, max_bytes)
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
        return "out_of_memory", message or "out of memory"
    if "too big" in message:
        return "byte_cap", message
    if "too many columns on" in message:
        return "db_error", f"{message} (a table is wider than MAX_COLUMNS={MAX_COLUMNS})"
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


def _fetch(
    conn: sqlite3.Connection, guard: _Guard, text: str, timeout_s: float, max_rows: int, max_bytes: int
) -> tuple[list[tuple[Any, ...]] | None, str, str]:
    """Run ``text`` on a hardened connection; (rows or None, reason, detail).

    Rows are taken one at a time and counted as they come, so a result is abandoned at the
    first row past ``max_rows`` or ``max_bytes`` -- never a batch of rows later.
    """
    cursor = None
    try:
        cursor = conn.execute(text)
        rows: list[tuple[Any, ...]] = []
        append = rows.append
        size = count = 0
        for row in cursor:
            count += 1
            # _value_size of every value, inlined: this loop runs once per result row
            size += 16 + 8 * len(row)
            for value in row:
                if value.__class__ is str or value.__class__ is bytes:
                    size += len(value) - 8
            if size > max_bytes:
                return None, "byte_cap", f"result larger than {max_bytes} bytes (at row {count})"
            append(row)
            if count > max_rows:
                return None, "row_cap", f"more than {max_rows} rows"
            if count % _DEADLINE_ROWS == 0 and guard.expired():  # time spent in Python between steps
                return None, "timeout", f"exceeded {timeout_s:g}s while fetching"
        return rows, "ok", ""
    except (sqlite3.Error, sqlite3.Warning, MemoryError) as exc:
        reason, detail = _classify(exc, guard)
        return None, reason, detail
    except Exception as exc:  # noqa: BLE001 - the contract is "never raises for bad SQL"
        return None, "internal_error", f"{type(exc).__name__}: {exc}"
    finally:
        if cursor is not None:
            try:
                cursor.close()  # resets the statement, so a reused connection holds no read lock
            except sqlite3.Error:
                pass


def _execute_inline(db_path: str, text: str, timeout_s: float, max_rows: int, max_bytes: int) -> QueryResult:
    start = time.monotonic()
    guard = _Guard(start + timeout_s)
    try:
        conn = _open_readonly(db_path, guard, max_bytes)
    except sqlite3.Error as exc:
        return QueryResult(None, "db_error", f"cannot open {db_path}: {exc}", time.monotonic() - start)
    try:
        rows, reason, detail = _fetch(conn, guard, text, timeout_s, max_rows, max_bytes)
    finally:
        conn.close()
    return QueryResult(rows, reason, detail, time.monotonic() - start)


class _CachedExecutor:
    """Runs queries on hardened connections kept open per database file (sandbox workers).

    Opening a connection and loading its schema costs more than a typical BIRD query, so a
    worker keeps the last few open. The key is the file's identity and version (device,
    inode, mtime, size): a database rebuilt in place gets a fresh connection. Not
    thread-safe: one worker runs one query at a time.
    """

    def __init__(self, max_connections: int = 8) -> None:
        self.max_connections = max_connections
        self._conns: collections.OrderedDict[tuple[Any, ...], tuple[sqlite3.Connection, _Guard]] = (
            collections.OrderedDict()
        )

    def _connection(self, path: str, st: os.stat_result, timeout_s: float) -> tuple[sqlite3.Connection, _Guard]:
        key = (path, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        entry = self._conns.get(key)
        if entry is not None:
            self._conns.move_to_end(key)
            return entry
        guard = _Guard(time.monotonic() + timeout_s)
        conn = _connect_readonly(path, timeout_s)
        try:
            _harden(conn, guard)
        except BaseException:
            conn.close()
            raise
        self._conns[key] = (conn, guard)
        while len(self._conns) > self.max_connections:
            _, (old, _) = self._conns.popitem(last=False)
            old.close()
        return conn, guard

    def _drop(self, conn: sqlite3.Connection) -> None:
        for key, (held, _) in list(self._conns.items()):
            if held is conn:
                del self._conns[key]
        conn.close()

    def execute(self, db_path: str, sql: str, timeout_s: float, max_rows: int, max_bytes: int) -> QueryResult:
        start = time.monotonic()
        text, reason, detail = _check_sql_text(sql)
        if text is None:
            return QueryResult(None, reason, detail, time.monotonic() - start)
        try:
            st = os.stat(db_path)
        except OSError:
            return QueryResult(None, "db_missing", f"no database file at {db_path}", time.monotonic() - start)
        try:
            conn, guard = self._connection(db_path, st, timeout_s)
        except sqlite3.Error as exc:
            return QueryResult(None, "db_error", f"cannot open {db_path}: {exc}", time.monotonic() - start)
        guard.reset(start + timeout_s)
        _set_value_limit(conn, guard, max_bytes)
        rows, reason, detail = _fetch(conn, guard, text, timeout_s, max_rows, max_bytes)
        if reason in ("db_error", "out_of_memory", "internal_error"):
            self._drop(conn)  # never reuse a connection in an unknown state
        return QueryResult(rows, reason, detail, time.monotonic() - start)

    def close(self) -> None:
        while self._conns:
            _, (conn, _) = self._conns.popitem()
            conn.close()
