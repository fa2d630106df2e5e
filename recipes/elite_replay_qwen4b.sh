#!/usr/bin/env bash
# EliteReplay on text-to-SQL with Qwen3.5-4B.
#
#   bash recipes/elite_replay_qwen4b.sh [hydra overrides for the training command ...]
#
# Stages (STAGES, comma-separated, default search,train,eval; STRATEGY=none: train,eval):
#   search  MAP-Elites archive search with the frozen base model through vLLM on the SQL training set
#           -> ARCHIVE (+ .manifest.json, .search_state); resumes an interrupted search
#   train   GRPO + EliteReplay (L = (1 - mu) L_GRPO + mu L_replay), full-parameter, split placement:
#           TRAIN_GPUS training + ROLLOUT_GPUS vLLM rollout GPUs per node (default 2 + 2 on 4xA100 80 GB),
#           TOTAL_STEPS steps x TRAIN_PROMPTS questions x GROUP_SIZE responses, 16K prompt / 4K response
#   eval    EVAL_N samples per question (pass@1..128, distinct SQL strategies, AmbiQT coverage) on
#           BIRD dev + Spider dev (+ AmbiQT when its parquet exists) with the trained checkpoint
#
# STRATEGY: elite (default) | elite_iid (baseline: IID replay of the same archive) | none (GRPO baseline).
# Main variables (all in recipes/README.md): MODEL_PATH, DATA_DIR, TRAIN_FILES, VAL_FILES, EVAL_FILES,
# OUTPUT_DIR, NNODES, GPUS_PER_NODE, TRAIN_GPUS, ROLLOUT_GPUS, ROLLOUT_TP, TOTAL_STEPS, TRAIN_PROMPTS,
# GROUP_SIZE, PPO_MINI_PROMPTS, MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH, LR, MU, ELITE_BATCH_SIZE,
# ARCHIVE, SEARCH_*, EVAL_N, EVAL_K, EVAL_MODEL, STAGES.
# DRY_RUN=1: compose + validate + print the training config on CPU; search/eval commands only printed.
# TINY=1: the same recipe at toy scale on CPU (tiny SQL model and databases; training rolls out with
# verl's vLLM server on vLLM's CPU build, the archive search and evaluation with transformers).
# TINY=1 TINY_TASK=shapes: the tiny query-shapes profile (questions with three right query shapes,
# 60 global steps of 8 questions x 8 responses, held-out validation every 10 steps; recipes/README.md).
set -euo pipefail

RECIPE_NAME=elite_replay_qwen4b
# shellcheck source=recipes/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# ------------------------------------------------------------------ what to run
: "${STRATEGY:=elite}"
require_one_of STRATEGY elite elite_iid none
if [[ "$STRATEGY" == none ]]; then : "${STAGES:=train,eval}"; else : "${STAGES:=search,train,eval}"; fi
check_stages search train eval
: "${TINY_TASK:=sql}"
require_one_of TINY_TASK sql shapes
is_tiny_shapes() { is_true "$TINY" && [[ "$TINY_TASK" == shapes ]]; }

# ------------------------------------------------------------------ inputs and outputs
if is_tiny_shapes; then
  load_tiny_task shapes
  : "${MODEL_PATH:=$TINY_TASK_MODEL_DIR}"
  : "${TRAIN_FILES:=$TINY_TASK_TRAIN}"
  : "${VAL_FILES:=$TINY_TASK_VAL}"
  : "${EVAL_FILES:=$TINY_TASK_VAL}"
  tiny_output_dir "tiny_elite_shapes"
elif is_true "$TINY"; then
  load_tiny_assets
  : "${MODEL_PATH:=$TINY_SQL_MODEL_DIR}"
  : "${TRAIN_FILES:=$TINY_SQL_TRAIN}"
  : "${VAL_FILES:=$TINY_SQL_VAL}"
  : "${EVAL_FILES:=$TINY_SQL_VAL}"
  tiny_output_dir "tiny_elite"
