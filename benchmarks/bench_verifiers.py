"""Verifier throughput and memory on this machine: the reward path, the pool, the sandbox.

    python benchmarks/bench_verifiers.py [--quick] [--workers 2] [--sections reward,memory,pool,math,deadlines]

Builds a small SQLite database in a temporary directory, then reports, in one table:

1. ``reward``: the training reward path, ``verl_replay.rewards.compute_score`` on SQL answers
   (simple SELECTs, gold results cached) from 1 and 4 threads (verl's reward loop calls it
   from executor threads), with the default process sandbox and with ``sql_isolation=
   "inline"``; the same with 1% of the answers stuck in one long SQLite step (quadratic
   ``instr``), which only the sandbox's kill stops; threads and processes left afterwards;
2. ``memory``: the peak memory of a query returning 150 rows of 16 MB, in a fresh interpreter
   (inline: that process; sandbox: its worker);
3. ``pool``: SQL verifications/second in process vs through ``VerifierPool(workers)``, one task
   per verification and in batches, and the pool's throughput when 10% of the tasks hang
   (half a pure-Python infinite loop that the pool must kill at its hard deadline, half an
   SQL infinite recursive CTE that SQLite's own deadline stops);
4. ``math``: fast path (in process) and sandbox (math-verify in worker processes);
5. ``deadlines``: how long each hard limit takes to return, against its target (the deadline
   plus the allowance the docs promise): the reward's SQL deadline, the sandbox's kill of one
   long SQLite step, four such steps side by side, the pool's hard deadline, two hung pool tasks
   side by side, the math sandbox's deadline, the pool's cold start. The test suite checks that
   these limits fire and stop the work; how fast they return is a property of a quiet machine,
   so it is measured here, not asserted there (a loaded CI machine delays any process 20x).

``reward`` and ``memory`` use only ``compute_score`` / ``execute_readonly``, so the script can
measure an older checkout too (``PYTHONPATH=<old checkout> python benchmarks/bench_verifiers.py
--sections reward,memory``); rows that need the sandbox then read ``n/a``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from verl_replay.verifiers.math import HARD_KILL_GRACE_S, shutdown_math_sandbox, verify_math
from verl_replay.verifiers.pool import VerifierPool
from verl_replay.verifiers.sql import KILL_GRACE_S, SQLVerification, sql_failure, verify_sql

GOLD = "SELECT name FROM emp WHERE salary > 100 ORDER BY name"
SIMPLE = [
    "SELECT name FROM emp WHERE salary > 100 ORDER BY name",
    "SELECT name FROM emp WHERE salary >= 101",
    "SELECT e.name FROM emp AS e JOIN dept AS d ON e.dept_id = d.id WHERE e.salary > 100",
    "SELECT name FROM emp WHERE salary < 100",
    "SELECT count(*) FROM t WHERE a % 7 = 0",
]
SQL_HANG = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"
# One SQLite step of ~50 s (quadratic instr on a 4 MB string): no progress handler can stop it.
LONG_STEP = (
    "SELECT instr(x || 'b', substr(x, 1, 200000) || 'b') FROM (SELECT replace(hex(zeroblob(2000000)), '0', 'a') AS x)"
)
ROWS_150_X_16MB = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 150) "
    "SELECT x, randomblob(16000000) FROM c"
)


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


def bench_hangs(
    pool: VerifierPool, db: str, n: int, hang_fraction: float, sql_timeout_s: float
) -> tuple[float, dict[str, int]]:
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


def _have_sandbox() -> bool:
    try:
        import verl_replay.verifiers.sandbox  # noqa: F401
    except ImportError:
        return False
    return True


def bench_reward(
    db: str, n: int, threads: int, isolation: str | None, timeout_s: float, long_every: int = 0
) -> tuple[float, dict[str, int]]:
    """compute_score calls/s from ``threads`` threads (and the reasons seen)."""
    from verl_replay.rewards import compute_score

    info = {"db_path": db}
    extra = {} if isolation is None else {"sql_isolation": isolation}

    def score(i: int) -> str:
        sql = LONG_STEP if long_every and i % long_every == long_every - 1 else SIMPLE[i % len(SIMPLE)]
        return compute_score("bird", f"```sql\n{sql}\n```", GOLD, info, sql_timeout_s=timeout_s, **extra)["reason"]

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(score, range(4 * threads)))  # warm: gold cache, one sandbox worker per thread
        start = time.perf_counter()
        reasons = list(ex.map(score, range(n)))
        elapsed = time.perf_counter() - start
    counts: dict[str, int] = {}
    for r in reasons:
        counts[r] = counts.get(r, 0) + 1
    return rate(n, elapsed), counts


def _child_pids() -> list[int]:
    me = str(os.getpid())
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        kids.append(int(entry))
            except OSError:
                pass
    return kids


# Peaks are VmHWM (per address space), not ru_maxrss, which Linux carries across exec.
_MEMORY_PROBE = r"""
import json, sys
from verl_replay.verifiers.sql import execute_readonly
db, isolation, sql = sys.argv[1], sys.argv[2], sys.argv[3]
kwargs = {} if isolation == "default" else {"isolation": isolation}
result = execute_readonly(db, sql, timeout_s=60.0, **kwargs)
worker_kb = 0
try:
    from verl_replay.verifiers.sandbox import get_sql_sandbox, shutdown_sql_sandbox
    worker_kb = get_sql_sandbox().peak_rss_kb
    shutdown_sql_sandbox()
