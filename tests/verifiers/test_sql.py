from __future__ import annotations

import os
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from load_tolerant import PeakSampler, within_deadline
from verifier_fixtures import build_db, fingerprint

from verl_replay.verifiers import sql as sqlmod
from verl_replay.verifiers import sqlite_exec
from verl_replay.verifiers.sandbox import get_sql_sandbox
from verl_replay.verifiers.sql import (
    REASONS,
    clear_gold_cache,
    execute_readonly,
    gold_cache_info,
    has_top_level_order_by,
    verify_sql,
)

GOLD = "SELECT name FROM emp WHERE salary > 100"
TIMEOUT = 1.5
# The contract (issue 12): a verification returns within its deadline + 0.5 s whatever the
# query does. SQLite's own deadline usually fires within milliseconds; the sandbox kills a
# worker stuck in one long step at deadline + KILL_GRACE_S (0.25 s).
BOUND = TIMEOUT + 0.5
# The cases that must trip a cap or a refusal get a deadline far past BOUND + the starved-scheduler
# allowance: on a loaded machine the short one could otherwise come first, and finishing inside
# the bound still shows they did not wait for it.
CAP_TIMEOUT = 60.0

# (predicted SQL with {dir} = the database's folder, expected reason)
ADVERSARIAL = [
    ("DELETE FROM t", "write_attempt"),
    ("UPDATE t SET b = 'x'", "write_attempt"),
    ("INSERT INTO t VALUES (5000, 'x')", "write_attempt"),
    ("REPLACE INTO t VALUES (1, 'x')", "write_attempt"),
    ("DROP TABLE t", "write_attempt"),
    ("CREATE TABLE z (a)", "write_attempt"),
    ("CREATE TEMP TABLE tt AS SELECT * FROM t", "write_attempt"),
    ("  /* hi */ -- x\n delete from t", "write_attempt"),
    # These start like a query, so only the in-SQLite layers (authorizer) stop them:
    ("WITH x AS (SELECT 1) DELETE FROM t", "write_attempt"),
    ("WITH x AS (SELECT 1) INSERT INTO t SELECT a + 5000, b FROM t", "write_attempt"),
    ("WITH x AS (SELECT 1) UPDATE t SET b = 'x'", "write_attempt"),
    ("ATTACH DATABASE '{dir}/other.db' AS o", "attach_refused"),
    ("PRAGMA user_version=5", "pragma_refused"),
    ("PRAGMA journal_mode=DELETE", "pragma_refused"),
    ("PRAGMA journal_mode=WAL", "pragma_refused"),
    ("PRAGMA wal_checkpoint", "pragma_refused"),
    ("SELECT load_extension('x')", "extension_refused"),
    ("SELECT name FROM emp WHERE load_extension('/tmp/evil.so') IS NULL", "extension_refused"),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c", "timeout"),
    ("SELECT count(*) FROM t a, t b, t c, t d", "timeout"),
    # few but expensive VM instructions (each hex() of an 8 MB blob takes milliseconds)
    (
        (
            "WITH RECURSIVE c(x, s) AS (SELECT 1, zeroblob(8000000) UNION ALL SELECT x + 1, s FROM c) "
            "SELECT max(length(hex(s))) FROM c"
        ),
        "timeout",
    ),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000) SELECT x FROM c", "row_cap"),
    ("SELECT a.a, b.a FROM t a, t b", "row_cap"),
    ("SELEC name FROM emp", "syntax_error"),
    ("SELECT name FROM emp WHERE", "syntax_error"),
    ("SELECT nope FROM emp", "exec_error"),
    (b"SELECT '\xff\xfe' FROM emp", "not_utf8"),
    ("SELECT '\udcff' FROM emp", "not_utf8"),
    ("SELECT name FROM emp\x00; DROP TABLE t", "nul_byte"),
    ("SELECT 1; DROP TABLE t", "multiple_statements"),
    ("SELECT name FROM emp; SELECT 2", "multiple_statements"),
    ("VACUUM INTO '{dir}/copy.db'", "write_attempt"),
    ("VACUUM", "write_attempt"),
    ("REINDEX s_x", "write_attempt"),
    ("ANALYZE", "write_attempt"),
    ("BEGIN IMMEDIATE", "not_a_query"),
    ("SELECT zeroblob(1000000000)", "byte_cap"),
    ("SELECT printf('%.*c', 1000000000, 'x')", "byte_cap"),
    ("SELECT format('%*d', 2000000000, 1)", "byte_cap"),
    ("   ", "empty_sql"),
    ("-- only a comment", "empty_sql"),
    (None, "no_sql"),
]


