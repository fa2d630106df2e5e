# Shared helpers for the recipes in this folder. Sourced by them, never run on its own.
#
# Conventions every recipe follows:
#   - every setting is an environment variable with a default, set with `: "${NAME:=default}"`;
#     `pick FULL TINY` chooses the default for the full-scale run or for TINY=1;
#   - every command a recipe runs is printed first, shell-quoted, on stderr (`[recipe] stage: ...`),
#     so it can be copied and re-run by hand; stdout carries only what the commands print;
#   - DRY_RUN=1 runs the training command with dry_run=true (compose + validate + print the config,
#     on CPU) and only prints the search / evaluation commands;
#   - otherwise `python -m verl_replay.preflight` checks the stack first (PREFLIGHT=0 skips it,
#     PREFLIGHT=only stops after it, PREFLIGHT=table prints the per-GPU memory budget and stops);
#   - extra command-line arguments of a recipe are Hydra overrides appended last to the training
#     command (the last value of a key wins).
# shellcheck shell=bash

: "${PYTHON:=python}"
: "${TINY:=0}"
: "${DRY_RUN:=0}"
: "${RECIPE_NAME:=recipe}"

log() { printf '[%s] %s\n' "$RECIPE_NAME" "$*" >&2; }

die() {
  printf '[%s] error: %s\n' "$RECIPE_NAME" "$*" >&2
  exit 2
}

is_true() { [[ "$1" == 1 || "$1" == true || "$1" == True || "$1" == yes ]]; }

# pick FULL TINY: the default for the full-scale recipe, or for TINY=1.
pick() { if is_true "$TINY"; then printf '%s' "$2"; else printf '%s' "$1"; fi; }

# quote_arg ARG: ARG as the shell reads it back: bare when it holds only safe characters,
# single-quoted otherwise (brackets included, so Hydra lists are not globbed).
quote_arg() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# quote_cmd ARGS...: one line that reproduces the command exactly when pasted into a shell.
quote_cmd() {
  local out="" arg
  for arg in "$@"; do out+="$(quote_arg "$arg") "; done
  printf '%s' "${out% }"
}

# run_stage STAGE CMD...: print the exact command, then run it (the recipe stops if it fails).
run_stage() {
  local stage=$1
  shift
  stop_on_input_problems
  log "$stage: $(quote_cmd "$@")"
  "$@"
}

# show_stage STAGE CMD...: print the command a DRY_RUN=1 recipe would run, without running it.
show_stage() {
  local stage=$1
  shift
  stop_on_input_problems
  log "$stage (DRY_RUN=1, not run): $(quote_cmd "$@")"
}

# require_uint NAME...: each variable holds a non-negative integer.
require_uint() {
  local name
  for name in "$@"; do
    [[ "${!name}" =~ ^[0-9]+$ ]] || die "$name must be a non-negative integer, got '${!name}'"
  done
}

# require_positive NAME...: each variable holds an integer >= 1.
require_positive() {
  local name
  require_uint "$@"
  for name in "$@"; do
    ((${!name} >= 1)) || die "$name must be >= 1, got '${!name}'"
  done
}

# require_number NAME...: each variable holds a decimal number (1e-6, 0.08, 3).
require_number() {
  local name
  for name in "$@"; do
    [[ "${!name}" =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]] || die "$name must be a number, got '${!name}'"
  done
}

# require_one_of NAME CHOICE...: the variable holds one of the choices.
require_one_of() {
  local name=$1 choice
  shift
  for choice in "$@"; do [[ "${!name}" == "$choice" ]] && return 0; done
  die "$name must be one of: $*; got '${!name}'"
}

# check_stages ALLOWED...: STAGES is a comma-separated subset of ALLOWED (in any order).
check_stages() {
  local stage allowed ok
  local -a _stages
  [[ -n "$STAGES" ]] || die "STAGES is empty; choose from: $*"
  IFS=',' read -r -a _stages <<<"$STAGES"
  for stage in "${_stages[@]}"; do
    ok=0
    for allowed in "$@"; do [[ "$stage" == "$allowed" ]] && ok=1; done
    ((ok)) || die "unknown stage '$stage' in STAGES=$STAGES; choose from: $*"
  done
}

