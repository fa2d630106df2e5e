"""verl-replay: Headroom-Drift Replay and EliteReplay for GRPO post-training on verl.

Public names are resolved lazily so that ``import verl_replay`` never imports verl, ray or
other heavy modules; each name is imported from its module on first access.
"""

from __future__ import annotations

from verl_replay._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # Headroom-Drift Replay (pure core)
    "headroom": "verl_replay.headroom_drift.scores",
    "policy_drift": "verl_replay.headroom_drift.scores",
    "replay_kl": "verl_replay.headroom_drift.scores",
    "HeadroomDriftBuffer": "verl_replay.headroom_drift.buffer",
    "NaiveReplayBuffer": "verl_replay.headroom_drift.buffer",
    "ReplayGroup": "verl_replay.headroom_drift.buffer",
    "SelectionResult": "verl_replay.headroom_drift.buffer",
    # EliteReplay (pure core)
    "EliteArchive": "verl_replay.elite.archive",
    "BalancedSampler": "verl_replay.elite.sampler",
    "IIDSampler": "verl_replay.elite.sampler",
    "length_normalized_nll": "verl_replay.elite.losses",
    # verifiers and descriptors
    "verify_sql": "verl_replay.verifiers.sql",
    "verify_math": "verl_replay.verifiers.math",
    "sql_skeleton": "verl_replay.sql.skeleton",
    # evaluation
    "pass_at_k": "verl_replay.eval.metrics",
    # configuration
    "ReplayConfig": "verl_replay.config",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
