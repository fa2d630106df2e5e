#!/usr/bin/env bash
# One-GPU smoke test of the GPU stack (under 8 minutes): the preflight, then three GRPO steps of
# the tiny recipe's model and data (the tiny assets, Qwen3.5's architecture at toy size) on CUDA
# with platform=gpu: FSDP2 training and a vLLM rollout colocated on one GPU (verl's sync trainer,
# weights handed over in place), Headroom-Drift replay on. Prints a short report at the end.
#
#   bash scripts/gpu_smoke.sh                  # on a machine with the GPU stack and one GPU
#   SMOKE_DRY_RUN=1 bash scripts/gpu_smoke.sh  # any machine: compose + validate the run (dry_run=true)
#
# vLLM 0.24 serves Qwen3.5 as Qwen3_5ForConditionalGeneration only, which the tiny assets (format
# v3) are, with their Qwen3VLProcessor; an older text-only Qwen3_5ForCausalLM tiny model makes the
# preflight stop here, naming the architecture.
#
# Settings (environment): PYTHON (python), OUTPUT_DIR (a fresh temporary folder), STEPS (3),
# SMOKE_TIMEOUT_S (420: the training run's limit), ROLLOUT_GPU_MEMORY_UTILIZATION (0.3),
# ATTN_IMPL (auto), CUDA_VISIBLE_DEVICES (which GPU). Extra arguments are Hydra overrides for the
# training command. Exit status: 0 when the preflight passed and every step was logged.
set -euo pipefail

: "${PYTHON:=python}"
: "${STEPS:=3}"
: "${SMOKE_TIMEOUT_S:=420}"
: "${ROLLOUT_GPU_MEMORY_UTILIZATION:=0.3}"
: "${ATTN_IMPL:=auto}"
: "${SMOKE_DRY_RUN:=0}"
if [[ -z "${OUTPUT_DIR:-}" ]]; then OUTPUT_DIR="$(mktemp -d "${TMPDIR:-/tmp}/verl_replay_gpu_smoke.XXXXXX")"; fi
RUN_DIR="$OUTPUT_DIR/gpu_smoke"
started=$SECONDS

say() { printf '[gpu_smoke] %s\n' "$*" >&2; }
fail() {
  say "FAILED: $*"
  exit 1
}

[[ "$STEPS" =~ ^[1-9][0-9]*$ ]] || fail "STEPS must be a positive integer, got '$STEPS'"
if [[ "$SMOKE_DRY_RUN" != 1 ]]; then
  command -v nvidia-smi >/dev/null && nvidia-smi -L >&2 || say "nvidia-smi not found"
  "$PYTHON" -c 'import sys, torch
if torch.version.cuda is None or not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__}: no usable CUDA GPU (install the GPU stack: pip install -e \".[gpu]\")")
print(f"[gpu_smoke] torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}", file=sys.stderr)' ||
    fail "no GPU"
fi

# The tiny recipe's assets (built and cached on first use, as TINY=1 does).
assets="$("$PYTHON" -c 'import shlex
from verl_replay.data.tiny_assets import build_tiny_assets
a = build_tiny_assets()
print(shlex.quote(str(a.model_dir)), shlex.quote(str(a.math_train)), shlex.quote(str(a.math_val)))')" ||
  fail "could not build the tiny assets"
read -r MODEL TRAIN_FILE VAL_FILE <<<"$assets"
read -r attn packed < <("$PYTHON" -m verl_replay.preflight --choose-attn "$ATTN_IMPL")

