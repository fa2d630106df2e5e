#!/usr/bin/env bash
# A Ray cluster for the recipes: start the head, join workers, submit a recipe as a Ray job.
#
#   bash recipes/ray_cluster.sh head                        # on the head node (blocks; Ctrl-C stops it)
#   bash recipes/ray_cluster.sh worker                      # on every other node (RAY_HEAD=<head ip>)
#   bash recipes/ray_cluster.sh status                      # resources of the running cluster
#   bash recipes/ray_cluster.sh submit RECIPE [overrides]   # from the repository root, on any machine
#                                                           # that reaches the head's dashboard port
#
# head / worker run `ray start --block`: the node lives as long as that command, and stopping it
# (Ctrl-C, `kill <pid>`, `docker rm -f`) stops every Ray process of that node and nothing else. (`ray
# stop` would also do, but it kills every Ray process of the machine, whoever started it.)
# submit runs `ray job submit --working-dir .` (the repository, minus what .gitignore leaves out)
# with JOB_ENV passed to the recipe, and waits for the job; Ray sets RAY_ADDRESS in the job, so
# the recipe's training joins this cluster (cluster_overrides in recipes/common.sh).
#
# Settings (environment):
#   RAY_HEAD            address of the head node (worker, submit, status); head: --node-ip-address if set
#   RAY_PORT            GCS port of the head (6379)
#   RAY_DASHBOARD_PORT  dashboard / job server port of the head (8265)
#   RAY_TEMP_DIR        Ray's session folder on the head (default: Ray's own, /tmp/ray)
#   RAY_NUM_CPUS, RAY_NUM_GPUS, RAY_RESOURCES   what this node offers (default: detected; RESOURCES is JSON)
#   RAY_START_ARGS      more `ray start` flags, word-split (ports when several nodes share one host)
#   JOB_ENV             NAME=value pairs for the recipe, word-split, e.g. "NNODES=2 GPUS_PER_NODE=8 ..."
#   JOB_ID              submission id of the job (default: Ray's)
set -euo pipefail

RECIPE_NAME=ray_cluster
# shellcheck source=recipes/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

: "${RAY:=ray}"
: "${RAY_PORT:=6379}"
: "${RAY_DASHBOARD_PORT:=8265}"
: "${RAY_HEAD:=}"
: "${RAY_TEMP_DIR:=}"
: "${RAY_NUM_CPUS:=}"
: "${RAY_NUM_GPUS:=}"
: "${RAY_RESOURCES:=}"
: "${RAY_START_ARGS:=}"
: "${JOB_ENV:=}"
: "${JOB_ID:=}"
require_positive RAY_PORT RAY_DASHBOARD_PORT

usage() { die "usage: bash recipes/ray_cluster.sh {head|worker|status|submit RECIPE [hydra overrides]}"; }
(($#)) || usage
command=$1
shift

# node_args: what this node offers, as `ray start` flags.
node_args() {
  NODE_ARGS=(--disable-usage-stats)
  if [[ -n "$RAY_NUM_CPUS" ]]; then NODE_ARGS+=("--num-cpus=$RAY_NUM_CPUS"); fi
  if [[ -n "$RAY_NUM_GPUS" ]]; then NODE_ARGS+=("--num-gpus=$RAY_NUM_GPUS"); fi
  if [[ -n "$RAY_RESOURCES" ]]; then NODE_ARGS+=("--resources=$RAY_RESOURCES"); fi
  local -a extra
  read -r -a extra <<<"$RAY_START_ARGS"
  NODE_ARGS+=("${extra[@]}")
}

need_head() { [[ -n "$RAY_HEAD" ]] || die "set RAY_HEAD to the head node's address (the one \`ray_cluster.sh head\` printed)"; }

case "$command" in
  head)
    node_args
    cmd=("$RAY" start --head --block "--port=$RAY_PORT" --dashboard-host=0.0.0.0 "--dashboard-port=$RAY_DASHBOARD_PORT"
      --include-dashboard=true)
    if [[ -n "$RAY_HEAD" ]]; then cmd+=("--node-ip-address=$RAY_HEAD"); fi
    if [[ -n "$RAY_TEMP_DIR" ]]; then cmd+=("--temp-dir=$RAY_TEMP_DIR"); fi
    run_stage head "${cmd[@]}" "${NODE_ARGS[@]}"
    ;;
  worker)
    need_head
    node_args
    run_stage worker "$RAY" start --block "--address=$RAY_HEAD:$RAY_PORT" "${NODE_ARGS[@]}"
    ;;
  status)
    need_head
    run_stage status "$RAY" status "--address=$RAY_HEAD:$RAY_PORT"
    ;;
  submit)
    need_head
    (($#)) || usage
    recipe=$1
    shift
    [[ -f "recipes/$recipe" ]] || die "no recipe recipes/$recipe (run from the repository root; e.g. headroom_drift_math.sh)"
    read -r -a job_env <<<"$JOB_ENV"
    for pair in "${job_env[@]}"; do
      [[ "$pair" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "JOB_ENV: '$pair' is not NAME=value"
    done
    cmd=("$RAY" job submit "--address=http://$RAY_HEAD:$RAY_DASHBOARD_PORT" --working-dir .)
    if [[ -n "$JOB_ID" ]]; then cmd+=("--submission-id=$JOB_ID"); fi
    run_stage submit "${cmd[@]}" -- env "${job_env[@]}" bash "recipes/$recipe" "$@"
    ;;
  *) usage ;;
esac
