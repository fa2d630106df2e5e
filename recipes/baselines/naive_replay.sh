#!/usr/bin/env bash
# Baseline for Headroom-Drift (math): naive replay. Every update round replays the latest buffered
# groups (newest first): no Headroom ranking, no Policy Drift gate, same answer-aligned ingress and
# FIFO buffer. Fresh stream as b256. K_REP groups per global step: 16 ("r128", the default) or
# K_REP=32 for "r256".
#   bash recipes/baselines/naive_replay.sh [hydra overrides ...]
#   K_REP=32 bash recipes/baselines/naive_replay.sh
set -euo pipefail
export STRATEGY=naive
exec bash "$(dirname "${BASH_SOURCE[0]}")/../headroom_drift_math.sh" "$@"
