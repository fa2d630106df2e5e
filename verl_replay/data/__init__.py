"""Tiny local assets, benchmark readers (BIRD, Spider, AmbiQT, math) and RL parquet preparation.

Names resolve lazily so that ``import verl_replay.data`` stays cheap (no torch/transformers).
"""

from __future__ import annotations

from verl_replay._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "TinyAssets": "verl_replay.data.tiny_assets",
    "build_tiny_assets": "verl_replay.data.tiny_assets",
    "default_root": "verl_replay.data.tiny_assets",
    "ASSET_FORMAT_VERSION": "verl_replay.data.tiny_assets",
    "SQLExample": "verl_replay.data.schema",
    "schema_text": "verl_replay.data.schema",
    "connect_readonly": "verl_replay.data.schema",
    "MathExample": "verl_replay.data.math_benchmarks",
    "load_math_file": "verl_replay.data.math_benchmarks",
    "load_math_benchmark": "verl_replay.data.math_benchmarks",
    "last_boxed": "verl_replay.data.math_benchmarks",
    "load_bird": "verl_replay.data.bird",
    "load_spider": "verl_replay.data.spider",
    "load_ambiqt": "verl_replay.data.ambiqt",
    "build_sql_messages": "verl_replay.data.prompts",
    "build_math_messages": "verl_replay.data.prompts",
    "sql_rows": "verl_replay.data.prepare",
    "math_rows": "verl_replay.data.prepare",
    "write_rl_parquet": "verl_replay.data.prepare",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
