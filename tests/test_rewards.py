from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from load_tolerant import assert_cpu_time_scales, within_deadline

from verl_replay.rewards import compute_score, is_math_source, is_sql_source
from verl_replay.verifiers.math import shutdown_math_sandbox

GOLD = "SELECT name FROM emp WHERE salary > 100"


@pytest.fixture(scope="module", autouse=True)
def _stop_math_sandbox():  # type: ignore[no-untyped-def]
    yield
    shutdown_math_sandbox()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "dbs" / "hr.sqlite"
    path.parent.mkdir()
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE emp (id INTEGER PRIMARY KEY, name TEXT, salary REAL);
        INSERT INTO emp VALUES (1, 'ann', 120), (2, 'bob', 90), (3, 'cid', 150), (4, 'cid', 150);
        CREATE TABLE big (a INTEGER);
        """
    )
    conn.executemany("INSERT INTO big VALUES (?)", [(i,) for i in range(1000)])
    conn.commit()
    conn.close()
    return path


def answer(sql: str) -> str:
    return f"<think>The user wants names.</think>\n```sql\n{sql};\n```"


class TestSql:
    def test_correct(self, db: Path) -> None:
        out = compute_score("bird", answer("SELECT name FROM emp WHERE salary >= 120"), GOLD, {"db_path": str(db)})
        assert out == {"score": 1.0, "acc": 1.0, "reason": "ok"}

    def test_wrong_and_format_bonus(self, db: Path) -> None:
        info = {"db_path": str(db)}
        wrong = answer("SELECT name FROM emp")
        assert compute_score("bird", wrong, GOLD, info) == {"score": 0.0, "acc": 0.0, "reason": "mismatch"}
        shaped = compute_score("bird", wrong, GOLD, info, format_bonus=0.1)
        assert shaped == {"score": 0.1, "acc": 0.0, "reason": "mismatch"}
        # no bonus for output that is not a runnable query
        assert compute_score("bird", "no sql here", GOLD, info, format_bonus=0.1) == {
            "score": 0.0,
            "acc": 0.0,
            "reason": "no_sql",
        }
        assert compute_score("bird", answer("DELETE FROM emp"), GOLD, info, format_bonus=0.1)["score"] == 0.0

    def test_db_root_and_relative_path(self, db: Path) -> None:
        info = {"db_path": "dbs/hr.sqlite", "db_root": str(db.parent.parent)}
        assert compute_score("sql_bird_train", answer(GOLD), GOLD, info)["acc"] == 1.0

    def test_spider_source_uses_spider_semantics_by_default(self, db: Path) -> None:
        info = {"db_path": str(db)}
        pred = answer("SELECT DISTINCT name FROM emp WHERE salary > 100")  # drops the duplicate 'cid'
        assert compute_score("bird", pred, GOLD, info)["acc"] == 1.0  # set semantics
        # the official Spider default removes DISTINCT from both queries
        assert compute_score("spider", pred, GOLD, info)["acc"] == 1.0
        keep = {**info, "semantics": "spider_keep_distinct"}
        assert compute_score("spider", pred, GOLD, keep)["reason"] == "mismatch"  # bag semantics
        swapped = answer("SELECT salary, name FROM emp WHERE salary > 100")
        two_cols = "SELECT name, salary FROM emp WHERE salary > 100"
        assert compute_score("spider", swapped, two_cols, info)["acc"] == 1.0  # column permutation
        assert compute_score("bird", swapped, two_cols, info)["reason"] == "mismatch"
        assert compute_score("bird", pred, GOLD, {**info, "semantics": "spider_keep_distinct"})["acc"] == 0.0

    def test_any_of_several_golds(self, db: Path) -> None:
        golds = ["SELECT id FROM emp WHERE salary > 100", GOLD]  # AmbiQT: two interpretations
        info = {"db_path": str(db)}
        assert compute_score("ambiqt", answer(GOLD), golds, info)["acc"] == 1.0
        assert compute_score("ambiqt", answer("SELECT 1"), golds, info)["reason"] == "mismatch"
        # the prepared-data layout: one gold in ground_truth, all of them in extra_info
        row_info = {**info, "gold_sqls": golds}
        assert compute_score("ambiqt", answer("SELECT id FROM emp WHERE salary > 100"), GOLD, row_info)["acc"] == 1.0
        assert compute_score("ambiqt", answer("SELECT id FROM emp WHERE salary > 100"), GOLD, info)["acc"] == 0.0

    def test_timeout_is_fast_and_database_untouched(self, db: Path) -> None:
        digest = hashlib.sha256(db.read_bytes()).hexdigest()
        start = time.monotonic()
        out = compute_score(
            "tiny_sql",
            answer("SELECT count(*) FROM big a, big b, big c, big d"),
            GOLD,
            {"db_path": str(db)},
            sql_timeout_s=0.5,
        )
        assert out == {"score": 0.0, "acc": 0.0, "reason": "timeout"}  # the deadline fired
        assert within_deadline(time.monotonic() - start, 0.5)  # the 4-way cross join runs for hours
        assert hashlib.sha256(db.read_bytes()).hexdigest() == digest

    def test_missing_db_path_is_a_configuration_error(self) -> None:
        with pytest.raises(ValueError, match="db_path"):
            compute_score("bird", answer(GOLD), GOLD, {})

    def test_missing_database_file(self, tmp_path: Path) -> None:
        out = compute_score("bird", answer(GOLD), GOLD, {"db_path": str(tmp_path / "nope.sqlite")})
        assert out["reason"] == "db_missing" and out["acc"] == 0.0


# Adversarial predictions for the reward path: (name, SQL, expected reason). Each must come
# back as a failed verification within the deadline + 0.5 s, in bounded memory, with the
# database unchanged. The two huge-row cases do ~0.5 s of real work before their cap trips;
# on an oversubscribed machine their deadline can come first ("timeout" is accepted there;
# tests/verifiers/test_sandbox.py checks those caps with a long deadline).
HARD_CASES = [
    # printf whose format is built at run time: 2000 paddings of 99,999 characters each
    ("printf-runtime-format", "SELECT length(printf(replace(hex(zeroblob(2000)), '00', '%.99999c'), 'x'))", "byte_cap"),
    ("printf-width-too-big", "SELECT printf('%.*c', 20000000, 'x')", "byte_cap"),
    # widths from the rows: each call fits the value limit, but they take ~0.1 s each
    ("printf-width-from-rows", "SELECT length(printf('%' || (a * 1000000) || 'd', 1)) FROM big", "timeout"),
    # quadratic string functions: one SQLite step of tens of seconds (only the kill stops it)
    (
        "instr-quadratic",
        "SELECT instr(x || 'b', substr(x, 1, 200000) || 'b') "
        "FROM (SELECT replace(hex(zeroblob(2000000)), '0', 'a') AS x)",
        "timeout",
    ),
    (
        "replace-quadratic",
        "SELECT length(replace(x, substr(x, 1, 100000) || 'b', 'c')) "
        "FROM (SELECT replace(hex(zeroblob(2000000)), '0', 'a') AS x)",
        "timeout",
    ),
    # huge rows: 150 rows of 16 MB (2.4 GB), and one row of 100 x 16 MB
    (
        "rows-150x16MB",
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 150) "
        "SELECT x, zeroblob(16000000) FROM c",
        "byte_cap",
    ),
    ("row-100x16MB", "SELECT " + ", ".join(["zeroblob(16000000)"] * 100), "out_of_memory"),
    # recursive CTEs: endless, and doubling a string every step
    ("cte-endless", "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c", "timeout"),
    (
        "cte-doubling",
        "WITH RECURSIVE c(s) AS (SELECT 'x' UNION ALL SELECT s || s FROM c) SELECT max(length(s)) FROM c",
        "byte_cap",
    ),
    # writes, in the forms that start like a query too
    ("delete", "DELETE FROM emp", "write_attempt"),
    ("cte-delete", "WITH x AS (SELECT 1) DELETE FROM emp", "write_attempt"),
    ("cte-insert", "WITH x AS (SELECT 1) INSERT INTO big SELECT a + 5000 FROM big", "write_attempt"),
    ("drop", "DROP TABLE big", "write_attempt"),
    ("pragma-wal", "PRAGMA journal_mode=WAL", "pragma_refused"),
    ("vacuum-into", "VACUUM INTO '{dir}/copy.sqlite'", "write_attempt"),
    ("attach", "ATTACH DATABASE '{dir}/other.sqlite' AS o", "attach_refused"),
]

_HARD_CASE_RUNNER = r"""
import hashlib, json, os, sys, threading, time
from verl_replay.rewards import compute_score
from verl_replay.verifiers.sandbox import get_sql_sandbox, shutdown_sql_sandbox