else
  : "${MODEL_PATH:=$HOME/models/Qwen3.5-4B}"
  : "${DATA_DIR:=$HOME/data/verl_replay}"
  DATA_PREPARE=bird,spider,ambiqt
  # python -m verl_replay.data prepare bird --split train / --split dev, spider --split dev, ambiqt
  : "${TRAIN_FILES:=$DATA_DIR/bird_train.parquet}"
  : "${VAL_FILES:=$DATA_DIR/bird_dev.parquet}"
  if [[ -z "${EVAL_FILES:-}" ]]; then
    EVAL_FILES="$DATA_DIR/bird_dev.parquet,$DATA_DIR/spider_dev.parquet"
    if [[ -f "$DATA_DIR/ambiqt_validation.parquet" ]]; then EVAL_FILES+=",$DATA_DIR/ambiqt_validation.parquet"; fi
  fi
  : "${OUTPUT_DIR:=$PWD/outputs}"
fi
absolute_paths OUTPUT_DIR TRAIN_FILES VAL_FILES EVAL_FILES
absolute_model MODEL_PATH
: "${PROJECT:=elite_replay_sql}"

# ------------------------------------------------------------------ training sizes
if is_tiny_shapes; then
  # GRPO's settings of the tiny addition profile (lr 2e-4 warmed up over 10 optimiser steps), sampled
  # held-out validation (128 questions x VAL_N) every 10 global steps; the search samples every
  # training question; the evaluation draws 16 answers per held-out question (pass@k, distinct shapes)
  : "${TOTAL_STEPS:=60}" "${TRAIN_PROMPTS:=8}" "${GROUP_SIZE:=8}" "${PPO_MINI_PROMPTS:=4}" "${LR:=2e-4}"
  : "${LR_WARMUP_STEPS:=10}" "${MAX_RESPONSE_LENGTH:=32}" "${MAX_PROMPT_LENGTH:=64}" "${TEST_FREQ:=10}"
  : "${VAL_N:=2}" "${VAL_TEMPERATURE:=1.0}" "${ELITE_BATCH_SIZE:=8}"
  : "${SEARCH_LIMIT:=}" "${SEARCH_SEEDS:=8}" "${SEARCH_MUTATIONS:=0}" "${SEARCH_BATCH_SIZE:=512}"
  : "${EVAL_N:=16}" "${EVAL_K:=1,4,16}" "${EVAL_LIMIT:=}"
fi
: "${TOTAL_STEPS:=$(pick 100 3)}"
: "${TRAIN_PROMPTS:=$(pick 128 4)}"           # questions per global step
: "${GROUP_SIZE:=$(pick 8 4)}"                # GRPO responses per question
: "${PPO_MINI_PROMPTS:=$(pick 32 2)}"         # questions per optimiser step (= per update round)
: "${MAX_PROMPT_LENGTH:=$(pick 16384 256)}"
: "${MAX_RESPONSE_LENGTH:=$(pick 4096 96)}"      # every tiny gold SQL answer fits (<= 89 tokens)
: "${LR:=$(pick 1e-6 1e-4)}"
: "${ROLLOUT_TEMPERATURE:=1.0}"
: "${SAVE_FREQ:=$(pick 25 "$TOTAL_STEPS")}"
: "${TEST_FREQ:=$(pick 25 -1)}"
: "${VAL_N:=1}"                               # validation during training: greedy, one sample
: "${VAL_TEMPERATURE:=}"                      # empty: verl's greedy validation; else sampled at this temperature
: "${LR_WARMUP_STEPS:=}"                      # optimiser steps of linear warm-up (empty: verl's default, none)
# EliteReplay: weight of the replay NLL term, archive entries per global step (spread over its
# update rounds: 32 per round of the full recipe), sampler seed
: "${MU:=0.05}"
: "${ELITE_BATCH_SIZE:=$(pick 128 4)}"
: "${ELITE_SEED:=0}"
: "${EXPERIMENT:=$([[ "$STRATEGY" == none ]] && echo grpo || echo "$STRATEGY")_q${TRAIN_PROMPTS}x${GROUP_SIZE}}"
: "${RUN_DIR:=$OUTPUT_DIR/$PROJECT/$EXPERIMENT}"
: "${ARCHIVE:=$OUTPUT_DIR/$PROJECT/archive/elite_archive.parquet}"

