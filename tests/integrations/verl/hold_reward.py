"""verl reward function for the Ctrl-C test: verl_replay's own, except that once the file named by
``hold_after`` holds a step number >= 1 (verl's latest checkpoint record) it never returns. The run
is then always inside step 2 when the test interrupts it: on a starved machine a 3-step run could
otherwise finish before the signal arrives (seen in a loaded CI run: exit 0 instead of 130)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from verl_replay.rewards import compute_score as _compute_score


def _saved_a_step(path: Path) -> bool:
    try:
        return int(path.read_text().strip() or 0) >= 1
    except (OSError, ValueError):
        return False


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Optional[dict] = None,
    hold_after: Optional[str] = None,
    **kwargs: Any,
) -> dict[str, Any]:
    if hold_after is not None and _saved_a_step(Path(hold_after)):
        while True:  # until the run is interrupted (Ray's shutdown kills this worker)
            time.sleep(0.05)
    return _compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
