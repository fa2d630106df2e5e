"""The recipe tests check a TINY run with the verl integration tests' helpers (``split_checks``,
``replay_audit``), which live on ``sys.path`` as uniquely named modules."""

from __future__ import annotations

import sys
from pathlib import Path

_VERL_HELPERS = str(Path(__file__).resolve().parents[1] / "integrations" / "verl")
if _VERL_HELPERS not in sys.path:
    sys.path.insert(0, _VERL_HELPERS)
