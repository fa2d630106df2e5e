"""verl trajectory rows <-> compact ReplayGroup: lossless for everything a replayed row needs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_replay.integrations.verl.rows import (
    REPLAY_SOURCE_FIELD,
    SOURCE_GROUP_REPLAY,
    GroupNotReplayable,
    correctness_bit,
    group_keys_by_uid,
    group_to_rows,
    rollout_counts,
    rows_to_group,
    split_rows,
)


def fresh_row(prompt, response, session, *, acc, advantage, score):
    prompt, response = torch.tensor(prompt), torch.tensor(response)
    input_ids = torch.cat([prompt, response])
    rm_scores = torch.zeros(len(response))
    rm_scores[-1] = score
    return {
        "prompts": prompt,
        "responses": response,
        "input_ids": input_ids,
        "position_ids": torch.arange(len(input_ids)),
        "response_mask": torch.ones(len(response), dtype=torch.int64),
        "loss_mask": torch.ones(len(response), dtype=torch.int64),
        "rm_scores": rm_scores,
        "rollout_log_probs": -torch.rand(len(response)),
        "old_log_probs": -torch.rand(len(response)),
        "advantages": torch.full((len(response),), advantage),
        "entropy": torch.rand(len(response)),
        "uid": "u1",
        "session_id": session,
        "global_steps": 3,
        "data_source": "tiny_math",
        "raw_prompt": [{"role": "user", "content": "What is 2 + 3?"}],
        "extra_info": {"index": 7, "gold_sqls": np.array(["SELECT 1"], dtype=object)},
        "extra_fields": {"reward_extra_info": {"acc": acc, "score": score}, "turn_scores": []},
        "metrics": {"generate_sequences": 0.1 * session},
        "dummy_tensor": torch.zeros(1, dtype=torch.uint8),
    }


@pytest.fixture
def group_rows():
    return [
        fresh_row([5, 6, 7], [1, 2], 0, acc=1.0, advantage=0.8, score=1.0),
        fresh_row([5, 6, 7], [3, 4, 5, 6], 1, acc=0.0, advantage=-0.8, score=0.0),
    ]


def test_round_trip_keeps_what_a_replayed_row_needs(group_rows):
    group = rows_to_group(group_rows, anchor_field="old_log_probs")
    torch.testing.assert_close(group.advantages, torch.tensor([0.8, -0.8]))
    assert group.correct.tolist() == [True, False]
    torch.testing.assert_close(group.gen_log_probs, torch.cat([r["old_log_probs"] for r in group_rows]))
    rows = group_to_rows(group, uid="replay-g0-s9", global_steps=9)
    for original, rebuilt in zip(group_rows, rows, strict=True):
        for name in ("prompts", "responses", "input_ids", "position_ids", "response_mask", "loss_mask", "rm_scores"):
            torch.testing.assert_close(rebuilt[name], original[name].to(rebuilt[name].dtype))
        # the anchor replaces the rollout log-probs (IS weight exactly 1 under rollout correction)
        torch.testing.assert_close(rebuilt["rollout_log_probs"], original["old_log_probs"])
        assert rebuilt["uid"] == "replay-g0-s9" and rebuilt["global_steps"] == 9
        assert rebuilt["raw_prompt"] == original["raw_prompt"] and rebuilt["data_source"] == "tiny_math"
        assert rebuilt["metrics"] == original["metrics"]  # per-row metadata survives
        assert rebuilt["extra_info"]["gold_sqls"] == ["SELECT 1"]  # numpy became plain
        assert "advantages" not in rebuilt and "old_log_probs" not in rebuilt and "entropy" not in rebuilt
    assert set(rows[0]) == set(rows[1])


def test_rollout_log_probs_are_not_stored_twice(group_rows):
    # sync mode: the anchor is old_log_probs and the rollout log-probs differ from it; they are
    # never read back (group_to_rows writes the anchor), so the group must not keep a copy
    assert not torch.equal(group_rows[0]["rollout_log_probs"], group_rows[0]["old_log_probs"])
    group = rows_to_group(group_rows, anchor_field="old_log_probs")
    assert all("rollout_log_probs" not in row for row in group.meta["per_row"])
    assert "rollout_log_probs" not in group.meta["shared"]
    for row, original in zip(group_to_rows(group, uid="x", global_steps=0), group_rows, strict=True):
        torch.testing.assert_close(row["rollout_log_probs"], original["old_log_probs"])


def test_async_anchor_is_the_rollout_log_probs(group_rows):
    group = rows_to_group(group_rows, anchor_field="rollout_log_probs")
    torch.testing.assert_close(group.gen_log_probs, torch.cat([r["rollout_log_probs"] for r in group_rows]))


def test_non_standard_token_fields_are_kept_verbatim(group_rows):
    group_rows[1]["position_ids"] = group_rows[1]["position_ids"] + 100  # e.g. an mRoPE-style layout
    group_rows[0]["loss_mask"] = torch.tensor([1, 0])
    rows = group_to_rows(rows_to_group(group_rows, anchor_field="old_log_probs"), uid="x", global_steps=0)
    torch.testing.assert_close(rows[1]["position_ids"], group_rows[1]["position_ids"])
    torch.testing.assert_close(rows[0]["loss_mask"], group_rows[0]["loss_mask"])


def test_missing_acc_is_a_clear_configuration_error(group_rows):
    del group_rows[0]["extra_fields"]["reward_extra_info"]["acc"]
    with pytest.raises(GroupNotReplayable, match="acc"):
        rows_to_group(group_rows, anchor_field="old_log_probs")
    # ingress by non-zero advantage does not need it: correctness falls back to score > 0
    group = rows_to_group(group_rows, anchor_field="old_log_probs", require_acc=False)
    assert group.correct.tolist() == [True, False]
    assert correctness_bit({"extra_fields": {"reward_extra_info": {"acc": np.float32(1.0)}}})


def test_groups_with_different_prompts_are_not_replayable(group_rows):
    group_rows[1]["prompts"] = torch.tensor([9, 9, 9])
    with pytest.raises(GroupNotReplayable, match="prompt"):
        rows_to_group(group_rows, anchor_field="old_log_probs")


def test_split_rows_and_key_grouping():
    from tensordict import NonTensorStack, TensorDict

    data = TensorDict(
        {
            "x": torch.nested.as_nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
            "tag": NonTensorStack("a", "b"),
        },
        batch_size=2,
    )
    rows = split_rows(data, 2)
    assert rows[1]["tag"] == "b" and rows[1]["x"].numel() == 3
    groups = group_keys_by_uid(["u_1_0", "v_0_0", "u_0_0", "u_2_1"])
    assert groups["u"] == [(0, 0, 2), (1, 0, 0), (2, 1, 3)] and groups["v"] == [(0, 0, 1)]


def test_mrope_position_ids_round_trip_without_a_stored_copy(group_rows):
    """Qwen3.5 (M-RoPE) rows carry (4, L) position ids; text-only ones are arange on every row."""
    for row in group_rows:
        row["position_ids"] = torch.arange(row["input_ids"].numel()).expand(4, -1).clone()
    group = rows_to_group(group_rows, anchor_field="old_log_probs")
    assert all("position_ids" not in per_row for per_row in group.meta["per_row"])  # rebuilt, not stored
    for original, rebuilt in zip(group_rows, group_to_rows(group, uid="x", global_steps=0), strict=True):
        assert rebuilt["position_ids"].shape == original["position_ids"].shape
        torch.testing.assert_close(rebuilt["position_ids"], original["position_ids"])


def test_rollout_log_probs_are_not_stored(group_rows):
    """A replayed row's rollout log-probs are its anchor: a stored copy would never be read."""
    group = rows_to_group(group_rows, anchor_field="old_log_probs")
    assert all("rollout_log_probs" not in per_row for per_row in group.meta["per_row"])
    assert "rollout_log_probs" not in group.meta["shared"]


