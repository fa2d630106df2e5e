"""Evaluation run: real verification (SQLite, math-verify) through the VerifierPool, a scripted
backend for hand-computed metrics, and the real HF backend on the tiny models."""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from verl_replay.data.prepare import MATH_RL_SCHEMA, SQL_RL_SCHEMA, write_rl_parquet
from verl_replay.eval import metrics
from verl_replay.eval.run import (
    EvalConfig,
    ambiqt_coverage_at_k,
    chunk_seed,
    evaluate,
    load_questions,
)
from verl_replay.generation.base import Generation, GenerationBackend
from verl_replay.rewards import compute_score
from verl_replay.sql.skeleton import sql_skeleton

# --------------------------------------------------------------------------- fixtures


class ScriptedBackend(GenerationBackend):
    """Returns fixed completions: ``script[key]`` for the prompt whose text contains ``key``."""

    def __init__(self, script: dict[str, list[str]]) -> None:
        self.script = script
        self.calls: list[dict[str, Any]] = []

    @property
    def tokenizer(self) -> Any:
        return None

    def generate(self, prompts, *, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, seed=0, logprobs=False):
        self.calls.append({"prompts": len(prompts), "n": n, "temperature": temperature, "seed": seed})
        out = []
        for prompt in prompts:
            text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
            (key,) = [k for k in self.script if k in text]
            answers = self.script[key]
            assert len(answers) == n
            out.append(
                [Generation(text=a, token_ids=list(range(len(a.split()))), finish_reason="stop") for a in answers]
            )
        return out


def fence(sql: str) -> str:
    return f"Here it is:\n```sql\n{sql}\n```"


def make_db(path: Path) -> Path:
    con = sqlite3.connect(path)
    con.executescript(
        """
        CREATE TABLE people (id INTEGER PRIMARY KEY, name TEXT, city TEXT, age INTEGER,
                             salary INTEGER, wage INTEGER);
        INSERT INTO people VALUES (1, 'Ann', 'Oslo', 25, 900, 10), (2, 'Bob', 'Rome', 41, 500, 99),
                                  (3, 'Cid', 'Oslo', 35, 100, 50), (4, 'Dan', 'Rome', 52, 300, 5);
        """
    )
    con.commit()
    con.close()
    return path


def sql_row(source: str, qid: str, question: str, gold: str, db: Path, gold_sqls: Sequence[str] | None = None) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": f"Schema: people. Question: {question}"}],
        "ability": "sql",
        "reward_model": {"style": "rule", "ground_truth": gold},
        "extra_info": {
            "split": "test",
            "index": 0,
            "question_id": qid,
            "db_id": "people",
            "db_path": str(db),
            "semantics": "bird",
            "question": question,
            "evidence": "",
            "gold_sqls": list(gold_sqls or [gold]),
        },
    }


