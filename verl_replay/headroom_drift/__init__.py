"""Headroom-Drift Replay, pure core (torch/numpy/stdlib only).

* :mod:`~verl_replay.headroom_drift.scores`: Headroom, Policy Drift, replay KL (padded and ragged).
* :mod:`~verl_replay.headroom_drift.buffer`: ``ReplayGroup``, ``HeadroomDriftBuffer``,
  ``NaiveReplayBuffer``, ``SelectionResult``, ``scan_chunk_multiple``.
* :mod:`~verl_replay.headroom_drift.packing`: the compact encodings a stored group is made of.
* :mod:`~verl_replay.headroom_drift.events`: JSONL event log (no torch import).

Names are resolved lazily so that importing the event log (e.g. from the plotting script)
does not import torch.
"""

from __future__ import annotations

from verl_replay._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "headroom": "scores",
    "policy_drift": "scores",
    "replay_kl": "scores",
    "headroom_flat": "scores",
    "policy_drift_flat": "scores",
    "replay_kl_flat": "scores",
    "headroom_segments": "scores",
    "policy_drift_segments": "scores",
    "replay_kl_segments": "scores",
    "group_scores_flat": "scores",
    "ReplayGroup": "buffer",
    "HeadroomDriftBuffer": "buffer",
    "NaiveReplayBuffer": "buffer",
    "SelectionResult": "buffer",
    "ScanRecord": "buffer",
    "scan_chunk_multiple": "buffer",
    "ReplayEventLog": "events",
    "read_events": "events",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, {name: "." + module for name, module in _EXPORTS.items()}, globals())
