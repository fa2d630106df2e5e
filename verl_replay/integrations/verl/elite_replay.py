"""EliteReplay inside verl's global step: frozen-archive rows added to every step.

Each global step, the sampler draws ``replay.elite.batch_size`` archive entries (balanced over
questions, then cells; or IID for the baseline), spread over the step's update rounds; they join
the rounds' existing optimiser steps. Each becomes one row: the question's prompt
through the run's chat template, the elite solution + eos as the response. Elite rows carry
``replay_source=2`` and ``loss_mask=0``: the actor loss turns them into the NLL term and keeps
them out of the GRPO term, its token count, KL and entropy; their rewards and advantages are 0
and they are kept out of verl's reward and advantage metrics.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from verl_replay.config import ReplayConfig
from verl_replay.elite.archive import FrozenArchive, FrozenEntry
from verl_replay.elite.archive_io import hf_tokenizer_fingerprint, load_frozen_archive
from verl_replay.elite.sampler import BalancedSampler, IIDSampler
from verl_replay.integrations.verl.rows import (
    CORE_FIELDS,
    DERIVED_FIELDS,
    REPLAY_GROUP_FIELD,
    REPLAY_SOURCE_FIELD,
    SOURCE_ELITE,
    plain,
    row_key,
    row_tag,
    text_position_ids,
)
from verl_replay.integrations.verl.streams import ReplayStream, StepContext, check_row_fields, split_over_rounds

logger = logging.getLogger(__name__)

SAMPLER_FILE = "elite_sampler.pt"


class EliteArchiveMismatch(ValueError):
    """The archive does not belong to this run (dataset or tokenizer); the message says why."""


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_archive_dataset(manifest: Mapping[str, Any], train_files: Sequence[str], archive_path: str) -> None:
    """The archive must come from one of the training files (same bytes)."""
    built = manifest.get("dataset") or {}
    built_sha = built.get("sha256") if isinstance(built, Mapping) else None
    if not built_sha:
        raise EliteArchiveMismatch(f"{archive_path}: the manifest records no dataset sha256; rebuild the archive")
    ours = {os.path.expanduser(path): file_sha256(os.path.expanduser(path)) for path in train_files}
    if built_sha not in ours.values():
        raise EliteArchiveMismatch(
            f"{archive_path} was built from {built.get('path')} (sha256 {built_sha[:12]}...), but the training data "
            f"is {', '.join(f'{p} (sha256 {h[:12]}...)' for p, h in ours.items())}; build the archive from the "
            "training parquet (python -m verl_replay.elite.search --data <train.parquet> ...)"
        )


def preflight_archive(config: ReplayConfig, *, tokenizer: Any, train_files: Sequence[str]) -> None:
    """The start-up checks of the archive (integrity, tokenizer, dataset, not empty), run in the
    driver before Ray starts so a wrong archive fails in seconds."""
    archive = load_frozen_archive(
        config.elite.archive, expected_tokenizer_fingerprint=hf_tokenizer_fingerprint(tokenizer)
    )
    check_archive_dataset(archive.manifest or {}, train_files, config.elite.archive)


def _leading_shape(positions: Any) -> tuple[int, ...]:
    if isinstance(positions, torch.Tensor) and positions.dim() > 1:
        return tuple(int(d) for d in positions.shape[:-1])
    return ()


class EliteReplayStream(ReplayStream):
    """Owns the frozen archive and its sampler; writes elite rows into every global step."""

    def __init__(
        self,
        config: ReplayConfig,
        *,
        tokenizer: Any,
        train_files: Sequence[str],
        max_prompt_length: int,
        max_response_length: int,
        chat_template_kwargs: Optional[dict] = None,
        has_rollout_log_probs: bool = True,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        path = config.elite.archive
        archive = load_frozen_archive(path, expected_tokenizer_fingerprint=hf_tokenizer_fingerprint(tokenizer))
        check_archive_dataset(archive.manifest or {}, train_files, path)
        # Entries that cannot fit the run's length limits are left out before sampling starts, so
        # the sampler's balance guarantee holds over what is actually replayed.
        fitting, self._tokens = [], []
        for entry in archive.entries:
            prompt, response = self._tokenize(entry)
            if prompt.numel() <= max_prompt_length and response.numel() <= max_response_length:
                fitting.append(entry)
                self._tokens.append((prompt, response))
        if not fitting:
            raise EliteArchiveMismatch(
                f"{path}: none of its {len(archive.entries)} entries fits data.max_prompt_length="
                f"{max_prompt_length} / data.max_response_length={max_response_length}"
            )
        self.skipped_too_long = len(archive.entries) - len(fitting)
        if self.skipped_too_long:
            logger.warning(
                "%s: %d archive entries exceed the run's length limits and are not replayed",
                path,
                self.skipped_too_long,
            )
        self.archive: FrozenArchive = FrozenArchive(fitting, manifest=archive.manifest)
        sampler_cls = IIDSampler if config.elite_sampler == "iid" else BalancedSampler
        self.sampler = sampler_cls(self.archive, seed=config.elite.seed)
        self._has_rollout_log_probs = has_rollout_log_probs
        self._step = -1
        self._by_round: list[list[int]] = []
        self._keys: list[str] = []
        self._lengths: list[int] = []
        self._stats: dict[str, float] = {}

    # ------------------------------------------------------------------ rows

    def _tokenize(self, entry: FrozenEntry) -> tuple[torch.Tensor, torch.Tensor]:
        messages = plain(entry.to_dict()["prompt"])
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        prompt = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **self.chat_template_kwargs
        )
        response = self.tokenizer.encode(entry.text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return torch.tensor(prompt, dtype=torch.int64), torch.tensor(response, dtype=torch.int64)

    def _row(self, index: int, template: dict[str, Any], uid: str, step: int) -> dict[str, Any]:
        entry = self.archive.entries[index]
        prompt, response = self._tokens[index]
        input_ids = torch.cat([prompt, response])
        row = {k: v for k, v in template.items() if k not in CORE_FIELDS | DERIVED_FIELDS}
        info = entry.to_dict()
        row.update(
            prompts=prompt.clone(),
            responses=response.clone(),
            input_ids=input_ids,
            # the layout of this batch's fresh rows: (L,), or (4, L) for M-RoPE models
            position_ids=text_position_ids(input_ids.numel(), _leading_shape(template.get("position_ids"))),
            response_mask=torch.ones_like(response),
            # 0: elite tokens are not GRPO tokens (verl's batch_num_tokens counts loss_mask)
            loss_mask=torch.zeros_like(response),
            rm_scores=torch.zeros(response.numel(), dtype=torch.float32),
            # placeholder; set to the rows' own old log-probs once computed (IS weight 1)
            rollout_log_probs=torch.zeros(response.numel(), dtype=torch.float32),
            uid=uid,
            session_id=0,
            global_steps=step,
            data_source=str(plain(info["question_metadata"]).get("data_source", "elite_archive")),
            raw_prompt=plain(info["prompt"]),
            prompt=plain(info["prompt"]),
            reward_model={"style": "elite_archive", "ground_truth": plain(info["ground_truth"])},
            extra_info={"question_id": entry.question_id, "approach": entry.approach, "descriptor": entry.descriptor},
        )
        if "multi_modal_inputs" in template:
            row["multi_modal_inputs"] = {}  # archive rows are text-only, whatever the template row holds
        row[REPLAY_SOURCE_FIELD] = torch.tensor(SOURCE_ELITE, dtype=torch.int64)
        row[REPLAY_GROUP_FIELD] = torch.tensor(-1, dtype=torch.int64)
        # Dataset fields the run's rows do not have (prompt, raw_prompt, rollout_log_probs, ...) are
        # left out; check_row_fields then holds the row to exactly the fresh rows' field set.
        return {name: value for name, value in row.items() if name in template}

    # ------------------------------------------------------------------ ReplayStream

    def begin_step(self, context: StepContext) -> None:
        """Draw this global step's archive examples (balanced or IID) and spread them over its rounds."""
        self._step = context.step
        indices = self.sampler.sample_indices(self.config.elite.batch_size).tolist()
        self._by_round, start = [], 0
        for share in split_over_rounds(len(indices), context.rounds):
            self._by_round.append(indices[start : start + share])
            start += share
        self._stats = {"examples": 0.0, "tokens": 0.0, "archive_entries": float(len(self.archive.entries))}
        self._stats.update({k: float(v) for k, v in self.sampler.stats().items() if isinstance(v, (int, float))})

    def inject(self, round_index: int, batch: KVBatchMeta, template: dict[str, Any]) -> tuple[KVBatchMeta, int, int]:
        """Append this round's elite rows to ``batch`` (``template``: a fresh row, for the field set)."""
        indices = self._by_round[round_index] if round_index < len(self._by_round) else []
        keys, tags, rows = [], [], []
        for position, index in enumerate(indices):
            uid = f"elite-s{self._step}-r{round_index}-{position}"
            row = self._row(index, template, uid, self._step)
            keys.append(row_key(uid, 0))
            tags.append(row_tag(row, global_steps=self._step, replay_source=SOURCE_ELITE))
            rows.append(row)
        if rows:
            check_row_fields(rows, template, source="EliteReplay archive")
            tq.kv_batch_put(
                keys=keys, partition_id=batch.partition_id, fields=list_of_dict_to_tensordict(rows), tags=tags
            )
        self._keys = keys
        self._lengths = [int(row["responses"].numel()) for row in rows]
        self._stats["examples"] += float(len(rows))
        self._stats["tokens"] += float(sum(int(r["responses"].numel()) for r in rows))
        merged = KVBatchMeta(
            keys=list(batch.keys) + keys,
            tags=list(batch.tags) + tags,
            partition_id=batch.partition_id,
            extra_info=batch.extra_info,
        )
        return merged, 0, len(rows)

    @property
    def keys(self) -> list[str]:
        return list(self._keys)

    def after_old_log_probs(self, partition_id: str, *, rollout_correction: bool, forwarded: bool = True) -> None:
        """Elite rows were never sampled by a rollout: their rollout log-probs are their own old
        log-probs, so rollout correction gives them weight 1 and never rejects their tokens.
        Skipped by the forward, both are zeros already (the row's placeholder): nothing to write."""
        if not self._keys or not self._has_rollout_log_probs or not forwarded:
            return
        data = tq.kv_batch_get(keys=self._keys, partition_id=partition_id, select_fields=["old_log_probs"])
        tq.kv_batch_put(
            keys=self._keys,
            partition_id=partition_id,
            fields=TensorDict({"rollout_log_probs": data["old_log_probs"]}, batch_size=len(self._keys)),
        )

    def after_advantages(self, partition_id: str) -> None:
        if not self._keys:
            return
        zeros = [torch.zeros(length, dtype=torch.float32) for length in self._lengths]
        nested = torch.nested.as_nested_tensor(zeros, layout=torch.jagged)
        fields = {
            "advantages": nested,
            "returns": torch.nested.as_nested_tensor([z.clone() for z in zeros], layout=torch.jagged),
        }
        tq.kv_batch_put(
            keys=self._keys, partition_id=partition_id, fields=TensorDict(fields, batch_size=len(self._keys))
        )

    def end_round(self) -> None:
        self._keys, self._lengths = [], []

    def end_step(self, batch: KVBatchMeta) -> dict[str, float]:
        stats, self._stats, self._by_round = self._stats, {}, []
        return stats

    # ------------------------------------------------------------------ state

    def save(self, folder: str | os.PathLike) -> None:
        path = Path(folder) / SAMPLER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(self.sampler.state_dict(), tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)

    def load(self, folder: str | os.PathLike, step: int) -> bool:
        path = Path(folder) / SAMPLER_FILE
        if not path.exists():
            raise FileNotFoundError(f"{path}: the checkpoint's replay state has no elite sampler")
        self.sampler.load_state_dict(torch.load(path, weights_only=True))
        return True
