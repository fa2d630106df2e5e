"""verl plugin entry point (entry-point group ``verl.plugins``), loaded by ``import verl``.

It runs in every process that imports verl: the driver, the TaskRunner and every Ray worker.
On a GPU host it registers the ``cpu`` platform class, which is never auto-detected, and the fixes
of ``verl_fixes`` (verl 0.9.1 bugs on the split-placement path, applied when their module is
imported) and the vectorised bootstrap of its validation statistics (``validation_metrics``: the
same numbers, a fraction of the driver's time), and the ``seeded_single_turn_agent`` agent loop
(``seeded_rollout``: a sampling seed per request, for paired comparisons; used only when a config
names it); otherwise verl behaves exactly as without us.
With ``VERL_PLATFORM=cpu`` it also installs the CPU extensions (FSDP engine for cpu, ``hf``
rollout, gloo, no pinned memory, the CPU weight-sync engine); see ``cpu_support``.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def cpu_mode_requested() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


def _load() -> None:
    from verl_replay.integrations.verl import platform_cpu  # noqa: F401  (registers the platform)
    from verl_replay.integrations.verl.seeded_rollout import AGENT_LOOP_MODULE, register_seeded_agent_loop
    from verl_replay.integrations.verl.validation_metrics import METRIC_UTILS_MODULE, use_vectorized_bootstrap
    from verl_replay.integrations.verl.verl_fixes import install_verl_fixes, patch_when_imported

    install_verl_fixes()
    patch_when_imported(METRIC_UTILS_MODULE, use_vectorized_bootstrap)
    patch_when_imported(AGENT_LOOP_MODULE, register_seeded_agent_loop)

    if cpu_mode_requested():
        from verl_replay.integrations.verl.cpu_support import install_cpu_support

        install_cpu_support()


try:
    _load()
except Exception:  # verl swallows plugin errors at debug level; make ours visible
    logger.exception("verl_replay: failed to install the verl plugin")
    raise
