#!/usr/bin/env bash
# Baseline for Headroom-Drift (math): a DAPO-style on-policy arm, b256 fresh stream, no replay.
# What verl's separate_async trainer provides of DAPO: clip-higher (clip ratio 0.2 below, 0.28
# above), token-mean loss aggregation, and overlong reward shaping by verl's `dapo` reward manager
# (a response longer than MAX_RESPONSE_LENGTH - OVERLONG_BUFFER loses up to OVERLONG_PENALTY,
# linearly over the buffer). DAPO's dynamic sampling (regenerating until no group is all-correct
# or all-wrong) lives in verl's separate DAPO trainer, not in separate_async: it is not part of
# this arm. Our reward function is unchanged: the manager adds the penalty to its score and keeps
# its `acc`.
#   bash recipes/baselines/dapo.sh [hydra overrides ...]
#   OVERLONG_BUFFER=512 OVERLONG_PENALTY=0.5 bash recipes/baselines/dapo.sh
set -euo pipefail
export STRATEGY=none
case "${TINY:-0}" in
  1 | true | True | yes) response_length="${MAX_RESPONSE_LENGTH:-24}" ;;
  *) response_length="${MAX_RESPONSE_LENGTH:-4096}" ;;
esac
# DAPO's own ratio: a 4,096-token buffer at 20,480 tokens, a fifth of the response budget
: "${OVERLONG_BUFFER:=$((response_length / 5))}"
: "${OVERLONG_PENALTY:=1.0}"
export BASELINE_NAME=dapo  # run dir .../dapo_b256, beside grpo_b256
exec bash "$(dirname "${BASH_SOURCE[0]}")/../headroom_drift_math.sh" \
  actor_rollout_ref.actor.clip_ratio_low=0.2 \
  actor_rollout_ref.actor.clip_ratio_high=0.28 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  reward.reward_manager.name=dapo \
  +reward.reward_kwargs.max_resp_len="$response_length" \
  +reward.reward_kwargs.overlong_buffer_cfg.enable=True \
  +reward.reward_kwargs.overlong_buffer_cfg.len="$OVERLONG_BUFFER" \
  +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor="$OVERLONG_PENALTY" \
  +reward.reward_kwargs.overlong_buffer_cfg.log=False \
  "$@"
