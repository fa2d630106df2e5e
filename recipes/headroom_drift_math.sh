#!/usr/bin/env bash
# GRPO + Headroom-Drift Replay on math with Qwen3.5-4B, "b256 + r128".
#
#   bash recipes/headroom_drift_math.sh [hydra overrides for the training command ...]
#
# Stages (STAGES, comma-separated, default train,eval):
#   train   GRPO with group size GROUP_SIZE on TRAIN_PROMPTS fresh prompts per global step
#           (32 x 8 = 256 fresh responses) plus up to K_REP replayed groups per global step
#           (16 x 8 = 128 replayed responses), split placement TRAIN_GPUS + ROLLOUT_GPUS per node
#           (default 2 + 2)
#   eval    Mean@EVAL_N / Best@EVAL_N (32) on MATH-500, AIME24, AIME25, AMC23, Minerva, OlympiadBench
#           with the trained checkpoint
#
# STRATEGY: headroom_drift (default) | naive (latest K groups, no ranking, no gate) | none (GRPO).
# Main variables (all in recipes/README.md): MODEL_PATH, DATA_DIR, TRAIN_FILES, VAL_FILES, EVAL_FILES,
# OUTPUT_DIR, NNODES, GPUS_PER_NODE, TRAIN_GPUS, ROLLOUT_GPUS, ROLLOUT_TP, TOTAL_STEPS, TRAIN_PROMPTS,
# GROUP_SIZE, PPO_MINI_PROMPTS, MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH, LR, K_REP (groups per global
# step), TAU, REPLAY_CAPACITY, EVAL_N, EVAL_K, EVAL_MODEL, STAGES.
# DRY_RUN=1: compose + validate + print the training config on CPU; the eval command is only printed.
# TINY=1: the same recipe at toy scale on CPU (tiny math model and data; training rolls out with
# verl's vLLM server on vLLM's CPU build, the evaluation with transformers).
# TINY=1 TINY_TASK=arith: the tiny addition profile (60 global steps of 8 prompts x 8 responses,
# validation on 256 held-out problems every 10 steps; train stage only; recipes/README.md).
# DOMAIN: math (default) | search (agentic search: verl's tool agent loop with a retrieval tool;
# recipes/headroom_drift_search.sh) | multimodal (image prompts; recipes/headroom_drift_multimodal.sh).
# The search and multimodal domains run the train stage only (the eval stage is math's benchmarks).
set -euo pipefail

: "${DOMAIN:=math}"
RECIPE_NAME=headroom_drift_$DOMAIN
# shellcheck source=recipes/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# ------------------------------------------------------------------ what to run
require_one_of DOMAIN math search multimodal
: "${STRATEGY:=headroom_drift}"
require_one_of STRATEGY headroom_drift naive none
case "$DOMAIN" in
  math) : "${TINY_TASK:=math}" ;;
  search) TINY_TASK=search ;;
  multimodal) TINY_TASK=image ;;
esac
if [[ "$DOMAIN" == math ]]; then require_one_of TINY_TASK math arith; fi
if [[ "$DOMAIN" == math && "$TINY_TASK" == math ]]; then
  : "${STAGES:=train,eval}"
  check_stages train eval
else
  : "${STAGES:=train}"
  check_stages train
fi
is_tiny_arith() { is_true "$TINY" && [[ "$TINY_TASK" == arith ]]; }

# ------------------------------------------------------------------ inputs and outputs
BENCHMARKS=(math500 aime24 aime25 amc23 minerva olympiadbench)
if is_true "$TINY" && [[ "$TINY_TASK" != math ]]; then
  load_tiny_task "$TINY_TASK"
  : "${MODEL_PATH:=$TINY_TASK_MODEL_DIR}"
  : "${TRAIN_FILES:=$TINY_TASK_TRAIN}"
  : "${VAL_FILES:=$TINY_TASK_VAL}"
  : "${EVAL_FILES:=}"
  : "${TOOL_CONFIG:=$TINY_TASK_TOOL_CONFIG}"
  tiny_output_dir "tiny_hd_${TINY_TASK/image/multimodal}"