OVERRIDES=(
  platform=gpu
  "actor_rollout_ref.model.path=$MODEL"
  "data.train_files=$TRAIN_FILE"
  "data.val_files=$VAL_FILE"
  data.train_batch_size=4
  data.max_prompt_length=256
  data.max_response_length=24
  data.dataloader_num_workers=0
  data.filter_overlong_prompts=True
  "actor_rollout_ref.model.override_config.attn_implementation=$attn"
  "actor_rollout_ref.model.use_remove_padding=$packed"
  actor_rollout_ref.actor.ppo_mini_batch_size=4
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096
  actor_rollout_ref.actor.optim.lr=1e-5
  actor_rollout_ref.rollout.n=4
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  "actor_rollout_ref.rollout.gpu_memory_utilization=$ROLLOUT_GPU_MEMORY_UTILIZATION"
  actor_rollout_ref.rollout.max_model_len=280
  actor_rollout_ref.rollout.max_num_batched_tokens=4096
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192
  actor_rollout_ref.rollout.enforce_eager=True
  actor_rollout_ref.rollout.agent.num_workers=1
  trainer.v1.trainer_mode=sync
  trainer.n_gpus_per_node=1
  trainer.nnodes=1
  "trainer.total_training_steps=$STEPS"
  trainer.save_freq=-1
  trainer.test_freq=-1
  trainer.val_before_train=False
  "trainer.logger=[console,file]"
  trainer.project_name=verl_replay
  trainer.experiment_name=gpu_smoke
  "run_dir=$RUN_DIR"
  replay.strategy=headroom_drift
  replay.k_rep=2
  replay.tau=0.08
  "$@"
)

if [[ "$SMOKE_DRY_RUN" == 1 ]]; then
  say "train (dry run): $PYTHON -m verl_replay.main ${OVERRIDES[*]} dry_run=true"
  "$PYTHON" -m verl_replay.main "${OVERRIDES[@]}" dry_run=true >/dev/null || fail "the smoke run's config does not compose"
  say "OK: the smoke run's config composes and validates (SMOKE_DRY_RUN=1; nothing ran)"
  exit 0
fi

say "preflight: $PYTHON -m verl_replay.preflight ${OVERRIDES[*]}"
preflight_log="$OUTPUT_DIR/preflight.txt"
if ! "$PYTHON" -m verl_replay.preflight "${OVERRIDES[@]}" | tee "$preflight_log"; then
  fail "preflight (see the FAIL lines above)"
fi

say "train: $PYTHON -m verl_replay.main ${OVERRIDES[*]}"
train_log="$OUTPUT_DIR/train.log"
train_started=$SECONDS
set +e
timeout "$SMOKE_TIMEOUT_S" "$PYTHON" -m verl_replay.main "${OVERRIDES[@]}" >"$train_log" 2>&1
status=$?
set -e
train_seconds=$((SECONDS - train_started))

# The report: what the run logged, one line per step, and the verdict.
"$PYTHON" - "$RUN_DIR/metrics.jsonl" "$STEPS" "$status" "$train_seconds" "$((SECONDS - started))" "$train_log" "$preflight_log" <<'EOF'
import json, sys
from pathlib import Path

metrics, steps, status, train_s, total_s, train_log, preflight_log = sys.argv[1:]
rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()] if Path(metrics).exists() else []
print("[gpu_smoke] report")
print("  preflight: " + (Path(preflight_log).read_text().strip().splitlines() or ["?"])[-1].replace("[preflight] ", ""))
for row in rows:
    d = row["data"]
    fields = [("step s", "timing_s/step"), ("gen s", "timing_s/gen"), ("score", "critic/score/mean"),
              ("pg loss", "actor/pg_loss"), ("replay accepted", "replay/accepted"), ("GPU max alloc GiB", "perf/max_memory_allocated_gb")]
    shown = ", ".join(f"{name} {d[key]:.3g}" for name, key in fields if isinstance(d.get(key), (int, float)))
    print(f"  step {row['step']}: {shown}")
ok = int(status) == 0 and [r["step"] for r in rows] == list(range(1, int(steps) + 1))
why = "" if ok else (f" (exit status {status}{', timed out' if int(status) == 124 else ''}; log: {train_log})")
print(f"  {len(rows)}/{steps} steps in {train_s} s of training, {total_s} s in all: {'OK' if ok else 'FAILED'}{why}")
sys.exit(0 if ok else 1)
EOF
