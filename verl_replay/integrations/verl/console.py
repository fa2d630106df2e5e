"""The console of a ``verl_replay.main`` run: verl's output routed to a file, one line per step.

Where verl's console lines come from (the default tiny run printed ~1,150 lines):

- the TaskRunner pprints the whole resolved config (~950 lines): ``task_runner.py`` now does so
  only with ``verbose=true`` (``config.yaml`` in the run dir holds the same config);
- verl's ``Tracking`` logger with the ``console`` backend prints every metric of every step on
  one long line: :func:`quiet_logger_backends` drops that backend (the ``file`` backend writes
  the same values to ``metrics.jsonl``, which :class:`StepFollower` reads back);
- every Ray process imports verl, which warns that torchtitan / veomni / automodel / mindspeed /
  megatron engines are unavailable, TransferQueue warns about its thread count on every call,
  the agent loop warns per sample about Continuous Token builders, tqdm bars of the trainer and
  weight loading, Ray's own start-up lines: Ray forwards all worker output to the driver's
  stdout/stderr, which :class:`verl_replay.console.Console` points at ``verl.log``.

:class:`StepFollower` tails ``metrics.jsonl`` in a driver thread and prints the compact step line
(:func:`step_fields`), so nothing inside verl's trainer is patched for the console.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, open_dict

from verl_replay.config import ReplayConfig
from verl_replay.console import format_value

__all__ = [
    "DriftFloorWatch",
    "StartupWatch",
    "StepFollower",
    "describe_failure",
    "quiet_logger_backends",
    "quiet_ray_environment",
    "step_fields",
]

# (label, metric key): what the step line shows, when the step reported it.
CORE_FIELDS: tuple[tuple[str, str], ...] = (
    ("score", "critic/score/mean"),
    ("pg_loss", "actor/pg_loss"),
    ("grad_norm", "actor/grad_norm"),
    ("resp_len", "response_length/mean"),
    # share of fresh responses cut off at the response budget (see truncated_share)
    ("trunc", "response_length/clip_ratio"),
)
TRUNC_KEY, LONGEST_KEY = CORE_FIELDS[-1][1], "response_length/max"
# Under split placement: how many weight versions the fresh rows lag behind the trainer (verl's
# lower bound, from the newest weights a trajectory saw); no importance correction is applied to it
# unless rollout correction is on.
STALENESS_FIELD = ("stale", "training/off_policy/trajectory_staleness/mean")
# The drift floor: the gate's statistic over the step's fresh groups (median), next to tau.
FLOOR_KEY = "replay/drift_fresh/p50"
GROUP_REPLAY_FIELDS: tuple[tuple[str, str], ...] = (
    ("buffer", "replay/buffer_size"),
    ("scanned", "replay/scanned"),
)
DRIFT_FIELDS: tuple[tuple[str, str], ...] = (
    ("drift", "replay/drift_accepted/mean"),
    ("replay_kl", "replay/replay_kl_accepted/mean"),
)
ELITE_FIELDS: tuple[tuple[str, str], ...] = (
    ("elite_nll", "replay/elite/nll"),
    ("elite_rows", "replay/elite/examples"),
)


def truncated_share(data: Mapping[str, Any], max_response_length: Optional[int]) -> Any:
    """The share of responses cut at ``max_response_length``.

    verl's ``response_length/clip_ratio`` counts the rows as long as the batch's response tensor,
    which is the budget only when rows are padded to it: a batch trimmed to its longest row
    (e.g. every answer 4 tokens of a budget of 8) reports its longest rows as clipped. With the
    longest row below the budget nothing was cut; at the budget, the tensor is the budget wide
    and verl's ratio is the share cut."""
    ratio, longest = data[TRUNC_KEY], data.get(LONGEST_KEY)
    if max_response_length is not None and isinstance(longest, (int, float)) and longest < max_response_length:
        return 0.0
    return ratio