@pytest.mark.parametrize(
    ("predicted", "expected"), ADVERSARIAL, ids=[f"{i}-{r}" for i, (_, r) in enumerate(ADVERSARIAL)]
)
def test_adversarial_sql_fails_safely(db: Path, predicted: object, expected: str) -> None:
    before = fingerprint(db)
    if isinstance(predicted, str):
        predicted = predicted.format(dir=db.parent)
    start = time.monotonic()
    timeout = TIMEOUT if expected == "timeout" else CAP_TIMEOUT
    result = verify_sql(db, predicted, GOLD, timeout_s=timeout)  # type: ignore[arg-type]
    elapsed = time.monotonic() - start
    assert (result.correct, result.reason) == (False, expected), result
    assert result.reason in REASONS
    # the queries that hit the deadline would run for minutes: finishing at all shows it fired
    assert within_deadline(elapsed, BOUND), f"{elapsed:.3f}s (verifier measured {result.elapsed_s:.3f}s)"
    # The file is byte-identical and no -journal/-wal/attached/vacuum files appeared.
    assert fingerprint(db) == before


def test_row_cap_fails_fast_on_a_million_rows(db: Path) -> None:
    q = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000) SELECT x FROM c"
    assert verify_sql(db, GOLD, GOLD).correct  # the sandbox's start-up is not what is measured
    result = verify_sql(db, q, GOLD, timeout_s=CAP_TIMEOUT)
    # stops after max_rows + 1 rows, long before the deadline (the reason says which limit
    # tripped; the bound allows for a starved scheduler and is still half the deadline)
    assert result.reason == "row_cap"
    assert within_deadline(result.elapsed_s, 1.0) and result.elapsed_s < CAP_TIMEOUT / 2


def test_correct_query_passes_and_ok_is_the_only_correct_reason(db: Path) -> None:
    result = verify_sql(db, "SELECT e.name FROM emp AS e WHERE e.salary >= 101", GOLD)
    assert (result.correct, result.reason, result.predicted_rows, result.gold_rows) == (True, "ok", 2, 2)
    wrong = verify_sql(db, "SELECT name FROM emp", GOLD)
    assert (wrong.correct, wrong.reason) == (False, "mismatch")


def test_views_recursive_ctes_and_window_functions_are_allowed(db: Path) -> None:
    assert verify_sql(db, "SELECT name FROM big_earners", GOLD).correct
    cte = "WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c WHERE n < 3) SELECT n FROM c"
    assert verify_sql(db, cte, "SELECT 1 UNION SELECT 2 UNION SELECT 3").correct
    window = "SELECT name FROM (SELECT name, rank() OVER (ORDER BY salary DESC) AS r FROM emp) WHERE r <= 2"
    assert verify_sql(db, window, "SELECT name FROM emp WHERE salary > 100").correct
    assert verify_sql(db, "SELECT printf('%.2f', salary) FROM emp WHERE id = 1", "SELECT '120.00'").correct


class TestInSqliteLayers:
    """Each in-SQLite defence blocks writes on its own (the keyword pre-check is bypassed)."""

    WRITES = (
        "DELETE FROM t",
        "DROP TABLE t",
        "INSERT INTO t VALUES (9999, 'x')",
        "CREATE TABLE z (a)",
        "PRAGMA user_version=5",
        "VACUUM INTO '{dir}/copy.db'",
        "ATTACH DATABASE '{dir}/other.db' AS o",
    )

    def _assert_unchanged(self, db: Path, before: tuple[str, list[str]]) -> None:
        assert fingerprint(db) == before
        check = sqlite3.connect(db)
        assert check.execute("SELECT count(*) FROM t").fetchone() == (2000,)
        assert check.execute("PRAGMA user_version").fetchone() == (0,)
        check.close()

    @pytest.mark.parametrize("statement", WRITES)
    def test_hardened_connection_refuses(self, db: Path, statement: str) -> None:
        before = fingerprint(db)
        guard = sqlite_exec._Guard(time.monotonic() + 5)
        conn = sqlite_exec._open_readonly(str(db), guard, 1 << 20)
        with pytest.raises(sqlite3.DatabaseError):
            conn.execute(statement.format(dir=db.parent))
        conn.close()
        assert guard.reason in ("write_attempt", "attach_refused", "pragma_refused")
        self._assert_unchanged(db, before)

    @pytest.mark.parametrize("statement", WRITES[:5])
    def test_authorizer_alone_on_a_writable_connection(self, db: Path, statement: str) -> None:
        before = fingerprint(db)
        conn = sqlite3.connect(db, isolation_level=None)
        conn.set_authorizer(sqlite_exec._Guard(time.monotonic() + 5).authorize)
        with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
            conn.execute(statement)
        conn.close()
        self._assert_unchanged(db, before)

    @pytest.mark.parametrize("statement", WRITES[:4])
    def test_read_only_uri_alone(self, db: Path, statement: str) -> None:
        before = fingerprint(db)
        conn = sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True, isolation_level=None)
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            conn.execute(statement)
        conn.close()
        self._assert_unchanged(db, before)

    def test_attach_limit_alone(self, db: Path) -> None:
        conn = sqlite3.connect(":memory:")
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        with pytest.raises(sqlite3.OperationalError, match="too many attached"):
            conn.execute(f"ATTACH DATABASE '{db.parent}/other.db' AS o")
        conn.close()
        assert not (db.parent / "other.db").exists()


