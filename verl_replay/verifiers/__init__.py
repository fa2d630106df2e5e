"""Verifiers: execution-based SQL, math-verify based math, and a crash/hang-proof pool.

Everything here imports only the standard library at import time (math-verify/sympy and
sqlglot are imported on first use).
"""

from verl_replay.verifiers.extract import (
    extract_boxed,
    extract_math_answer,
    extract_sql,
    strip_think,
)
from verl_replay.verifiers.math import (
    MathVerification,
    shutdown_math_sandbox,
    verify_math,
)
from verl_replay.verifiers.pool import TaskFailure, VerifierPool, in_pool_worker
from verl_replay.verifiers.sql import (
    QueryResult,
    SQLVerification,
    clear_gold_cache,
    execute_readonly,
    gold_cache_info,
    has_top_level_order_by,
    sql_failure,
    verify_sql,
)

__all__ = [
    "MathVerification",
    "QueryResult",
    "SQLVerification",
    "TaskFailure",
    "VerifierPool",
    "clear_gold_cache",
    "execute_readonly",
    "extract_boxed",
    "extract_math_answer",
    "extract_sql",
    "gold_cache_info",
    "has_top_level_order_by",
    "in_pool_worker",
    "shutdown_math_sandbox",
    "sql_failure",
    "strip_think",
    "verify_math",
    "verify_sql",
]
