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
    [
        ("tau", 0.1),
        ("k_rep", 3),
        ("capacity", 8),
        ("ingress", "nonzero_advantage"),
        ("scan_order", "recency"),
        ("scan_skip", "cooldown"),
        ("drift_norm", "mean_sq"),
    ],
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


def test_a_manifest_written_before_scan_skip_existed_means_the_papers_scan(tmp_path):
    folder = saved_state(tmp_path)
    manifest = json.loads((folder / STATE_MANIFEST).read_text())
    del manifest["settings"]["scan_skip"]
    (folder / STATE_MANIFEST).write_text(json.dumps(manifest))
    base = {"strategy": "headroom_drift", "k_rep": 2, "tau": 0.05}
    # under the paper's scan the rule's parameters shape only its shadow: free to change
    shadow = decision_settings(ReplayConfig.from_mapping({**base, "scan_skip_margin": 3.0}))
    assert check_state_manifest(folder, step=4, identity=IDENTITY, settings=shadow)
    live = decision_settings(ReplayConfig.from_mapping({**base, "scan_skip": "cooldown"}))
    with pytest.raises(ReplayStateError, match="replay.scan_skip was 'none'"):
        check_state_manifest(folder, step=4, identity=IDENTITY, settings=live)


def test_a_live_rule_keeps_its_parameters(tmp_path):
    live = {"strategy": "headroom_drift", "k_rep": 2, "tau": 0.05, "scan_skip": "cooldown"}
    folder = saved_state(tmp_path, ReplayConfig.from_mapping(live))
    for key, value in (("scan_skip_margin", 5.0), ("scan_skip_versions", None), ("scan_skip_growth", 0.5)):
        changed = decision_settings(ReplayConfig.from_mapping({**live, key: value}))
        with pytest.raises(ReplayStateError, match=f"replay.{key} was"):
            check_state_manifest(folder, step=4, identity=IDENTITY, settings=changed)


def test_a_live_rule_saved_before_growth_existed_had_none(tmp_path):
    live = {"strategy": "headroom_drift", "k_rep": 2, "tau": 0.05, "scan_skip": "cooldown"}
    folder = saved_state(tmp_path, ReplayConfig.from_mapping(live))
    manifest = json.loads((folder / STATE_MANIFEST).read_text())
    del manifest["settings"]["scan_skip_growth"]
    (folder / STATE_MANIFEST).write_text(json.dumps(manifest))
    without_growth = decision_settings(ReplayConfig.from_mapping({**live, "scan_skip_growth": 0.0}))
    assert check_state_manifest(folder, step=4, identity=IDENTITY, settings=without_growth)
    default = decision_settings(ReplayConfig.from_mapping(live))  # growth 2.0
    with pytest.raises(ReplayStateError, match="replay.scan_skip_growth was 0.0"):
        check_state_manifest(folder, step=4, identity=IDENTITY, settings=default)


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


def _checkpoint(root, step, *, actor=True, buffer=b"groups"):
    from verl_replay.integrations.verl.replay_state import STATE_DIR

    state = root / f"global_step_{step}" / STATE_DIR
    state.mkdir(parents=True)
    if actor:
        (state.parent / "actor").mkdir()
    (state / "group_buffer.pt").write_bytes(buffer)
    write_state_manifest(state, step=step, identity={"trainer_mode": "sync"}, settings={})
    return state


def test_the_driver_verifies_every_file_and_the_manifest_itself(tmp_path):
    from verl_replay.integrations.verl.replay_state import verify_state

    assert verify_state(tmp_path / "none") is False
    state = _checkpoint(tmp_path, 3)
    assert verify_state(state) is True
    with open(state / "group_buffer.pt", "r+b") as handle:
        handle.truncate(2)  # torn
    with pytest.raises(ReplayStateError, match=r"group_buffer.pt is missing or does not match its recorded sha256"):
        verify_state(state)
    (state / "replay_state.json").write_text("{torn")
    with pytest.raises(ReplayStateError, match=r"replay_state.json is corrupted"):
        verify_state(state)
    (state / "replay_state.json").write_text(json.dumps({"format": 99, "files": {}}))
    with pytest.raises(ReplayStateError, match=r"replay state format 99"):
        verify_state(state)


def test_the_newest_intact_checkpoint_skips_damaged_and_model_less_ones(tmp_path):
    from verl_replay.integrations.verl.replay_state import STATE_DIR, newest_intact_checkpoint

    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4, actor=False)  # verl's model state is gone: nothing to resume
    damaged = _checkpoint(tmp_path, 6)
    (damaged / "group_buffer.pt").write_bytes(b"edited")
    _checkpoint(tmp_path, 8)
    assert newest_intact_checkpoint(tmp_path, STATE_DIR, before_step=8) == tmp_path / "global_step_2"
    assert newest_intact_checkpoint(tmp_path, STATE_DIR, before_step=9) == tmp_path / "global_step_8"
    assert newest_intact_checkpoint(tmp_path, STATE_DIR, before_step=2) is None
