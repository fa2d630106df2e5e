"""Conversion between verl's per-trajectory TransferQueue rows and compact ``ReplayGroup``s.

A verl row (one response of a GRPO group) is a dict of fields as the agent loop writes them:
token tensors (``prompts``, ``responses``, ``input_ids``, ``position_ids``, ``response_mask``,
``loss_mask``, ``rm_scores``, ``rollout_log_probs``) plus dataset and bookkeeping fields
(``raw_prompt``, ``data_source``, ``reward_model``, ``extra_info``, ``extra_fields``, ...). The
buffer keeps the token tensors compactly and the rest as opaque metadata, so an injected replay
row carries exactly the fields a fresh row has and verl's stages treat it like any other row.
Fields the trainer derives every step (advantages, old/ref log-probs, entropy, ...) are not
stored: the replay hooks write the stored anchor and advantages instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from verl_replay.headroom_drift.buffer import ReplayGroup

# Token fields rebuilt from the compact group (checked at ingress, stored as metadata otherwise).
CORE_FIELDS = frozenset(
    {
        "prompts",
        "responses",
        "input_ids",
        "position_ids",
        "response_mask",
        "loss_mask",
        "rm_scores",
        "rollout_log_probs",
    }
)
# Written by the trainer during a step; a replayed row gets them again (or our stored values).
DERIVED_FIELDS = frozenset(
    {
        "advantages",
        "returns",
        "old_log_probs",
        "ref_log_prob",
        "log_probs",
        "entropy",
        "values",
        "token_level_rewards",
        "token_level_scores",
        "rollout_is_weights",
        "replay_source",
        "replay_group_id",
    }
)
# Identity of the row inside one step; assigned anew at injection.
IDENTITY_FIELDS = frozenset({"uid", "session_id", "global_steps"})

# Per-row markers written on every row of an update: which stream the row comes from, and for
# replayed groups the buffer's group id (-1 otherwise).
REPLAY_SOURCE_FIELD = "replay_source"
REPLAY_GROUP_FIELD = "replay_group_id"
SOURCE_FRESH, SOURCE_GROUP_REPLAY, SOURCE_ELITE = 0, 1, 2


class GroupNotReplayable(ValueError):
    """A fresh group that cannot enter the buffer (reason in the message, counted in metrics)."""


def is_fresh(tag: Mapping[str, Any]) -> bool:
    """A real (not padding) row of this step's fresh rollouts."""
    return not tag.get("is_padding", False) and tag.get(REPLAY_SOURCE_FIELD, SOURCE_FRESH) == SOURCE_FRESH


def rollout_counts(tags: Sequence[Mapping[str, Any]], expected: int, planned_padding: int = 0) -> dict[str, int]:
    """A step's fresh rollouts: ``expected`` (prompts x responses per prompt), ``lost`` (expected but
    not in the update: verl's agent loop drops a rollout whose post-processing fails), the synthetic
    ``padding_rows`` of the update (they carry no gradient) and, of those, the ones the replay
    mini-batch plan asked for (``planned_padding_rows``); verl pads the rest to make up for lost rows."""
    fresh = sum(1 for tag in tags if is_fresh(tag))
    padding = sum(1 for tag in tags if tag.get("is_padding", False))
    return {
        "rollout/expected": int(expected),
        "rollout/lost": max(0, int(expected) - fresh),
        "rollout/padding_rows": padding,
        "rollout/planned_padding_rows": int(planned_padding),
    }


def tensor_bytes(value: Any) -> bytes:
    """The raw bytes of a tensor: a cheap, exact sort key for token sequences."""
    return torch.as_tensor(value).contiguous().numpy().tobytes()


def text_position_ids(length: int, leading: tuple[int, ...] = ()) -> torch.Tensor:
    """Position ids of a text-only row: ``arange(length)``, repeated over ``leading`` dims.

    verl gives M-RoPE models (Qwen3.5's ``Qwen3_5ForConditionalGeneration``) position ids of
    shape ``(4, L)`` for every row: one text row and the three M-RoPE rows, which for a row
    without images or videos all count 0..L-1 (``get_rope_index`` with no grid).
    """
    positions = torch.arange(length, dtype=torch.int64)
    return positions.expand(*leading, length).clone() if leading else positions