except ImportError:
    pass
hwm = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])
print(json.dumps({"reason": result.reason, "detail": result.detail, "self_mb": hwm / 1024,
                  "children_mb": worker_kb / 1024}))
"""


def bench_memory(db: str, isolation: str) -> dict[str, object]:
    """Peak memory of the 150 x 16 MB query in a fresh interpreter."""
    # cwd: not the checkout, whose verl_replay/ would shadow PYTHONPATH for `python -c`
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, db, isolation, ROWS_150_X_16MB],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        cwd=os.path.dirname(db),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def reward_rows(db: str, n: int, quick: bool) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    sandbox = _have_sandbox()
    threads_before = threading.active_count()
    for threads in (1, 4):
        value, _ = bench_reward(db, n, threads, None, 5.0)
        rows.append((f"reward: compute_score, {threads} thread(s)", f"{value:9.0f} verif/s"))
    if sandbox:
        value, _ = bench_reward(db, n, 1, "inline", 5.0)
        rows.append(("reward: compute_score, sql_isolation=inline", f"{value:9.0f} verif/s"))
        from verl_replay.verifiers.sandbox import get_sql_sandbox, shutdown_sql_sandbox

        kills = get_sql_sandbox().kills
        n_long = 200 if quick else 1000
        value, reasons = bench_reward(db, n_long, 4, None, 0.2, long_every=100)
        rows.append(
            (
                f"reward: 4 threads, 1% long steps ({n_long}, 0.2 s)",
                f"{value:9.0f} verif/s  {reasons}  kills={get_sql_sandbox().kills - kills}",
            )
        )
        ideal = n_long / (n_long / 100 * (0.2 + 0.25) / 4)
        rows.append(("  bound from the kills alone (1%, 0.45 s / 4 threads)", f"{ideal:9.0f} verif/s"))
        shutdown_sql_sandbox()
        rows.append(
            (
                "reward: after shutdown: extra threads / child processes",
                f"{threading.active_count() - threads_before:9d} / {len(_child_pids())}",
            )
        )
    else:
        rows.append(("reward: 4 threads, 1% long steps", "      n/a (no sandbox: each takes ~50 s)"))
    return rows


def memory_rows(db: str) -> list[tuple[str, str]]:
    rows = []
    inline = bench_memory(db, "inline" if _have_sandbox() else "default")
    rows.append(
        (
            "memory: 150 x 16 MB rows, inline (scoring process peak)",
            f"{inline['self_mb']:9.0f} MB  {inline['reason']}: {inline['detail']}",
        )
    )
    if _have_sandbox():
        proc = bench_memory(db, "process")
        rows.append(
            (
                "memory: 150 x 16 MB rows, sandbox (worker peak)",
                f"{proc['children_mb']:9.0f} MB  {proc['reason']}: {proc['detail']}",
            )
        )
        rows.append(("memory:   the scoring process meanwhile", f"{proc['self_mb']:9.0f} MB"))
    return rows


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
    wrong = [(p, r.reason) for (p, _), r in zip(pairs, results, strict=True) if not r.correct]
    assert not wrong, f"benchmark pairs must all verify: {wrong[:3]}"
    return fast, sandbox, cold


def pool_rows(
    db: str, n: int, n_hang: int, workers: int, sql_timeout: float, pool_deadline: float
) -> list[tuple[str, str]]:
    rows = [("sql in process (1 thread)", f"{bench_in_process(db, n, sql_timeout):9.0f} verif/s")]
    t0 = time.perf_counter()
    with VerifierPool(workers, task_timeout_s=pool_deadline, on_failure=sql_failure) as pool:
        pool.wait_ready(60)
        rows.append((f"pool({workers}) start until workers ready", f"{time.perf_counter() - t0:9.2f} s"))
        rows.append((f"sql via pool({workers}), 1 task each", f"{bench_pool(pool, db, n, sql_timeout):9.0f} verif/s"))
        rows.append(
            (
                f"sql via pool({workers}), batches of 50",
                f"{bench_pool_batched(pool, db, n, sql_timeout, 50):9.0f} verif/s",
            )
        )
        base, base_reasons = bench_hangs(pool, db, n_hang, 0.0, sql_timeout)
        replaced = pool.replacements
        hung, hung_reasons = bench_hangs(pool, db, n_hang, 0.10, sql_timeout)
        kills = pool.replacements - replaced
    rows.append((f"pool, 0% hanging ({n_hang} tasks)", f"{base:9.1f} tasks/s  {base_reasons}"))
    rows.append((f"pool, 10% hanging ({n_hang} tasks)", f"{hung:9.1f} tasks/s  {hung_reasons}"))
    rows.append(("  ratio 10% / 0%", f"{hung / base:9.3f}   (workers killed+replaced: {kills})"))
    n_hangs = n_hang // 10
    ideal = n_hang / (n_hang / base + (n_hangs / 2 * pool_deadline + n_hangs / 2 * sql_timeout) / workers)
    rows.append(("  ideal 10% rate (hang time / workers)", f"{ideal:9.1f} tasks/s"))
    return rows


def math_rows(n: int) -> list[tuple[str, str]]:
    fast, sandbox, cold = bench_math(n)
    shutdown_math_sandbox()
    return [
        ("math fast path (in process)", f"{fast:9.0f} verif/s"),
        ("math sandbox first call (cold)", f"{cold:9.2f} s"),
        ("math sandbox (math-verify, mixed forms)", f"{sandbox:9.1f} verif/s"),
    ]


def python_sleep(_seconds: float) -> None:
    """A pool task that never returns on its own (only the pool's hard deadline ends it)."""
    time.sleep(3600)


def _timed(fn, *args, **kwargs) -> tuple[object, float]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def _deadline_row(name: str, seconds: float, target: float, outcome: str) -> tuple[str, str]:
    verdict = "met" if seconds <= target else "MISSED"
    return (f"deadline: {name}", f"{seconds:9.3f} s  (target <= {target:.2f} s: {verdict})  {outcome}")


def deadline_rows(db: str) -> list[tuple[str, str]]:
    """Each hard limit's return time on this machine against its target."""
    from verl_replay.rewards import compute_score
    from verl_replay.verifiers.sandbox import SQLSandbox

    rows = []
    cross_join = "SELECT count(*) FROM t a, t b, t c, t d"  # hours without a deadline
    compute_score("bird", f"```sql\n{GOLD}\n```", GOLD, {"db_path": db})  # warm the sandbox, cache gold
    out, seconds = _timed(compute_score, "bird", f"```sql\n{cross_join}\n```", GOLD, {"db_path": db}, sql_timeout_s=0.5)
    rows.append(_deadline_row("reward, SQL deadline 0.5 s", seconds, 0.5 + 0.5, out["reason"]))

    with SQLSandbox(max_workers=4, min_workers=4) as sandbox:
        sandbox.wait_ready(60)
        args = dict(timeout_s=0.5, max_rows=100_000, max_bytes=64 * 2**20)
        result, seconds = _timed(sandbox.execute, db, LONG_STEP, **args)
        rows.append(_deadline_row("sandbox kill, one long step", seconds, 0.5 + KILL_GRACE_S + 0.2, result.reason))
        sandbox.wait_ready(60)
        with ThreadPoolExecutor(4) as ex:
            start = time.perf_counter()
            reasons = list(ex.map(lambda _: sandbox.execute(db, LONG_STEP, **args).reason, range(4)))
            seconds = time.perf_counter() - start
        # one after the other they would need 4 x (deadline + grace)
        rows.append(
            _deadline_row("sandbox, 4 long steps side by side", seconds, 2 * (0.5 + KILL_GRACE_S), str(reasons))
        )

    verify = functools.partial(verify_sql, timeout_s=30.0)
    start = time.perf_counter()
    with VerifierPool(num_workers=2, task_timeout_s=0.5, on_failure=sql_failure) as pool:
        pool.map(verify, [(db, GOLD, GOLD)])
        rows.append(_deadline_row("pool cold start (start + one query)", time.perf_counter() - start, 5.0, ""))
        pool.wait_ready(60)
        [hung], seconds = _timed(pool.map, verify, [(db, cross_join, GOLD)])
        rows.append(_deadline_row("pool hard deadline 0.5 s", seconds, 0.5 * 1.1 + 0.5, hung.reason))
    with VerifierPool(num_workers=2, task_timeout_s=1.0) as pool:
        pool.wait_ready(60)
        results, seconds = _timed(pool.map, python_sleep, [(0,), (1,)])
        rows.append(
            _deadline_row(
                "pool, 2 hung tasks side by side (1 s)", seconds, 1.0 * 1.1 + 0.5, str([r.reason for r in results])
            )
        )

    verify_math(r"\boxed{\sqrt{4}}", "2")  # the math sandbox's cold start is not its deadline
    result, seconds = _timed(verify_math, r"\boxed{10^{10^{10}}}", "1", timeout_s=1.0)
    rows.append(_deadline_row("math deadline 1 s", seconds, 1.0 + HARD_KILL_GRACE_S + 0.5, result.reason))
    shutdown_math_sandbox()
    return rows


SECTIONS = ("reward", "memory", "pool", "math", "deadlines")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tasks and shorter deadlines")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    args = parser.parse_args()
    sections = [x for x in args.sections.split(",") if x]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; choose from {list(SECTIONS)}")
    n = 1000 if args.quick else 5000
    n_hang = 200 if args.quick else 1000
    sql_timeout, pool_deadline = (0.2, 0.4) if args.quick else (0.5, 1.0)
    load = os.getloadavg()[0]

    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        db = str(build_db(Path(tmp) / "bench.sqlite"))
        if "reward" in sections:
            rows += reward_rows(db, n, args.quick)
        if "memory" in sections:
            rows += memory_rows(db)
        if "pool" in sections:
            rows += pool_rows(db, n, n_hang, args.workers, sql_timeout, pool_deadline)
        if "deadlines" in sections:
            rows += deadline_rows(db)
    if "math" in sections:
        rows += math_rows(n)

    print(
        f"# bench_verifiers  cpus={os.cpu_count()}  python={sys.version.split()[0]}  quick={args.quick}  "
        f"load(1 min) {load:.2f} -> {os.getloadavg()[0]:.2f}  sandbox={_have_sandbox()}"
    )
    print(f"# pool section: sql timeout {sql_timeout}s, pool hard deadline {pool_deadline}s")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
