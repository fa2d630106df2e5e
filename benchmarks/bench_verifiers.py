"""Verifier throughput on this machine: in process vs VerifierPool, and the pool under hangs.

    python benchmarks/bench_verifiers.py [--quick] [--workers 2]

Builds a small SQLite database in a temporary directory, then reports, in one table:

1. SQL verifications/second in process (simple SELECTs, gold results cached);
2. the same through ``VerifierPool(workers)``, one task per verification and in batches;
3. the pool's throughput when 10% of the tasks hang (half a pure-Python infinite loop that the
   pool must kill at its hard deadline, half an SQL infinite recursive CTE that SQLite's own
   deadline stops) next to 0% hanging, and their ratio;
4. math: fast path (in process) and sandbox (math-verify in worker processes).
"""

from __future__ import annotations

import argparse
import functools
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from verl_replay.verifiers.math import shutdown_math_sandbox, verify_math
from verl_replay.verifiers.pool import VerifierPool
from verl_replay.verifiers.sql import SQLVerification, sql_failure, verify_sql

GOLD = "SELECT name FROM emp WHERE salary > 100 ORDER BY name"
SIMPLE = [
    "SELECT name FROM emp WHERE salary > 100 ORDER BY name",
    "SELECT name FROM emp WHERE salary >= 101",
    "SELECT e.name FROM emp AS e JOIN dept AS d ON e.dept_id = d.id WHERE e.salary > 100",
    "SELECT name FROM emp WHERE salary < 100",
    "SELECT count(*) FROM t WHERE a % 7 = 0",
]
SQL_HANG = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"


def build_db(path: Path) -> Path:
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE t (a INTEGER PRIMARY KEY, b TEXT);
        CREATE TABLE dept (id INTEGER PRIMARY KEY, name TEXT);
        CREATE TABLE emp (id INTEGER PRIMARY KEY, name TEXT, dept_id INTEGER, salary REAL);
        """
    )
    conn.executemany("INSERT INTO t VALUES (?, ?)", [(i, f"row{i}") for i in range(2000)])
    conn.executemany("INSERT INTO dept VALUES (?, ?)", [(1, "eng"), (2, "ops")])
    conn.executemany(
        "INSERT INTO emp VALUES (?, ?, ?, ?)",
        [(i, f"e{i}", 1 + i % 2, 50.0 + 10 * (i % 12)) for i in range(40)],
    )
    conn.commit()
    conn.close()
    return path


# ----------------------------------------------------------------- tasks (top level: picklable)


def python_hang(_db: str, _sql: str, _gold: str) -> SQLVerification:
    """A verification stuck in pure Python: only the pool's hard deadline stops it."""
    n = 0
    while True:
        n += 1


def verify_batch(db: str, queries: list[str], gold: str, timeout_s: float) -> list[str]:
    return [verify_sql(db, q, gold, timeout_s=timeout_s).reason for q in queries]


# ----------------------------------------------------------------- measurements


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def bench_in_process(db: str, n: int, timeout_s: float) -> float:
    verify_sql(db, SIMPLE[0], GOLD)  # fill the gold cache
    start = time.perf_counter()
    for i in range(n):
        verify_sql(db, SIMPLE[i % len(SIMPLE)], GOLD, timeout_s=timeout_s)
    return rate(n, time.perf_counter() - start)


def bench_pool(pool: VerifierPool, db: str, n: int, timeout_s: float) -> float:
    fn = functools.partial(verify_sql, timeout_s=timeout_s)
    pool.map(fn, [(db, SIMPLE[0], GOLD)] * pool.num_workers * 2)  # warm every worker's gold cache
    start = time.perf_counter()
    results = pool.map(fn, [(db, SIMPLE[i % len(SIMPLE)], GOLD) for i in range(n)])
    elapsed = time.perf_counter() - start
    assert all(isinstance(r, SQLVerification) for r in results)
    return rate(n, elapsed)


def bench_pool_batched(pool: VerifierPool, db: str, n: int, timeout_s: float, batch: int) -> float:
    jobs = [(db, [SIMPLE[(i + j) % len(SIMPLE)] for j in range(batch)], GOLD, timeout_s) for i in range(0, n, batch)]
    start = time.perf_counter()
    pool.map(verify_batch, jobs)
    return rate(len(jobs) * batch, time.perf_counter() - start)