db, timeout, cases = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3])
info = {"db_path": db}
gold = "SELECT name FROM emp WHERE salary > 100"
assert get_sql_sandbox().wait_ready(60)
assert compute_score("bird", gold, gold, info)["acc"] == 1.0  # warm: the gold result is cached
out = []
for name, sql, expected in cases:
    sql = sql.replace("{dir}", os.path.dirname(db))
    start = time.monotonic()
    score = compute_score("bird", "```sql\n" + sql + "\n```", gold, info, sql_timeout_s=timeout)
    out.append({"name": name, "expected": expected, "elapsed": time.monotonic() - start, **score})
stats = get_sql_sandbox().stats()  # peak_rss_kb: the largest VmHWM of any sandbox worker
shutdown_sql_sandbox()
me = str(os.getpid())
children = [
    p for p in os.listdir("/proc")
    if p.isdigit() and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == me
]
# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec (this process would inherit the
# peak of the pytest process that started it)
hwm = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])
print(json.dumps({
    "cases": out,
    "stats": stats,
    "self_peak_kb": hwm,
    "children_left": children,
    "threads": threading.active_count(),
}))
"""


def test_hard_limits_through_compute_score(db: Path) -> None:
    """Issue 12, must show: every adversarial prediction is a failed verification that stops at
    its deadline (how far past it on a quiet machine: ``bench_verifiers.py --sections deadlines``)
    and under 1 GiB (the scoring process and every sandbox worker), the
    database is byte-identical, and no process or thread is left behind. Runs in a fresh
    interpreter so that its peak memory is this test's."""
    timeout = 1.0
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    listing = sorted(os.listdir(db.parent))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_HARD_CASE_RUNNER), str(db), str(timeout), json.dumps(HARD_CASES)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    # which limit trips first depends on the CPU: a slow one reaches the deadline, a fast one
    # the byte cap (printf's output is counted as it is produced); both are a refusal in time
    # (the doubling CTE too: a handful of steps, but each copies up to the cap on a starved core)
    either_limit = {"rows-150x16MB", "row-100x16MB", "printf-width-from-rows", "cte-doubling"}
    for case in report["cases"]:
        accepted = {case["expected"], "timeout", "byte_cap"} if case["name"] in either_limit else {case["expected"]}
        assert (case["acc"], case["score"]) == (0.0, 0.0) and case["reason"] in accepted, case
        assert within_deadline(case["elapsed"], timeout + 0.5), case
    assert report["stats"]["kills"] >= 2  # at least the two quadratic string functions
    gib_kb = 1024 * 1024
    assert 0 < report["self_peak_kb"] < gib_kb and 0 < report["stats"]["peak_rss_kb"] < gib_kb, report
    assert report["children_left"] == [] and report["threads"] == 1
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest
    assert sorted(os.listdir(db.parent)) == listing  # no copy, attached file, journal or WAL


