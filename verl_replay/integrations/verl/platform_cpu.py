"""A ``cpu`` platform for verl 0.9.1, selected with ``VERL_PLATFORM=cpu``.

verl has no CPU platform: without one, ``trainer.device=cpu`` is rewritten to ``cuda`` and every
worker asks for NCCL. This platform answers the device questions for a CPU-only host. Its Ray
resource name is ``GPU`` on purpose: verl's resource pools always request GPU bundles, so a
CPU run declares logical GPU slots (``ray_init.num_gpus``) that only serve Ray's bookkeeping.
"""

from __future__ import annotations

import contextlib
import os
import sys
from types import ModuleType
from typing import Any, Iterator, Optional

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

CPU_PLATFORM_NAME = "cpu"


def _host_memory_bytes() -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _build_device_module() -> ModuleType:
    """``torch.cpu`` plus the CUDA-style functions verl calls on its device module.

    verl calls e.g. ``memory_reserved`` and ``mem_get_info`` on whatever ``device_module`` is;
    ``torch.cpu`` lacks them. Host memory has no caching allocator, so allocator statistics are 0
    and cache control does nothing; ``mem_get_info`` reports host RAM.
    """
    module = ModuleType("verl_replay_cpu_device")
    for name in ("Event", "Stream", "StreamContext", "current_stream", "stream", "synchronize", "is_available"):
        setattr(module, name, getattr(torch.cpu, name))

    def zero(*args: Any, **kwargs: Any) -> int:
        return 0

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    for name in ("memory_reserved", "memory_allocated", "max_memory_reserved", "max_memory_allocated"):
        setattr(module, name, zero)
    for name in (
        "empty_cache",
        "ipc_collect",
        "reset_peak_memory_stats",
        "set_per_process_memory_fraction",
        "set_device",
    ):
        setattr(module, name, nothing)
    module.current_device = lambda: "cpu"
    module.device_count = lambda: 1
    module.mem_get_info = lambda *args, **kwargs: _host_memory_bytes()
    module.get_device_name = lambda *args, **kwargs: "cpu"
    module.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    module.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    sys.modules.setdefault(module.__name__, module)
    return module


CPU_DEVICE_MODULE = _build_device_module()


@PlatformRegistry.register(platform=CPU_PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """CPU-only platform: gloo collectives, no pinned memory, no device streams."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: a CPU run is always an explicit VERL_PLATFORM=cpu choice, so a
        # GPU host keeps verl's own platform detection untouched.
        return False

    def current_device(self) -> str:  # type: ignore[override]
        # verl passes get_device_id() straight to `.to(...)` / `device=`; an index (0) would
        # address an accelerator, the string "cpu" addresses host memory.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