class TestSemantics:
    def test_column_order_matters_for_bird_not_for_spider(self, db: Path) -> None:
        assert verify_sql(db, "SELECT y, x FROM s", "SELECT x, y FROM s", semantics="bird").reason == "mismatch"
        for semantics in ("spider", "spider_keep_distinct"):
            assert verify_sql(db, "SELECT y, x FROM s", "SELECT x, y FROM s", semantics=semantics).correct
        # a permutation only helps when the columns really are the same
        assert verify_sql(db, "SELECT y, x + 1 FROM s", "SELECT x, y FROM s", semantics="spider").reason == "mismatch"

    def test_row_order_bird_ignores_it(self, db: Path) -> None:
        gold = "SELECT name FROM emp ORDER BY salary"
        assert verify_sql(db, "SELECT name FROM emp ORDER BY salary DESC", gold, semantics="bird").correct

    def test_row_order_spider_respects_it_iff_gold_orders(self, db: Path) -> None:
        ordered_gold = "SELECT name FROM emp ORDER BY salary"
        assert verify_sql(db, "SELECT name FROM emp ORDER BY salary", ordered_gold, semantics="spider").correct
        r = verify_sql(db, "SELECT name FROM emp ORDER BY salary DESC", ordered_gold, semantics="spider")
        assert r.reason == "mismatch" and "ordered" in r.detail
        unordered_gold = "SELECT name FROM emp"
        assert verify_sql(db, "SELECT name FROM emp ORDER BY name DESC", unordered_gold, semantics="spider").correct
        # ORDER BY only inside a subquery does not make the gold ordered
        sub_gold = "SELECT name FROM (SELECT name FROM emp ORDER BY salary)"
        assert verify_sql(db, "SELECT name FROM emp ORDER BY name DESC", sub_gold, semantics="spider").correct

    def test_duplicates_bird_set_vs_spider_bag(self, db: Path) -> None:
        gold, pred = "SELECT x FROM s", "SELECT DISTINCT x FROM s"
        assert verify_sql(db, pred, gold, semantics="bird").correct
        # Spider's default removes DISTINCT before running the queries, so they are the same query
        assert verify_sql(db, pred, gold, semantics="spider").correct
        assert verify_sql(db, pred, gold, semantics="spider_keep_distinct").reason == "mismatch"
        assert verify_sql(db, "SELECT x FROM s WHERE x > 1", gold, semantics="spider").reason == "mismatch"
        # same multiset in a different order: spider (unordered gold) accepts
        assert verify_sql(db, "SELECT x FROM s ORDER BY x DESC", gold, semantics="spider").correct

    def test_value_normalisation_is_python_equality(self, db: Path) -> None:
        assert verify_sql(db, "SELECT 1.0", "SELECT 1").correct  # INTEGER 1 == REAL 1.0
        assert verify_sql(db, "SELECT '1'", "SELECT 1").reason == "mismatch"  # TEXT != INTEGER
        assert verify_sql(db, "SELECT X'61'", "SELECT 'a'").reason == "mismatch"  # BLOB != TEXT
        assert verify_sql(db, "SELECT NULL", "SELECT NULL").correct
        assert verify_sql(db, "SELECT 0.1 + 0.2", "SELECT 0.3").reason == "mismatch"  # no rounding
        assert verify_sql(db, "SELECT name FROM emp WHERE 0", "SELECT x FROM s WHERE 0").correct  # both empty

    def test_non_utf8_text_is_decoded_losslessly(self, db: Path) -> None:
        gold = "SELECT v FROM raw WHERE id = 1"  # b'caf\xe9' (latin-1)
        assert verify_sql(db, "SELECT v FROM raw WHERE id = 1", gold).correct
        assert verify_sql(db, "SELECT 'café'", gold).reason == "mismatch"  # valid UTF-8, other bytes
        rows = execute_readonly(db, "SELECT v FROM raw ORDER BY id").rows
        assert rows == [("caf\udce9",), ("naïve",)]

    def test_spider_union_with_order_by(self, db: Path) -> None:
        gold = "SELECT x FROM s WHERE x = 1 UNION SELECT x FROM s WHERE x = 3 ORDER BY x DESC"
        pred = "SELECT DISTINCT x FROM s WHERE x <> 2 ORDER BY x DESC"
        assert verify_sql(db, pred, gold, semantics="spider_keep_distinct").correct
        wrong_order = "SELECT DISTINCT x FROM s WHERE x <> 2 ORDER BY x"
        assert verify_sql(db, wrong_order, gold, semantics="spider_keep_distinct").reason == "mismatch"
        # without DISTINCT the prediction returns 1, 1, 3, 3: the official default rejects it
        assert verify_sql(db, pred, gold, semantics="spider").reason == "mismatch"

    def test_invalid_semantics_is_a_caller_error(self, db: Path) -> None:
        with pytest.raises(ValueError, match="semantics"):
            verify_sql(db, "SELECT 1", "SELECT 1", semantics="exact")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT a FROM t ORDER BY a", True),
        ("SELECT a FROM t ORDER BY a LIMIT 3", True),
        ("select a from t order   by a desc", True),
        ("SELECT a FROM t UNION SELECT b FROM u ORDER BY 1", True),
        ("WITH c AS (SELECT a FROM t) SELECT * FROM c ORDER BY a", True),
        ("(SELECT a FROM t ORDER BY a)", True),
        ("SELECT a FROM t", False),
        ("SELECT a FROM (SELECT a FROM t ORDER BY a)", False),
        ("WITH c AS (SELECT a FROM t ORDER BY a LIMIT 2) SELECT * FROM c", False),
        ("SELECT ROW_NUMBER() OVER (ORDER BY a) FROM t", False),
        ("SELECT group_concat(a ORDER BY a) FROM t", False),
        ("SELECT 'ORDER BY x' FROM t", False),
        ("SELECT a FROM t -- ORDER BY a", False),
    ],
)
def test_has_top_level_order_by(sql: str, expected: bool) -> None:
    assert has_top_level_order_by(sql) is expected