def bench_hangs(pool: VerifierPool, db: str, n: int, hang_fraction: float, sql_timeout_s: float) -> tuple[float, dict[str, int]]:
    """Tasks/s over n tasks of which ``hang_fraction`` hang (alternating Python / SQL hangs)."""
    verify = functools.partial(verify_sql, timeout_s=sql_timeout_s)
    every = round(1 / hang_fraction) if hang_fraction > 0 else 0
    futures = []
    start = time.perf_counter()
    hang_count = 0
    for i in range(n):
        if every and i % every == every - 1:
            fn = python_hang if hang_count % 2 == 0 else verify
            sql = SQL_HANG
            hang_count += 1
        else:
            fn, sql = verify, SIMPLE[i % len(SIMPLE)]
        futures.append(pool.submit(fn, db, sql, GOLD))
    reasons: dict[str, int] = {}
    for f in futures:
        r = f.result()
        reasons[r.reason] = reasons.get(r.reason, 0) + 1
    return rate(n, time.perf_counter() - start), reasons


def bench_math(n: int) -> tuple[float, float, float]:
    """(fast path /s, sandbox /s, sandbox cold start s)."""
    start = time.perf_counter()
    for i in range(n):
        verify_math(rf"The answer is \boxed{{{i}}}", str(i if i % 3 else i + 1))
    fast = rate(n, time.perf_counter() - start)
    start = time.perf_counter()
    verify_math(r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}")
    cold = time.perf_counter() - start
    kinds = [
        lambda k: (rf"\boxed{{\sqrt{{{k * k}}}}}", str(k)),  # evaluates to an integer
        lambda k: (rf"\boxed{{\frac{{1}}{{{k}}}}}", f"{1 / k:.6f}"),  # fraction vs rounded decimal
        lambda k: (rf"\boxed{{{k}\sqrt{{2}}}}", rf"\sqrt{{{2 * k * k}}}"),  # radical simplification
        lambda k: (rf"\boxed{{\{{{k}, {k + 1}\}}}}", rf"\{{{k + 1}, {k}\}}"),  # sets
    ]
    pairs = [kinds[k % len(kinds)](k) for k in range(2, 2 + n // 10)]
    start = time.perf_counter()
    results = [verify_math(predicted, gold) for predicted, gold in pairs]
    sandbox = rate(len(pairs), time.perf_counter() - start)
    wrong = [(p, r.reason) for (p, _), r in zip(pairs, results) if not r.correct]
    assert not wrong, f"benchmark pairs must all verify: {wrong[:3]}"
    return fast, sandbox, cold


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tasks and shorter deadlines (~10 s)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    n = 1000 if args.quick else 5000
    n_hang = 200 if args.quick else 1000
    sql_timeout, pool_deadline = (0.2, 0.4) if args.quick else (0.5, 1.0)

    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        db = str(build_db(Path(tmp) / "bench.sqlite"))
        rows.append(("sql in process (1 thread)", f"{bench_in_process(db, n, sql_timeout):9.0f} verif/s"))

        t0 = time.perf_counter()
        with VerifierPool(args.workers, task_timeout_s=pool_deadline, on_failure=sql_failure) as pool:
            pool.wait_ready(60)
            rows.append((f"pool({args.workers}) start until workers ready", f"{time.perf_counter() - t0:9.2f} s"))
            rows.append((f"sql via pool({args.workers}), 1 task each", f"{bench_pool(pool, db, n, sql_timeout):9.0f} verif/s"))
            rows.append((f"sql via pool({args.workers}), batches of 50",
                         f"{bench_pool_batched(pool, db, n, sql_timeout, 50):9.0f} verif/s"))
            base, base_reasons = bench_hangs(pool, db, n_hang, 0.0, sql_timeout)
            replaced = pool.replacements
            hung, hung_reasons = bench_hangs(pool, db, n_hang, 0.10, sql_timeout)
            kills = pool.replacements - replaced
        rows.append((f"pool, 0% hanging ({n_hang} tasks)", f"{base:9.1f} tasks/s  {base_reasons}"))
        rows.append((f"pool, 10% hanging ({n_hang} tasks)", f"{hung:9.1f} tasks/s  {hung_reasons}"))
        rows.append(("  ratio 10% / 0%", f"{hung / base:9.3f}   (workers killed+replaced: {kills})"))
        n_hangs = n_hang // 10
        ideal = n_hang / (n_hang / base + (n_hangs / 2 * pool_deadline + n_hangs / 2 * sql_timeout) / args.workers)
        rows.append(("  ideal 10% rate (hang time / workers)", f"{ideal:9.1f} tasks/s"))

    fast, sandbox, cold = bench_math(n)
    shutdown_math_sandbox()
    rows.append(("math fast path (in process)", f"{fast:9.0f} verif/s"))
    rows.append(("math sandbox first call (cold)", f"{cold:9.2f} s"))
    rows.append(("math sandbox (math-verify, mixed forms)", f"{sandbox:9.1f} verif/s"))

    print(f"# bench_verifiers  cpus={os.cpu_count()}  python={sys.version.split()[0]}  quick={args.quick}")
    print(f"# sql timeout {sql_timeout}s, pool hard deadline {pool_deadline}s")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