elif is_true "$TINY"; then
  load_tiny_assets
  : "${MODEL_PATH:=$TINY_MODEL_DIR}"
  : "${TRAIN_FILES:=$TINY_MATH_TRAIN}"
  : "${VAL_FILES:=$TINY_MATH_VAL}"
  : "${EVAL_FILES:=$TINY_MATH_VAL}"
  tiny_output_dir "tiny_hd"
elif [[ "$DOMAIN" == search ]]; then
  : "${MODEL_PATH:=$HOME/models/Qwen3.5-4B}"
  : "${DATA_DIR:=$HOME/data/verl_replay}"
  DATA_PREPARE=search
  # python -m verl_replay.data prepare search --input SEARCH_R1_DATA --output DATA_DIR \
  #   --retrieval-url http://HOST:8000/retrieve  (the server: python -m verl_replay.search.server)
  : "${TRAIN_FILES:=$DATA_DIR/search_train.parquet}"
  : "${VAL_FILES:=$DATA_DIR/search_test.parquet}"
  : "${EVAL_FILES:=}"
  : "${TOOL_CONFIG:=$DATA_DIR/search_tools.yaml}"
  : "${OUTPUT_DIR:=$PWD/outputs}"
elif [[ "$DOMAIN" == multimodal ]]; then
  : "${MODEL_PATH:=$HOME/models/Qwen3.5-4B}"
  : "${DATA_DIR:=$HOME/data/verl_replay}"
  DATA_PREPARE=geo3k
  # python -m verl_replay.data prepare geo3k --input GEO3K_DIR --output DATA_DIR
  : "${TRAIN_FILES:=$DATA_DIR/geo3k_train.parquet}"
  : "${VAL_FILES:=$DATA_DIR/geo3k_test.parquet}"
  : "${EVAL_FILES:=}"
  : "${OUTPUT_DIR:=$PWD/outputs}"
else
  : "${MODEL_PATH:=$HOME/models/Qwen3.5-4B}"
  : "${DATA_DIR:=$HOME/data/verl_replay}"
  DATA_PREPARE=math
  # python -m verl_replay.data prepare math --input TRAIN_SET --benchmark train / --input BENCH_DIR
  : "${TRAIN_FILES:=$DATA_DIR/math_train.parquet}"
  : "${VAL_FILES:=$DATA_DIR/math_math500.parquet}"
  if [[ -z "${EVAL_FILES:-}" ]]; then
    EVAL_FILES=""
    for benchmark in "${BENCHMARKS[@]}"; do EVAL_FILES+="${EVAL_FILES:+,}$DATA_DIR/math_$benchmark.parquet"; done
  fi
  : "${OUTPUT_DIR:=$PWD/outputs}"
fi
absolute_paths OUTPUT_DIR TRAIN_FILES VAL_FILES EVAL_FILES
absolute_model MODEL_PATH
: "${PROJECT:=headroom_drift_$DOMAIN}"

# ------------------------------------------------------------------ training sizes
if is_tiny_arith; then
  # GRPO's settings for the tiny addition task: lr 2e-4 warmed up over 10 optimiser steps, held-out
  # validation (256 problems x VAL_N samples) every 10 global steps
  : "${TOTAL_STEPS:=60}" "${TRAIN_PROMPTS:=8}" "${GROUP_SIZE:=8}" "${PPO_MINI_PROMPTS:=4}"
  : "${MAX_RESPONSE_LENGTH:=8}" "${LR:=2e-4}" "${LR_WARMUP_STEPS:=10}" "${TEST_FREQ:=10}" "${K_REP:=4}" "${VAL_N:=2}"
  # the gate passes few of its groups (a scan reaches ~200 groups by step 30): up to 64 groups a
  # forward pass (512 answers of ~21 tokens). Measured alone, 24 steps: 2.45 ms a scanned answer at
  # 16 groups a pass, 2.12 at 64 and at 256 (what remains is per answer, not per pass); the chunks
  # still shrink to the acceptances the scan expects, so the unscanned tail stays small
  : "${SCAN_CHUNK_GROUPS:=64}"
