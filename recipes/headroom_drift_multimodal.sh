#!/usr/bin/env bash
# GRPO + Headroom-Drift Replay on multimodal math (image prompts, Qwen3.5-4B's vision input):
# recipes/headroom_drift_math.sh with DOMAIN=multimodal (same variables; train stage only).
#
#   bash recipes/headroom_drift_multimodal.sh [hydra overrides for the training command ...]
#
# Data: python -m verl_replay.data prepare geo3k --input GEO3K_DIR --output "$DATA_DIR"
# (hiyouga/geometry3k's parquet files, downloaded by hand). Replayed groups keep their pictures
# once per group and get their pixel inputs and M-RoPE position ids rebuilt (docs/headroom_drift.md).
# TINY=1: the tiny image task on CPU (64 x 64 pictures of coloured squares, the tiny model's
# one-block vision tower).
set -euo pipefail
DOMAIN=multimodal exec bash "$(dirname "${BASH_SOURCE[0]}")/headroom_drift_math.sh" "$@"
