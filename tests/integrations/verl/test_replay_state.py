"""A checkpoint's replay state: complete, intact and from a compatible run, or a clear refusal."""

from __future__ import annotations

import json

import pytest

from verl_replay.config import ReplayConfig
from verl_replay.integrations.verl.replay_state import (
    STATE_MANIFEST,
    ReplayStateError,
    check_state_manifest,
    decision_settings,
    prune_orphaned_states,
    write_state_manifest,
)

IDENTITY = {"trainer_mode": "separate_async", "anchor_field": "rollout_log_probs", "tokenizer_fingerprint": "ab" * 32}


def saved_state(tmp_path, config=None, step=4):
    folder = tmp_path / f"global_step_{step}" / "replay"
    folder.mkdir(parents=True)
    (folder / "group_buffer.pt").write_bytes(b"buffer bytes")
    config = config or ReplayConfig.from_mapping({"strategy": "headroom_drift", "k_rep": 2, "tau": 0.05})
    write_state_manifest(folder, step=step, identity=IDENTITY, settings=decision_settings(config))
    return folder


def test_round_trip_and_free_settings_may_change(tmp_path):
    folder = saved_state(tmp_path)
    rechunked = ReplayConfig.from_mapping(
        {"strategy": "headroom_drift", "k_rep": 2, "tau": 0.05, "scan_chunk_groups": 3, "event_log": "/elsewhere.jsonl"}
    )
    assert check_state_manifest(folder, step=4, identity=IDENTITY, settings=decision_settings(rechunked))
    manifest = json.loads((folder / STATE_MANIFEST).read_text())
    assert set(manifest["files"]) == {"group_buffer.pt"}


def test_no_state_is_reported_not_guessed(tmp_path):
    assert not check_state_manifest(tmp_path / "global_step_4" / "replay", step=4, identity=IDENTITY, settings={})


@pytest.mark.parametrize(
    "key, value",
    [("tau", 0.1), ("k_rep", 3), ("capacity", 8), ("ingress", "nonzero_advantage"), ("scan_order", "recency")],
)
def test_decision_settings_must_match(tmp_path, key, value):
    folder = saved_state(tmp_path)
    changed = ReplayConfig.from_mapping({"strategy": "headroom_drift", "k_rep": 2, "tau": 0.05, key: value})
    with pytest.raises(ReplayStateError, match=f"replay.{key} was"):
        check_state_manifest(folder, step=4, identity=IDENTITY, settings=decision_settings(changed))


def test_a_manifest_written_before_scan_order_existed_means_headroom_order(tmp_path):
    folder = saved_state(tmp_path)
    manifest = json.loads((folder / STATE_MANIFEST).read_text())
    del manifest["settings"]["scan_order"]
    (folder / STATE_MANIFEST).write_text(json.dumps(manifest))
    base = {"strategy": "headroom_drift", "k_rep": 2, "tau": 0.05}
    assert check_state_manifest(
        folder, step=4, identity=IDENTITY, settings=decision_settings(ReplayConfig.from_mapping(base))
    )
    recency = decision_settings(ReplayConfig.from_mapping({**base, "scan_order": "recency"}))
    with pytest.raises(ReplayStateError, match="replay.scan_order was 'headroom'"):
        check_state_manifest(folder, step=4, identity=IDENTITY, settings=recency)


@pytest.mark.parametrize("key", sorted(IDENTITY))
def test_identity_must_match(tmp_path, key):
    folder = saved_state(tmp_path)
    other = dict(IDENTITY, **{key: "something else"})
    with pytest.raises(ReplayStateError, match=f"saved with {key}="):
        check_state_manifest(
            folder,
            step=4,
            identity=other,
            settings=decision_settings(
                ReplayConfig.from_mapping({"strategy": "headroom_drift", "k_rep": 2, "tau": 0.05})
            ),
        )


def test_edited_or_torn_files_are_refused(tmp_path):
    folder = saved_state(tmp_path)
    (folder / "group_buffer.pt").write_bytes(b"buffer bytez")
    settings = decision_settings(ReplayConfig.from_mapping({"strategy": "headroom_drift", "k_rep": 2, "tau": 0.05}))
    with pytest.raises(ReplayStateError, match="sha256"):
        check_state_manifest(folder, step=4, identity=IDENTITY, settings=settings)
    with pytest.raises(ReplayStateError, match="belongs to global step 4"):
        check_state_manifest(folder, step=5, identity=IDENTITY, settings=settings)


def test_states_of_pruned_checkpoints_are_removed(tmp_path):
    for step in (2, 4, 6):
        saved_state(tmp_path, step=step)
        (tmp_path / f"global_step_{step}" / "actor").mkdir()
        (tmp_path / f"global_step_{step}" / "data.pt").write_bytes(b"verl's dataloader state")
    import shutil

    shutil.rmtree(tmp_path / "global_step_2" / "actor")  # what verl's max_actor_ckpt_to_keep does
    removed = prune_orphaned_states(tmp_path, "replay", keep_step=6)
    assert removed == [tmp_path / "global_step_2" / "replay"]
    assert not removed[0].exists()
    assert (tmp_path / "global_step_4" / "replay").is_dir() and (tmp_path / "global_step_6" / "replay").is_dir()
    # only our state goes: what else verl keeps in the folder is verl's to prune
    assert (tmp_path / "global_step_2" / "data.pt").read_bytes() == b"verl's dataloader state"
    shutil.rmtree(tmp_path / "global_step_6" / "actor")
    assert prune_orphaned_states(tmp_path, "replay", keep_step=6) == []  # the step being saved is kept
