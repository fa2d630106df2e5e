#!/usr/bin/env bash
# Baseline for Headroom-Drift (math): GRPO on-policy, matched fresh budget "b256" = 32 prompts x 8
# responses per step, no replay. Everything else as recipes/headroom_drift_math.sh (same env vars).
#   bash recipes/baselines/grpo_onpolicy_b256.sh [hydra overrides ...]
set -euo pipefail
export STRATEGY=none
exec bash "$(dirname "${BASH_SOURCE[0]}")/../headroom_drift_math.sh" "$@"
