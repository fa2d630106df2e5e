"""JSONL event log of the replay buffer.

One JSON object per line, each with an ``"event"`` field:

* ``ingress``:    step, group_id, birth_step, generated_version, initial_headroom, n, num_correct
                  (+ from verl's integration: turns, the assistant turns of the group's longest
                  trajectory, 1 for single-turn rows; images, the pictures in its prompt)
* ``scan``:       step, group_id, rank, drift, replay_kl, headroom_before, headroom_after,
                  accepted, age, birth_step, generated_version
                  (+ ``would_skip``: whether the configured scan-skip rule would have skipped
                  the scan, see :mod:`~verl_replay.headroom_drift.scan_skip`)
* ``skip``:       step, group_ids, last_step, last_drift (the groups ``replay.scan_skip`` did
                  not scan this step, with the scan that started each skip)
* ``evict``:      step, group_id, birth_step, lifetime_replay_count
* ``fresh``:      step, age, drift (one entry per fresh group of the step, in the same order;
                  drift is ``null`` where the floor is not measured, see below)
* ``round``:      step, round, stats (what one update round of the step added: replayed groups,
                  rows, tokens by source, optimiser steps, seconds; the step's totals are their sums)
* ``step``:       step, stats (the selection statistics merged with the ingress counts)
* ``checkpoint``: step, buffer_fingerprint, buffer_size, next_group_id (the buffer as saved)
* ``resume``:     step, buffer_fingerprint, buffer_size, next_group_id (the buffer as loaded)

``birth_step`` is the global step that admitted a group, ``generated_version`` the weight version
that generated it (version v: the weights after step v; step t trains from version t - 1), and
``age`` counts weight versions since generation: ``(step - 1) - generated_version``. A ``fresh``
record holds, for each of the step's fresh groups, the drift between the rollout engine's
log-probs and the trainer's log-probs under the weights the step started from (the statistic
the gate applies to buffered groups), and the group's age. ``drift`` may be ``Infinity`` (a
token the current policy gives probability 0) and is ``null`` for the naive buffer, which never
scores groups. Records are buffered in memory and written by
:meth:`ReplayEventLog.flush`, which :meth:`ReplayEventLog.log_step` calls once per step, so a
crash loses at most the current step. The file is opened in append mode: a resumed run keeps
writing to the same file; pass ``resume_from_step`` to drop records of steps after the
checkpoint the run resumed from (they will be produced again).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "EVENT_TYPES",
    "ReplayEventLog",
    "buffer_state_record",
    "evict_record",
    "fresh_record",
    "ingress_record",
    "read_events",
    "round_record",
    "scan_record",
    "skip_record",
    "step_record",
]

EVENT_TYPES: tuple[str, ...] = ("ingress", "scan", "skip", "evict", "fresh", "round", "step", "checkpoint", "resume")


def _opt_float(x: float | None) -> float | None:
    return None if x is None else float(x)


def ingress_record(
    *,
    step: int,
    group_id: int,
    birth_step: int,
    generated_version: int,
    initial_headroom: float,
    n: int,
    num_correct: int,
) -> dict[str, Any]:
    return {
        "event": "ingress",
        "step": int(step),
        "group_id": int(group_id),
        "birth_step": int(birth_step),
        "generated_version": int(generated_version),
        "initial_headroom": float(initial_headroom),
        "n": int(n),
        "num_correct": int(num_correct),
    }


def scan_record(
    *,
    step: int,
    group_id: int,
    rank: int,
    drift: float | None,
    replay_kl: float | None,
    headroom_before: float,
    headroom_after: float | None,
    accepted: bool,
    age: int,
    birth_step: int,
    generated_version: int,
    would_skip: bool | None = None,
) -> dict[str, Any]:
    record = {
        "event": "scan",
        "step": int(step),
        "group_id": int(group_id),
        "rank": int(rank),
        "drift": _opt_float(drift),
        "replay_kl": _opt_float(replay_kl),
        "headroom_before": float(headroom_before),
        "headroom_after": _opt_float(headroom_after),
        "accepted": bool(accepted),
        "age": int(age),
        "birth_step": int(birth_step),
        "generated_version": int(generated_version),
    }
    if would_skip is not None:
        record["would_skip"] = bool(would_skip)
    return record


def skip_record(
    *, step: int, group_ids: Sequence[int], last_step: Sequence[int], last_drift: Sequence[float]
) -> dict[str, Any]:
    """The groups a scan-skip rule left out of one step's scan, each with its last scan."""
    if not len(group_ids) == len(last_step) == len(last_drift):
        raise ValueError("skip record: group_ids, last_step and last_drift differ in length")
    return {
        "event": "skip",
        "step": int(step),
        "group_ids": [int(g) for g in group_ids],
        "last_step": [int(s) for s in last_step],
        "last_drift": [float(d) for d in last_drift],
    }


def evict_record(*, step: int, group_id: int, birth_step: int, lifetime_replay_count: int) -> dict[str, Any]:
    return {
        "event": "evict",
        "step": int(step),
        "group_id": int(group_id),
        "birth_step": int(birth_step),
        "lifetime_replay_count": int(lifetime_replay_count),
    }