def plain(value: Any) -> Any:
    """Python/tensor value for buffer metadata: numpy arrays and scalars become lists and numbers."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # values without a boolean equality are kept per row
        return False


def correctness_bit(row: Mapping[str, Any]) -> bool:
    """c_i from the reward's ``acc`` (answer correctness, not ``score > 0``)."""
    extra = row.get("extra_fields") or {}
    info = extra.get("reward_extra_info") if isinstance(extra, Mapping) else None
    if not isinstance(info, Mapping) or "acc" not in info:
        raise GroupNotReplayable(
            "the reward function reports no 'acc' (answer correctness) in reward_extra_info; return "
            "{'score': ..., 'acc': 0/1} from compute_score or set replay.ingress=nonzero_advantage"
        )
    return float(plain(info["acc"])) > 0.5


def _first_valid(values: torch.Tensor, mask: torch.Tensor) -> float:
    valid = torch.nonzero(mask != 0)
    return float(values[valid[0, 0]]) if valid.numel() else 0.0


def _score_tensor(length: int, score: float) -> torch.Tensor:
    """verl's rule-based rm_scores: the sequence reward on the last response token."""
    out = torch.zeros(length, dtype=torch.float32)
    if length:
        out[-1] = score
    return out


@dataclass(frozen=True)
class RebuiltTokens:
    prompts: torch.Tensor
    responses: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    rm_scores: torch.Tensor


def rebuild_tokens(
    prompt: torch.Tensor,
    response: torch.Tensor,
    mask: torch.Tensor,
    gen: torch.Tensor,
    score: float,
    position_rows: tuple[int, ...] = (),
) -> RebuiltTokens:
    input_ids = torch.cat([prompt, response])
    return RebuiltTokens(
        prompts=prompt,
        responses=response,
        input_ids=input_ids,
        position_ids=text_position_ids(input_ids.numel(), position_rows),
        response_mask=mask,
        rollout_log_probs=gen,
        rm_scores=_score_tensor(response.numel(), score),
    )


# Group metadata key: the leading shape of the rows' position ids ((4,) for M-RoPE), when not 1-D.
POSITION_ROWS_META = "__position_rows__"
# Output metric of the actor worker's forward-only calls: the CPU seconds its process spent in the
# call. On the CPU test bed the rollout shares the cores, so a call's wall time also holds the
# rollout's work; on separate GPUs the two agree.
WORKER_CPU_SECONDS = "replay/worker_cpu_seconds"
# Group metadata key: the reference model's log-probs of the responses (flat [L]), with a KL loss.
REF_LOG_PROBS_META = "ref_log_probs"


def _position_rows(row: Mapping[str, Any]) -> tuple[int, ...]:
    positions = row.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() > 1:
        return tuple(int(d) for d in positions.shape[:-1])
    return ()


