#!/usr/bin/env bash
# Install the two CUDA kernel packages of the GPU stack that have no wheel on PyPI, against the
# torch already installed (pip install -e ".[gpu]" first, or inside the Docker image):
#
#   flash-attn     attn_implementation=flash_attention_2 with padding-free packing, and the in-place
#                  Triton cross-entropy verl uses for log-probs (halves the logits' memory in training)
#   causal-conv1d  the short convolution of Qwen3.5's Gated DeltaNet layers (without it verl runs a
#                  per-sequence torch convolution)
#
#   bash docker/install_kernels.sh [--dry-run] [flash-attn] [causal-conv1d]    # default: both
#
# First a prebuilt wheel from WHEEL_INDEX (default: verl's wheelhouse, where verl itself takes
# flash-attn 2.8.3 for torch 2.11 + CUDA 13; cp312 builds), kept only if its CUDA extension
# imports against the installed torch. Otherwise the PyPI sdist is compiled: its setup.py first
# looks for the project's own prebuilt wheel on GitHub (the published build matrices stop at
# torch 2.10), then builds: flash-attn takes ~30-90 min at MAX_JOBS=8 (each job needs ~4-8 GB of
# RAM), causal-conv1d a few minutes. A build needs nvcc of the CUDA major version torch was built
# for (13.x for torch 2.11.0 from PyPI; CUDA_HOME, /usr/local/cuda, or nvcc on PATH): the script
# stops before compiling with another one, whose extension would not load.
#
# Settings (environment): PYTHON, FLASH_ATTN_VERSION, CAUSAL_CONV1D_VERSION (empty: skip that
# package), MAX_JOBS, NVCC_THREADS, FLASH_ATTN_CUDA_ARCHS, FORCE_BUILD (TRUE: never use a
# prebuilt wheel), WHEEL_INDEX (empty: no wheel index). --dry-run prints what it would run and
# checks nvcc without stopping. docker/check_pins.py checks the version defaults against setup.py.
set -euo pipefail

: "${PYTHON:=python}"
: "${FLASH_ATTN_VERSION:=2.8.3}"
: "${CAUSAL_CONV1D_VERSION:=1.7.0}"
: "${MAX_JOBS:=8}"
: "${NVCC_THREADS:=2}"
: "${FLASH_ATTN_CUDA_ARCHS:=80;90;100}"
: "${FORCE_BUILD:=FALSE}"
: "${WHEEL_INDEX=https://verl-project.github.io/verl-wheelhouse/simple/}"

DRY_RUN=0
PACKAGES=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    flash-attn | causal-conv1d) PACKAGES+=("$arg") ;;
    -h | --help)
      sed -n '2,26p' "$0"
      exit 0
      ;;
    *)
      echo "[install_kernels] error: unknown argument '$arg' (flash-attn, causal-conv1d, --dry-run)" >&2
      exit 2
      ;;
  esac