fi
# TINY: 6 global steps, enough for buffered groups to age past tau and be rejected (a step takes
# ~2 s; start-up dominates)
: "${TOTAL_STEPS:=$(pick 500 6)}"
# TINY=1 keeps the full recipe's shape: 2 update rounds per global step.
: "${TRAIN_PROMPTS:=$(pick 32 4)}"            # fresh prompts per global step (x GROUP_SIZE = b256)
: "${GROUP_SIZE:=$(pick 8 4)}"
: "${PPO_MINI_PROMPTS:=$(pick 8 2)}"          # prompts (groups) per optimiser step
: "${MAX_PROMPT_LENGTH:=$(pick 1024 256)}"
case "$DOMAIN" in
  # search: every assistant turn and tool output of a trajectory (tiny: one call, one answer)
  search) : "${MAX_RESPONSE_LENGTH:=$(pick 4096 128)}" ;;
  *) : "${MAX_RESPONSE_LENGTH:=$(pick 4096 24)}" ;;
esac
: "${LR_WARMUP_STEPS:=}"                      # optimiser steps of linear warm-up (empty: verl's default, none)
# a control arm: training rewards drawn at this rate whatever the answer (validation scored as usual)
: "${REWARD_CONTROL_RATE:=}"
: "${MAX_TURNS:=$(pick 4 2)}"                  # search: assistant turns per trajectory
: "${LR:=$(pick 1e-6 1e-4)}"
: "${ROLLOUT_TEMPERATURE:=1.0}"
: "${SAVE_FREQ:=$(pick 50 "$TOTAL_STEPS")}"
: "${TEST_FREQ:=$(pick 50 -1)}"
: "${VAL_N:=4}"                               # validation during training: Mean@4, sampled
: "${VAL_TEMPERATURE:=1.0}"
# Replay: K_REP groups per global step (r128 = 16 groups x 8), selected once per global step and
# spread over its update rounds; Policy Drift gate TAU.
: "${K_REP:=$(pick 16 2)}"
: "${TAU:=0.08}"
: "${REPLAY_CAPACITY:=1024}"
: "${SCAN_CHUNK_GROUPS:=$(pick 16 2)}"
: "${MAX_SCAN_GROUPS:=}"                      # empty = no scan budget
: "${DRIFT_NORM:=l2}"                         # l2 (TAU in rms units) | mean_sq (the paper's units: TAU_l2 ** 2) | l1
: "${WEIGHTING:=sign}"
: "${INGRESS:=answer_disagree}"
: "${SCAN_ORDER:=headroom}"                   # recency: the Policy-Drift-only ablation (no Headroom ranking)

# ------------------------------------------------------------------ evaluation
: "${EVAL_BACKEND:=$(pick vllm hf)}"
: "${EVAL_N:=$(pick 32 4)}"
: "${EVAL_K:=$(pick 1,8,32 1,4)}"
: "${EVAL_LIMIT:=$(pick "" 2)}"               # empty = every question
: "${EVAL_MAX_NEW_TOKENS:=$MAX_RESPONSE_LENGTH}"
: "${EVAL_TEMPERATURE:=1.0}"
: "${EVAL_TOP_P:=1.0}"
: "${EVAL_TP:=1}"
: "${VERIFY_WORKERS:=$(pick 8 1)}"
: "${VERIFY_TIMEOUT_S:=5}"

