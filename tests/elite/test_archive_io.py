"""Frozen-archive file: roundtrip, integrity, refusals, atomic writes."""

from __future__ import annotations

import ast
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from verl_replay.elite import archive_io
from verl_replay.elite.archive import Candidate, EliteArchive, Question
from verl_replay.elite.archive_io import (
    COLUMNS,
    ArchiveFileError,
    ArchiveIntegrityError,
    DatasetMismatchError,
    EmptyArchiveError,
    TokenizerMismatchError,
    load_frozen_archive,
    manifest_path,
    save_frozen_archive,
    tokenizer_fingerprint,
)
from verl_replay.elite.sampler import BalancedSampler

VOCAB = ["sum", "product", "difference"]
FP = tokenizer_fingerprint({"<pad>": 0, "1": 1, "+": 2}, ["<pad>"], "{{ messages }}")


@dataclass(frozen=True)
class Verdict:
    correct: bool
    reason: str


_OPS = {ast.Add: ("+", "sum"), ast.Mult: ("*", "product"), ast.Sub: ("-", "difference")}


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _value(node.left), _value(node.right)
        return {"+": a + b, "*": a * b, "-": a - b}[_OPS[type(node.op)][0]]
    raise ValueError(f"disallowed syntax {type(node).__name__}")


def verify(question: Question, text: str) -> Verdict:
    try:
        ok = _value(ast.parse(text, mode="eval").body) == question.ground_truth
    except (SyntaxError, ValueError) as exc:
        return Verdict(False, str(exc))
    return Verdict(ok, "match" if ok else "mismatch")


def describe(question: Question, text: str) -> tuple[str, str]:
    tree = ast.parse(text, mode="eval").body
    if not isinstance(tree, ast.BinOp) or type(tree.op) not in _OPS:
        raise ValueError("no top-level operator")
    return _OPS[type(tree.op)][1], f"terms={text.count('+') + text.count('*') + text.count('-') + 1}"


def build_archive() -> EliteArchive:
    arch = EliteArchive(verifier=verify, describer=describe, token_counter=len, approaches=VOCAB, seed=0)
    qa = Question(
        id="qa",
        prompt=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "make 12 ✓"}],
        ground_truth=12,
        metadata={"db_path": "/data/a.sqlite", "split": "train"},
    )
    qb = Question(id="qb", prompt="make 6", ground_truth=6, metadata={})
    for question, text, requested in [
        (qa, "7+5", None),
        (qa, "3*4", "product"),
        (qa, "20-8", "sum"),  # approach miss
        (qa, "2+2+8", "sum"),
        (qa, "9+9", None),  # rejected
        (qb, "2*3", None),
        (qb, "1+5", "difference"),
    ]:
        arch.insert(question, Candidate(question.id, text, requested, metadata={"temperature": 0.8}), round=1)
    return arch


def base_manifest(**extra) -> dict:
    m = {
        "base_model": "Qwen/Qwen3.5-4B",
        "tokenizer_name": "Qwen/Qwen3.5-4B",
        "tokenizer_fingerprint": FP,
        "dataset": {"name": "toy-arith", "split": "train", "sha256": "abc"},
        "search_config": {"mutations_per_question": 4, "seed": 0},
    }
    m.update(extra)
    return m