def math_row(qid: str, question: str, answer: str) -> dict:
    return {
        "data_source": "math_synth",
        "prompt": [{"role": "user", "content": f"{question} Put the final answer in \\boxed{{}}."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {
            "split": "test",
            "index": 0,
            "question_id": qid,
            "benchmark": "math_synth",
            "question": question,
        },
    }


OVER_30 = "SELECT name FROM people WHERE age > 30"
OVER_30_SUBQUERY = "SELECT name FROM people WHERE id IN (SELECT id FROM people WHERE age > 30)"
OVER_30_ALIAS = "SELECT p.name FROM people AS p WHERE p.age > 30"  # same skeleton as OVER_30
OSLO = "SELECT name FROM people WHERE city = 'Oslo'"
TOP_SALARY = "SELECT name FROM people ORDER BY salary DESC LIMIT 1"  # Ann
TOP_WAGE = "SELECT name FROM people ORDER BY wage DESC LIMIT 1"  # Bob
LOW_SALARY = "SELECT name FROM people ORDER BY salary LIMIT 1"  # Cid
LOW_WAGE = "SELECT name FROM people ORDER BY wage LIMIT 1"  # Dan


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return make_db(tmp_path / "people.sqlite")


@pytest.fixture
def one_thread():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # 2-core CI: keep generation from fighting the verifier workers
    yield
    torch.set_num_threads(previous)


# --------------------------------------------------------------------------- scripted backend


def test_hand_computed_metrics_strategies_and_averages(tmp_path: Path, db: Path) -> None:
    sql_path = write_rl_parquet(
        [
            sql_row("sqlbench", "q1", "Who is older than 30?", OVER_30, db),
            sql_row("sqlbench", "q2", "Who lives in Oslo?", OSLO, db),
            sql_row("sqlbench", "q3", "Name everyone over thirty.", OVER_30, db),
        ],
        tmp_path / "sql.parquet",
        SQL_RL_SCHEMA,
    )
    math_path = write_rl_parquet(
        [math_row("m1", "What is 2 + 2?", "4"), math_row("m2", "What is 1 / 2?", "\\frac{1}{2}")],
        tmp_path / "math.parquet",
        MATH_RL_SCHEMA,
    )
    backend = ScriptedBackend(
        {
            # 2 correct, different skeletons -> 2 strategies
            "older than 30": [fence(OVER_30), fence(OVER_30_SUBQUERY), fence(OSLO), "I cannot answer."],
            # 0 correct: wrong rows, syntax error, no SQL, a write attempt
            "Oslo": [fence(OVER_30), fence("SELEC name FROM people"), "no idea", fence("DELETE FROM people")],
            # 4 correct; aliases/identical texts collapse to 1 strategy
            "over thirty": [fence(OVER_30), fence(OVER_30_ALIAS), fence(OVER_30_ALIAS), fence(OVER_30)],
            "2 + 2": ["\\boxed{4}", "\\boxed{5}", "no answer here", "so \\boxed{4}"],
            "1 / 2": ["\\boxed{0.5}", "\\boxed{1/3}", "\\boxed{2}", "\\boxed{3}"],
        }
    )
    out = tmp_path / "out"
    config = EvalConfig(data=(str(sql_path), str(math_path)), out=str(out), n=4, k=(1, 2, 4, 8), verify_workers=2)
    result = evaluate(config, backend=backend)

    assert backend.calls == [{"prompts": 5, "n": 4, "temperature": 1.0, "seed": chunk_seed(0, 0)}]
    assert list(result.benchmarks) == ["sqlbench", "math_synth"]
    sql, math_b = result.benchmarks["sqlbench"], result.benchmarks["math_synth"]
    assert (sql.task, sql.num_questions, sql.n, math_b.task, math_b.num_questions) == ("sql", 3, 4, "math", 2)

    per_q = {q["question_id"]: q for q in result.questions}
    assert [per_q[q]["num_correct"] for q in ("q1", "q2", "q3", "m1", "m2")] == [2, 0, 4, 2, 1]
    assert [per_q[q]["distinct_strategies"] for q in ("q1", "q2", "q3")] == [2, 0, 1]
    assert per_q["q1"]["skeletons"] == sorted({sql_skeleton(OVER_30), sql_skeleton(OVER_30_SUBQUERY)})
    assert per_q["q3"]["skeletons"] == [sql_skeleton(OVER_30)]
    # pass@2 of q1: 1 - C(2,2)/C(4,2) = 5/6
    assert per_q["q1"]["pass_at_k"]["2"] == pytest.approx(5 / 6)

    # sqlbench: pass@1 = (2/4 + 0 + 1) / 3, pass@2 = (5/6 + 0 + 1) / 3, pass@4 = 2/3
    assert sql.metrics["pass@1"] == pytest.approx(0.5)
    assert sql.metrics["pass@2"] == pytest.approx(11 / 18)
    assert sql.metrics["pass@4"] == pytest.approx(2 / 3)
    assert "pass@8" not in sql.metrics and result.config.ks_skipped == (8,)
    assert sql.metrics["mean@n"] == pytest.approx(0.5) and sql.metrics["best@n"] == pytest.approx(2 / 3)
    assert sql.metrics["distinct_strategies"] == pytest.approx(1.0)
    assert sql.strategy_distribution == {"0": 1, "1": 1, "2": 1}
    assert sql.reasons["ok"] == 6 and sql.reasons["no_sql"] == 2 and sql.reasons["syntax_error"] == 1
    assert sql.verification_failures == 0
    # math_synth: mean@n = (2/4 + 1/4) / 2; pass@2 = ((1 - 1/6) + (1 - 3/6)) / 2
    assert math_b.metrics["mean@n"] == pytest.approx(0.375)
    assert math_b.metrics["pass@2"] == pytest.approx((5 / 6 + 0.5) / 2)
    assert "distinct_strategies" not in math_b.metrics
    # averages: macro over 2 benchmarks, weighted by 3 vs 2 questions
    assert result.averages["macro"]["mean@n"] == pytest.approx((0.5 + 0.375) / 2)
    assert result.averages["weighted"]["mean@n"] == pytest.approx((0.5 * 3 + 0.375 * 2) / 5)
    assert result.averages["macro"]["distinct_strategies"] == pytest.approx(1.0)
    assert result.averages["benchmarks"]["distinct_strategies"] == ["sqlbench"]

    # correctness equals the verl reward function's acc, computed here in-process
    rows = {q.question_id: q for q in load_questions(config.data)}
    for s in result.samples:
        q = rows[s["question_id"]]
        acc = compute_score(q.data_source, s["text"], q.ground_truth, q.extra_info)["acc"]
        assert s["correct"] == (acc == 1.0), s

    doc = json.loads((out / "results.json").read_text())
    assert doc["benchmarks"]["sqlbench"]["metrics"]["pass@2"] == pytest.approx(11 / 18)
    assert doc["k_skipped"] == [8] and doc["ks"] == [1, 2, 4]
    assert len((out / "samples.jsonl").read_text().splitlines()) == 5 * 4


def test_ambiqt_dual_interpretation_coverage(tmp_path: Path, db: Path) -> None:
    path = write_rl_parquet(
        [
            sql_row("ambiqt", "a1", "Who earns the most?", TOP_SALARY, db, [TOP_SALARY, TOP_WAGE]),
            sql_row("ambiqt", "a2", "Who earns the least?", LOW_SALARY, db, [LOW_SALARY, LOW_WAGE]),
        ],
        tmp_path / "ambiqt.parquet",
        SQL_RL_SCHEMA,
    )
    backend = ScriptedBackend(
        {
            # both interpretations covered, by different samples
            "the most": [fence(TOP_SALARY), fence(TOP_WAGE.replace("wage", "people.wage")), fence(OSLO), "none"],
            # only the salary reading, twice
            "the least": [fence(LOW_SALARY), fence(LOW_SALARY + " OFFSET 0"), fence(OSLO), fence(TOP_WAGE)],
        }
    )
    result = evaluate(EvalConfig(data=(str(path),), n=4, k=(1, 2, 4)), backend=backend)
    bench = result.benchmarks["ambiqt"]
    per_q = {q["question_id"]: q for q in result.questions}
    assert per_q["a1"]["interpretation_hits"] == [1, 1] and per_q["a1"]["covered"] is True
    assert per_q["a2"]["interpretation_hits"] == [2, 0] and per_q["a2"]["covered"] is False
    assert [per_q[q]["num_correct"] for q in ("a1", "a2")] == [2, 2]
    assert bench.metrics["ambiqt_coverage"] == pytest.approx(0.5)
    assert bench.ambiqt == {"coverage": 0.5, "interpretation_hit_rate": [1.0, 0.5]}
    # a1: a k-subset covers both iff it holds samples 0 and 1: 0 of 4 singletons, 1 of 6 pairs
    assert per_q["a1"]["ambiqt_coverage_at_k"] == pytest.approx({"1": 0.0, "2": 1 / 6, "4": 1.0})
    assert bench.metrics["ambiqt_coverage@2"] == pytest.approx(1 / 12)
    assert bench.metrics["ambiqt_coverage@4"] == pytest.approx(bench.metrics["ambiqt_coverage"])
    assert bench.metrics["pass@1"] == pytest.approx(0.5)
    samples = [s for s in result.samples if s["question_id"] == "a1"]
    assert [s["interpretation_hits"] for s in samples] == [[True, False], [False, True], [False, False], [False, False]]
    # a sample is correct iff compute_score (both golds at once) says so
    rows = {q.question_id: q for q in load_questions([str(path)])}
    for s in result.samples:
        q = rows[s["question_id"]]
        assert s["correct"] == (compute_score("ambiqt", s["text"], q.ground_truth, q.extra_info)["acc"] == 1.0)


def test_coverage_at_k_matches_brute_force_over_subsets() -> None:
    from itertools import combinations

    hits = [(True, False), (False, True), (True, True), (False, False), (True, False)]  # per sample
    n = len(hits)
    h1, h2 = sum(a for a, _ in hits), sum(b for _, b in hits)
    either = sum(a or b for a, b in hits)
    for k in range(1, n + 1):
        subsets = list(combinations(hits, k))
        exact = sum(any(a for a, _ in s) and any(b for _, b in s) for s in subsets) / len(subsets)
        assert ambiqt_coverage_at_k(n, h1, h2, either, k) == pytest.approx(exact)


def test_hung_verification_counts_incorrect_and_spares_the_rest(tmp_path: Path, db: Path) -> None:
    slow = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000000) SELECT count(*) FROM c"
    path = write_rl_parquet(
        [sql_row("sqlbench", "q1", "Who lives in Oslo?", OSLO, db)], tmp_path / "d.parquet", SQL_RL_SCHEMA
    )
    backend = ScriptedBackend({"Oslo": [fence(slow), fence(OSLO), fence(OVER_30)]})
    # SQLite's own deadline (60 s) is beyond the pool's kill deadline (2 s): the pool must act
    config = EvalConfig(data=(str(path),), n=3, k=(1,), verify_timeout_s=60.0, verify_hard_timeout_s=2.0)
    result = evaluate(config, backend=backend)
    reasons = [s["reason"] for s in result.samples]
    assert reasons == ["worker_timeout", "ok", "mismatch"]
    assert [s["correct"] for s in result.samples] == [False, True, False]
    assert "deadline" in result.samples[0]["detail"]
    assert result.benchmarks["sqlbench"].verification_failures == 1
    assert result.benchmarks["sqlbench"].metrics["pass@1"] == pytest.approx(1 / 3)


# --------------------------------------------------------------------------- loading errors


def test_clear_errors_for_missing_files_columns_and_golds(tmp_path: Path, db: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pytest.raises(FileNotFoundError, match="no such parquet file"):
        load_questions([str(tmp_path / "nope.parquet")])
    pq.write_table(pa.table({"data_source": ["x"], "reward_model": [{"ground_truth": "1"}]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['prompt'\]"):
        load_questions([str(tmp_path / "bad.parquet")])
    missing_db = write_rl_parquet(
        [sql_row("sqlbench", "q", "Who?", OSLO, tmp_path / "gone.sqlite")], tmp_path / "m.parquet", SQL_RL_SCHEMA
    )
    with pytest.raises(FileNotFoundError, match="gone.sqlite"):
        load_questions([str(missing_db)])
    one_gold = write_rl_parquet([sql_row("ambiqt", "a", "Who?", OSLO, db)], tmp_path / "a.parquet", SQL_RL_SCHEMA)
    with pytest.raises(ValueError, match="exactly two distinct gold interpretations"):
        load_questions([str(one_gold)])
    good = write_rl_parquet([sql_row("sqlbench", "q", "Who?", OSLO, db)], tmp_path / "g.parquet", SQL_RL_SCHEMA)
    with pytest.raises(ValueError, match="--model"):
        evaluate(EvalConfig(data=(str(good),), n=2, k=(1,)))
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        evaluate(EvalConfig(data=(str(good),), model=str(tmp_path / "no_model"), n=2, k=(1,)))


def test_limit_is_per_benchmark_and_benchmark_key(tmp_path: Path, db: Path) -> None:
    rows = [sql_row("sqlbench", f"s{i}", "Who?", OSLO, db) for i in range(3)]
    rows += [sql_row("sql_other", f"o{i}", "Who?", OSLO, db) for i in range(2)]
    path = write_rl_parquet(rows, tmp_path / "mixed.parquet", SQL_RL_SCHEMA)
    limited = load_questions([str(path)], limit=2)
    assert [(q.benchmark, q.question_id) for q in limited] == [
        ("sqlbench", "s0"),
        ("sqlbench", "s1"),
        ("sql_other", "o0"),
        ("sql_other", "o1"),
    ]
    by_db = load_questions([str(path)], benchmark_key="extra_info.db_id")
    assert {q.benchmark for q in by_db} == {"people"}
    with pytest.raises(ValueError, match="no extra_info.missing"):
        load_questions([str(path)], benchmark_key="extra_info.missing")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 4, "k": (8, 16)}, "exceeds n=4"),
        ({"n": 0}, "n must be a positive integer"),
        ({"k": ()}, "at least one k"),
        ({"limit": 0}, "limit"),
        ({"backend": "tgi"}, "backend"),
        ({"top_p": 0.0}, "top_p"),
        ({"benchmark_key": "ability"}, "benchmark_key"),
        ({"verify_timeout_s": 0}, "verify_timeout_s"),
    ],
)
def test_config_validation_names_the_setting(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EvalConfig(data=("x.parquet",), **kwargs)


# --------------------------------------------------------------------------- real HF backend


def _recompute_from_samples(path: Path, ks: Sequence[int]) -> dict[str, dict[str, float]]:
    by_question: dict[tuple[str, int], list[bool]] = defaultdict(list)
    for line in path.read_text().splitlines():
        s = json.loads(line)
        by_question[(s["benchmark"], s["row"])].append(bool(s["correct"]))
    per_bench: dict[str, list[list[bool]]] = defaultdict(list)
    for (bench, _), flags in by_question.items():
        per_bench[bench].append(flags)
    return {
        b: {
            **{f"pass@{k}": metrics.mean_pass_at_k(rows, k) for k in ks},
            "mean@n": metrics.mean_at_n(rows),
            "best@n": metrics.best_at_n(rows),
        }
        for b, rows in per_bench.items()
    }


@pytest.mark.parametrize("task", ["math", "sql"])
def test_tiny_models_end_to_end(task: str, tiny_assets, tmp_path: Path, one_thread) -> None:
    from matplotlib.image import imread

    from verl_replay.generation import make_backend

    data = tiny_assets.math_val if task == "math" else tiny_assets.sql_val
    model = tiny_assets.model_dir if task == "math" else tiny_assets.sql_model_dir
    backend = make_backend("hf", model_path=str(model), batch_size=16)
    out = tmp_path / "out"
    config = EvalConfig(
        data=(str(data),),
        model=str(model),
        out=str(out),
        n=4,
        k=(1, 2, 4),
        limit=4,
        max_new_tokens=24 if task == "math" else 48,
        seed=2,
    )
    result = evaluate(config, backend=backend)

    assert set(result.files) == {"results", "samples", "table", "plot"}
    for name in ("results.json", "samples.jsonl", "table.md", "pass_at_k.png"):
        assert (out / name).stat().st_size > 0
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left
    image = imread(out / "pass_at_k.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100

    doc = json.loads((out / "results.json").read_text())
    (bench,) = doc["benchmarks"]
    values = doc["benchmarks"][bench]["metrics"]
    assert doc["benchmarks"][bench]["num_questions"] == 4 and doc["benchmarks"][bench]["n"] == 4
    assert values["pass@1"] == pytest.approx(values["mean@n"])
    assert values["pass@4"] == pytest.approx(values["best@n"])
    assert values["pass@1"] <= values["pass@2"] <= values["pass@4"]
    recomputed = _recompute_from_samples(out / "samples.jsonl", (1, 2, 4))
    assert recomputed[bench] == pytest.approx({k: v for k, v in values.items() if k in recomputed[bench]})
    assert doc["averages"]["macro"]["pass@2"] == pytest.approx(values["pass@2"])
    # sample texts are exactly what the backend produces for this seed (one chunk: chunk_seed(2, 0))
    questions = load_questions(config.data, limit=4)
    direct = backend.generate(
        [q.prompt for q in questions],
        n=4,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=config.max_new_tokens,
        seed=chunk_seed(2, 0),
    )
    assert [s["text"] for s in result.samples] == [g.text for row in direct for g in row]
    # every verdict from the pool equals the reward function's acc computed here
    by_row = {q.row: q for q in questions}
    for s in result.samples:
        q = by_row[s["row"]]
        scored = compute_score(q.data_source, s["text"], q.ground_truth, q.extra_info)
        assert (s["correct"], s["reason"]) == (scored["acc"] == 1.0, scored["reason"]), s
    if task == "sql":
        for q in doc["questions"]:
            correct = [s for s in result.samples if s["row"] == q["row"] and s["correct"]]
            assert q["distinct_strategies"] == len({s["skeleton"] for s in correct if s["skeleton"]})
    table = (out / "table.md").read_text()
    assert bench in table and "Avg (macro)" in table
