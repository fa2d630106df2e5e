#!/usr/bin/env bash
# GPU smoke test of the recipes' own path, sized by the GPUs it sees (one command):
#
#   1 GPU    sync GRPO steps with vLLM rollout and flash-attn packing on the tiny real-architecture
#            model (Qwen3.5 at toy size, the tiny assets): Headroom-Drift on tiny math, then the
#            EliteReplay archive search (vLLM) and EliteReplay steps on tiny SQL. Under 10 minutes.
#   2+ GPUs  the split placement both recipes run (trainer.v1.trainer_mode=separate_async: 1 training
#            + 1 rollout GPU, nccl weight push, pi_old saved and restored between update rounds)
#            through the recipes themselves, at their TINY=1 shapes on the tiny model.
#   4+ GPUs  and a model at MODEL_PATH (config.json): also a few steps of the real recipes (paper
#            placement 2 + 2, their default sizes; DATA_DIR's prepared files, else the tiny data).
#
# Before the runs the preflight checks the stack (flash-attn, vLLM, cupy, ...). While each stage
# runs, nvidia-smi samples every GPU's memory; the report prints the peak per GPU and per stage and
# writes OUTPUT_DIR/gpu_smoke_report.json (mode, GPUs, per stage: command, exit status, seconds,
# steps logged, peak MiB per GPU, verl's perf/max_memory_* of the training rank).
#
#   bash scripts/gpu_smoke.sh                    # on a GPU host with the GPU stack (README's GPU command)
#   SMOKE_DRY_RUN=1 bash scripts/gpu_smoke.sh    # any machine: print the plan for the GPUs it sees
#   SMOKE_DRY_RUN=1 SMOKE_GPUS=4 MODEL_PATH=~/models/Qwen3.5-4B bash scripts/gpu_smoke.sh
#
# Settings (environment): PYTHON (python), OUTPUT_DIR (a fresh temporary folder), SMOKE_GPUS (the
# GPU count to plan for; default: what nvidia-smi lists), STEPS (3: tiny runs; 2: the real
# recipes), SMOKE_TIMEOUT_S (600: each tiny stage's limit), MODEL_PATH / DATA_DIR (the 4-GPU
# stage), ROLLOUT_GPU_MEMORY_UTILIZATION (0.3 for the tiny model), SMOKE_DRY_RUN (1: print the
# plan; SMOKE_COMPOSE=1 also composes and validates every training config, DRY_RUN=1 / dry_run=true).
# Exit status: 0 when the preflight passed and every stage logged all its steps.
set -euo pipefail

: "${PYTHON:=python}"
: "${STEPS:=3}"
: "${SMOKE_TIMEOUT_S:=600}"
: "${ROLLOUT_GPU_MEMORY_UTILIZATION:=0.3}"
: "${SMOKE_DRY_RUN:=0}"
: "${SMOKE_COMPOSE:=0}"
: "${MODEL_PATH:=}"
: "${DATA_DIR:=$HOME/data/verl_replay}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -z "${OUTPUT_DIR:-}" ]]; then OUTPUT_DIR="$(mktemp -d "${TMPDIR:-/tmp}/verl_replay_gpu_smoke.XXXXXX")"; fi
mkdir -p "$OUTPUT_DIR"
REPORT="$OUTPUT_DIR/gpu_smoke_report.json"
STAGES_FILE="$OUTPUT_DIR/stages.jsonl"
: >"$STAGES_FILE"
started=$SECONDS

say() { printf '[gpu_smoke] %s\n' "$*" >&2; }
fail() {
  say "FAILED: $*"
  exit 1
}
quote() { printf '%q ' "$@"; }

[[ "$STEPS" =~ ^[1-9][0-9]*$ ]] || fail "STEPS must be a positive integer, got '$STEPS'"

# ---- the GPUs ------------------------------------------------------------------------------
if [[ -z "${SMOKE_GPUS:-}" ]]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    SMOKE_GPUS="$(nvidia-smi -L | grep -c '^GPU ')"
  else
    SMOKE_GPUS=0
  fi
fi
[[ "$SMOKE_GPUS" =~ ^[0-9]+$ ]] || fail "SMOKE_GPUS must be a GPU count, got '$SMOKE_GPUS'"
if [[ "$SMOKE_DRY_RUN" != 1 ]]; then
  ((SMOKE_GPUS > 0)) || fail "no GPU: nvidia-smi lists none (SMOKE_DRY_RUN=1 prints the plan on any machine)"
  nvidia-smi -L >&2
  "$PYTHON" -c 'import sys, torch
if torch.version.cuda is None or not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__}: no usable CUDA GPU (the README GPU command: pip install -e \".[gpu,test]\" && bash docker/install_kernels.sh)")
print(f"[gpu_smoke] torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}", file=sys.stderr)' ||
    fail "no usable CUDA GPU"
