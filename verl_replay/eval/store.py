"""Resumable evaluation output: ``samples.jsonl`` grows as questions complete, ``eval_state.json``
says which part of it is committed.

At evaluation scale (BIRD + Spider dev x 128 samples, ~330K completions, hours of GPU time) a
crash must not lose the finished work, so :func:`verl_replay.eval.run.evaluate` writes every
chunk of questions as soon as it is generated and verified:

1. the chunk's sample lines (all ``n`` lines of each question, in question order) are appended to
   ``samples.jsonl`` in one write, then flushed and fsynced;
2. ``eval_state.json`` is rewritten atomically (temporary file + ``os.replace``) with the new
   committed byte length of ``samples.jsonl`` and the chunk's blake2b digest.

A crash between 1 and 2 leaves bytes past the committed length: :meth:`EvalStore.open` cuts them
off. On load every committed chunk is re-hashed and its lines re-parsed, so a file edited or
damaged since is refused (with the path and what to do) instead of being silently re-counted.
The state also holds the run's *fingerprint* (everything that decides which samples a question
gets and how they are verified); a rerun with other settings is refused unless ``overwrite``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_replay.eval.report import SAMPLES_JSONL, atomic_write_text

__all__ = ["STATE_JSON", "EvalStore", "EvalStoreError", "fingerprint_diff"]

STATE_JSON = "eval_state.json"
STATE_VERSION = 1


class EvalStoreError(ValueError):
    """The output folder holds an evaluation this run cannot continue; the message says why."""


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def fingerprint_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``key: old -> new`` for every setting that differs (keys of either side)."""
    changed = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            changed.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return changed


@dataclass
class EvalStore:
    """The committed part of an evaluation in ``out_dir`` (see the module docstring)."""

    out_dir: Path
    fingerprint: dict[str, Any]
    chunks: list[dict[str, Any]] = field(default_factory=list)  # {"rows", "bytes", "digest"}
    skipped: list[dict[str, Any]] = field(default_factory=list)
    max_prompt_tokens: int | None = None  # the limit the skipped prompts exceed (None: no limit known)
    sessions: int = 1
    complete: bool = False

    @property
    def samples_path(self) -> Path:
        return self.out_dir / SAMPLES_JSONL

    @property
    def state_path(self) -> Path:
        return self.out_dir / STATE_JSON

    @property
    def committed_bytes(self) -> int:
        return sum(int(c["bytes"]) for c in self.chunks)

    @property
    def done_rows(self) -> set[int]:
        return {int(r) for c in self.chunks for r in c["rows"]}

    # ------------------------------------------------------------------ open / resume

    @classmethod
    def open(
        cls, out_dir: str | os.PathLike[str], fingerprint: Mapping[str, Any], *, overwrite: bool = False
    ) -> EvalStore:
        """Start a fresh store in ``out_dir``, or continue the one there (same fingerprint)."""
        out = Path(out_dir)
        fingerprint = json.loads(json.dumps(dict(fingerprint)))  # plain JSON values, compared as stored
        store = cls(out, fingerprint)
        if overwrite or not store.state_path.exists():
            if store.samples_path.exists() and not overwrite and store.samples_path.stat().st_size > 0:
                raise EvalStoreError(
                    f"{store.samples_path} exists but {store.state_path} does not: it was written by an older "
                    "or interrupted run that cannot be resumed; choose another --out or pass --overwrite"
                )
            out.mkdir(parents=True, exist_ok=True)
            store.samples_path.write_bytes(b"")
            store._write_state()
            return store
        state = store._read_state()
        if state.get("version") != STATE_VERSION:
            raise EvalStoreError(
                f"{store.state_path}: unknown state version {state.get('version')!r}; pass --overwrite"
            )
        changed = fingerprint_diff(state.get("fingerprint", {}), fingerprint)
        if changed:
            raise EvalStoreError(
                f"{out} holds an evaluation with other settings ({'; '.join(changed)}); rerun with the "
                "same settings to resume it, choose another --out, or pass --overwrite to start over"
            )
        store.chunks = list(state.get("chunks", []))
        store.skipped = list(state.get("skipped", []))
        store.max_prompt_tokens = state.get("max_prompt_tokens")
        store.sessions = int(state.get("sessions", 1)) + 1
        store._truncate_uncommitted()
        store._verify_chunks()
        store._write_state()
        return store

    def _read_state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise EvalStoreError(f"{self.state_path} is unreadable ({exc}); pass --overwrite to start over") from exc

    def _truncate_uncommitted(self) -> None:
        """Bytes appended after the last state write belong to a chunk that never committed."""
        committed = self.committed_bytes
        size = self.samples_path.stat().st_size if self.samples_path.exists() else -1
        if size < committed:
            raise EvalStoreError(
                f"{self.samples_path} has {max(size, 0)} bytes but {self.state_path} committed {committed}: "
                "the file was truncated or replaced; pass --overwrite to start over"
            )
        if size > committed:
            with open(self.samples_path, "r+b") as handle:
                handle.truncate(committed)
                handle.flush()
                os.fsync(handle.fileno())

    def _verify_chunks(self) -> None:
        with open(self.samples_path, "rb") as handle:
            for index, chunk in enumerate(self.chunks):
                data = handle.read(int(chunk["bytes"]))
                if _digest(data) != chunk["digest"]:
                    raise EvalStoreError(
                        f"{self.samples_path}: committed chunk {index} (rows {chunk['rows'][:3]}...) does not match "
                        f"its digest in {self.state_path}; the file was modified. Pass --overwrite to start over"
                    )

    # ------------------------------------------------------------------ write

    def _write_state(self) -> None:
        atomic_write_text(
            self.state_path,
            json.dumps(
                {
                    "version": STATE_VERSION,
                    "fingerprint": self.fingerprint,
                    "chunks": self.chunks,
                    "skipped": self.skipped,
                    "max_prompt_tokens": self.max_prompt_tokens,
                    "sessions": self.sessions,
                    "complete": self.complete,
                },
                indent=1,
            )
            + "\n",
        )

    def set_skipped(self, skipped: Sequence[Mapping[str, Any]], max_prompt_tokens: int | None) -> None:
        """Record the questions left out for prompts longer than ``max_prompt_tokens``."""
        self.skipped = [dict(s) for s in skipped]
        self.max_prompt_tokens = None if max_prompt_tokens is None else int(max_prompt_tokens)
        self._write_state()

    def commit(self, rows: Sequence[int], records: Sequence[Mapping[str, Any]]) -> None:
        """Append one chunk's sample records (every sample of ``rows``) and commit them."""
        data = b"".join((json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8") for r in records)
        with open(self.samples_path, "ab") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        self.chunks.append({"rows": [int(r) for r in rows], "bytes": len(data), "digest": _digest(data)})
        self._write_state()

    def mark_complete(self) -> None:
        self.complete = True
        self._write_state()

    # ------------------------------------------------------------------ read

    def iter_samples(self) -> Iterator[dict[str, Any]]:
        """The committed sample records, in file order."""
        with open(self.samples_path, "rb") as handle:
            remaining = self.committed_bytes
            for line in handle:
                if remaining <= 0:
                    break
                remaining -= len(line)
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:  # pragma: no cover - digests are checked first
                    raise EvalStoreError(f"{self.samples_path}: unparseable line ({exc})") from exc