stage_on() { [[ ",$STAGES," == *",$1,"* ]]; }

# Missing inputs are collected, not fatal one by one: a stage checks all of its inputs, the
# preflight (when it runs) checks the stack too, and then every problem is reported together
# (stop_on_input_problems; run_stage and show_stage stop on them in any case).
INPUT_PROBLEMS=()

# require_file PATH [WHAT]: the file exists (skipped under DRY_RUN=1: the run only composes).
require_file() {
  is_true "$DRY_RUN" && return 0
  [[ -f "$1" ]] || INPUT_PROBLEMS+=("${2:-input} not found: $1")
}

# require_model PATH: a local model directory, or a hub id such as Qwen/Qwen3.5-4B (org/name that
# is not a local path; vLLM and transformers resolve it from their cache or the hub).
require_model() {
  is_true "$DRY_RUN" && return 0
  [[ -d "$1" ]] && return 0
  if [[ "$1" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$ && ! -e "${1%%/*}" ]]; then
    log "model '$1' is not a local directory: treating it as a hub id"
    return 0
  fi
  INPUT_PROBLEMS+=("model directory not found: $1 (set MODEL_PATH)")
}

# report_input_problems: one error line per missing input (and where prepared data sets come
# from); returns 1 when there were any.
report_input_problems() {
  ((${#INPUT_PROBLEMS[@]})) || return 0
  local problem data=0
  for problem in "${INPUT_PROBLEMS[@]}"; do
    printf '[%s] error: %s\n' "$RECIPE_NAME" "$problem" >&2
    [[ "$problem" == *" set ("*"_FILES) not found: "* ]] && data=1
  done
  if ((data)); then
    local sets=${DATA_PREPARE:-bird,spider,ambiqt,math,search,geo3k}
    [[ "$sets" == *,* ]] && sets="{$sets}"
    log "the data sets are written from your downloads by python -m verl_replay.data prepare $sets --input DOWNLOAD --output ${DATA_DIR:-DATA_DIR} (recipes/README.md, Data; or point TRAIN_FILES / VAL_FILES / EVAL_FILES at them)"
  fi
  return 1
}

# stop_on_input_problems: report the missing inputs, if any, and stop the recipe.
stop_on_input_problems() {
  report_input_problems || die "${#INPUT_PROBLEMS[@]} input(s) missing (above)"
}

# split_csv VAR CSV: VAR becomes an array of the non-empty comma-separated fields of CSV.
split_csv() {
  local -n _out=$1
  local field
  local -a _fields
  _out=()
  IFS=',' read -r -a _fields <<<"$2"
  for field in "${_fields[@]}"; do [[ -n "$field" ]] && _out+=("$field"); done
  return 0
}

# absolute_paths NAME...: rewrite each variable (a path or a comma-separated list of paths) with
# absolute paths, so Ray workers and later stages read the same files whatever their cwd.
absolute_paths() {
  local name field out
  local -a fields
  for name in "$@"; do
    [[ -n "${!name:-}" ]] || continue
    out=""
    split_csv fields "${!name}"
    for field in "${fields[@]}"; do out+="${out:+,}$(realpath -m -- "$field")"; done
    printf -v "$name" '%s' "$out"
  done
}

# absolute_model NAME: like absolute_paths for a model, unless it is a hub id (see require_model).
absolute_model() {
  local value=${!1}
  if [[ -e "$value" || ! "$value" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$ ]]; then
    absolute_paths "$1"
  fi
}

# hydra_list ITEM...: [a,b,c] for a Hydra list override.
hydra_list() {
  local IFS=,
  printf '[%s]' "$*"
}

# load_tiny_assets: set TINY_<FIELD> (TINY_MODEL_DIR, TINY_SQL_MODEL_DIR, TINY_MATH_TRAIN,
# TINY_MATH_VAL, TINY_SQL_TRAIN, TINY_SQL_VAL, TINY_SQL_DB_ROOT) to the tiny local assets of
# verl_replay.data.tiny_assets, built and cached on first use (the same ones platform=cpu_tiny uses).
load_tiny_assets() {
  local assignments
  assignments="$("$PYTHON" -c 'import shlex
from verl_replay.data.tiny_assets import build_tiny_assets
assets = build_tiny_assets()
for name in ("model_dir", "sql_model_dir", "math_train", "math_val", "sql_train", "sql_val", "sql_db_root"):
    print(f"TINY_{name.upper()}={shlex.quote(str(getattr(assets, name)))}")')" ||
    die "could not build the tiny assets (python -m verl_replay.data prepare tiny --output DIR shows why)"
  eval "$assignments"
}

# tiny_output_dir NAME: OUTPUT_DIR, when unset, becomes a folder of its own under ./outputs for this
# TINY run (outputs/NAME-<date>-XXXX; the run dir is printed at the end).
tiny_output_dir() {
  if [[ -z "${OUTPUT_DIR:-}" ]]; then
    mkdir -p "$PWD/outputs"
    OUTPUT_DIR="$(mktemp -d "$PWD/outputs/$1-$(date +%Y%m%d-%H%M%S)-XXXX")"
  fi
}

# load_tiny_task TASK: set TINY_TASK_MODEL_DIR, TINY_TASK_TRAIN, TINY_TASK_VAL (and, for search,
# TINY_TASK_TOOL_CONFIG) to the tiny TASK (search | image) of verl_replay.data.tiny_tasks, built and
# cached on first use next to the tiny assets (the same ones platform=cpu_tiny tiny_task=TASK uses).
load_tiny_task() {
  local assignments
  assignments="$("$PYTHON" -c 'import shlex, sys
from verl_replay.data.tiny_tasks import build_tiny_task
task = build_tiny_task(sys.argv[1])
for name in ("model_dir", "train", "val", "tool_config"):
    value = getattr(task, name)
    print(f"TINY_TASK_{name.upper()}={shlex.quote(str(value) if value else str())}")' "$1")" ||
    die "could not build the tiny $1 task (python -m verl_replay.data prepare tiny-$1 shows why)"
  eval "$assignments"
}

# placement_overrides: append the hardware placement to the array TRAIN_ARGS: verl 0.9.1's split
# placement (trainer.v1.trainer_mode=separate_async) at every scale, PARAMETER_SYNC_STEP update
# rounds per global step, weights pushed to the rollout side once per global step.
#   full scale: training on TRAIN_NNODES x TRAIN_GPUS GPUs, vLLM rollout on ROLLOUT_NNODES x
#     ROLLOUT_GPUS other GPUs, weights over NCCL;
#   TINY=1: the same trainer on CPU: one training worker and one rollout worker (the cpu_tiny
#     profile's hf rollout server), weights over verl_replay's CPU engine (cpu_gloo).
placement_overrides() {
  if is_true "$TINY"; then
    TRAIN_ARGS+=(
      trainer.v1.trainer_mode=separate_async
      actor_rollout_ref.hybrid_engine=False
      trainer.nnodes=1
      trainer.n_gpus_per_node=1
      actor_rollout_ref.rollout.nnodes=1
      actor_rollout_ref.rollout.n_gpus_per_node=1
      actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo
      "trainer.v1.separate_async.parameter_sync_step=$PARAMETER_SYNC_STEP"
    )
    return
  fi
  TRAIN_ARGS+=(
    trainer.v1.trainer_mode=separate_async
    actor_rollout_ref.hybrid_engine=False
    "trainer.nnodes=$TRAIN_NNODES"
    "trainer.n_gpus_per_node=$TRAIN_GPUS"
    "actor_rollout_ref.rollout.nnodes=$ROLLOUT_NNODES"
    "actor_rollout_ref.rollout.n_gpus_per_node=$ROLLOUT_GPUS"
    actor_rollout_ref.rollout.checkpoint_engine.backend=nccl
    "trainer.v1.separate_async.parameter_sync_step=$PARAMETER_SYNC_STEP"
  )
}

# setup_placement: defaults and checks of the cluster layout variables (see recipes/README.md).
setup_placement() {
  : "${NNODES:=1}"
  : "${GPUS_PER_NODE:=4}"
  : "${TRAIN_GPUS:=2}"
  : "${ROLLOUT_GPUS:=2}"
  : "${TRAIN_NNODES:=$NNODES}"
  : "${ROLLOUT_NNODES:=$NNODES}"
  : "${ROLLOUT_TP:=1}"
  require_positive NNODES GPUS_PER_NODE TRAIN_GPUS ROLLOUT_GPUS TRAIN_NNODES ROLLOUT_NNODES ROLLOUT_TP
  if ! is_true "$TINY"; then
    if ((TRAIN_NNODES == NNODES && ROLLOUT_NNODES == NNODES)); then
      # every node hosts both roles
      ((TRAIN_GPUS + ROLLOUT_GPUS <= GPUS_PER_NODE)) ||
        die "TRAIN_GPUS ($TRAIN_GPUS) + ROLLOUT_GPUS ($ROLLOUT_GPUS) exceed GPUS_PER_NODE ($GPUS_PER_NODE)"
    else
      ((TRAIN_NNODES + ROLLOUT_NNODES <= NNODES)) ||
        die "TRAIN_NNODES ($TRAIN_NNODES) + ROLLOUT_NNODES ($ROLLOUT_NNODES) exceed NNODES ($NNODES)"
      ((TRAIN_GPUS <= GPUS_PER_NODE && ROLLOUT_GPUS <= GPUS_PER_NODE)) ||
        die "TRAIN_GPUS / ROLLOUT_GPUS cannot exceed GPUS_PER_NODE ($GPUS_PER_NODE)"
    fi
    ((ROLLOUT_GPUS % ROLLOUT_TP == 0)) ||
      die "ROLLOUT_GPUS ($ROLLOUT_GPUS) must be a multiple of ROLLOUT_TP ($ROLLOUT_TP)"
  fi
  return 0
}

# setup_rounds: update rounds per global step (PARAMETER_SYNC_STEP) and their sizes.
#   verl's separate_async step runs PARAMETER_SYNC_STEP rounds (`_step_once`), each on
#   ROUND_PROMPTS = TRAIN_PROMPTS / PARAMETER_SYNC_STEP fresh prompts, then pushes the weights to the
#   rollout side; verl asserts actor.ppo_mini_batch_size == ROUND_PROMPTS, i.e. one optimiser step per
#   round. Default: one round per mini-batch of PPO_MINI_PROMPTS (verl's own layout). A recipe may set
#   PARAMETER_SYNC_STEP first (group replay does); optimiser steps then stay PPO_MINI_PROMPTS groups
#   (replay.ppo_mini_batch_size).
setup_rounds() {
  require_positive TRAIN_PROMPTS PPO_MINI_PROMPTS
  ((TRAIN_PROMPTS % PPO_MINI_PROMPTS == 0)) ||
    die "TRAIN_PROMPTS ($TRAIN_PROMPTS) must be a multiple of PPO_MINI_PROMPTS ($PPO_MINI_PROMPTS)"
  : "${PARAMETER_SYNC_STEP:=$((TRAIN_PROMPTS / PPO_MINI_PROMPTS))}"
  require_positive PARAMETER_SYNC_STEP
  ((TRAIN_PROMPTS % PARAMETER_SYNC_STEP == 0)) ||
    die "TRAIN_PROMPTS ($TRAIN_PROMPTS) must split evenly over PARAMETER_SYNC_STEP ($PARAMETER_SYNC_STEP) update rounds"
  ROUND_PROMPTS=$((TRAIN_PROMPTS / PARAMETER_SYNC_STEP))
}

# replay_rounds FRESH REPLAY MINI: the update rounds of a global step that adds REPLAY replayed
# groups to FRESH fresh prompts, with optimiser steps of MINI groups: the most rounds that split both
# evenly and give every round whole optimiser steps (so every step holds the same share of replayed
# rows), if that is at least 2; else 2 rounds when both split evenly (toy scale: a round's
# last step is then short), else 1.
replay_rounds() {
  local fresh=$1 replay=$2 mini=$3 rounds best=0
  for ((rounds = fresh / mini; rounds >= 1; rounds--)); do
    ((fresh % rounds == 0 && replay % rounds == 0)) || continue
    if ((((fresh + replay) / rounds) % mini == 0)); then best=$rounds; break; fi
  done
  if ((best >= 2)); then echo "$best"; elif ((fresh % 2 == 0 && replay % 2 == 0 && fresh / 2 >= 1)); then echo 2; else echo 1; fi
}

# checkpoint_overrides: save verl's resumable checkpoint plus an HF model (the evaluation input).
checkpoint_overrides() {
  TRAIN_ARGS+=(
    "trainer.save_freq=$SAVE_FREQ"
    "actor_rollout_ref.actor.checkpoint.save_contents=$(hydra_list model optimizer extra hf_model)"
    "actor_rollout_ref.actor.checkpoint.load_contents=$(hydra_list model optimizer extra)"
  )
  if ! is_true "$TINY"; then
    TRAIN_ARGS+=("trainer.max_actor_ckpt_to_keep=$KEEP_CHECKPOINTS")
  fi
}

# dynamic_batch_overrides: verl's token-budget micro-batches (use_dynamic_bsz), as the GPU profile
# runs them: an update micro-batch holds up to PPO_MAX_TOKEN_LEN tokens, a log-prob pass up to
# LOG_PROB_MAX_TOKEN_LEN (see setup_engine).
dynamic_batch_overrides() {
  TRAIN_ARGS+=(
    actor_rollout_ref.actor.use_dynamic_bsz=True
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$PPO_MAX_TOKEN_LEN"
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$LOG_PROB_MAX_TOKEN_LEN"
  )
}

# gpu_engine_overrides: FSDP2 / vLLM sizing for long sequences (the GPU profile's open knobs).
gpu_engine_overrides() {
  is_true "$TINY" && return 0
  dynamic_batch_overrides
  TRAIN_ARGS+=(
    "actor_rollout_ref.actor.fsdp_config.param_offload=$ACTOR_PARAM_OFFLOAD"
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=$ACTOR_OFFLOAD"
    "actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP"
    "actor_rollout_ref.rollout.gpu_memory_utilization=$ROLLOUT_GPU_MEMORY_UTILIZATION"
    "actor_rollout_ref.rollout.max_model_len=$MAX_MODEL_LEN"
    "actor_rollout_ref.rollout.max_num_batched_tokens=$MAX_NUM_BATCHED_TOKENS"
    data.filter_overlong_prompts=True
    "trainer.logger=$LOGGER"
  )
}

# setup_engine: defaults of the GPU engine knobs (used by gpu_engine_overrides); after setup_attention.
#   Token limits per micro-batch and training GPU: PPO_MAX_TOKEN_LEN = max(one sequence, 16K);
#   LOG_PROB_MAX_TOKEN_LEN = max(one sequence, 32K) on the packed path, where the entropy runs in
#   chunks (the pass holds the logits, 2 B x tokens x 248K vocab, plus one chunk), and
#   PPO_MAX_TOKEN_LEN on the padded path (sdpa), where verl computes the entropy on the whole
#   micro-batch (three times the logits). At the paper's shapes these leave at least
#   MEMORY_MARGIN (10%) of an A100 80GB free at the peak pass (recipes/README.md, memory tables).
setup_engine() {
  MAX_MODEL_LEN=$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))
  : "${PPO_MAX_TOKEN_LEN:=$((MAX_MODEL_LEN > 16384 ? MAX_MODEL_LEN : 16384))}"
  if [[ "${USE_REMOVE_PADDING:-True}" == True ]]; then
    : "${LOG_PROB_MAX_TOKEN_LEN:=$((MAX_MODEL_LEN > 32768 ? MAX_MODEL_LEN : 32768))}"
  else
    : "${LOG_PROB_MAX_TOKEN_LEN:=$PPO_MAX_TOKEN_LEN}"
  fi
  : "${MAX_NUM_BATCHED_TOKENS:=$((MAX_MODEL_LEN > 16384 ? MAX_MODEL_LEN : 16384))}"
  : "${ROLLOUT_GPU_MEMORY_UTILIZATION:=0.85}"
  : "${ACTOR_OFFLOAD:=False}"       # optimizer state to CPU (fine with separate_async)
  : "${ACTOR_PARAM_OFFLOAD:=False}" # parameters too: only with one update round per weight push
  : "${LOGGER:=[console,file]}"
  : "${KEEP_CHECKPOINTS:=2}"
  require_positive PPO_MAX_TOKEN_LEN LOG_PROB_MAX_TOKEN_LEN MAX_NUM_BATCHED_TOKENS KEEP_CHECKPOINTS
  ((PPO_MAX_TOKEN_LEN >= MAX_MODEL_LEN)) ||
    die "PPO_MAX_TOKEN_LEN ($PPO_MAX_TOKEN_LEN) must hold one full sequence (MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH = $MAX_MODEL_LEN)"
  ((LOG_PROB_MAX_TOKEN_LEN >= MAX_MODEL_LEN)) ||
    die "LOG_PROB_MAX_TOKEN_LEN ($LOG_PROB_MAX_TOKEN_LEN) must hold one full sequence (MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH = $MAX_MODEL_LEN)"
  require_number ROLLOUT_GPU_MEMORY_UTILIZATION
  require_one_of ACTOR_OFFLOAD True False
  require_one_of ACTOR_PARAM_OFFLOAD True False
  if [[ "$ACTOR_PARAM_OFFLOAD" == True ]] && ((PARAMETER_SYNC_STEP > 1)); then
    die "ACTOR_PARAM_OFFLOAD=True with $PARAMETER_SYNC_STEP update rounds per weight push: verl's separate_async snapshots pi_old with save_model_to_cpu, which assumes GPU-resident parameters; use ACTOR_OFFLOAD=True (optimizer only) or PARAMETER_SYNC_STEP=1"
  fi
}

# eval_model_dir: the HF model the evaluation stage reads: EVAL_MODEL if set, else the latest
# checkpoint of RUN_DIR (verl's latest_checkpointed_iteration.txt) -> actor/huggingface. Under
# DRY_RUN=1 without a checkpoint yet, the path the training run will write at TOTAL_STEPS.
eval_model_dir() {
  if [[ -n "${EVAL_MODEL:-}" ]]; then
    printf '%s' "$EVAL_MODEL"
    return
  fi
  local ckpt="$RUN_DIR/checkpoints" step="$TOTAL_STEPS"
  if [[ -f "$ckpt/latest_checkpointed_iteration.txt" ]]; then
    step="$(tr -d '[:space:]' <"$ckpt/latest_checkpointed_iteration.txt")"
  elif ! is_true "$DRY_RUN"; then
    die "no checkpoint under $ckpt (run the train stage first, or set EVAL_MODEL=PATH)"
  fi
  printf '%s' "$ckpt/global_step_$step/actor/huggingface"
}

# print_settings NAME...: one line with the values the recipe resolved (+ the cluster layout).
print_settings() {
  local name line=""
  for name in "$@"; do line+="$name=${!name} "; done
  if is_true "$TINY"; then
    line+="placement=separate_async(cpu_tiny: 1 training + 1 rollout worker, cpu_gloo weight sync)"
  else
    line+="placement=separate_async(TRAIN_NNODES=$TRAIN_NNODES x TRAIN_GPUS=$TRAIN_GPUS + ROLLOUT_NNODES=$ROLLOUT_NNODES x ROLLOUT_GPUS=$ROLLOUT_GPUS, ROLLOUT_TP=$ROLLOUT_TP)"
  fi
  log "settings: $line"
}

# The evaluation command (python -m verl_replay.eval) for MODEL into EVAL_OUT; math rows are
# grouped per benchmark (extra_info.benchmark): Mean@n / Best@n per benchmark + Avg.
eval_cmd() {
  local model=$1 data
  local -a files
  split_csv files "$EVAL_FILES"
  ((${#files[@]})) || die "EVAL_FILES is empty"
  data="$(IFS=,; printf '%s' "${files[*]}")"
  EVAL_CMD=()
  if is_true "$TINY"; then EVAL_CMD+=(env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"); fi
  EVAL_CMD+=("$PYTHON" -m verl_replay.eval --data "$data" --model "$model" --out "$EVAL_OUT"
    --backend "$EVAL_BACKEND" --n "$EVAL_N" --k "$EVAL_K" --temperature "$EVAL_TEMPERATURE" --top-p "$EVAL_TOP_P"
    --max-new-tokens "$EVAL_MAX_NEW_TOKENS" --verify-workers "$VERIFY_WORKERS" --verify-timeout-s "$VERIFY_TIMEOUT_S")
  if [[ -n "$EVAL_LIMIT" ]]; then EVAL_CMD+=(--limit "$EVAL_LIMIT"); fi
  if [[ "$EVAL_BACKEND" == vllm ]]; then
    EVAL_CMD+=(--tensor-parallel-size "$EVAL_TP" --max-model-len "$MAX_MODEL_LEN")
  fi
}

# TRAIN_ARGS: the training overrides both recipes share (platform, data, sizes, logging, strategy).
# $1: the tiny task used with TINY=1 (math or sql).
base_train_args() {
  local platform=(platform=gpu)
  if is_true "$TINY"; then platform=(platform=cpu_tiny "tiny_task=$1"); fi
  TRAIN_ARGS=(
    "${platform[@]}"
    "data.train_files=$TRAIN_FILES"
    "data.val_files=$VAL_FILES"
    "actor_rollout_ref.model.path=$MODEL_PATH"
    "data.train_batch_size=$TRAIN_PROMPTS"
    "data.max_prompt_length=$MAX_PROMPT_LENGTH"
    "data.max_response_length=$MAX_RESPONSE_LENGTH"
    "actor_rollout_ref.rollout.n=$GROUP_SIZE"
    "actor_rollout_ref.rollout.temperature=$ROLLOUT_TEMPERATURE"
    "actor_rollout_ref.actor.ppo_mini_batch_size=$ROUND_PROMPTS"
    "actor_rollout_ref.actor.optim.lr=$LR"
    "trainer.total_training_steps=$TOTAL_STEPS"
    "trainer.test_freq=$TEST_FREQ"
    "actor_rollout_ref.rollout.val_kwargs.n=$VAL_N"
    "trainer.project_name=$PROJECT"
    "trainer.experiment_name=$EXPERIMENT"
    "run_dir=$RUN_DIR"
    "replay.strategy=$STRATEGY"
  )
  # replayed groups add optimiser steps of PPO_MINI_PROMPTS groups, whatever the round size
  if [[ "$STRATEGY" != none ]]; then TRAIN_ARGS+=("replay.ppo_mini_batch_size=$PPO_MINI_PROMPTS"); fi
}

# setup_attention: ATTN_IMPL (auto, flash_attention_2, sdpa, eager) -> ATTN_IMPL + USE_REMOVE_PADDING.
#   auto: what a GPU host runs, flash_attention_2 with padding-free packing, whether or not
#   flash-attn is installed where the recipe is composed (DRY_RUN=1 on a CPU machine shows the GPU
#   config; the preflight on the GPU host fails without flash-attn, with the memory the padded path
#   would need). sdpa / eager: padded micro-batches, only when asked for (verl packs sequences for
#   flash attention only). TINY=1: the CPU profile's sdpa with packing (exact on CPU).
setup_attention() {
  : "${ATTN_IMPL:=auto}"
  require_one_of ATTN_IMPL auto flash_attention_2 sdpa eager
  if is_true "$TINY"; then
    USE_REMOVE_PADDING=True
    return 0
  fi
  local choice why line
  why="$(mktemp)"
  # its reason is the recipe's line, not a preflight result (the preflight has not run yet)
  choice="$("$PYTHON" -m verl_replay.preflight --choose-attn "$ATTN_IMPL" 2>"$why")" || {
    cat "$why" >&2
    rm -f "$why"
    die "could not choose the attention implementation ($PYTHON -m verl_replay.preflight --choose-attn $ATTN_IMPL)"
  }
  while IFS= read -r line; do
    if [[ "$line" == "[preflight] attention: "* ]]; then log "attention: ${line#\[preflight\] attention: }"; else printf '%s\n' "$line" >&2; fi
  done <"$why"
  rm -f "$why"
  read -r ATTN_IMPL USE_REMOVE_PADDING <<<"$choice"
}

# gpu_stack_overrides: the attention choice (see setup_attention) for the GPU profile.
gpu_stack_overrides() {
  is_true "$TINY" && return 0
  TRAIN_ARGS+=(
    "actor_rollout_ref.model.override_config.attn_implementation=$ATTN_IMPL"
    "actor_rollout_ref.model.use_remove_padding=$USE_REMOVE_PADDING"
  )
}

# cluster_overrides: joining a running Ray cluster (RAY_ADDRESS is set, e.g. inside `ray job submit`).
#   Ray refuses num_cpus / num_gpus when it joins a cluster, so the CPU profile's logical counts are
#   dropped (the cluster's nodes declare their own). TINY=1's one training and one rollout worker then
#   go wherever the nodes offer a slot: on a cluster of two one-slot nodes, a whole-node split with
#   the weights sent between the nodes.
cluster_overrides() {
  [[ -n "${RAY_ADDRESS:-}" ]] || return 0
  TRAIN_ARGS+=(ray_kwargs.ray_init.num_cpus=null ray_kwargs.ray_init.num_gpus=null)
}

# run_preflight GENERATION_GPUS: `python -m verl_replay.preflight` with the training overrides
# (TRAIN_ARGS, from the recipe's train_cmd), the stages and the GPUs of the search / eval engine.
# Stops the recipe when a check fails. PREFLIGHT=0 skips it; PREFLIGHT=only stops after it;
# PREFLIGHT=table prints the per-GPU memory budget of the config instead (no checks, any machine).
run_preflight() {
  local generation_gpus=$1
  if [[ -n "${PREFLIGHT_DONE:-}" ]]; then
    stop_on_input_problems
    return 0
  fi
  PREFLIGHT_DONE=1
  : "${PREFLIGHT:=1}"
  require_one_of PREFLIGHT 1 0 only table
  local -a args=()
  local arg
  for arg in "${TRAIN_ARGS[@]}"; do [[ "$arg" == dry_run=* ]] || args+=("$arg"); done
  if [[ "$PREFLIGHT" == table ]]; then
    INPUT_PROBLEMS=() # the memory budget reads the config only
    run_stage memory "$PYTHON" -m verl_replay.preflight --memory-table "${args[@]}"
    exit 0
  fi
  if is_true "$DRY_RUN" || [[ "$PREFLIGHT" == 0 ]]; then
    stop_on_input_problems
    return 0
  fi
  # the stack is checked even when inputs are missing: every problem is reported in one go
  log "preflight: $(quote_cmd "$PYTHON" -m verl_replay.preflight --stages "$STAGES" --generation-gpus "$generation_gpus" "${args[@]}")"
  local stack_ok=1
  "$PYTHON" -m verl_replay.preflight --stages "$STAGES" --generation-gpus "$generation_gpus" "${args[@]}" || stack_ok=0
  if ! report_input_problems; then
    if ((stack_ok)); then die "${#INPUT_PROBLEMS[@]} input(s) missing (above); the stack checks passed"; fi
    die "${#INPUT_PROBLEMS[@]} input(s) missing and the preflight failed: fix the error and FAIL lines above (PREFLIGHT=0 skips the stack checks)"
  fi
  ((stack_ok)) || die "preflight failed: fix the FAIL lines above (PREFLIGHT=0 skips this check)"
  if [[ "$PREFLIGHT" == only ]]; then
    log "preflight OK (PREFLIGHT=only: stopping here)"
    exit 0
  fi
}

# preflight_val_files: VAL_FILES as the training stage passes it (a Hydra list for several files).
preflight_val_files() {
  if [[ "$VAL_FILES" == \[* ]]; then
    printf '%s' "$VAL_FILES" # already a Hydra list (the train stage converted it)
    return
  fi
  local -a files
  split_csv files "$VAL_FILES"
  if ((${#files[@]} > 1)); then printf '%s' "$(hydra_list "${files[@]}")"; else printf '%s' "$VAL_FILES"; fi
}