fi
((SMOKE_GPUS >= 1)) || SMOKE_GPUS=1 # a dry run on a machine without GPUs plans the one-GPU mode
if ((SMOKE_GPUS == 1)); then MODE=one_gpu; else MODE=split; fi
PAPER=0
if ((SMOKE_GPUS >= 4)) && [[ -n "$MODEL_PATH" && -f "$MODEL_PATH/config.json" ]]; then PAPER=1; fi
say "mode: $MODE ($SMOKE_GPUS GPU(s))$( ((PAPER)) && printf ' + the real recipes on %s' "$MODEL_PATH")"

# ---- the tiny assets (built and cached on first use, as TINY=1 does) --------------------------
assets="$("$PYTHON" -c 'import shlex
from verl_replay.data.tiny_assets import build_tiny_assets
a = build_tiny_assets()
for name in ("model_dir", "sql_model_dir", "math_train", "math_val", "sql_train", "sql_val"):
    print(shlex.quote(str(getattr(a, name))), end=" ")')" || fail "could not build the tiny assets"
read -r TINY_MODEL TINY_SQL_MODEL MATH_TRAIN MATH_VAL SQL_TRAIN SQL_VAL <<<"$assets"
read -r ATTN PACKED < <("$PYTHON" -m verl_replay.preflight --choose-attn auto 2>/dev/null)

# ---- the stages ---------------------------------------------------------------------------------
# Each stage: a name, the environment it adds, the command, the run folder whose metrics.jsonl
# counts its steps ('' for stages without training steps) and the steps it must log.
declare -a STAGE_NAMES=() STAGE_ENVS=() STAGE_CMDS=() STAGE_RUNS=() STAGE_STEPS=()
stage() { # stage NAME "ENV..." RUN_DIR STEPS CMD...
  STAGE_NAMES+=("$1")
  STAGE_ENVS+=("$2")
  STAGE_RUNS+=("$3")
  STAGE_STEPS+=("$4")
  shift 4
  STAGE_CMDS+=("$(quote "$@")")
}

# The one-GPU sync run (verl's sync trainer, FSDP2 + vLLM colocated, weights handed over in place).
sync_overrides() { # sync_overrides MODEL TRAIN VAL RESPONSE_LEN RUN_DIR
  SYNC=(
    platform=gpu
    "actor_rollout_ref.model.path=$1" "data.train_files=$2" "data.val_files=$3"
    data.train_batch_size=4 data.max_prompt_length=256 "data.max_response_length=$4"
    data.dataloader_num_workers=0 data.filter_overlong_prompts=True
    "actor_rollout_ref.model.override_config.attn_implementation=$ATTN"
    "actor_rollout_ref.model.use_remove_padding=$PACKED"
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096
    actor_rollout_ref.actor.optim.lr=1e-5 actor_rollout_ref.rollout.n=4
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    "actor_rollout_ref.rollout.gpu_memory_utilization=$ROLLOUT_GPU_MEMORY_UTILIZATION"
    "actor_rollout_ref.rollout.max_model_len=$((256 + $4))" actor_rollout_ref.rollout.max_num_batched_tokens=4096
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192 actor_rollout_ref.rollout.enforce_eager=True
    actor_rollout_ref.rollout.agent.num_workers=1
    trainer.v1.trainer_mode=sync trainer.n_gpus_per_node=1 trainer.nnodes=1 "trainer.total_training_steps=$STEPS"
    trainer.save_freq=-1 trainer.test_freq=-1 trainer.val_before_train=False "trainer.logger=[console,file]"
    trainer.project_name=gpu_smoke "trainer.experiment_name=$(basename "$5")" "run_dir=$5"
  )
}

# The recipes' TINY=1 shapes on the GPU path (platform=gpu, split placement, nccl).
TINY_SHAPES="GPUS_PER_NODE=$SMOKE_GPUS TRAIN_GPUS=1 ROLLOUT_GPUS=1 TOTAL_STEPS=$STEPS TRAIN_PROMPTS=4 GROUP_SIZE=4 PPO_MINI_PROMPTS=2 MAX_PROMPT_LENGTH=256 TEST_FREQ=-1 SAVE_FREQ=$STEPS KEEP_CHECKPOINTS=1 LR=1e-5 ROLLOUT_GPU_MEMORY_UTILIZATION=$ROLLOUT_GPU_MEMORY_UTILIZATION OUTPUT_DIR=$OUTPUT_DIR PYTHON=$PYTHON"
ARCHIVE="$OUTPUT_DIR/elite_replay_sql/archive/elite_archive.parquet"
SEARCH_TINY="SEARCH_LIMIT=8 SEARCH_SEEDS=4 SEARCH_MUTATIONS=1 SEARCH_ROUNDS=1 SEARCH_BATCH_SIZE=64"