def rows_to_group(rows: Sequence[Mapping[str, Any]], *, anchor_field: str, require_acc: bool = True) -> ReplayGroup:
    """One GRPO group (the rows of one uid, session order) as a compact ``ReplayGroup``.

    ``anchor_field`` names the per-token log-probs stored as l_gen: ``old_log_probs`` in
    synchronous training, ``rollout_log_probs`` in the asynchronous modes.
    Without ``require_acc`` (ingress by non-zero advantage), a reward without ``acc`` is allowed
    and the stored correctness bits fall back to ``score > 0`` (reported, not used for ingress).
    """
    if not rows:
        raise GroupNotReplayable("empty group")
    prompt = torch.as_tensor(rows[0]["prompts"]).to(torch.int64)
    position_rows = _position_rows(rows[0])
    responses, masks, gens, advantages, correct, scores, overrides, refs = [], [], [], [], [], [], [], []
    for row in rows:
        row_prompt = torch.as_tensor(row["prompts"]).to(torch.int64)
        if not torch.equal(row_prompt, prompt):
            raise GroupNotReplayable("the group's rows do not share one prompt (multi-turn trajectories)")
        response = torch.as_tensor(row["responses"]).to(torch.int64)
        mask = torch.as_tensor(row["response_mask"]).to(torch.int64)
        gen = torch.as_tensor(row[anchor_field]).to(torch.float32)
        if gen.numel() != response.numel() or mask.numel() != response.numel():
            raise GroupNotReplayable(f"{anchor_field} / response_mask do not align with responses")
        score = float(torch.as_tensor(row["rm_scores"]).to(torch.float32).sum())
        rebuilt = rebuild_tokens(prompt, response, mask, gen, score, position_rows)
        override = {}
        # rollout_log_probs is not kept even when it differs from the anchor (always, in sync
        # mode): group_to_rows writes the anchor there, so a stored copy would never be read.
        for name in ("input_ids", "position_ids", "rm_scores", "loss_mask"):
            if name not in row:
                continue
            expected = mask if name == "loss_mask" else getattr(rebuilt, name)
            actual = torch.as_tensor(row[name])
            if actual.shape != expected.shape or not torch.equal(actual.to(expected.dtype), expected):
                override[name] = actual.detach().cpu().clone()
        responses.append(response)
        masks.append(mask)
        gens.append(gen)
        if "ref_log_prob" in row:  # with a KL loss: the frozen reference's log-probs, reused on replay
            refs.append(torch.as_tensor(row["ref_log_prob"]).to(torch.float32).reshape(-1))
        advantages.append(_first_valid(torch.as_tensor(row["advantages"]).float(), mask))
        try:
            correct.append(correctness_bit(row))
        except GroupNotReplayable:
            if require_acc:
                raise
            correct.append(score > 0)
        scores.append(score)
        overrides.append(override)

    field_names = [k for k in rows[0].keys() if k not in CORE_FIELDS | DERIVED_FIELDS | IDENTITY_FIELDS]
    shared: dict[str, Any] = {}
    per_row: list[dict[str, Any]] = [dict(o) for o in overrides]
    for name in field_names:
        values = [row.get(name) for row in rows]
        if all(_same(values[0], v) for v in values[1:]):
            shared[name] = plain(values[0])
        else:
            for target, value in zip(per_row, values, strict=True):
                target[name] = plain(value)
    if position_rows:
        shared[POSITION_ROWS_META] = list(position_rows)
    meta: dict[str, Any] = {"shared": shared, "per_row": per_row, "source_uid": str(rows[0].get("uid", ""))}
    if refs:
        if len(refs) != len(rows) or any(r.numel() != m.numel() for r, m in zip(refs, masks, strict=True)):
            raise GroupNotReplayable("ref_log_prob does not align with responses")
        meta[REF_LOG_PROBS_META] = torch.cat(refs)
    return ReplayGroup(
        prompt_ids=prompt,
        response_ids=torch.cat(responses),
        response_lengths=torch.tensor([r.numel() for r in responses], dtype=torch.int64),
        response_mask=torch.cat(masks) != 0,
        gen_log_probs=torch.cat(gens),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        correct=torch.tensor(correct, dtype=torch.bool),
        scores=torch.tensor(scores, dtype=torch.float32),
        meta=meta,
    )


