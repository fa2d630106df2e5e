"""Start-up checks and row construction of EliteReplay's training side (no Ray)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl_replay.config import ReplayConfig
from verl_replay.elite.archive import Candidate, EliteArchive, Question
from verl_replay.elite.archive_io import ArchiveIntegrityError, EmptyArchiveError, TokenizerMismatchError, save_frozen_archive
from verl_replay.elite.domains import hf_tokenizer_fingerprint
from verl_replay.integrations.verl.elite_replay import (
    EliteArchiveMismatch,
    EliteReplayController,
    file_sha256,
    preflight_archive,
)


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
    save_frozen_archive(archive, path, manifest={
        "base_model": "tiny", "tokenizer_name": "tiny",
        "tokenizer_fingerprint": fingerprint or hf_tokenizer_fingerprint(tokenizer),
        "dataset": {"path": str(train_file), "sha256": file_sha256(str(train_file))},
    })
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
    controller = EliteReplayController(config, tokenizer=tokenizer, train_files=[str(tiny_assets.math_train)],
                                       max_prompt_length=256, max_response_length=32)
    template = {"data_source": "tiny_math", "extra_fields": {}, "metrics": {}, "advantages": torch.zeros(2)}
    row = controller._row(0, template, uid="elite-s1-0", step=1)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 0 + 5?"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    assert row["prompts"].tolist() == prompt
    assert row["responses"].tolist() == tokenizer.encode("\\boxed{5}", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert row["loss_mask"].sum() == 0 and row["response_mask"].sum() == row["responses"].numel()
    assert row["replay_source"].item() == 2 and "advantages" not in row
    assert row["input_ids"].tolist() == prompt + row["responses"].tolist()


def test_entries_longer_than_the_run_allows_are_left_out(tmp_path, tokenizer, tiny_assets):
    path = build_archive(tmp_path / "a.parquet", tokenizer, tiny_assets.math_train, texts=("\\boxed{5}", "\\boxed{" + "9" * 60 + "}"))
    kwargs = dict(tokenizer=tokenizer, train_files=[str(tiny_assets.math_train)], max_prompt_length=256)
    controller = EliteReplayController(elite_config(path), max_response_length=16, **kwargs)
    assert len(controller.archive.entries) == 1 and controller.skipped_too_long == 1
    with pytest.raises(EliteArchiveMismatch, match="none of its 2 entries fits"):
        EliteReplayController(elite_config(path), max_response_length=2, **kwargs)


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
