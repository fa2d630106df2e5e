#!/usr/bin/env bash
# One-command CPU install of verl-replay: .venv in the repository with the CPU build of torch 2.13.0,
# then the package (editable) with its test tools. Quiet: one line per stage, pip's errors only.
#
#   bash scripts/install_cpu.sh            # then: . .venv/bin/activate
#
# Which torch: PyPI's torch 2.13.0 is a CUDA build of several GB. A local CPU wheel that pip finds
# (its find-links or a local index, as on this project's CI machines) is used as is; otherwise the
# CPU wheel comes from PyTorch's CPU index (TORCH_INDEX_URL moves it). Only when neither is there
# does it fall back to PyPI's build, and says so. Python 3.10-3.12 (PYTHON picks the interpreter).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

: "${PYTHON:=python3}"
: "${TORCH_INDEX_URL:=https://download.pytorch.org/whl/cpu}"
TORCH_PIN="torch==2.13.0"
QUIET=(-qq --progress-bar off)

say() { printf 'install_cpu: %s\n' "$*"; }

started=$SECONDS
"$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate

if pip install --dry-run --ignore-installed --no-deps --no-index "${QUIET[@]}" "$TORCH_PIN" >/dev/null 2>&1; then
  say "$TORCH_PIN from the local CPU wheel pip finds ..."
  pip install "${QUIET[@]}" "$TORCH_PIN"
elif say "$TORCH_PIN, CPU build, from $TORCH_INDEX_URL ..." &&
  pip install "${QUIET[@]}" "$TORCH_PIN" --index-url "$TORCH_INDEX_URL"; then
  :
else
  say "no CPU build of $TORCH_PIN reachable ($TORCH_INDEX_URL); installing PyPI's (a CUDA build, several GB) ..."
  pip install "${QUIET[@]}" "$TORCH_PIN"
fi
say "verl-replay (editable) with verl 0.9.1 and the test tools ..."
pip install "${QUIET[@]}" -e ".[test]"
say "done in $((SECONDS - started)) s: .venv ($(du -sh .venv | cut -f1)), $(python -c 'import torch; print("torch", torch.__version__)')"