def test_order_by_token_fallback() -> None:
    assert sqlmod._order_by_from_tokens("SELECT a FROM t WHERE x IN (SELECT y FROM u ORDER BY y) ORDER BY a")
    assert not sqlmod._order_by_from_tokens("SELECT a FROM t WHERE x IN (SELECT y FROM u ORDER BY y)")


class TestGold:
    def test_cache_hits_and_invalidation_on_file_change(self, tmp_path: Path) -> None:
        clear_gold_cache()
        path = build_db(tmp_path / "g.sqlite")
        gold = "SELECT count(*) FROM emp"
        assert verify_sql(path, "SELECT 4", gold).correct
        assert verify_sql(path, "SELECT 4", gold).correct
        info = gold_cache_info()
        assert (info["entries"], info["hits"], info["misses"]) == (1, 1, 1)
        # Rebuild the database in place with one more row: new mtime/size -> new key.
        conn = sqlite3.connect(path)
        conn.execute("INSERT INTO emp VALUES (5, 'eve', 1, 10.0)")
        conn.execute("CREATE TABLE pad AS SELECT * FROM t")  # guarantees a size change
        conn.commit()
        conn.close()
        assert verify_sql(path, "SELECT 4", gold).reason == "mismatch"
        assert verify_sql(path, "SELECT 5", gold).correct
        info = gold_cache_info()
        assert (info["entries"], info["hits"], info["misses"]) == (2, 2, 2)

    def test_cache_is_lru_bounded(self, db: Path) -> None:
        cache = sqlmod._GoldCache(max_entries=2)
        for i in range(3):
            cache.put(("k", i), [(i,)])
        assert cache.get(("k", 0)) is None
        assert cache.get(("k", 2)) == [(2,)]
        tiny = sqlmod._GoldCache(max_bytes=100)
        tiny.put(("big",), [("x" * 200,)])
        assert tiny.info()["entries"] == 0

    @pytest.mark.parametrize(
        "gold",
        [
            "SELECT nope FROM emp",
            "SELEC 1",
            "DELETE FROM emp",
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c",
        ],
    )
    def test_gold_failure_is_gold_error_and_not_cached(self, db: Path, gold: str) -> None:
        clear_gold_cache()
        result = verify_sql(db, "SELECT 1", gold, timeout_s=0.3)
        assert (result.correct, result.reason) == (False, "gold_error")
        assert gold_cache_info()["entries"] == 0

    def test_gold_is_checked_before_the_prediction(self, db: Path) -> None:
        # A broken gold is reported as such even when the prediction also fails.
        assert verify_sql(db, "SELECT nope", "SELECT nope2 FROM emp").reason == "gold_error"