def step_fields(
    data: Mapping[str, Any],
    replay: ReplayConfig,
    *,
    split: bool = False,
    max_response_length: Optional[int] = None,
) -> list[tuple[str, Any]]:
    """The (label, value) pairs of one step's compact line: score, pg loss, grad norm, response
    length, truncation rate (responses cut at ``max_response_length``), rollouts lost / padding
    rows (when any), the fresh rows' staleness (``split``: split placement), the replay summary of
    the run's strategy (with the drift floor next to tau), and the step time."""
    fields = [
        (label, truncated_share(data, max_response_length) if key == TRUNC_KEY else data[key])
        for label, key in CORE_FIELDS
        if key in data
    ]
    # rollouts the step lost (its score covers fewer) or padded: shown only when it happened
    if data.get("rollout/lost"):
        fields.append(("lost", f"{int(data['rollout/lost'])}/{int(data.get('rollout/expected', 0))}"))
    unplanned = int(data.get("rollout/padding_rows", 0)) - int(data.get("rollout/planned_padding_rows", 0))
    if unplanned > 0:  # rows verl padded beyond the replay mini-batch plan's: made up for lost rollouts
        fields.append(("padded", unplanned))
    if split and STALENESS_FIELD[1] in data:
        fields.append((STALENESS_FIELD[0], data[STALENESS_FIELD[1]]))
    if replay.uses_group_buffer and "replay/accepted" in data:
        if replay.uses_headroom_drift:
            fields.append(("replayed", f"{int(data['replay/accepted'])}/{replay.k_rep}"))
            fields += [(label, data[key]) for label, key in GROUP_REPLAY_FIELDS if key in data]
        else:  # naive replay takes the latest groups: nothing is scanned, ranked or gated
            fields.append(("replayed", f"{int(data['replay/accepted'])}/{replay.k_rep} latest"))
            fields += [(label, data[key]) for label, key in GROUP_REPLAY_FIELDS if key in data and label != "scanned"]
        if replay.uses_headroom_drift and data["replay/accepted"] > 0:  # over the accepted groups
            fields += [(label, data[key]) for label, key in DRIFT_FIELDS if key in data]
        if replay.uses_headroom_drift and FLOOR_KEY in data:
            fields.append(("floor/tau", f"{format_value(data[FLOOR_KEY])}/{format_value(replay.tau)}"))
        fields += ingress_fields(data)
    if replay.uses_elite:
        fields += [(label, data[key]) for label, key in ELITE_FIELDS if key in data]
    if "timing_s/step" in data:
        fields.append(("time", f"{float(data['timing_s/step']):.1f}s"))
    return fields


