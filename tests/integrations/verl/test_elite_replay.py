"""Start-up checks and row construction of EliteReplay's training side (no Ray)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl_replay.config import ReplayConfig
from verl_replay.elite.archive import Candidate, EliteArchive, Question
from verl_replay.elite.archive_io import (
    ArchiveIntegrityError,
    EmptyArchiveError,
    TokenizerMismatchError,
    save_frozen_archive,
)
from verl_replay.elite.domains import hf_tokenizer_fingerprint
from verl_replay.integrations.verl.elite_replay import (
    EliteArchiveMismatch,
    EliteReplayStream,
    file_sha256,
    preflight_archive,
)
from verl_replay.integrations.verl.streams import InjectedRowMismatch, check_row_fields, split_over_rounds


class ExactAnswer:
    """Real verification for these fixtures: the answer text must equal the ground truth."""

    def __call__(self, question, text):
        return SimpleNamespace(correct=text.strip() == str(question.ground_truth), reason="ok")


def build_archive(path, tokenizer, train_file, *, texts=("\\boxed{5}",), empty=False, fingerprint=None):
    archive = EliteArchive(
        verifier=ExactAnswer(),
        describer=lambda question, text: ("numeric_computation", f"len{len(text)}"),
        token_counter=lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
        approaches=["numeric_computation"],
        seed=0,
    )
    for i, text in enumerate(texts):
        question = Question(id=f"q{i}", prompt=({"role": "user", "content": f"What is {i} + 5?"},), ground_truth=text)
        archive.register(question)
        if not empty:
            archive.insert(question, Candidate(question_id=question.id, text=text))
    save_frozen_archive(
        archive,
        path,
        manifest={
            "base_model": "tiny",
            "tokenizer_name": "tiny",
            "tokenizer_fingerprint": fingerprint or hf_tokenizer_fingerprint(tokenizer),
            "dataset": {"path": str(train_file), "sha256": file_sha256(str(train_file))},
        },
    )
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets.model_dir)


def elite_config(path, **elite):
    return ReplayConfig.from_mapping({"strategy": "elite", "elite": {"archive": str(path), **elite}})


def test_good_archive_passes_and_rows_are_built(tmp_path, tokenizer, tiny_assets):
    path = build_archive(tmp_path / "a.parquet", tokenizer, tiny_assets.math_train, texts=("\\boxed{5}", "\\boxed{6}"))
    config = elite_config(path, batch_size=3)
    preflight_archive(config, tokenizer=tokenizer, train_files=[str(tiny_assets.math_train)])
    controller = EliteReplayStream(
        config,
        tokenizer=tokenizer,
        train_files=[str(tiny_assets.math_train)],
        max_prompt_length=256,
        max_response_length=32,
    )
    template = fresh_row_template()
    row = controller._row(0, template, uid="elite-s1-0", step=1)
    check_row_fields([row], template, source="EliteReplay archive")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 0 + 5?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert row["prompts"].tolist() == prompt
    assert row["responses"].tolist() == tokenizer.encode("\\boxed{5}", add_special_tokens=False) + [
        tokenizer.eos_token_id
    ]
    assert row["loss_mask"].sum() == 0 and row["response_mask"].sum() == row["responses"].numel()
    assert row["replay_source"].item() == 2 and "advantages" not in row
    assert row["input_ids"].tolist() == prompt + row["responses"].tolist()
    assert row["position_ids"].tolist() == list(range(row["input_ids"].numel()))
    assert "raw_prompt" not in row  # the run's rows have no such field: left out, not added


def fresh_row_template(position_rows=()):
    """The fields a fresh verl row carries when replay injects (after the reward, before old log-probs)."""
    length = 6
    positions = torch.arange(length)
    return {
        "prompts": torch.arange(3),
        "responses": torch.arange(3),
        "input_ids": torch.arange(length),
        "position_ids": positions.expand(*position_rows, length).clone() if position_rows else positions,
        "response_mask": torch.ones(3, dtype=torch.int64),
        "loss_mask": torch.ones(3, dtype=torch.int64),
        "rm_scores": torch.zeros(3),
        "rollout_log_probs": torch.zeros(3),
        "uid": "u",
        "session_id": 0,
        "global_steps": 1,
        "data_source": "tiny_math",
        "reward_model": {},
        "extra_info": {},
        "extra_fields": {},
        "metrics": {},
        "multi_modal_inputs": {"pixel_values": torch.zeros(1)},
        "replay_source": torch.tensor(0),
        "replay_group_id": torch.tensor(-1),
    }


def test_elite_rows_follow_the_fresh_rows_position_layout(tmp_path, tokenizer, tiny_assets):
    """Qwen3.5-4B's rows carry M-RoPE position ids (4, L); an elite row must carry the same layout."""
    path = build_archive(tmp_path / "a.parquet", tokenizer, tiny_assets.math_train)
    controller = EliteReplayStream(
        elite_config(path),
        tokenizer=tokenizer,
        train_files=[str(tiny_assets.math_train)],
        max_prompt_length=256,
        max_response_length=32,
    )
    template = fresh_row_template(position_rows=(4,))
    row = controller._row(0, template, uid="elite-s1-0", step=1)
    check_row_fields([row], template, source="EliteReplay archive")
    length = row["input_ids"].numel()
    assert row["position_ids"].shape == (4, length)
    assert all(r.tolist() == list(range(length)) for r in row["position_ids"])
    assert row["multi_modal_inputs"] == {}  # text-only, whatever the template row held


