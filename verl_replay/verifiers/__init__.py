"""Verifiers: execution-based SQL, math-verify based math, a crash/hang-proof pool and the SQL
process sandbox.

Everything here imports only the standard library at import time (math-verify/sympy and
sqlglot are imported on first use). Public names are resolved lazily, so a module of this
package (e.g. a sandbox worker importing ``verl_replay.verifiers.sandbox``) does not pay for
the others.
"""

from __future__ import annotations

from verl_replay._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "extract_boxed": ".extract",
    "extract_math_answer": ".extract",
    "extract_sql": ".extract",
    "strip_think": ".extract",
    "MathVerification": ".math",
    "shutdown_math_sandbox": ".math",
    "verify_math": ".math",
    "TaskFailure": ".pool",
    "VerifierPool": ".pool",
    "in_pool_worker": ".pool",
    "SQLSandbox": ".sandbox",
    "SandboxError": ".sandbox",
    "get_sql_sandbox": ".sandbox",
    "shutdown_sql_sandbox": ".sandbox",
    "warm_sql_sandbox": ".sandbox",
    "QueryResult": ".sql",
    "SQLVerification": ".sql",
    "clear_gold_cache": ".sql",
    "execute_readonly": ".sql",
    "gold_cache_info": ".sql",
    "has_top_level_order_by": ".sql",
    "sql_failure": ".sql",
    "verify_sql": ".sql",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
