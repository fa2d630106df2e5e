"""Generation backends with one interface: transformers ``generate`` (CPU) and vLLM (GPU).

``make_backend("hf", model_path=...)`` / ``make_backend("vllm", model_path=...)``. Importing this
package imports neither torch, transformers nor vllm; each backend imports its library when
constructed.
"""

from __future__ import annotations

import importlib
from typing import Any

from verl_replay._lazy import lazy_exports
from verl_replay.generation.base import Generation, GenerationBackend, Prompt

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "Generation",
    "GenerationBackend",
    "HFBackend",
    "Prompt",
    "VLLMBackend",
    "make_backend",
]

# backend name (and aliases) -> (module, class)
BACKENDS: dict[str, tuple[str, str]] = {
    "hf": ("verl_replay.generation.hf", "HFBackend"),
    "transformers": ("verl_replay.generation.hf", "HFBackend"),
    "vllm": ("verl_replay.generation.vllm", "VLLMBackend"),
}
_LAZY = {
    "HFBackend": "verl_replay.generation.hf",
    "VLLMBackend": "verl_replay.generation.vllm",
    "BackendUnavailableError": "verl_replay.generation.vllm",
}


def make_backend(name: str, **kwargs: Any) -> GenerationBackend:
    """Construct a backend by name (``hf`` / ``transformers`` / ``vllm``); kwargs go to its class.

    Raises ``BackendUnavailableError`` (an ImportError) naming the install command when ``vllm``
    is requested but not installed, and ValueError for an unknown name.
    """
    key = str(name).strip().lower()
    if key not in BACKENDS:
        raise ValueError(f"unknown generation backend {name!r}; choose one of {sorted(BACKENDS)}")
    module_name, class_name = BACKENDS[key]
    module = importlib.import_module(module_name)
    if key == "vllm" and not module.vllm_available():
        raise module.BackendUnavailableError(module.VLLM_INSTALL_HINT)
    return getattr(module, class_name)(**kwargs)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