def test_split_rows_cuts_3d_nested_position_ids():
    from tensordict import TensorDict

    from verl_replay.integrations.verl.rows import unbind_rows

    per_row = [torch.arange(3).expand(4, 3).clone(), torch.arange(5).expand(4, 5).clone()]
    nested_positions = torch.nested.as_nested_tensor(per_row, layout=torch.jagged)  # [B, 4, j]
    rows = unbind_rows(nested_positions)
    assert [r.shape for r in rows] == [(4, 3), (4, 5)]
    assert all(torch.equal(a, b) for a, b in zip(rows, per_row, strict=True))
    split = split_rows(TensorDict({"position_ids": nested_positions}, batch_size=2), 2)
    assert torch.equal(split[1]["position_ids"], per_row[1])


@pytest.mark.parametrize("lengths", [(45, 45, 45), (45, 44, 43)])
def test_unbind_rows_follows_the_ragged_dimension(lengths):
    """TransferQueue returns rows of equal length ragged in the leading dimension ([B, j, L],
    j = 4: a GRPO group whose responses all have one length) and others ragged in the last:
    both must give back each row's own (4, L) (a (4, 4) cut once reached the scan forward)."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from verl_replay.integrations.verl.rows import unbind_rows

    per_row = [torch.arange(n).expand(4, n).clone() + i for i, n in enumerate(lengths)]
    # verl's own batching: [B, 4, j] for mixed lengths, a dense [B, 4, L] for equal ones
    constructions = [list_of_dict_to_tensordict([{"position_ids": p} for p in per_row])["position_ids"]]
    if len(set(lengths)) == 1:
        constructions.append(torch.nested.as_nested_tensor(per_row, layout=torch.jagged))  # [B, j, L]
    for nested_positions in constructions:
        rows = unbind_rows(nested_positions)
        assert [tuple(r.shape) for r in rows] == [(4, n) for n in lengths]
        assert all(torch.equal(a, b) for a, b in zip(rows, per_row, strict=True))


def test_reference_log_probs_are_kept_for_a_kl_loss(group_rows):
    for row in group_rows:
        row["ref_log_prob"] = -torch.rand(len(row["responses"]))
    group = rows_to_group(group_rows, anchor_field="old_log_probs")
    from verl_replay.integrations.verl.rows import REF_LOG_PROBS_META

    torch.testing.assert_close(group.meta[REF_LOG_PROBS_META], torch.cat([r["ref_log_prob"] for r in group_rows]))
    rows = group_to_rows(group, uid="x", global_steps=0)
    assert all("ref_log_prob" not in row for row in rows)  # written after verl's ref stage, not injected


def test_rollout_counts_tell_lost_fresh_rows_from_padding_and_replay():
    fresh = [{} for _ in range(15)]
    replayed = [{REPLAY_SOURCE_FIELD: SOURCE_GROUP_REPLAY} for _ in range(8)]
    padding = [{"is_padding": True}]
    assert rollout_counts(fresh + replayed + padding, expected=16) == {
        "rollout/expected": 16,
        "rollout/lost": 1,
        "rollout/padding_rows": 1,
        "rollout/planned_padding_rows": 0,
    }
    assert rollout_counts(fresh + padding, expected=16, planned_padding=1)["rollout/planned_padding_rows"] == 1
    assert rollout_counts([{} for _ in range(16)], expected=16)["rollout/lost"] == 0
