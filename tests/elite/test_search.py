"""MAP-Elites search on CPU: the tiny SQL model, the tiny SQL data, real SQLite
files, the HF backend and a real verification pool.

One uninterrupted run is shared by several tests (module fixture); the resume test re-runs the
same config interrupted after round 1 and resumed, and must produce the same archive bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_replay.elite.archive import SEED_KEY
from verl_replay.elite.archive_io import ArchiveIntegrityError, load_frozen_archive, manifest_path
from verl_replay.elite.domains import TokenCounter, hf_tokenizer_fingerprint, make_domain
from verl_replay.elite.search import (
    SearchConfig,
    SearchError,
    main,
    mutation_schedule,
    run_search,
    state_path,
)
from verl_replay.sql.vocabulary import load_vocabulary
from verl_replay.verifiers.sql import REASONS as SQL_REASONS

LIMIT = 8  # the tiny model is right ~10% of the time: 8 questions x 8 seeds give a few elites
SEEDS = 8
MUTATIONS = 4
ROUNDS = 2


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: threads only oversubscribe the shared CPU
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def backend(tiny_assets):
    from verl_replay.generation import make_backend

    return make_backend("hf", model_path=str(tiny_assets.sql_model_dir), batch_size=32)


def make_config(tiny_assets, out: Path, **overrides) -> SearchConfig:
    settings = dict(
        data=str(tiny_assets.sql_train),
        model=str(tiny_assets.sql_model_dir),
        out=str(out),
        limit=LIMIT,
        seeds_per_question=SEEDS,
        mutations_per_question=MUTATIONS,
        rounds=ROUNDS,
        batch_size=32,
        max_new_tokens=96,
        seed=0,
        verify_workers=2,
        progress=False,
    )
    settings.update(overrides)
    return SearchConfig(**settings)


@pytest.fixture(scope="module")
def full_run(tiny_assets, backend, tmp_path_factory):
    out = tmp_path_factory.mktemp("search") / "archive.parquet"
    config = make_config(tiny_assets, out)
    return config, run_search(config, backend=backend)


def test_mutation_schedule() -> None:
    assert mutation_schedule(16, 4) == [4, 4, 4, 4]
    assert mutation_schedule(5, 2) == [3, 2]
    assert mutation_schedule(1, 3) == [1, 0, 0]
    assert mutation_schedule(0, 2) == [0, 0]


def test_search_writes_a_verified_archive(full_run, tiny_assets, backend) -> None:
    config, summary = full_run
    out = Path(config.out)
    assert summary.finished and summary.rounds_completed == ROUNDS and not summary.resumed
    assert out.is_file() and manifest_path(out).is_file() and state_path(out).is_file()
    # every candidate is accounted for, and every verification came from the pool prefetch
    attempts = LIMIT * (SEEDS + MUTATIONS)
    assert summary.counts["attempts"] == attempts
    assert summary.seed_counts["attempts"] == LIMIT * SEEDS
    # (cut-off generations are refused unverified)
    assert summary.verification == {"pooled": attempts - summary.counts["truncated"], "inline": 0}
    assert summary.coverage["questions"] == LIMIT
    assert summary.coverage["questions_covered"] >= 1 and summary.coverage["cells"] >= 1
    assert summary.insert_rate == summary.counts["insertions"] / attempts > 0

    archive = load_frozen_archive(
        out,
        expected_tokenizer_fingerprint=hf_tokenizer_fingerprint(backend.tokenizer),
        expected_dataset=summary.manifest_data["dataset"],
    )
    assert len(archive) == summary.coverage["cells"]
    # independent re-verification of every entry (in process, fresh domain adapter)
    domain = make_domain("sql", token_counter=TokenCounter(backend.tokenizer))
    rows = pq.read_table(tiny_assets.sql_train).to_pylist()
    by_id = {r["extra_info"]["question_id"]: (i, r) for i, r in enumerate(rows)}
    for entry in archive:
        index, row = by_id[entry.question_id]
        question = domain.question_from_row(row, index)
        assert domain.verify(question, entry.text).correct, entry.text
        assert domain.describe(question, entry.text) == (entry.approach, entry.descriptor)
        assert entry.num_tokens == domain.token_counter(entry.text)
        assert entry.to_dict()["prompt"] == row["prompt"]  # replayed with the dataset prompt


def test_manifest_records_provenance_config_and_denominators(full_run, tiny_assets, backend) -> None:
    import hashlib

    config, summary = full_run
    manifest = json.loads(manifest_path(config.out).read_text())
    assert manifest["base_model"]["path"] == str(Path(tiny_assets.sql_model_dir).resolve())
    assert manifest["base_model"]["name"] == "model_sql"
    assert manifest["tokenizer_name"] == str(tiny_assets.sql_model_dir)
    assert manifest["tokenizer_fingerprint"] == hf_tokenizer_fingerprint(backend.tokenizer)
    dataset = manifest["dataset"]
    assert dataset["sha256"] == hashlib.sha256(Path(tiny_assets.sql_train).read_bytes()).hexdigest()
    assert dataset["splits"] == ["train"] and dataset["data_sources"] == ["tiny_sql"]
    assert dataset["num_questions"] == LIMIT and dataset["num_rows"] == 48 and dataset["limit"] == LIMIT
    vocab = load_vocabulary()
    assert manifest["vocabulary"] == list(vocab.names) and manifest["vocabulary_hash"] == vocab.content_hash()
    assert manifest["domain"] == "sql"
    search_config = manifest["search_config"]
    assert search_config["seeds_per_question"] == SEEDS and search_config["mutation_schedule"] == [2, 2]
    assert search_config["labeler"] == "rule" and search_config["temperature"] == 1.0
    totals = manifest["counts"]["totals"]
    assert totals == summary.counts
    assert totals["attempts"] == (
        totals["truncated"]
        + totals["parse_failures"]
        + totals["verification_failures"]
        + totals["not_added"]
        + totals["new"]
        + totals["improved"]
    )
    assert manifest["coverage"]["cells"] == manifest["num_entries"] == summary.coverage["cells"]
    # mutations: each question asked for MUTATIONS distinct approaches (2 per round, top-ranked)
    per_qa = manifest["counts"]["per_question_approach"]
    for qid, by_approach in per_qa.items():
        assert by_approach[SEED_KEY]["attempts"] == SEEDS
        requested = {a: c["attempts"] for a, c in by_approach.items() if a != SEED_KEY}
        assert sum(requested.values()) == MUTATIONS and set(requested.values()) == {1}, (qid, requested)
    # a question without any elite after the seeds never had a parent; others record theirs
    for entry in load_frozen_archive(config.out):
        if entry.requested_approach is None:
            assert entry.insertion_round == 0 and entry.parent is None
            assert entry.generation_metadata["kind"] == "seed"


def test_generations_cut_off_by_the_length_limit_never_enter_the_archive(tiny_assets, backend, tmp_path) -> None:
    """Only finished answers: with a token limit that cuts off a good part of the tiny model's answers, the
    cut-off generations are counted as ``truncated`` -- their own failure kind, in every
    denominator -- and none becomes an elite (an unclosed ```sql block would still verify)."""
    config = make_config(
        tiny_assets,
        tmp_path / "short.parquet",
        limit=4,
        seeds_per_question=8,
        mutations_per_question=0,
        rounds=1,
        max_new_tokens=24,
        verify_workers=1,
    )
    summary = run_search(config, backend=backend)
    totals = summary.counts
    assert 0 < totals["truncated"] < totals["attempts"] == 4 * 8
    assert totals["attempts"] == (
        totals["truncated"]
        + totals["parse_failures"]
        + totals["verification_failures"]
        + totals["not_added"]
        + totals["new"]
        + totals["improved"]
    )
    assert summary.verification["pooled"] == totals["attempts"] - totals["truncated"]  # never verified
    manifest = json.loads(manifest_path(config.out).read_text())
    per_question = manifest["counts"]["per_question"]
    assert sum(c["truncated"] for c in per_question.values()) == totals["truncated"]
    assert manifest["counts"]["per_approach"][SEED_KEY]["truncated"] == totals["truncated"]
    for entry in load_frozen_archive(config.out, allow_empty=True):
        assert entry.generation_metadata["finish_reason"] == "stop"


def test_corrupted_archive_is_refused(full_run, tmp_path) -> None:
    config, _ = full_run
    copy = tmp_path / "archive.parquet"
    data = bytearray(Path(config.out).read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    manifest_path(copy).write_bytes(manifest_path(config.out).read_bytes())
    with pytest.raises(ArchiveIntegrityError, match="content hash mismatch"):
        load_frozen_archive(copy)


def test_resume_gives_the_same_archive(full_run, tiny_assets, backend, tmp_path) -> None:
    reference_config, reference = full_run
    out = tmp_path / "resumed.parquet"
    first = run_search(make_config(tiny_assets, out, stop_after_round=1), backend=backend)
    assert not first.finished and first.rounds_completed == 1
    assert not out.exists()  # the archive is written only by a finished search
    state = json.loads(state_path(out).read_text())
    assert state["next_round"] == 2 and not state["finished"]
    assert state["stats"]["generated"] == LIMIT * (SEEDS + MUTATIONS // ROUNDS)

    second = run_search(make_config(tiny_assets, out, resume=True), backend=backend)
    assert second.finished and second.resumed and second.rounds_completed == ROUNDS
    assert out.read_bytes() == Path(reference_config.out).read_bytes()  # identical entries, byte for byte
    assert second.counts == reference.counts and second.coverage == reference.coverage
    assert second.verification == reference.verification
    # the whole archive state matches, RNG included (targets and parents of later rounds)
    resumed_state = json.loads(state_path(out).read_text())
    reference_state = json.loads(state_path(reference_config.out).read_text())
    assert resumed_state["archive"] == reference_state["archive"]
    assert resumed_state["next_round"] == reference_state["next_round"] == ROUNDS + 1
    resumed_manifest = json.loads(manifest_path(out).read_text())
    assert resumed_manifest["content_sha256"] == reference.manifest_data["content_sha256"]
    assert resumed_manifest["counts"] == reference.manifest_data["counts"]
    assert resumed_manifest["search"]["resumed"] is True

    # a finished state resumes to the same archive without generating anything
    again = run_search(make_config(tiny_assets, out, resume=True), backend=backend)
    assert again.counts == reference.counts and out.read_bytes() == Path(reference_config.out).read_bytes()


def test_resume_refuses_a_different_config(full_run, tiny_assets, backend, tmp_path) -> None:
    out = tmp_path / "a.parquet"
    run_search(
        make_config(
            tiny_assets, out, stop_after_round=0, mutations_per_question=0, rounds=1, seeds_per_question=2, limit=2
        ),
        backend=backend,
    )
    changed = make_config(
        tiny_assets,
        out,
        resume=True,
        mutations_per_question=0,
        rounds=1,
        seeds_per_question=2,
        limit=2,
        temperature=0.7,
    )
    with pytest.raises(SearchError, match=r"cannot --resume .*temperature: saved 1\.0, now 0\.7"):
        run_search(changed, backend=backend)
    with pytest.raises(SearchError, match="pass --resume to continue it or --overwrite"):
        run_search(dataclasses.replace(changed, resume=False), backend=backend)
    with pytest.raises(SearchError, match="no search state"):
        run_search(make_config(tiny_assets, tmp_path / "none.parquet", resume=True), backend=backend)


def test_clear_errors_for_bad_inputs(tiny_assets, tmp_path, capsys) -> None:
    base = ["--model", str(tiny_assets.sql_model_dir), "--out", str(tmp_path / "o.parquet"), "--no-progress"]
    assert main(["--data", str(tmp_path / "missing.parquet"), *base]) == 2
    assert "missing.parquet: file not found" in capsys.readouterr().err
    no_reward = tmp_path / "no_reward.parquet"
    pq.write_table(pa.table({"prompt": ["q"], "data_source": ["tiny_sql"]}), no_reward)
    assert main(["--data", str(no_reward), *base]) == 2
    assert "missing column(s) ['reward_model']" in capsys.readouterr().err
    rows = pq.read_table(tiny_assets.sql_train).to_pylist()[:2]
    rows[1]["extra_info"]["db_path"] = str(tmp_path / "gone.sqlite")
    bad_db = tmp_path / "bad_db.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(tiny_assets.sql_train)), bad_db)
    assert main(["--data", str(bad_db), *base]) == 2
    assert "row 1: database file" in capsys.readouterr().err
    assert main(["--data", str(tiny_assets.sql_train), *base, "--top-p", "0"]) == 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err
    assert main(["--data", str(tiny_assets.sql_train), *base, "--model", str(tmp_path / "nomodel")]) == 2
    assert "directory not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--data", "x", *base, "--labeler", "gpt"])


def test_cli_subprocess_prints_a_json_summary_with_json(tiny_assets, tmp_path) -> None:
    out = tmp_path / "cli.parquet"
    command = [
        sys.executable,
        "-m",
        "verl_replay.elite.search",
        "--data",
        str(tiny_assets.sql_train),
        "--model",
        str(tiny_assets.sql_model_dir),
        "--out",
        str(out),
        "--limit",
        "3",
        "--seeds-per-question",
        "4",
        "--mutations-per-question",
        "2",
        "--rounds",
        "1",
        "--max-new-tokens",
        "64",
        "--verify-workers",
        "1",
        "--json",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)  # --json: stdout holds only the JSON summary; the bar is on stderr
    assert summary["finished"] and summary["counts"]["attempts"] == 3 * (4 + 2)
    # every failed verification is counted under the verifier's reason
    assert sum(summary["failure_reasons"].values()) == summary["counts"]["verification_failures"]
    assert summary["domain"] == "sql" and set(summary["failure_reasons"]) <= set(SQL_REASONS)
    assert "fast path" not in result.stderr and "Loading weights" not in result.stderr  # transformers is quiet
    assert set(summary["coverage"]) >= {"questions", "questions_covered", "cells", "mean_cells"}
    assert "elite search" in result.stderr  # the progress bar
    manifest = json.loads(manifest_path(out).read_text())
    assert manifest["num_entries"] == summary["coverage"]["cells"]


def test_math_search_with_the_math_model(tiny_assets, tmp_path) -> None:
    from verl_replay.generation import make_backend

    math_backend = make_backend("hf", model_path=str(tiny_assets.model_dir), batch_size=32)
    out = tmp_path / "math.parquet"
    config = make_config(
        tiny_assets,
        out,
        data=str(tiny_assets.math_train),
        model=str(tiny_assets.model_dir),
        limit=4,
        seeds_per_question=4,
        mutations_per_question=2,
        rounds=1,
        max_new_tokens=48,
        verify_workers=1,
    )
    summary = run_search(config, backend=math_backend)
    assert summary.finished and summary.counts["attempts"] == 4 * (4 + 2)
    assert summary.verification == {"pooled": 24, "inline": 0}
    manifest = json.loads(manifest_path(out).read_text())
    assert manifest["domain"] == "math" and "numeric_computation" in manifest["vocabulary"]
    domain = make_domain("math", token_counter=TokenCounter(math_backend.tokenizer))
    rows = pq.read_table(tiny_assets.math_train).to_pylist()
    archive = load_frozen_archive(out, allow_empty=True)
    assert len(archive) == summary.coverage["cells"] >= 1
    for entry in archive:
        index = next(i for i, r in enumerate(rows) if r["extra_info"]["question_id"] == entry.question_id)
        question = domain.question_from_row(rows[index], index)
        assert domain.verify(question, entry.text).correct
        assert domain.describe(question, entry.text) == (entry.approach, entry.descriptor)
    # a SQL vocabulary on math data is refused before any generation
    with pytest.raises(SearchError, match="is a sql vocabulary, the data is math"):
        from verl_replay.sql.vocabulary import DEFAULT_SQL_VOCABULARY_PATH

        run_search(
            dataclasses.replace(config, out=str(tmp_path / "x.parquet"), vocabulary=str(DEFAULT_SQL_VOCABULARY_PATH)),
            backend=math_backend,
        )


def test_llm_labeler_search_labels_with_the_frozen_model(full_run, tiny_assets, backend, tmp_path) -> None:
    out = tmp_path / "llm.parquet"
    summary = run_search(
        make_config(tiny_assets, out, labeler="llm", mutations_per_question=0, rounds=1), backend=backend
    )
    # same seeds as the rule-labeled run: the same candidates verify, only labels may differ
    _, reference = full_run
    assert summary.seed_counts["verification_failures"] == reference.seed_counts["verification_failures"]
    assert summary.labeler["kind"] == "llm" and summary.labeler["labeled"] >= 1
    verified = summary.counts["attempts"] - summary.counts["verification_failures"]
    assert summary.labeler["labeled"] <= verified  # only verified solutions are labeled
    manifest = json.loads(manifest_path(out).read_text())
    assert manifest["search"]["labeler"] == summary.labeler
    assert all(entry.approach in manifest["vocabulary"] for entry in load_frozen_archive(out))


def test_tiny_preset_fills_in_the_tiny_runs_data_model_and_budget(tiny_assets, tmp_path, capsys) -> None:
    from verl_replay.elite.search import TINY_SEARCH, parse_config

    out = str(tmp_path / "tiny.parquet")
    config = parse_config(["--tiny", "--out", out])
    assert (config.data, config.model, config.out) == (str(tiny_assets.sql_train), str(tiny_assets.sql_model_dir), out)
    assert {name: getattr(config, name) for name in TINY_SEARCH} == TINY_SEARCH
    # flags given next to --tiny win over the preset
    config = parse_config(["--tiny", "--out", out, "--limit", "4", "--model", str(tmp_path)])
    assert config.limit == 4 and config.model == str(tmp_path) and config.data == str(tiny_assets.sql_train)
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--out", out])
    assert exit_info.value.code == 2 and "--data is required (or --tiny" in capsys.readouterr().err


def test_the_search_state_file_gets_the_users_umask(tiny_assets, tmp_path) -> None:
    """mkstemp creates 0600 files (the archive's own writer is tested in test_archive_io)."""
    import stat

    from verl_replay._files import default_file_mode
    from verl_replay.elite.search import state_path

    out = tmp_path / "umask.parquet"
    config = make_config(
        tiny_assets,
        out,
        limit=2,
        seeds_per_question=2,
        mutations_per_question=1,
        rounds=1,
        max_new_tokens=32,
        verify_workers=0,
        stop_after_round=0,
    )
    assert not run_search(config).finished
    assert stat.S_IMODE(state_path(out).stat().st_mode) == default_file_mode() != 0o600


def test_the_summary_says_what_became_of_every_candidate() -> None:
    from verl_replay.elite.search import SearchSummary, summary_lines

    counts = {
        "attempts": 160,
        "insertions": 20,
        "new": 18,
        "improved": 2,
        "not_added": 5,
        "verification_failures": 133,
        "truncated": 2,
        "parse_failures": 0,
        "approach_misses": 0,
    }
    summary = SearchSummary(
        out="/x/archive.parquet",
        manifest="/x/archive.parquet.manifest.json",
        state="/x/s",
        finished=True,
        rounds_completed=4,
        total_rounds=4,
        coverage={"cells": 20, "questions": 16, "questions_covered": 12, "mean_cells": 1.25},
        counts=counts,
        seed_counts={},
        insert_rate=0.125,
        verification={},
        labeler={},
        elapsed_s=81.4,
        domain="sql",
        failure_reasons={"mismatch": 90, "syntax_error": 30, "exec_error": 13},
    )
    assert summary_lines(summary) == [
        "elite search: done in 81 s; archive /x/archive.parquet",
        "  20 elites: 12 of 16 questions covered, 1.25 cells a question",
        "  160 candidates:",
        "    20 inserted (18 in a new cell, 2 shorter than their cell's elite)",
        "    5 correct, but no shorter than their cell's elite",
        "    133 failed verification",
        "      90 mismatch: both queries ran; results differ",
        "      30 syntax_error: SQLite could not parse the query",
        "      13 exec_error: the query failed at prepare/run time (no such table/column, a SQLite limit, ...)",
        "    2 cut off at --max-new-tokens (never verified)",
    ]
    stopped = dataclasses.replace(summary, finished=False, rounds_completed=1, failure_reasons={})
    lines = summary_lines(stopped)
    assert lines[0].startswith("elite search: stopped after round 1 of 4") and "--resume" in lines[0]
    assert "      (their reasons were not recorded: the search resumed from an older state)" in lines
