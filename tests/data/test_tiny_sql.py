from __future__ import annotations

import hashlib
import re
import sqlite3

from verl_replay.data.schema import execute_readonly
from verl_replay.data.tiny_sql import DB_IDS, build_tiny_sql, database_path

# Strategy families the alternatives must cover (regexes over upper-cased SQL).
STRATEGIES = {
    "join": r"\bJOIN\b",
    "in_subquery": r"\bIN \(SELECT\b",
    "exists": r"(?<!NOT )\bEXISTS \(",
    "not_exists": r"\bNOT EXISTS \(",
    "left_join_anti": r"LEFT JOIN .* IS NULL",
    "cte": r"^WITH\b",
    "having": r"\bHAVING\b",
    "order_limit": r"ORDER BY .* LIMIT 1",
    "scalar_subquery": r"= \(SELECT (MAX|ID)",
    "intersect": r"\bINTERSECT\b",
    "except": r"\bEXCEPT\b",
    "window": r"\bOVER \(",
}


def test_databases_have_keys_and_consistent_rows(tmp_path):
    build_tiny_sql(tmp_path, seed=0)
    for db_id in DB_IDS:
        conn = sqlite3.connect(database_path(tmp_path, db_id))
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        assert len(tables) == 3
        foreign_keys = sum(len(conn.execute(f"PRAGMA foreign_key_list({t})").fetchall()) for t in tables)
        assert foreign_keys == 2
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        assert all(conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] >= 8 for t in tables)
        conn.close()


def test_questions_are_verified_distinct_and_cover_strategies(tmp_path):
    splits = build_tiny_sql(tmp_path, seed=0)
    assert (len(splits["train"]), len(splits["val"])) == (48, 12)
    examples = splits["train"] + splits["val"]
    assert len({e.question for e in examples}) == len(examples)
    assert {e.db_id for e in splits["val"]} == set(DB_IDS)
    covered = set()
    for ex in examples:
        assert ex.db_path == database_path(tmp_path, ex.db_id).absolute()
        results = [set(execute_readonly(ex.db_path, sql)) for sql in ex.gold_sqls]
        assert results[0] and all(r == results[0] for r in results)
        assert not all(v in (None, 0) for row in results[0] for v in row)
        for sql in ex.gold_sqls:
            covered |= {name for name, pattern in STRATEGIES.items() if re.search(pattern, sql.upper())}
    assert covered == set(STRATEGIES)


def test_final_db_root_and_determinism(tmp_path):
    first = build_tiny_sql(tmp_path / "a", seed=5, final_db_root=tmp_path / "final")
    second = build_tiny_sql(tmp_path / "b", seed=5)
    assert first["train"][0].db_path == database_path(tmp_path / "final", first["train"][0].db_id).absolute()
    assert [e.question for e in first["train"]] == [e.question for e in second["train"]]
    for db_id in DB_IDS:
        digest = [hashlib.sha256(database_path(tmp_path / d, db_id).read_bytes()).hexdigest() for d in ("a", "b")]
        assert digest[0] == digest[1]
    other = build_tiny_sql(tmp_path / "c", seed=6)
    assert [e.question for e in other["train"]] != [e.question for e in first["train"]]
