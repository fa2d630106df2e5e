#!/usr/bin/env bash
# Baseline for Headroom-Drift (math): GRPO on-policy, larger fresh budget "b384" = 48 prompts x 8
# responses per step (1.5x the fresh rollouts of b256; as many responses per update as b256 + r128),
# no replay. With 8 prompts per mini-batch a step is 6 update rounds. TINY=1: 6 prompts (1.5 x 4).
#   bash recipes/baselines/grpo_onpolicy_b384.sh [hydra overrides ...]
set -euo pipefail
export STRATEGY=none
case "${TINY:-0}" in
  1 | true | True | yes) export TRAIN_PROMPTS="${TRAIN_PROMPTS:-6}" PPO_MINI_PROMPTS="${PPO_MINI_PROMPTS:-2}" ;;
  *) export TRAIN_PROMPTS="${TRAIN_PROMPTS:-48}" ;;
esac
exec bash "$(dirname "${BASH_SOURCE[0]}")/../headroom_drift_math.sh" "$@"