def fresh_record(*, step: int, age: Sequence[int], drift: Sequence[float] | None = None) -> dict[str, Any]:
    """One step's fresh groups: their ages and (``None`` when not measured) their drift floor."""
    if drift is not None and len(drift) != len(age):
        raise ValueError(f"fresh record: {len(drift)} drifts for {len(age)} ages")
    return {
        "event": "fresh",
        "step": int(step),
        "age": [int(a) for a in age],
        "drift": None if drift is None else [float(d) for d in drift],
    }


def buffer_state_record(
    event: str, *, step: int, buffer_fingerprint: str, buffer_size: int, next_group_id: int
) -> dict[str, Any]:
    """``checkpoint`` (the buffer a checkpoint saved) or ``resume`` (the buffer a run loaded)."""
    if event not in ("checkpoint", "resume"):
        raise ValueError(f"buffer state records are 'checkpoint' or 'resume', got {event!r}")
    return {
        "event": event,
        "step": int(step),
        "buffer_fingerprint": str(buffer_fingerprint),
        "buffer_size": int(buffer_size),
        "next_group_id": int(next_group_id),
    }


def _numeric(stats: Mapping[str, Any]) -> dict[str, Any]:
    clean: dict[str, Any] = {}
    for key, value in stats.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # only numeric statistics go into the summary
        clean[str(key)] = float(value) if isinstance(value, float) else int(value)
    return clean


def round_record(*, step: int, round: int, stats: Mapping[str, Any]) -> dict[str, Any]:
    return {"event": "round", "step": int(step), "round": int(round), "stats": _numeric(stats)}


def step_record(*, step: int, stats: Mapping[str, Any]) -> dict[str, Any]:
    return {"event": "step", "step": int(step), "stats": _numeric(stats)}


def _parse_lines(text: str, path: Path) -> list[dict[str, Any]]:
    """Parse complete lines; an unterminated last line (a crash mid-write) is ignored."""
    lines = text.split("\n")
    complete = lines[:-1]  # the piece after the last "\n" is empty or an unfinished record
    records: list[dict[str, Any]] = []
    for lineno, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: malformed event record: {exc}") from exc
        if not isinstance(rec, dict) or rec.get("event") not in EVENT_TYPES:
            raise ValueError(f"{path}:{lineno}: not a replay event record: {line[:80]!r}")
        records.append(rec)
    return records


def read_events(path: str | os.PathLike[str], events: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """All records of an event log in file order, optionally only the given event types."""
    p = Path(path)
    records = _parse_lines(p.read_text(encoding="utf-8"), p)
    if events is None:
        return records
    wanted = set(events)
    unknown = wanted - set(EVENT_TYPES)
    if unknown:
        raise ValueError(f"events must be among {EVENT_TYPES}, got {sorted(unknown)}")
    return [r for r in records if r["event"] in wanted]


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class ReplayEventLog:
    """Append-only JSONL writer for replay events (see module docstring for the schema)."""

    def __init__(self, path: str | os.PathLike[str], *, resume_from_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._pending: list[str] = []
        self._repair(resume_from_step)
        self._fh = open(self.path, "a", encoding="utf-8")

    def _repair(self, resume_from_step: int | None) -> None:
        """Drop an unfinished last line and, when resuming, records of later steps."""
        if not self.path.exists():
            return
        text = self.path.read_text(encoding="utf-8")
        if resume_from_step is None and (text == "" or text.endswith("\n")):
            return
        records = _parse_lines(text, self.path)
        if resume_from_step is not None:
            records = [r for r in records if int(r["step"]) <= resume_from_step]
        _atomic_write_text(self.path, "".join(self._dumps(r) for r in records))

    @staticmethod
    def _dumps(record: Mapping[str, Any]) -> str:
        # allow_nan: drift can legitimately be +inf; Python's json reads it back.
        return json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n"

    # -- writing ------------------------------------------------------------------------

    def write(self, record: Mapping[str, Any]) -> None:
        if record.get("event") not in EVENT_TYPES:
            raise ValueError(f"record['event'] must be one of {EVENT_TYPES}, got {record!r}")
        self._pending.append(self._dumps(record))

    def extend(self, records: Iterable[Mapping[str, Any]]) -> None:
        for record in records:
            self.write(record)

    def log_selection(self, result: Any) -> None:
        """Scan records of a :class:`~verl_replay.headroom_drift.buffer.SelectionResult`."""
        self.extend(result.events())

    def log_admit(self, admit_result: Mapping[str, Any]) -> None:
        """Ingress/evict records returned by ``buffer.admit``."""
        self.extend(admit_result["events"])

    def log_step(self, step: int, stats: Mapping[str, Any], *, flush: bool = True) -> None:
        """Step summary; flushes the step's records to disk (the per-step durability point)."""
        self.write(step_record(step=step, stats=stats))
        if flush:
            self.flush()

    def flush(self) -> None:
        if self._fh.closed:
            raise ValueError(f"event log {self.path} is closed")
        if self._pending:
            self._fh.write("".join(self._pending))
            self._pending.clear()
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        if not self._fh.closed:
            self.flush()
            self._fh.close()

    def __enter__(self) -> ReplayEventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pending(self) -> Sequence[str]:
        """Lines written since the last flush (not yet on disk)."""
        return tuple(self._pending)
