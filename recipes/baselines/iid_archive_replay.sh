#!/usr/bin/env bash
# Baseline for EliteReplay (SQL): IID replay, entries drawn uniformly from the same frozen archive
# (no balancing across questions and cells), same mu and NLL term. Shares the archive of
# recipes/elite_replay_qwen4b.sh (ARCHIVE): an existing finished search is only re-written.
#   bash recipes/baselines/iid_archive_replay.sh [hydra overrides ...]
set -euo pipefail
export STRATEGY=elite_iid
exec bash "$(dirname "${BASH_SOURCE[0]}")/../elite_replay_qwen4b.sh" "$@"