def test_roundtrip(tmp_path: Path):
    arch = build_archive()
    path = tmp_path / "out" / "archive.parquet"
    written = save_frozen_archive(arch, path, manifest=base_manifest(note="extra keys are kept"))
    assert path.exists() and manifest_path(path) == tmp_path / "out" / "archive.parquet.manifest.json"
    assert sorted(p.name for p in path.parent.iterdir()) == ["archive.parquet", "archive.parquet.manifest.json"]

    man = json.loads(manifest_path(path).read_text())
    assert man == written
    assert man["content_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert man["counts"] == arch.counts() and man["coverage"] == arch.coverage()
    assert man["vocabulary"] == VOCAB and man["num_entries"] == len(arch) == 6 and man["num_questions"] == 2
    assert man["note"] == "extra keys are kept" and man["format_version"] == 1
    for key in ("base_model", "tokenizer_name", "tokenizer_fingerprint", "dataset", "search_config", "created_at"):
        assert key in man
    assert pq.read_table(path).column_names == list(COLUMNS)

    loaded = load_frozen_archive(path, expected_tokenizer_fingerprint=FP, expected_dataset=base_manifest()["dataset"])
    expected = arch.freeze()
    assert [e.to_dict() for e in loaded.entries] == [e.to_dict() for e in expected.entries]
    assert loaded.fingerprint == expected.fingerprint
    assert loaded.question_ids == ("qa", "qb")
    assert [tuple(c) for c in loaded.cells("qa")] == [
        ("difference", "terms=2"),
        ("product", "terms=2"),
        ("sum", "terms=2"),
        ("sum", "terms=3"),
    ]
    e = loaded.groups["qa"][("difference", "terms=2")]
    assert e.text == "20-8" and e.requested_approach == "sum" and e.num_tokens == 4
    assert e.prompt[1]["content"] == "make 12 ✓" and e.question_metadata["db_path"] == "/data/a.sqlite"
    assert e.generation_metadata["temperature"] == 0.8
    assert loaded.manifest["counts"]["totals"]["verification_failures"] == 1
    assert BalancedSampler(loaded, seed=0).sample(2)  # a loaded archive is directly replayable


def test_flipped_byte_is_refused_with_both_hashes(tmp_path: Path):
    path = tmp_path / "a.parquet"
    save_frozen_archive(build_archive(), path, manifest=base_manifest())
    good = hashlib.sha256(path.read_bytes()).hexdigest()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    bad = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(ArchiveIntegrityError) as info:
        load_frozen_archive(path)
    msg = str(info.value)
    assert str(path) in msg and good in msg and bad in msg and "corrupted" in msg


def test_truncated_file_is_refused(tmp_path: Path):
    path = tmp_path / "a.parquet"
    save_frozen_archive(build_archive(), path, manifest=base_manifest())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ArchiveIntegrityError, match="content hash mismatch"):
        load_frozen_archive(path)


def test_tokenizer_and_dataset_mismatch_are_refused(tmp_path: Path):
    path = tmp_path / "a.parquet"
    save_frozen_archive(build_archive(), path, manifest=base_manifest())
    other = tokenizer_fingerprint({"<pad>": 0, "1": 1, "+": 3}, ["<pad>"], "{{ messages }}")
    with pytest.raises(TokenizerMismatchError) as info:
        load_frozen_archive(path, expected_tokenizer_fingerprint=other)
    assert FP in str(info.value) and other in str(info.value) and "Qwen/Qwen3.5-4B" in str(info.value)
    with pytest.raises(DatasetMismatchError, match="toy-arith"):
        load_frozen_archive(path, expected_dataset={"name": "toy-arith", "split": "test", "sha256": "abc"})
    # key order of the expected dataset does not matter
    load_frozen_archive(path, expected_dataset={"sha256": "abc", "split": "train", "name": "toy-arith"})


def test_empty_archive_is_refused_unless_allowed(tmp_path: Path):
    empty = EliteArchive(verifier=verify, describer=describe, token_counter=len, approaches=VOCAB, seed=0)
    path = tmp_path / "empty.parquet"
    save_frozen_archive(empty, path, manifest=base_manifest())
    with pytest.raises(EmptyArchiveError, match="no entries"):
        load_frozen_archive(path)
    assert len(load_frozen_archive(path, allow_empty=True)) == 0


def test_missing_and_malformed_files(tmp_path: Path):
    path = tmp_path / "a.parquet"
    with pytest.raises(FileNotFoundError, match="manifest"):
        load_frozen_archive(path)
    save_frozen_archive(build_archive(), path, manifest=base_manifest())
    path.unlink()
    with pytest.raises(FileNotFoundError, match="data file"):
        load_frozen_archive(path)
    save_frozen_archive(build_archive(), path, manifest=base_manifest())
    manifest_path(path).write_text("{not json")
    with pytest.raises(ArchiveFileError, match="not valid JSON"):
        load_frozen_archive(path)
    save_frozen_archive(build_archive(), path, manifest=base_manifest())
    man = json.loads(manifest_path(path).read_text())
    man["format_version"] = 99
    manifest_path(path).write_text(json.dumps(man))
    with pytest.raises(ArchiveFileError, match="version 99"):
        load_frozen_archive(path)