class TestDatabaseProblems:
    def test_missing_database(self, tmp_path: Path) -> None:
        result = verify_sql(tmp_path / "absent.sqlite", "SELECT 1", "SELECT 1")
        assert result.reason == "db_missing"
        assert not (tmp_path / "absent.sqlite").exists()  # mode=ro never creates a file

    def test_not_a_database(self, tmp_path: Path) -> None:
        path = tmp_path / "junk.sqlite"
        path.write_bytes(b"this is not sqlite" * 100)
        assert verify_sql(path, "SELECT 1 FROM emp", "SELECT 1 FROM emp").reason == "db_error"

    def test_wal_database_contents_unchanged(self, tmp_path: Path) -> None:
        path = build_db(tmp_path / "w.sqlite", journal_mode="wal")
        digest = fingerprint(path)[0]
        assert verify_sql(path, "SELECT name FROM big_earners", GOLD).correct
        assert verify_sql(path, "DELETE FROM t", GOLD).reason == "write_attempt"
        assert fingerprint(path)[0] == digest

    def test_caps(self, db: Path) -> None:
        assert verify_sql(db, "SELECT x FROM s", "SELECT x FROM s", max_rows=5).correct
        assert verify_sql(db, "SELECT a FROM t WHERE a < 6", "SELECT 1", max_rows=5).reason == "row_cap"
        assert verify_sql(db, "SELECT b FROM t", "SELECT 1", max_bytes=2000).reason == "byte_cap"
        # the gold is held to the same caps
        assert verify_sql(db, "SELECT 1", "SELECT a FROM t", max_rows=5).reason == "gold_error"


def test_concurrent_threads_get_independent_deadlines(db: Path) -> None:
    before = fingerprint(db)
    threads_before = threading.active_count()
    jobs = [
        ("SELECT name FROM emp WHERE salary > 100", "ok"),
        ("SELECT count(*) FROM t a, t b, t c, t d", "timeout"),
        ("DELETE FROM t", "write_attempt"),
        ("SELECT name FROM emp", "mismatch"),
    ] * 4
    with ThreadPoolExecutor(max_workers=8) as ex:
        # warm-up: eight concurrent callers make the sandbox start eight workers
        list(ex.map(lambda _: verify_sql(db, GOLD, GOLD, timeout_s=0.5), range(16)))
        with PeakSampler(get_sql_sandbox().busy_count) as busy:
            # only the slow query gets the short deadline: the others must not race it on a loaded machine
            results = list(
                ex.map(
                    lambda job: verify_sql(db, job[0], GOLD, timeout_s=0.5 if job[1] == "timeout" else CAP_TIMEOUT),
                    jobs,
                )
            )
    assert [r.reason for r in results] == [reason for _, reason in jobs]
    # the callers ran side by side: each held its own sandbox worker at the same time as others
    # (seen from inside the sandbox, which load on the machine cannot fake)
    assert busy.peak >= 4, busy.peak
    assert fingerprint(db) == before
    # no watchdog thread was left behind to enforce any deadline
    assert threading.active_count() == threads_before


def test_execute_readonly_reports_rows(db: Path) -> None:
    result = execute_readonly(db, "SELECT id, name FROM dept ORDER BY id")
    assert (result.rows, result.reason) == ([(1, "eng"), (2, "ops")], "ok")
    assert execute_readonly(db, "SELECT", timeout_s=1).rows is None
    assert os.path.exists(db)