# ------------------------------------------------------------------ search budget (frozen base model)
: "${SEARCH_BACKEND:=$(pick vllm hf)}"
: "${SEARCH_SEEDS:=8}"                        # base-model samples per question (round 0)
: "${SEARCH_MUTATIONS:=$(pick 16 2)}"         # directed mutations per question, over SEARCH_ROUNDS
: "${SEARCH_ROUNDS:=$(pick 4 1)}"
: "${SEARCH_LIMIT=$(pick "" 8)}"              # empty = every training question (unset, TINY=1: 8)
: "${SEARCH_BATCH_SIZE:=$(pick 2048 32)}"     # sequences per generate call
: "${SEARCH_MAX_NEW_TOKENS:=$MAX_RESPONSE_LENGTH}"
: "${SEARCH_TP:=1}"
: "${SEARCH_TEMPERATURE:=1.0}"
: "${SEARCH_SEED:=0}"
: "${SEARCH_LABELER:=rule}"
: "${SEARCH_OVERWRITE:=0}"                    # 1 = start the search over instead of resuming it

# ------------------------------------------------------------------ evaluation
: "${EVAL_BACKEND:=$(pick vllm hf)}"
: "${EVAL_N:=$(pick 128 4)}"
: "${EVAL_K:=$(pick 1,2,4,8,16,32,64,128 1,2,4)}"
: "${EVAL_LIMIT=$(pick "" 2)}"                # empty = every question (unset, TINY=1: 2)
: "${EVAL_MAX_NEW_TOKENS:=$MAX_RESPONSE_LENGTH}"
: "${EVAL_TEMPERATURE:=1.0}"
: "${EVAL_TOP_P:=1.0}"
: "${EVAL_TP:=1}"
: "${EVAL_OUT:=$RUN_DIR/eval}"
: "${VERIFY_WORKERS:=$(pick 8 1)}"
: "${VERIFY_TIMEOUT_S:=$(pick 30 5)}"

absolute_paths RUN_DIR ARCHIVE EVAL_OUT
if [[ -n "${EVAL_MODEL:-}" ]]; then absolute_model EVAL_MODEL; fi

setup_placement
require_positive TOTAL_STEPS GROUP_SIZE MAX_PROMPT_LENGTH MAX_RESPONSE_LENGTH SAVE_FREQ VAL_N ELITE_BATCH_SIZE
require_positive SEARCH_ROUNDS SEARCH_BATCH_SIZE SEARCH_MAX_NEW_TOKENS SEARCH_TP EVAL_N EVAL_MAX_NEW_TOKENS EVAL_TP
require_uint SEARCH_SEEDS SEARCH_MUTATIONS SEARCH_SEED ELITE_SEED VERIFY_WORKERS
require_number LR MU ROLLOUT_TEMPERATURE SEARCH_TEMPERATURE EVAL_TEMPERATURE EVAL_TOP_P VERIFY_TIMEOUT_S
if [[ -n "$VAL_TEMPERATURE" ]]; then require_number VAL_TEMPERATURE; fi
if [[ -n "$LR_WARMUP_STEPS" ]]; then require_uint LR_WARMUP_STEPS; fi
require_one_of SEARCH_BACKEND vllm hf
require_one_of EVAL_BACKEND vllm hf
setup_rounds
setup_attention
setup_engine
: "${SEARCH_MAX_MODEL_LEN:=$((MAX_MODEL_LEN + SEARCH_MAX_NEW_TOKENS))}" # mutation prompts add a parent

print_settings STRATEGY STAGES TINY DRY_RUN MODEL_PATH TRAIN_FILES VAL_FILES EVAL_FILES ARCHIVE RUN_DIR TOTAL_STEPS \
  TRAIN_PROMPTS GROUP_SIZE PPO_MINI_PROMPTS PARAMETER_SYNC_STEP MAX_PROMPT_LENGTH MAX_RESPONSE_LENGTH MU \
  ELITE_BATCH_SIZE ATTN_IMPL