if [[ "$MODE" == one_gpu ]]; then
  sync_overrides "$TINY_MODEL" "$MATH_TRAIN" "$MATH_VAL" 24 "$OUTPUT_DIR/hd_sync"
  stage preflight "" "" 0 "$PYTHON" -m verl_replay.preflight "${SYNC[@]}" replay.strategy=headroom_drift
  stage headroom_drift_sync "" "$OUTPUT_DIR/hd_sync" "$STEPS" "$PYTHON" -m verl_replay.main "${SYNC[@]}" \
    replay.strategy=headroom_drift replay.k_rep=2 replay.tau=0.08
  # the elite recipe's search stage only (a single vLLM process on this GPU)
  stage elite_search "$TINY_SHAPES GPUS_PER_NODE=2 STAGES=search PREFLIGHT=0 MODEL_PATH=$TINY_SQL_MODEL TRAIN_FILES=$SQL_TRAIN VAL_FILES=$SQL_VAL EVAL_FILES=$SQL_VAL MAX_RESPONSE_LENGTH=96 $SEARCH_TINY" \
    "" 0 bash "$REPO/recipes/elite_replay_qwen4b.sh"
  sync_overrides "$TINY_SQL_MODEL" "$SQL_TRAIN" "$SQL_VAL" 96 "$OUTPUT_DIR/elite_sync"
  stage elite_sync "" "$OUTPUT_DIR/elite_sync" "$STEPS" "$PYTHON" -m verl_replay.main "${SYNC[@]}" \
    replay.strategy=elite "replay.elite.archive=$ARCHIVE" replay.elite.batch_size=4
else
  stage headroom_drift_split "$TINY_SHAPES STAGES=train K_REP=2 MODEL_PATH=$TINY_MODEL TRAIN_FILES=$MATH_TRAIN VAL_FILES=$MATH_VAL EVAL_FILES=$MATH_VAL MAX_RESPONSE_LENGTH=24" \
    "$OUTPUT_DIR/headroom_drift_math/hd_b16_r8" "$STEPS" bash "$REPO/recipes/headroom_drift_math.sh"
  stage elite_split "$TINY_SHAPES STAGES=search,train ELITE_BATCH_SIZE=4 MODEL_PATH=$TINY_SQL_MODEL TRAIN_FILES=$SQL_TRAIN VAL_FILES=$SQL_VAL EVAL_FILES=$SQL_VAL MAX_RESPONSE_LENGTH=96 $SEARCH_TINY" \
    "$OUTPUT_DIR/elite_replay_sql/elite_q4x4" "$STEPS" bash "$REPO/recipes/elite_replay_qwen4b.sh"
fi
if ((PAPER)); then
  PAPER_ENV="MODEL_PATH=$MODEL_PATH DATA_DIR=$DATA_DIR TOTAL_STEPS=2 OUTPUT_DIR=$OUTPUT_DIR/paper PYTHON=$PYTHON"
  if [[ ! -f "$DATA_DIR/math_train.parquet" ]]; then
    PAPER_ENV+=" TRAIN_FILES=$MATH_TRAIN VAL_FILES=$MATH_VAL EVAL_FILES=$MATH_VAL"
  fi
  stage headroom_drift_paper "$PAPER_ENV STAGES=train TEST_FREQ=-1" "$OUTPUT_DIR/paper/headroom_drift_math/hd_b256_r128" 2 \
    bash "$REPO/recipes/headroom_drift_math.sh" trainer.save_freq=-1
  PAPER_ENV="MODEL_PATH=$MODEL_PATH DATA_DIR=$DATA_DIR TOTAL_STEPS=2 OUTPUT_DIR=$OUTPUT_DIR/paper PYTHON=$PYTHON"
  if [[ ! -f "$DATA_DIR/bird_train.parquet" ]]; then
    PAPER_ENV+=" TRAIN_FILES=$SQL_TRAIN VAL_FILES=$SQL_VAL EVAL_FILES=$SQL_VAL"
  fi
  stage elite_paper "$PAPER_ENV STAGES=search,train TEST_FREQ=-1 SEARCH_LIMIT=16" "$OUTPUT_DIR/paper/elite_replay_sql/elite_q128x8" 2 \
    bash "$REPO/recipes/elite_replay_qwen4b.sh" trainer.save_freq=-1
fi