class TestPrintfGuard:
    @pytest.mark.parametrize(
        ("fmt", "args", "expected"),
        [
            ("%5d%.3c", (1, "x"), 5 + 3),  # width; %c repeats its character `precision` times
            ("%-7s|", ("ab",), 7),
            ("%*d", (-7, 1), 7),  # a negative * width left-justifies
            ("%.*c", (10, "x"), 10),
            ("%.100s", ("ab",), 0),  # precision only truncates a string
            ("%.100g", (1.5,), 0),  # ... and %g drops trailing zeros
            ("%.100f", (1.5,), 100),
            ("%%%%", (), 0),
            ("%4294967301d", (1,), 5),  # SQLite reads widths in 32 bits and masks them
            ("%*d", (2**32 + 5, 1), 5),  # (int) of the int64 argument
            ("%*d", ("12abc", 1), 12),  # TEXT: its leading integer
            ("%*d", (None, 1), 0),
            ("%*d%*d", (3,), 3),  # missing arguments count as 0
        ],
    )
    def test_min_output(self, fmt: str, args: tuple, expected: int) -> None:
        guard = sqlite_exec._Guard(time.monotonic() + 5)
        assert sqlite_exec._printf_min_output(fmt, args, guard) == expected

    def test_many_small_paddings_are_refused_at_once(self, db: Path) -> None:
        # 2000 specifiers of 99,999 each: under any per-specifier limit, 200 MB in total
        sql = "SELECT length(printf(replace(hex(zeroblob(2000)), '00', '%.99999c'), 'x'))"
        result = execute_readonly(db, sql, timeout_s=1.0, isolation="inline")
        # refused by the size check before printf runs (the result cap would only see it after
        # 200 MB were made); the check stops counting once past the limit
        assert result.reason == "byte_cap"
        assert result.detail.startswith("printf output of at least"), result.detail

    def test_legitimate_wide_padding_still_works(self, db: Path) -> None:
        assert execute_readonly(db, "SELECT length(printf('%200000d', 1))").rows == [(200000,)]
        sql = "SELECT format('%5.1f|%-3s|%05d', 2.25, 'a', 42)"
        assert execute_readonly(db, sql).rows == sqlite3.connect(":memory:").execute(sql).fetchall()  # SQLite's own


class TestSqliteLimits:
    @pytest.mark.parametrize(
        ("sql", "message"),
        [
            ("SELECT " + " + ".join(["1"] * 700), "Expression tree is too large"),
            (" UNION ALL ".join(["SELECT 1"] * 150), "too many terms in compound SELECT"),
            ("SELECT 'a' LIKE '" + "%" * 20000 + "'", "pattern too complex"),
            ("SELECT " + ", ".join(["1"] * 1200), "too many columns"),
        ],
        ids=["expr-depth", "compound", "like-pattern", "columns"],
    )
    def test_limits_fail_the_query(self, db: Path, sql: str, message: str) -> None:
        for isolation in ("inline", "process"):
            result = execute_readonly(db, sql, isolation=isolation)  # type: ignore[arg-type]
            assert (result.rows, result.reason) == (None, "exec_error")
            assert message in result.detail

    def test_a_table_wider_than_the_column_limit_is_a_db_error(self, tmp_path: Path) -> None:
        path = tmp_path / "wide.sqlite"
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE w (" + ", ".join(f"c{i}" for i in range(sqlite_exec.MAX_COLUMNS + 1)) + ")")
        conn.close()
        result = verify_sql(path, "SELECT c0 FROM w", "SELECT count(*) FROM w")
        assert result.reason == "db_error" and "MAX_COLUMNS" in result.detail

    def test_rows_are_counted_as_they_are_produced(self, db: Path) -> None:
        sql = "SELECT zeroblob(1000000) FROM t"  # 2000 rows of 1 MB
        for isolation in ("inline", "process"):
            result = execute_readonly(db, sql, max_bytes=3_500_000, isolation=isolation)  # type: ignore[arg-type]
            assert result.reason == "byte_cap"
            assert "at row 4" in result.detail  # three rows fit; the fourth trips the cap

    def test_invalid_isolation(self, db: Path) -> None:
        with pytest.raises(ValueError, match="isolation"):
            verify_sql(db, "SELECT 1", "SELECT 1", isolation="thread")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="isolation"):
            execute_readonly(db, "SELECT 1", isolation="thread")  # type: ignore[arg-type]