# The frozen base model does the search; the archive is shared by the elite and elite_iid runs.
search_cmd() {
  SEARCH_CMD=()
  if is_true "$TINY"; then SEARCH_CMD+=(env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"); fi
  SEARCH_CMD+=("$PYTHON" -m verl_replay.elite.search
    --data "$TRAIN_FILES" --model "$MODEL_PATH" --out "$ARCHIVE" --domain sql
    --backend "$SEARCH_BACKEND" --seeds-per-question "$SEARCH_SEEDS" --mutations-per-question "$SEARCH_MUTATIONS"
    --rounds "$SEARCH_ROUNDS" --batch-size "$SEARCH_BATCH_SIZE" --temperature "$SEARCH_TEMPERATURE"
    --max-new-tokens "$SEARCH_MAX_NEW_TOKENS" --seed "$SEARCH_SEED" --labeler "$SEARCH_LABELER"
    --verify-workers "$VERIFY_WORKERS" --verify-timeout-s "$VERIFY_TIMEOUT_S" --no-progress)
  if [[ -n "$SEARCH_LIMIT" ]]; then SEARCH_CMD+=(--limit "$SEARCH_LIMIT"); fi
  if [[ "$SEARCH_BACKEND" == vllm ]]; then
    SEARCH_CMD+=(--tensor-parallel-size "$SEARCH_TP" --max-model-len "$SEARCH_MAX_MODEL_LEN")
  fi
  if is_true "$SEARCH_OVERWRITE"; then
    SEARCH_CMD+=(--overwrite)
  elif [[ -f "$ARCHIVE.search_state" ]]; then
    SEARCH_CMD+=(--resume) # continues an interrupted search; refuses if the settings changed
  fi
}

train_cmd() {
  base_train_args "$TINY_TASK"
  if [[ -n "$VAL_TEMPERATURE" ]]; then
    TRAIN_ARGS+=("actor_rollout_ref.rollout.val_kwargs.temperature=$VAL_TEMPERATURE"
      actor_rollout_ref.rollout.val_kwargs.do_sample=True)
  fi
  if [[ -n "$LR_WARMUP_STEPS" ]]; then TRAIN_ARGS+=("actor_rollout_ref.actor.optim.lr_warmup_steps=$LR_WARMUP_STEPS"); fi
  if [[ "$STRATEGY" != none ]]; then
    TRAIN_ARGS+=(
      "replay.elite.archive=$ARCHIVE"
      "replay.elite.mu=$MU"
      "replay.elite.batch_size=$ELITE_BATCH_SIZE"
      "replay.elite.seed=$ELITE_SEED"
    )
  fi
  placement_overrides
  cluster_overrides
  checkpoint_overrides
  gpu_engine_overrides
  # as the addition profile: micro-batches by tokens, one per optimiser step at its sizes
  if is_tiny_shapes; then dynamic_batch_overrides; fi
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
  run_preflight "$((SEARCH_TP > EVAL_TP ? SEARCH_TP : EVAL_TP))"
}

# PREFLIGHT=only stops after the first stage's checks: the later stages' data sets are checked with them
if [[ "${PREFLIGHT:-1}" == only ]]; then
  if stage_on search && stage_on train; then
    val_files=()
    split_csv val_files "$VAL_FILES"
    for file in "${val_files[@]}"; do require_file "$file" "validation set (VAL_FILES)"; done
  fi
  if stage_on eval && { stage_on search || stage_on train; }; then
    eval_files=()
    split_csv eval_files "$EVAL_FILES"
    for file in "${eval_files[@]}"; do require_file "$file" "evaluation set (EVAL_FILES)"; done
  fi
fi

if stage_on search; then
  require_file "$TRAIN_FILES" "SQL training set (TRAIN_FILES)"
  require_model "$MODEL_PATH"
  if ! is_true "$DRY_RUN"; then mkdir -p "$(dirname "$ARCHIVE")"; fi
  search_cmd
  preflight "$@"
  if is_true "$DRY_RUN"; then show_stage search "${SEARCH_CMD[@]}"; else run_stage search "${SEARCH_CMD[@]}"; fi
fi

if stage_on train; then
  require_file "$TRAIN_FILES" "SQL training set (TRAIN_FILES)"
  val_files=()
  split_csv val_files "$VAL_FILES"
  for file in "${val_files[@]}"; do require_file "$file" "validation set (VAL_FILES)"; done
  require_model "$MODEL_PATH"
  if ((${#val_files[@]} > 1)); then VAL_FILES="$(hydra_list "${val_files[@]}")"; fi
  if [[ "$STRATEGY" != none ]]; then
    require_file "$ARCHIVE" "frozen archive (ARCHIVE; run the search stage first)"
    require_file "$ARCHIVE.manifest.json" "archive manifest"
  fi
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