class TestMath:
    @pytest.mark.parametrize(
        ("solution", "gold", "acc"),
        [
            (r"... so the total is \boxed{42}.", "42", 1.0),
            (r"\boxed{41}", "42", 0.0),
            (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
            (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
            (r"\boxed{\pi}", "3.14", 0.0),
        ],
    )
    def test_scores(self, solution: str, gold: str, acc: float) -> None:
        out = compute_score("lighteval/MATH", solution, gold)
        assert out["acc"] == acc and out["score"] == acc
        assert out["reason"] == ("ok" if acc else "mismatch")

    def test_format_bonus_and_no_answer(self) -> None:
        assert compute_score("openai/gsm8k", r"\boxed{7}", "8", format_bonus=0.2) == {
            "score": 0.2,
            "acc": 0.0,
            "reason": "mismatch",
        }
        assert compute_score("aime24", "I give up", "8", format_bonus=0.2) == {
            "score": 0.0,
            "acc": 0.0,
            "reason": "no_answer",
        }

    def test_pathological_answer_times_out(self) -> None:
        compute_score("math_dapo", r"\boxed{\sqrt{4}}", "2")  # warm the sandbox
        start = time.monotonic()
        out = compute_score("math_dapo", r"\boxed{10^{10^{10}}}", "1", math_timeout_s=1.0)
        assert out == {"score": 0.0, "acc": 0.0, "reason": "timeout"}  # 10^(10^10) never finishes
        assert within_deadline(time.monotonic() - start, 1.0 + 1.0)


def test_math_reward_is_bounded_on_degenerate_responses() -> None:
    """A response stuck in a loop (thousands of unclosed boxes or delimiters) is scored in
    linear time in the calling thread (its CPU time at two sizes); before, 28 KB of '\\boxed{'
    took 15 s there."""
    for piece, tail in (("\\boxed{", ""), ("\\( x ", ""), ("$$ 1 ", "$")):

        def score(repeats: int, piece: str = piece, tail: str = tail):
            text = piece * repeats + tail
            return lambda: compute_score("math_dapo", text, "2", math_timeout_s=1.0)

        assert score(20000)()["acc"] == 0.0
        assert_cpu_time_scales(score, 5000, 20000)
    huge = "9" * 5000  # more digits than int() converts: math-verify decides, not an internal error
    assert compute_score("math_dapo", "\\boxed{" + huge + "}", huge)["acc"] == 1.0
    assert compute_score("math_dapo", "\\boxed{" + huge + "}", huge[:-1] + "8", math_timeout_s=2.0)["reason"] in (
        "mismatch",
        "timeout",
    )


def test_threads_mixing_sql_and_math(db: Path) -> None:
    info = {"db_path": str(db)}
    calls = [
        ("bird", answer(GOLD), GOLD, info, 1.0),
        ("bird", answer("SELECT name FROM emp"), GOLD, info, 0.0),
        ("MATH-500", r"\boxed{\frac{\sqrt{3}}{3}}", r"\frac{1}{\sqrt{3}}", None, 1.0),
        ("gsm8k", "The answer is 12", "12", None, 1.0),
    ] * 4
    with ThreadPoolExecutor(max_workers=8) as ex:
        outs = list(ex.map(lambda c: compute_score(c[0], c[1], c[2], c[3]), calls))
    assert [o["acc"] for o in outs] == [c[4] for c in calls]


def test_unknown_source_raises() -> None:
    with pytest.raises(ValueError, match="unknown data_source"):
        compute_score("imdb_sentiment", "positive", "positive")
    with pytest.raises(ValueError, match="unknown data_source"):
        compute_score("train", "positive", "positive", {"split": "train"})


def test_unnamed_sources_dispatch_on_extra_info(db: Path) -> None:
    # verl_replay.data writes math training rows with data_source="train"
    math_row = {"split": "train", "index": 0, "question_id": "train-0", "benchmark": "train", "question": "?"}
    assert compute_score("train", r"\boxed{12}", "12", math_row)["acc"] == 1.0
    assert compute_score("train", r"\boxed{13}", "12", math_row)["reason"] == "mismatch"
    assert compute_score("my_db_set", answer(GOLD), GOLD, {"db_path": str(db)})["acc"] == 1.0


def test_source_classification() -> None:
    assert all(is_sql_source(s) for s in ["bird", "spider", "ambiqt", "tiny_sql", "sql_custom", "SQL-x"])
    assert not is_sql_source("mysqlish")
    assert all(
        is_math_source(s)
        for s in ["lighteval/MATH", "openai/gsm8k", "aime25", "amc23", "minerva_math", "olympiadbench", "math_dapo"]
    )
    assert not is_math_source("bird")


def test_gold_sqls_as_numpy_array_from_parquet(tmp_path):
    """verl hands extra_info from parquet rows; list columns can arrive as numpy arrays."""
    import sqlite3

    import numpy as np

    from verl_replay.rewards import compute_score

    db = tmp_path / "t.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
        conn.executemany("INSERT INTO t VALUES (?)", [(1,), (2,)])
    extra = {"db_path": str(db), "gold_sqls": np.array(["SELECT x FROM t WHERE x = 2", "SELECT 2"], dtype=object)}
    score = compute_score("tiny_sql", "```sql\nSELECT 2\n```", "SELECT x FROM t WHERE x = 2", extra)
    assert score["acc"] == 1.0
    empty = {"db_path": str(db), "gold_sqls": np.array([], dtype=object)}
    assert compute_score("tiny_sql", "```sql\nSELECT 1\n```", "SELECT x FROM t WHERE x = 1", empty)["acc"] == 1.0


@pytest.mark.parametrize(
    "solution, ground_truth, acc",
    [
        ("<tool_call>...</tool_call> Doc 1 ... so <answer> The Beijing </answer>", {"target": ["beijing"]}, 1.0),
        ("<answer>Paris</answer> then <answer>Rome</answer>", ["Paris"], 0.0),  # the last answer counts
        ("the code is \\boxed{47}", "47", 1.0),
        ("the code is \\boxed{46}", "47", 0.0),
        ("no answer at all", "47", 0.0),
    ],
)
def test_search_sources_are_scored_by_exact_match_of_the_last_answer(solution, ground_truth, acc):
    for source in ("tiny_search", "nq", "hotpotqa", "searchR1_nq"):
        result = compute_score(source, solution, ground_truth)
        assert result["acc"] == acc and result["score"] == acc, (source, result)
    assert compute_score("nq", "no answer at all", "47")["reason"] == "no_answer"