# ---- dry run: the plan ----------------------------------------------------------------------------
if [[ "$SMOKE_DRY_RUN" == 1 ]]; then
  for i in "${!STAGE_NAMES[@]}"; do
    say "stage ${STAGE_NAMES[$i]}: ${STAGE_ENVS[$i]:+env ${STAGE_ENVS[$i]} }${STAGE_CMDS[$i]}"
    if [[ "$SMOKE_COMPOSE" == 1 ]]; then
      command="${STAGE_CMDS[$i]}"
      case "$command" in
        *verl_replay.main*) eval "env ${STAGE_ENVS[$i]} $command dry_run=true" >/dev/null ;;
        *recipes/*) eval "env ${STAGE_ENVS[$i]} DRY_RUN=1 $command" >/dev/null ;;
        *) continue ;;
      esac || fail "stage ${STAGE_NAMES[$i]}: the config does not compose"
      say "  composes and validates"
    fi
  done
  say "OK: the plan of mode $MODE (SMOKE_DRY_RUN=1; nothing ran)"
  exit 0
fi

# ---- run: each stage with nvidia-smi sampling the GPUs' memory -----------------------------------
status_all=0
for i in "${!STAGE_NAMES[@]}"; do
  name=${STAGE_NAMES[$i]}
  samples="$OUTPUT_DIR/$name.memory.csv"
  log_file="$OUTPUT_DIR/$name.log"
  say "stage $name: ${STAGE_ENVS[$i]:+env ${STAGE_ENVS[$i]} }${STAGE_CMDS[$i]}"
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 >"$samples" 2>/dev/null &
  sampler=$!
  stage_started=$SECONDS
  set +e
  eval "timeout $SMOKE_TIMEOUT_S env ${STAGE_ENVS[$i]} ${STAGE_CMDS[$i]}" >"$log_file" 2>&1
  status=$?
  set -e
  kill "$sampler" 2>/dev/null || true
  wait "$sampler" 2>/dev/null || true
  set +e
  "$PYTHON" - "$STAGES_FILE" "$name" "$status" "$((SECONDS - stage_started))" "$samples" "${STAGE_RUNS[$i]}" \
    "${STAGE_STEPS[$i]}" "$log_file" "${STAGE_ENVS[$i]} ${STAGE_CMDS[$i]}" <<'EOF'
import json, sys
from pathlib import Path

out, name, status, seconds, samples, run_dir, steps, log_file, command = sys.argv[1:]
peak = {}
for line in Path(samples).read_text().splitlines() if Path(samples).exists() else []:
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and all(p.isdigit() for p in parts):
        peak[f"gpu{parts[0]}"] = max(peak.get(f"gpu{parts[0]}", 0), int(parts[1]))
metrics = Path(run_dir) / "metrics.jsonl" if run_dir else None
rows = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()] if metrics and metrics.exists() else []
verl_peak = {k: max(r["data"].get(k, 0) for r in rows) for k in ("perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb")} if rows else {}
logged = [r["step"] for r in rows]
ok = int(status) == 0 and (logged == list(range(1, int(steps) + 1)) if int(steps) else True)
record = {"stage": name, "ok": ok, "exit_status": int(status), "seconds": int(seconds), "steps_logged": logged,
          "steps_expected": int(steps), "peak_memory_mib": peak, "training_rank_peak_gb": verl_peak,
          "log": log_file, "command": command.strip()}
with open(out, "a", encoding="utf-8") as handle:
    handle.write(json.dumps(record) + "\n")
shown = ", ".join(f"{gpu} {mib} MiB" for gpu, mib in sorted(peak.items())) or "no samples"
print(f"[gpu_smoke] {name}: {'OK' if ok else 'FAILED'} in {seconds} s, {len(logged)}/{steps} steps, peak {shown}"
      + (f"; training rank max allocated {verl_peak['perf/max_memory_allocated_gb']:.2f} GB" if verl_peak else "")
      + ("" if ok else f" (exit status {status}; log: {log_file})"), file=sys.stderr)
sys.exit(0 if ok else 1)
EOF
  stage_ok=$?
  set -e
  if ((stage_ok != 0)); then
    status_all=1
    [[ "$name" != preflight ]] || break # nothing else can run on a stack that fails its preflight
  fi
done

"$PYTHON" - "$STAGES_FILE" "$REPORT" "$MODE" "$SMOKE_GPUS" "$((SECONDS - started))" <<'EOF'
import json, sys
from pathlib import Path

stages_file, report, mode, gpus, seconds = sys.argv[1:]
stages = [json.loads(l) for l in Path(stages_file).read_text().splitlines() if l.strip()]
summary = {"mode": mode, "gpus": int(gpus), "seconds": int(seconds), "ok": bool(stages) and all(s["ok"] for s in stages), "stages": stages}
Path(report).write_text(json.dumps(summary, indent=1) + "\n")
print(f"[gpu_smoke] report: {report}", file=sys.stderr)
print(f"[gpu_smoke] {sum(s['ok'] for s in stages)}/{len(stages)} stages OK in {seconds} s: {'OK' if summary['ok'] else 'FAILED'}", file=sys.stderr)
EOF
exit "$status_all"