def test_row_field_check_names_the_field():
    template = fresh_row_template(position_rows=(4,))
    flat = dict(template, position_ids=torch.arange(6))
    with pytest.raises(InjectedRowMismatch, match="'position_ids'"):
        check_row_fields([flat], template, source="EliteReplay archive")
    missing = {k: v for k, v in template.items() if k != "rollout_log_probs"}
    with pytest.raises(InjectedRowMismatch, match=r"missing \['rollout_log_probs'\]"):
        check_row_fields([missing], template, source="replayed group")
    wrong_dtype = dict(template, rm_scores=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(InjectedRowMismatch, match="'rm_scores'"):
        check_row_fields([wrong_dtype], template, source="replayed group")


@pytest.mark.parametrize(
    "count,rounds,expected", [(5, 2, [3, 2]), (16, 4, [4, 4, 4, 4]), (1, 3, [1, 0, 0]), (0, 2, [0, 0])]
)
def test_split_over_rounds(count, rounds, expected):
    assert split_over_rounds(count, rounds) == expected


def test_split_over_rounds_is_even_and_complete():
    """Every split the function makes: all groups placed, shares differ by at most one, the extra
    ones in the earliest rounds."""
    for rounds in range(1, 6):
        for count in range(0, 3 * rounds + 2):
            shares = split_over_rounds(count, rounds)
            assert len(shares) == rounds and sum(shares) == count, (count, rounds, shares)
            assert max(shares) - min(shares) <= 1 and shares == sorted(shares, reverse=True), (count, rounds, shares)


def test_entries_longer_than_the_run_allows_are_left_out(tmp_path, tokenizer, tiny_assets):
    path = build_archive(
        tmp_path / "a.parquet", tokenizer, tiny_assets.math_train, texts=("\\boxed{5}", "\\boxed{" + "9" * 60 + "}")
    )
    kwargs = dict(tokenizer=tokenizer, train_files=[str(tiny_assets.math_train)], max_prompt_length=256)
    controller = EliteReplayStream(elite_config(path), max_response_length=16, **kwargs)
    assert len(controller.archive.entries) == 1 and controller.skipped_too_long == 1
    with pytest.raises(EliteArchiveMismatch, match="none of its 2 entries fits"):
        EliteReplayStream(elite_config(path), max_response_length=2, **kwargs)


def test_archive_from_another_dataset_is_refused(tmp_path, tokenizer, tiny_assets):
    path = build_archive(tmp_path / "a.parquet", tokenizer, tiny_assets.sql_train)
    with pytest.raises(EliteArchiveMismatch, match="was built from .*sql/train.parquet"):
        preflight_archive(elite_config(path), tokenizer=tokenizer, train_files=[str(tiny_assets.math_train)])


def test_tokenizer_mismatch_is_refused(tmp_path, tokenizer, tiny_assets):
    path = build_archive(tmp_path / "a.parquet", tokenizer, tiny_assets.math_train, fingerprint="0" * 64)
    with pytest.raises(TokenizerMismatchError, match="fingerprint"):
        preflight_archive(elite_config(path), tokenizer=tokenizer, train_files=[str(tiny_assets.math_train)])


def test_empty_and_corrupted_archives_are_refused(tmp_path, tokenizer, tiny_assets):
    empty = build_archive(tmp_path / "empty.parquet", tokenizer, tiny_assets.math_train, empty=True)
    with pytest.raises(EmptyArchiveError):
        preflight_archive(elite_config(empty), tokenizer=tokenizer, train_files=[str(tiny_assets.math_train)])
    good = build_archive(tmp_path / "good.parquet", tokenizer, tiny_assets.math_train)
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0xFF
    good.write_bytes(bytes(data))
    with pytest.raises(ArchiveIntegrityError, match="content hash mismatch"):
        preflight_archive(elite_config(good), tokenizer=tokenizer, train_files=[str(tiny_assets.math_train)])