done
((${#PACKAGES[@]})) || PACKAGES=(flash-attn causal-conv1d)

log() { printf '[install_kernels] %s\n' "$*" >&2; }
die() {
  printf '[install_kernels] error: %s\n' "$*" >&2
  exit 1
}
run() {
  log "run: $*"
  if ((DRY_RUN)); then return 0; fi
  "$@"
}

# installed_version DIST: the installed version of DIST, empty when it is not installed.
installed_version() {
  "$PYTHON" -c 'import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass' "$1"
}

# imports MODULE: the module (a CUDA extension) loads against the installed torch.
imports() { "$PYTHON" -c "import torch, $1" >/dev/null 2>&1; }

torch_cuda="$("$PYTHON" -c 'import torch; print(torch.version.cuda or "")')" ||
  die "$PYTHON cannot import torch: install the GPU stack first (pip install -e \".[gpu]\")"
[[ -n "$torch_cuda" ]] ||
  die "torch $("$PYTHON" -c 'import torch; print(torch.__version__)') is a CPU build: these kernels need the CUDA build (pip install -e \".[gpu]\" in a fresh venv)"

find_nvcc() {
  local candidate
  for candidate in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)"; do
    if [[ -n "$candidate" && -x "$candidate" ]]; then
      printf '%s' "$candidate"
      return 0
    fi
  done
  return 1
}

# nvcc_cuda NVCC: the CUDA release of an nvcc ("13.0" from "Cuda compilation tools, release 13.0, V13.0.88").
nvcc_cuda() { "$1" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1; }

# build_nvcc: the nvcc a build uses, on stdout; fails (message on stderr) when there is none or its
# CUDA major differs from torch's (torch.utils.cpp_extension refuses that, or the extension fails to load).
build_nvcc() {
  local nvcc version
  nvcc="$(find_nvcc)" || {
    log "no nvcc (CUDA $torch_cuda toolkit): set CUDA_HOME, install the toolkit, or use the Docker image (docker/README.md)"
    return 1
  }
  version="$(nvcc_cuda "$nvcc")"
  if [[ -z "$version" ]]; then
    log "cannot read the CUDA release from '$nvcc --version'"
    return 1
  fi
  if [[ "${version%%.*}" != "${torch_cuda%%.*}" ]]; then
    log "$nvcc is CUDA $version but torch is built for CUDA $torch_cuda: use a CUDA ${torch_cuda%%.*}.x toolkit (CUDA_HOME=...)"
    return 1
  fi
  log "nvcc $nvcc: CUDA $version, torch's CUDA $torch_cuda (same major)"
  printf '%s' "$nvcc"
}

# install PACKAGE VERSION MODULE EXTRA_ENV...: skip when pinned + importable, else wheel index, else build.
install() {
  local package=$1 version=$2 module=$3
  shift 3
  if [[ -z "$version" ]]; then
    log "$package: skipped (version is empty)"
    return 0
  fi
  local have
  have="$(installed_version "$package")"
  if [[ "${have%%+*}" == "$version" ]] && imports "$module"; then
    log "$package $have: already installed and importable"
    return 0
  fi
  if [[ -n "$WHEEL_INDEX" && "$FORCE_BUILD" != TRUE ]]; then
    if ((DRY_RUN)); then
      run "$PYTHON" -m pip install --no-deps --only-binary=:all: --index-url "$WHEEL_INDEX" "$package==$version"
      log "$package: kept if '$module' then imports against torch; else built:"
    elif run "$PYTHON" -m pip install --no-deps --only-binary=:all: --index-url "$WHEEL_INDEX" "$package==$version"; then
      if imports "$module"; then
        log "$package $version: prebuilt wheel from $WHEEL_INDEX"
        return 0
      fi
      log "$package: the wheel from $WHEEL_INDEX does not import against torch $("$PYTHON" -c 'import torch; print(torch.__version__)'); building instead"
      run "$PYTHON" -m pip uninstall -y "$package"
    else
      log "$package: no usable wheel at $WHEEL_INDEX; building instead"
    fi
  fi
  local nvcc
  if ! nvcc="$(build_nvcc)"; then
    ((DRY_RUN)) || die "$package $version cannot be built here (see above)"
    log "$package: (dry run) the build would stop here"
    return 0
  fi
  log "$package $version: building against torch (CUDA $torch_cuda) with $nvcc, MAX_JOBS=$MAX_JOBS"
  # setuptools<82: torch 2.11 declares it (a newer one breaks torch.utils.cpp_extension's contract)
  run "$PYTHON" -m pip install "ninja>=1.11" "packaging>=24" "psutil>=5.9" "setuptools>=70.1,<82" "wheel>=0.45"
  local cuda_home force=$FORCE_BUILD
  cuda_home="$(dirname "$(dirname "$nvcc")")"
  if ! run env CUDA_HOME="$cuda_home" MAX_JOBS="$MAX_JOBS" NVCC_THREADS="$NVCC_THREADS" "$@" \
    "$PYTHON" -m pip install --no-build-isolation --no-deps "$package==$version"; then
    # the setup.py probes GitHub for a prebuilt wheel and, offline, fails instead of compiling
    [[ "$force" != TRUE ]] || die "$package $version did not build; see the pip output above"
    log "$package: no prebuilt wheel could be fetched; compiling from source (FORCE_BUILD=TRUE)"
    run env CUDA_HOME="$cuda_home" MAX_JOBS="$MAX_JOBS" NVCC_THREADS="$NVCC_THREADS" "${@//=FALSE/=TRUE}" \
      "$PYTHON" -m pip install --no-build-isolation --no-deps "$package==$version" ||
      die "$package $version did not build; see the pip output above"
  fi
  if ((DRY_RUN == 0)); then
    imports "$module" || die "$package $version installed but '$module' does not import; see the pip output above"
    log "$package $(installed_version "$package"): installed"
  fi
}

for package in "${PACKAGES[@]}"; do
  case "$package" in
    flash-attn)
      install flash-attn "$FLASH_ATTN_VERSION" flash_attn_2_cuda \
        FLASH_ATTENTION_FORCE_BUILD="$FORCE_BUILD" FLASH_ATTN_CUDA_ARCHS="$FLASH_ATTN_CUDA_ARCHS"
      ;;
    causal-conv1d)
      install causal-conv1d "$CAUSAL_CONV1D_VERSION" causal_conv1d_cuda CAUSAL_CONV1D_FORCE_BUILD="$FORCE_BUILD"
      ;;
  esac
done