setup_placement
require_positive TOTAL_STEPS GROUP_SIZE MAX_PROMPT_LENGTH MAX_RESPONSE_LENGTH SAVE_FREQ VAL_N K_REP
require_positive REPLAY_CAPACITY SCAN_CHUNK_GROUPS EVAL_N EVAL_MAX_NEW_TOKENS EVAL_TP
require_uint VERIFY_WORKERS
if [[ -n "$LR_WARMUP_STEPS" ]]; then require_uint LR_WARMUP_STEPS; fi
if [[ -n "$REWARD_CONTROL_RATE" ]]; then require_number REWARD_CONTROL_RATE; fi
require_number LR TAU ROLLOUT_TEMPERATURE VAL_TEMPERATURE EVAL_TEMPERATURE EVAL_TOP_P VERIFY_TIMEOUT_S
require_one_of DRIFT_NORM l2 l1 mean_sq
require_one_of WEIGHTING sign advantage
require_one_of INGRESS answer_disagree nonzero_advantage
require_one_of SCAN_ORDER headroom recency
require_one_of EVAL_BACKEND vllm hf
if [[ -n "$MAX_SCAN_GROUPS" ]]; then require_positive MAX_SCAN_GROUPS; fi
# Group replay selects up to K_REP groups once per global step and spreads them over the step's
# rounds; the rounds are chosen so every optimiser step (PPO_MINI_PROMPTS groups) holds the same share
# of replayed rows: b256 + r128 -> 2 rounds x 3 steps = 6 optimiser steps of 64 responses, like b384.
if [[ "$STRATEGY" != none && -z "${PARAMETER_SYNC_STEP:-}" ]]; then
  require_positive TRAIN_PROMPTS PPO_MINI_PROMPTS
  PARAMETER_SYNC_STEP="$(replay_rounds "$TRAIN_PROMPTS" "$K_REP" "$PPO_MINI_PROMPTS")"
fi
setup_rounds
setup_attention
setup_engine
FRESH_RESPONSES=$((TRAIN_PROMPTS * GROUP_SIZE))
REPLAY_RESPONSES=$((K_REP * GROUP_SIZE))
case "$STRATEGY" in
  headroom_drift) default_experiment="hd_b${FRESH_RESPONSES}_r${REPLAY_RESPONSES}" ;;
  naive) default_experiment="naive_b${FRESH_RESPONSES}_r${REPLAY_RESPONSES}" ;;
  none) default_experiment="${BASELINE_NAME:-grpo}_b${FRESH_RESPONSES}" ;; # BASELINE_NAME: set by baselines/dapo.sh
esac
: "${EXPERIMENT:=$default_experiment}"
: "${RUN_DIR:=$OUTPUT_DIR/$PROJECT/$EXPERIMENT}"
: "${EVAL_OUT:=$RUN_DIR/eval}"
absolute_paths RUN_DIR EVAL_OUT
if [[ -n "${EVAL_MODEL:-}" ]]; then absolute_model EVAL_MODEL; fi

print_settings STRATEGY STAGES TINY DRY_RUN MODEL_PATH TRAIN_FILES VAL_FILES EVAL_FILES RUN_DIR TOTAL_STEPS TRAIN_PROMPTS \
  GROUP_SIZE PPO_MINI_PROMPTS PARAMETER_SYNC_STEP K_REP TAU MAX_PROMPT_LENGTH MAX_RESPONSE_LENGTH ATTN_IMPL

