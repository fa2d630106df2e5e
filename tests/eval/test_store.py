"""Evaluation at scale: chunks stream to samples.jsonl as they are verified, a rerun resumes after
the last committed chunk (and refuses other settings), over-long prompts are skipped and counted,
progress is reported per chunk. Real SQLite verification, a scripted backend for the samples."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from verl_replay.data.prepare import SQL_RL_SCHEMA, write_rl_parquet
from verl_replay.eval.run import EvalConfig, chunk_seed, evaluate
from verl_replay.eval.store import STATE_JSON, EvalStore, EvalStoreError, fingerprint_diff

from .test_run import OSLO, OVER_30, ScriptedBackend, fence, make_db, sql_row

QUESTIONS = [f"Question {i}: who lives in Oslo?" for i in range(5)]


class FlakyBackend(ScriptedBackend):
    """Answers like ScriptedBackend; raises on the ``fail_on``-th generate call (1-based)."""

    def __init__(self, script, fail_on: int | None = None) -> None:
        super().__init__(script)
        self.fail_on = fail_on

    def generate(self, prompts, **kwargs):
        if self.fail_on is not None and len(self.calls) + 1 == self.fail_on:
            self.calls.append({"failed": True})
            raise RuntimeError("simulated crash (GPU lost)")
        return super().generate(prompts, **kwargs)


class WordTokenizerBackend(ScriptedBackend):
    """Counts one token per whitespace-separated word and reports a model context."""

    def __init__(self, script, max_model_len: int) -> None:
        super().__init__(script)
        self.max_model_len = max_model_len

    def encode(self, prompts):
        return [[0] * len((p if isinstance(p, str) else " ".join(m["content"] for m in p)).split()) for p in prompts]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    db = make_db(tmp_path / "people.sqlite")
    return write_rl_parquet(
        [sql_row("sqlbench", f"q{i}", text, OSLO, db) for i, text in enumerate(QUESTIONS)],
        tmp_path / "sql.parquet",
        SQL_RL_SCHEMA,
    )


def _script() -> dict[str, list[str]]:
    # question i: i % 3 correct samples of 3
    return {f"Question {i}:": [fence(OSLO)] * (i % 3) + [fence(OVER_30)] * (3 - i % 3) for i in range(5)}


def _config(data: Path, out: Path, **changes) -> EvalConfig:
    settings = dict(data=(str(data),), out=str(out), n=3, k=(1, 2, 3), verify_workers=1, chunk_questions=2)
    return EvalConfig(**{**settings, **changes})


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_chunks_are_sampled_with_their_own_seeds_and_streamed(data, tmp_path):
    backend = ScriptedBackend(_script())
    result = evaluate(_config(data, tmp_path / "out"), backend=backend)
    assert [(c["prompts"], c["seed"]) for c in backend.calls] == [
        (2, chunk_seed(0, 0)),
        (2, chunk_seed(0, 1)),
        (1, chunk_seed(0, 2)),
    ]
    state = json.loads((tmp_path / "out" / STATE_JSON).read_text())
    assert [c["rows"] for c in state["chunks"]] == [[0, 1], [2, 3], [4]] and state["complete"] is True
    samples = _lines(tmp_path / "out" / "samples.jsonl")
    assert [s["row"] for s in samples] == [r for r in range(5) for _ in range(3)]
    assert [q["num_correct"] for q in result.questions] == [0, 1, 2, 0, 1]
    assert result.benchmarks["sqlbench"].metrics["mean@n"] == pytest.approx(4 / 15)
    assert result.resume == {"sessions": 1, "resumed_questions": 0}


def test_a_crash_keeps_committed_chunks_and_a_rerun_resumes(data, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated crash"):
        evaluate(_config(data, out), backend=FlakyBackend(_script(), fail_on=3))
    # chunk 0 was verified and committed while chunk 1 generated; chunk 1 was pending when chunk 2 crashed
    committed = _lines(out / "samples.jsonl")
    assert {s["row"] for s in committed} <= {0, 1, 2, 3} and len(committed) % 3 == 0 and committed
    assert not (out / "results.json").exists()

    again = ScriptedBackend(_script())
    resumed = evaluate(_config(data, out), backend=again)
    done_before = len({s["row"] for s in committed})
    assert sum(c["prompts"] for c in again.calls) == 5 - done_before  # only what was not committed
    assert resumed.resume == {"sessions": 2, "resumed_questions": done_before}

    fresh = evaluate(_config(data, tmp_path / "fresh"), backend=ScriptedBackend(_script()))
    assert resumed.to_json()["benchmarks"] == fresh.to_json()["benchmarks"]
    assert [s["text"] for s in resumed.samples] == [s["text"] for s in fresh.samples]
    assert (out / "samples.jsonl").read_bytes() == (tmp_path / "fresh" / "samples.jsonl").read_bytes()


def test_a_finished_run_is_re_aggregated_without_a_model(data, tmp_path):
    out = tmp_path / "out"
    evaluate(_config(data, out), backend=ScriptedBackend(_script()))
    again = evaluate(_config(data, out, k=(1, 3)))  # no backend: nothing is left to sample
    assert again.to_json()["ks"] == [1, 3] and again.benchmarks["sqlbench"].num_questions == 5


def test_bytes_past_the_last_commit_are_cut_off(data, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        evaluate(_config(data, out), backend=FlakyBackend(_script(), fail_on=2))
    committed = (out / "samples.jsonl").read_bytes()
    with open(out / "samples.jsonl", "ab") as handle:  # a crash in the middle of an append
        handle.write(b'{"row": 2, "sample": 0, "te')
    evaluate(_config(data, out), backend=ScriptedBackend(_script()))
    assert (out / "samples.jsonl").read_bytes().startswith(committed)
    assert len(_lines(out / "samples.jsonl")) == 15


def test_modified_samples_or_other_settings_are_refused(data, tmp_path):
    out = tmp_path / "out"
    evaluate(_config(data, out), backend=ScriptedBackend(_script()))
    with pytest.raises(EvalStoreError, match=r"temperature: 1.0 -> 0.5"):
        evaluate(_config(data, out, temperature=0.5), backend=ScriptedBackend(_script()))
    text = (out / "samples.jsonl").read_text()
    (out / "samples.jsonl").write_text(text.replace('"correct": false', '"correct": falsE', 1))  # same size
    with pytest.raises(EvalStoreError, match="does not match its digest"):
        evaluate(_config(data, out), backend=ScriptedBackend(_script()))
    overwritten = evaluate(_config(data, out, temperature=0.5), backend=ScriptedBackend(_script()), overwrite=True)
    assert overwritten.resume["sessions"] == 1


def test_samples_without_state_are_not_resumed(tmp_path):
    (tmp_path / "samples.jsonl").write_text('{"row": 0}\n')
    with pytest.raises(EvalStoreError, match="cannot be resumed"):
        EvalStore.open(tmp_path, {"n": 1})
    assert fingerprint_diff({"n": 1, "seed": 0}, {"n": 2, "seed": 0}) == ["n: 1 -> 2"]


def test_over_long_prompts_are_skipped_and_counted(tmp_path):
    db = make_db(tmp_path / "people.sqlite")
    long_question = "who lives in Oslo? " + "please " * 40
    data = write_rl_parquet(
        [
            sql_row("sqlbench", "short", "Short: who lives in Oslo?", OSLO, db),
            sql_row("sqlbench", "long", "Long: " + long_question, OSLO, db),
            sql_row("other", "long2", "Long: " + long_question, OSLO, db),
        ],
        tmp_path / "d.parquet",
        SQL_RL_SCHEMA,
    )
    script = {"Short:": [fence(OSLO)] * 3, "Long:": [fence(OSLO)] * 3}
    backend = WordTokenizerBackend(script, max_model_len=20)
    result = evaluate(_config(data, tmp_path / "out"), backend=backend)
    assert sum(c["prompts"] for c in backend.calls) == 1  # the long prompts never reach generate
    assert [s["question_id"] for s in result.skipped] == ["long", "long2"]
    assert all(s["prompt_tokens"] > 19 for s in result.skipped)
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["skipped"]["over_long"]["count"] == 2 and doc["skipped"]["over_long"]["max_prompt_tokens"] == 19
    assert doc["skipped"]["over_long"]["by_benchmark"] == {"sqlbench": 1, "other": 1}
    assert list(doc["benchmarks"]) == ["sqlbench"] and doc["benchmarks"]["sqlbench"]["num_questions"] == 1
    assert "2 question(s) skipped, prompt longer than 19 tokens" in (tmp_path / "out" / "table.md").read_text()
    # EvalConfig.max_model_len wins over the backend's own context
    result = evaluate(_config(data, tmp_path / "out2", max_model_len=200), backend=WordTokenizerBackend(script, 20))
    assert result.skipped == []
    with pytest.raises(ValueError, match="no question was evaluated"):
        evaluate(_config(data, tmp_path / "out3", max_model_len=3), backend=WordTokenizerBackend(script, 20))


def test_progress_reports_questions_samples_and_rates(data, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="verl_replay.eval.run"):
        evaluate(_config(data, tmp_path / "out"), backend=ScriptedBackend(_script()), progress=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eval: ")]
    assert [line.split(" questions")[0] for line in lines] == ["eval: 2/5", "eval: 4/5", "eval: 5/5"]
    assert "15 samples done" in lines[-1] and "samples/s" in lines[-1] and "q/s" in lines[-1]
