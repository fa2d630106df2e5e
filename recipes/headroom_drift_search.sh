#!/usr/bin/env bash
# GRPO + Headroom-Drift Replay on agentic search (Search-R1-style multi-turn retrieval) with
# Qwen3.5-4B: recipes/headroom_drift_math.sh with DOMAIN=search (same variables; train stage only).
#
#   bash recipes/headroom_drift_search.sh [hydra overrides for the training command ...]
#
# Trajectories come from verl's tool agent loop (agent_name=tool_agent) calling the `search` tool
# of TOOL_CONFIG (verl_replay.integrations.verl.search_tool.LocalSearchTool). Data and tool config:
#   python -m verl_replay.search.server --corpus wiki-18.jsonl --port 8000 &     # paper scale
#   python -m verl_replay.data prepare search --input SEARCH_R1_DATA --output "$DATA_DIR" \
#       --retrieval-url http://127.0.0.1:8000/retrieve
# Extra variables: TOOL_CONFIG (default $DATA_DIR/search_tools.yaml), MAX_TURNS (assistant turns).
# TINY=1: the tiny search task on CPU (BM25 over a 12-document corpus, a tiny warm-started model).
set -euo pipefail
DOMAIN=search exec bash "$(dirname "${BASH_SOURCE[0]}")/headroom_drift_math.sh" "$@"