train_cmd() {
  base_train_args "$TINY_TASK"
  if [[ "$DOMAIN" == search ]]; then
    # verl's tool agent loop (rows name agent_name=tool_agent) with the retrieval tool of TOOL_CONFIG
    TRAIN_ARGS+=(
      actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent
      "actor_rollout_ref.rollout.multi_turn.tool_config_path=$TOOL_CONFIG"
      "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=$MAX_TURNS"
      actor_rollout_ref.rollout.multi_turn.format=hermes
    )
  fi
  TRAIN_ARGS+=(
    "actor_rollout_ref.rollout.val_kwargs.temperature=$VAL_TEMPERATURE"
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
  )
  if [[ -n "$LR_WARMUP_STEPS" ]]; then TRAIN_ARGS+=("actor_rollout_ref.actor.optim.lr_warmup_steps=$LR_WARMUP_STEPS"); fi
  if [[ -n "$REWARD_CONTROL_RATE" ]]; then
    TRAIN_ARGS+=("+reward.custom_reward_function.reward_kwargs.control_reward_rate=$REWARD_CONTROL_RATE")
  fi
  if [[ "$STRATEGY" != none ]]; then
    TRAIN_ARGS+=(
      "replay.k_rep=$K_REP"
      "replay.capacity=$REPLAY_CAPACITY"
      "replay.ingress=$INGRESS"
      "replay.weighting=$WEIGHTING"
    )
  fi
  if [[ "$STRATEGY" == headroom_drift ]]; then
    TRAIN_ARGS+=(
      "replay.tau=$TAU"
      "replay.drift_norm=$DRIFT_NORM"
      "replay.scan_order=$SCAN_ORDER"
      "replay.scan_chunk_groups=$SCAN_CHUNK_GROUPS"
      "replay.max_scan_groups=${MAX_SCAN_GROUPS:-null}"
    )
  fi
  placement_overrides
  cluster_overrides
  checkpoint_overrides
  gpu_engine_overrides
  # the addition profile's runs batch by tokens as the GPU profile does (one micro-batch per
  # optimiser step at its sizes: ~3x faster steps than 4-row micro-batches on CPU)
  if is_tiny_arith; then dynamic_batch_overrides; fi
  gpu_stack_overrides
  TRAIN_ARGS+=("$@")
  if is_true "$DRY_RUN"; then TRAIN_ARGS+=(dry_run=true); fi
  TRAIN_CMD=("$PYTHON" -m verl_replay.main "${TRAIN_ARGS[@]}")
}


# The stack check before the first stage that runs (after that stage's input checks): the training
# overrides, as the train stage passes them, go to `python -m verl_replay.preflight` (once).
preflight() {
  local train_val_files=$VAL_FILES
  VAL_FILES="$(preflight_val_files)"
  train_cmd "$@"
  VAL_FILES=$train_val_files
  run_preflight "$EVAL_TP"
}

# PREFLIGHT=only stops after the first stage's checks: the evaluation sets are checked with them
if [[ "${PREFLIGHT:-1}" == only ]] && stage_on train && stage_on eval; then
  eval_files=()
  split_csv eval_files "$EVAL_FILES"
  for file in "${eval_files[@]}"; do require_file "$file" "evaluation set (EVAL_FILES)"; done
fi

if stage_on train; then
  require_file "$TRAIN_FILES" "$DOMAIN training set (TRAIN_FILES)"
  if [[ "$DOMAIN" == search ]]; then require_file "$TOOL_CONFIG" "search tool config (TOOL_CONFIG)"; fi
  val_files=()
  split_csv val_files "$VAL_FILES"
  for file in "${val_files[@]}"; do require_file "$file" "validation set (VAL_FILES)"; done
  require_model "$MODEL_PATH"
  if ((${#val_files[@]} > 1)); then VAL_FILES="$(hydra_list "${val_files[@]}")"; fi
  preflight "$@"
  train_cmd "$@"
  run_stage train "${TRAIN_CMD[@]}"
fi

if stage_on eval; then
  eval_model="$(eval_model_dir)"
  eval_files=()
  split_csv eval_files "$EVAL_FILES"
  for file in "${eval_files[@]}"; do require_file "$file" "evaluation set (EVAL_FILES)"; done
  require_model "$eval_model"
  eval_cmd "$eval_model"
  preflight "$@"
  if is_true "$DRY_RUN"; then show_stage eval "${EVAL_CMD[@]}"; else run_stage eval "${EVAL_CMD[@]}"; fi
fi

if is_true "$DRY_RUN"; then
  log "dry run: nothing was run (stages: $STAGES). run dir would be: $RUN_DIR"
else
  log "done (stages: $STAGES). run dir: $RUN_DIR"
fi
