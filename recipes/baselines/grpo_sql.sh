#!/usr/bin/env bash
# Baseline for EliteReplay (SQL): plain GRPO (no archive, no replay term), same model, data, sizes,
# placement and evaluation as recipes/elite_replay_qwen4b.sh. Stages default to train,eval.
#   bash recipes/baselines/grpo_sql.sh [hydra overrides ...]
set -euo pipefail
export STRATEGY=none
exec bash "$(dirname "${BASH_SOURCE[0]}")/../elite_replay_qwen4b.sh" "$@"