def test_manifest_validation(tmp_path: Path):
    arch = build_archive()
    path = tmp_path / "a.parquet"
    m = base_manifest()
    del m["tokenizer_fingerprint"]
    with pytest.raises(ValueError, match="missing"):
        save_frozen_archive(arch, path, manifest=m)
    with pytest.raises(ValueError, match="computed by the writer"):
        save_frozen_archive(arch, path, manifest=base_manifest(content_sha256="x"))
    with pytest.raises(ValueError, match="vocabulary"):
        save_frozen_archive(arch, path, manifest=base_manifest(vocabulary=["sum"]))
    with pytest.raises(TypeError, match="JSON"):
        save_frozen_archive(arch, path, manifest=base_manifest(search_config={"fn": print}))
    bad_q = Question(id="qc", prompt="make 2", ground_truth=2, metadata={"tags": {"a", "b"}})
    assert arch.insert(bad_q, Candidate("qc", "1+1")).inserted  # a set in the metadata is not JSON
    with pytest.raises(TypeError, match="question metadata of question 'qc'"):
        save_frozen_archive(arch, path, manifest=base_manifest())
    assert not path.exists() and not manifest_path(path).exists()


def test_save_from_elites_and_questions(tmp_path: Path):
    arch = build_archive()
    path = tmp_path / "a.parquet"
    with pytest.raises(ValueError, match="questions="):
        save_frozen_archive(arch.elites(), path, manifest=base_manifest(vocabulary=VOCAB, counts=arch.counts()))
    with pytest.raises(ValueError, match="vocabulary"):
        save_frozen_archive(arch.elites(), path, manifest=base_manifest(counts={}), questions=arch.questions())
    save_frozen_archive(
        arch.elites(), path, manifest=base_manifest(vocabulary=VOCAB, counts=arch.counts()), questions=arch.questions()
    )
    loaded = load_frozen_archive(path)
    assert loaded.fingerprint == arch.freeze().fingerprint


def test_atomic_overwrite_keeps_old_file_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "a.parquet"
    save_frozen_archive(build_archive(), path, manifest=base_manifest())
    before = (path.read_bytes(), manifest_path(path).read_bytes())

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(archive_io.os, "replace", failing_replace)
    small = EliteArchive(verifier=verify, describer=describe, token_counter=len, approaches=VOCAB, seed=0)
    with pytest.raises(OSError, match="disk full"):
        save_frozen_archive(small, path, manifest=base_manifest())
    monkeypatch.undo()
    assert (path.read_bytes(), manifest_path(path).read_bytes()) == before
    assert sorted(os.listdir(tmp_path)) == ["a.parquet", "a.parquet.manifest.json"]  # no temp files left
    assert len(load_frozen_archive(path)) == 6


def test_tokenizer_fingerprint_is_canonical():
    vocab = {"a": 0, "b": 1, "<eos>": 2}
    fp = tokenizer_fingerprint(vocab, {"eos_token": "<eos>"}, "tmpl")
    canonical = '{"chat_template":"tmpl","special_tokens":{"eos_token":"<eos>"},"vocab":[[0,"a"],[1,"b"],[2,"<eos>"]]}'
    assert fp == hashlib.sha256(canonical.encode()).hexdigest()
    assert fp == tokenizer_fingerprint(dict(reversed(list(vocab.items()))), {"eos_token": "<eos>"}, "tmpl")
    assert fp != tokenizer_fingerprint({"a": 1, "b": 0, "<eos>": 2}, {"eos_token": "<eos>"}, "tmpl")
    assert fp != tokenizer_fingerprint(vocab, {"eos_token": "b"}, "tmpl")
    assert fp != tokenizer_fingerprint(vocab, {"eos_token": "<eos>"}, None)
    assert tokenizer_fingerprint(vocab, ["x", "y"]) == tokenizer_fingerprint(vocab, ["y", "x"])
    with pytest.raises(TypeError):
        tokenizer_fingerprint({"a": "0"})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        tokenizer_fingerprint(vocab, "<eos>")


def test_archive_files_get_the_users_umask(tmp_path: Path):
    """mkstemp creates 0600 files; a saved archive is readable like any other output."""
    import stat

    from verl_replay._files import default_file_mode

    path = tmp_path / "a.parquet"
    save_frozen_archive(build_archive(), path, manifest=base_manifest())
    for written in (path, manifest_path(path)):
        assert stat.S_IMODE(written.stat().st_mode) == default_file_mode() != 0o600, written