def group_to_rows(group: ReplayGroup, *, uid: str, global_steps: int) -> list[dict[str, Any]]:
    """verl rows for an injected replay group: one row per response, session ids 0..n-1."""
    # The group's fields decode from its packed storage on every read: read each once.
    offsets = group.response_offsets().tolist()
    prompt = group.prompt_ids.to(torch.int64)
    meta = group.meta
    shared = dict(meta.get("shared", {}))
    position_rows = tuple(shared.pop(POSITION_ROWS_META, ()))
    per_row = meta.get("per_row", [{}] * group.n)
    response_ids = group.response_ids.to(torch.int64)
    response_mask = group.response_mask.to(torch.int64)
    gen_log_probs, scores = group.gen_log_probs, group.scores.tolist()
    rows = []
    for i in range(group.n):
        start, end = offsets[i], offsets[i + 1]
        response = response_ids[start:end].clone()
        mask = response_mask[start:end].clone()
        gen = gen_log_probs[start:end].clone()
        rebuilt = rebuild_tokens(prompt, response, mask, gen, float(scores[i]), position_rows)
        row: dict[str, Any] = {**shared, **per_row[i]}
        row.update(
            prompts=prompt.clone(),
            responses=response,
            input_ids=row.pop("input_ids", rebuilt.input_ids),
            position_ids=row.pop("position_ids", rebuilt.position_ids),
            response_mask=mask,
            loss_mask=row.pop("loss_mask", mask.clone()),
            rm_scores=row.pop("rm_scores", rebuilt.rm_scores),
            # The rollout log-probs of a replayed row are its anchor: with rollout correction on,
            # its IS weight is exactly 1.
            rollout_log_probs=gen.clone(),
            uid=uid,
            session_id=i,
            global_steps=global_steps,
        )
        rows.append(row)
    return rows


def row_key(uid: str, session_id: int, index: int = 0) -> str:
    """verl's trajectory key ``{uid}_{session}_{index}``."""
    return f"{uid}_{session_id}_{index}"


def row_tag(row: Mapping[str, Any], *, global_steps: int, **extra: Any) -> dict[str, Any]:
    prompt_len, response_len = int(row["prompts"].numel()), int(row["responses"].numel())
    return {
        "status": "success",
        "prompt_len": prompt_len,
        "response_len": response_len,
        "seq_len": prompt_len + response_len,
        "global_steps": global_steps,
        "min_global_steps": global_steps,
        "max_global_steps": global_steps,
        **extra,
    }


def unbind_rows(values: torch.Tensor) -> list[torch.Tensor]:
    """Per-row tensors of a batch tensor, nested or not.

    ``unbind`` of a 3-D jagged nested tensor (M-RoPE position ids, per row ``(4, L)``) splits
    the wrong dimension (pytorch#153238); those rows are cut from the padded form instead, along
    the tensor's own ragged dimension: TransferQueue hands back rows of equal length as a jagged
    tensor ragged in the *leading* dimension (``[B, j, L]``, each ``j`` = 4), rows of different
    lengths ragged in the last (``[B, 4, j]``).
    """
    if not values.is_nested or values.dim() < 3:
        return list(values.unbind(0))
    ragged_dim = values._ragged_idx - 1  # in a row: 0 for [B, j, L], 1 for [B, 4, j]
    lengths = values.offsets().diff().tolist()
    padded = values.to_padded_tensor(0)  # [B, *row dims, ragged one padded to its max]
    return [padded[i].narrow(ragged_dim, 0, length).clone() for i, length in enumerate(lengths)]


def split_rows(data: Any, size: int) -> list[dict[str, Any]]:
    """Rows of a TensorDict fetched from TransferQueue (nested tensors and non-tensor stacks)."""
    rows: list[dict[str, Any]] = [{} for _ in range(size)]
    for name in data.keys():
        values = data[name]
        if isinstance(values, torch.Tensor):
            items = unbind_rows(values)
        else:
            items = list(values)
        if len(items) != size:
            raise ValueError(f"field {name!r} has {len(items)} rows, expected {size}")
        for row, item in zip(rows, items, strict=True):
            row[name] = item
    return rows


def group_keys_by_uid(keys: Sequence[str]) -> dict[str, list[tuple[int, int, int]]]:
    """uid -> [(session_id, output_index, position in keys)], sessions in ascending order."""
    groups: dict[str, list[tuple[int, int, int]]] = {}
    for position, key in enumerate(keys):
        uid, session, index = key.rsplit("_", 2)
        groups.setdefault(uid, []).append((int(session), int(index), position))
    for members in groups.values():
        members.sort()
    return groups