def ingress_fields(data: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``admitted N (x multi-turn, y image)`` once a step admits multi-turn or image groups, and
    ``not_replayable N`` when fresh groups could not be stored (verl.log says why)."""
    fields: list[tuple[str, Any]] = []
    multi, images = data.get("replay/ingress_multi_turn", 0), data.get("replay/ingress_images", 0)
    if multi or images:
        fields.append(
            ("admitted", f"{int(data.get('replay/ingress', 0))} ({int(multi)} multi-turn, {int(images)} image)")
        )
    if data.get("replay/skipped_ingress", 0):
        fields.append(("not_replayable", int(data["replay/skipped_ingress"])))
    return fields


class DriftFloorWatch:
    """Warns once when tau is at or below the measured drift floor.

    Drift compares the trainer's log-probs with the rollout engine's: even groups the current
    weights just generated drift by the two engines' numeric difference (plus, under split
    placement, the updates since the rollout began). If tau sits at or below that floor the gate
    rejects nearly everything, and a run would otherwise just report ``replayed 0/K`` step after
    step. After ``warmup_steps`` steps that measured it, the floor is the median of their
    per-step medians (``replay/drift_fresh/p50``).
    """

    def __init__(self, tau: float, *, warmup_steps: int = 2) -> None:
        self.tau = float(tau)
        self.warmup_steps = warmup_steps
        self.floors: list[float] = []
        self.warned = False

    def update(self, data: Mapping[str, Any]) -> Optional[str]:
        """The warning line, the first time the floor reaches tau; None otherwise."""
        value = data.get(FLOOR_KEY)
        if self.warned or not isinstance(value, (int, float)):
            return None
        self.floors.append(float(value))
        if len(self.floors) < self.warmup_steps:
            return None
        floor = statistics.median(self.floors)
        if self.tau > floor:
            return None
        self.warned = True
        return (
            f"verl_replay: warning: replay.tau={self.tau:g} is at or below the drift floor {floor:.4g} (median "
            f"drift of this run's fresh groups, replay/drift_fresh/p50, over {len(self.floors)} steps): the gate "
            "will reject nearly every buffered group; set replay.tau above the floor (docs/headroom_drift.md, "
            "choosing tau)"
        )


def quiet_logger_backends(config: DictConfig) -> None:
    """``trainer.logger`` without ``console`` and with ``file`` (the step lines read that file)."""
    loggers = config.trainer.get("logger") or []
    loggers = [loggers] if isinstance(loggers, str) else list(loggers)
    kept = [name for name in loggers if name != "console"]
    if "file" not in kept:
        kept.append("file")
    with open_dict(config.trainer):
        config.trainer.logger = ListConfig(kept)


def quiet_ray_environment(environ: Optional[dict[str, str]] = None) -> None:
    """Plain text in the log file: Ray colours its ``(pid=...)`` prefixes unless told not to."""
    env = os.environ if environ is None else environ
    env.setdefault("RAY_COLOR_PREFIX", "0")


# The last line of a Python traceback: ``OSError: [Errno 98] ...``, ``ray.exceptions.X: ...``
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b")


def describe_failure(error: BaseException) -> str:
    """One line for a failed run: the original exception of a Ray task error, first line only.

    An actor whose ``__init__`` raised reaches the driver as ``ActorDiedError`` holding only the
    text of its traceback; the line names the actor and the exception that ended it, so the reason
    is on the console rather than only in ``verl.log``."""
    cause = getattr(error, "cause", None)
    cause = cause if isinstance(cause, BaseException) else error
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    if not lines:
        return type(cause).__name__
    summary = f"{type(cause).__name__}: {lines[0].strip()}"
    if getattr(cause, "_actor_init_failed", False):
        raised = next((line.strip() for line in reversed(lines[1:]) if _EXCEPTION_LINE.match(line)), None)
        actor = re.search(r"ray::([\w.:]+?)\(\)", lines[0])
        where = actor.group(1).rsplit(":", 1)[-1] if actor else "an actor's __init__"
        summary = f"{type(cause).__name__}: {where} raised {raised}" if raised else summary
    return summary


# What a run waits for before its first step, by the verl.log lines that end each stage (in order);
# ``{step}``: the step the run starts with (1, or the one after a resumed run's checkpoint).
STARTUP_STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("starting Ray", ()),
    ("starting the trainer", ("Started a local Ray instance", "Connected to Ray cluster")),
    ("starting the training workers", ("(ReplayTaskRunner pid=",)),
    ("starting the rollout and reward workers", ("actor and ref model engine initialized",)),
    ("running step {step}", ("all initialize finished, ready to fit",)),
)


def resumed_step(trainer: Mapping[str, Any]) -> Optional[int]:
    """The global step of the checkpoint verl will resume from (None: the run starts at step 1).

    verl's rule (``RayPPOTrainer._load_checkpoint``): ``resume_mode=disable`` starts afresh;
    ``resume_path`` loads ``resume_from_path`` (a ``global_step_N`` folder); ``auto`` the folder
    named by ``default_local_dir/latest_checkpointed_iteration.txt``, when there is one."""
    mode = trainer.get("resume_mode", "auto")
    if mode == "disable":
        return None
    if mode == "resume_path":
        _, marker, digits = str(trainer.get("resume_from_path") or "").rstrip("/").rpartition("global_step_")
        return int(digits) if marker and digits.isdigit() else None
    local_dir = trainer.get("default_local_dir")
    if not local_dir:
        return None
    try:
        text = (Path(str(local_dir)) / "latest_checkpointed_iteration.txt").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and (Path(str(local_dir)) / f"global_step_{text}").is_dir() else None


class StartupWatch:
    """Which start-up stage a run is in, read from the new text of its ``verl.log``."""

    def __init__(self, log_path: Path, *, first_step: int = 1) -> None:
        self.log_path = Path(log_path)
        self.first_step = first_step
        self.stage = 0
        self._offset: Optional[int] = None
        self._tail = ""

    def poll(self) -> str:
        """The current stage's description (``starting Ray`` ... ``running step N``)."""
        try:
            size = self.log_path.stat().st_size
            if self._offset is None:
                self._offset = 0
            if size > self._offset:
                with open(self.log_path, "rb") as handle:
                    handle.seek(self._offset)
                    text = handle.read(size - self._offset).decode("utf-8", "replace")
                self._offset = size
                self._advance(self._tail + text)
                self._tail = text[-200:]  # a marker split across two reads
        except OSError:
            pass
        return STARTUP_STAGES[self.stage][0].format(step=self.first_step)

    def _advance(self, text: str) -> None:
        for index in range(len(STARTUP_STAGES) - 1, self.stage, -1):
            if any(marker in text for marker in STARTUP_STAGES[index][1]):
                self.stage = index
                return


class StepFollower:
    """Reads ``metrics.jsonl`` as verl's file logger appends to it; calls ``on_step(step, data)``
    once per new complete line, from a background thread (``start`` / ``stop``)."""

    def __init__(
        self,
        path: Path,
        on_step: Callable[[int, dict[str, Any]], None],
        *,
        interval_s: float = 0.5,
        on_idle: Optional[Callable[[], None]] = None,
    ) -> None:
        self.path = Path(path)
        self.on_step = on_step
        self.on_idle = on_idle
        self.interval_s = interval_s
        self.steps: list[int] = []
        self._offset = 0
        self._partial = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="verl_replay-steps", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and read what is left (the last step's line)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.poll()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()
            if self.on_idle is not None:
                self.on_idle()

    def poll(self) -> None:
        for record in self._read_new():
            step, data = record.get("step"), record.get("data")
            if isinstance(step, int) and isinstance(data, dict):
                self.steps.append(step)
                self.on_step(step, data)

    def _read_new(self) -> Sequence[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:  # truncated: a new logger opened the file
            self._offset, self._partial = 0, b""
        if size == self._offset:
            return []
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read(size - self._offset)
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # an unfinished last line waits for the next poll
        records = []
        for line in lines:
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # not ours to judge: verl.log keeps verl's own output
        return records
