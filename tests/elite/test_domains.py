"""SQL / math domain adapters on the real tiny assets (SQLite files, tokenizer, tiny model).

Covers: parquet row -> Question, verification (correct, wrong, unparseable, write attempt),
description (approach label + structural descriptor, parse failures), agreement with the
training reward, the pool-backed verifier the archive calls, and the LLM labeler path.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from verl_replay.elite.archive import Candidate, EliteArchive, InsertStatus
from verl_replay.elite.domains import (
    CachedDescriber,
    DataError,
    PooledVerifier,
    TokenCounter,
    detect_domain,
    hf_tokenizer_fingerprint,
    make_domain,
)
from verl_replay.rewards import compute_score
from verl_replay.sql.vocabulary import VocabularyError, load_vocabulary
from verl_replay.verifiers.pool import VerifierPool

# tiny_sql row 0: "What is the most expensive home product?" (shop database), two gold queries
ORDER_LIMIT = "SELECT name FROM products WHERE category = 'home' ORDER BY price DESC LIMIT 1"
SCALAR = (
    "SELECT name FROM products WHERE category = 'home' AND price = "
    "(SELECT MAX(price) FROM products WHERE category = 'home')"
)
CTE = (
    "WITH home AS (SELECT name, price FROM products WHERE category = 'home') "
    "SELECT name FROM home WHERE price = (SELECT MAX(price) FROM home)"
)
WRONG = "SELECT name FROM products WHERE category = 'office' ORDER BY price DESC LIMIT 1"


def fenced(sql: str) -> str:
    return f"```sql\n{sql}\n```"


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: threads only oversubscribe the shared CPU
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_assets.sql_model_dir))


@pytest.fixture(scope="module")
def sql_rows(tiny_assets):
    return pq.read_table(tiny_assets.sql_train).to_pylist()


@pytest.fixture(scope="module")
def math_rows(tiny_assets):
    return pq.read_table(tiny_assets.math_train).to_pylist()


@pytest.fixture(scope="module")
def sql(tokenizer):
    return make_domain("sql", token_counter=TokenCounter(tokenizer), verify_timeout_s=5.0)


@pytest.fixture(scope="module")
def math(tokenizer):
    return make_domain("math", token_counter=TokenCounter(tokenizer), verify_timeout_s=5.0)


def _sha(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- SQL


def test_sql_question_from_a_real_row(sql, sql_rows) -> None:
    q = sql.question_from_row(sql_rows[0], 0)
    assert q.id == sql_rows[0]["extra_info"]["question_id"] == "tiny_sql-0000"
    assert q.prompt == tuple(sql_rows[0]["prompt"])  # the dataset prompt, verbatim
    assert Path(q.metadata["db_path"]).is_file() and q.metadata["semantics"] == "bird"
    assert q.metadata["golds"] == [ORDER_LIMIT, SCALAR]  # ground truth + extra gold, deduplicated
    assert q.ground_truth == ORDER_LIMIT


def test_sql_semantics_of_a_row(sql, sql_rows) -> None:
    import copy

    from verl_replay.elite.domains import DataError

    row = copy.deepcopy(sql_rows[0])
    row["extra_info"]["semantics"] = "spider_keep_distinct"
    assert sql.question_from_row(row, 0).metadata["semantics"] == "spider_keep_distinct"
    row["extra_info"]["semantics"] = "exact"
    with pytest.raises(DataError, match="spider_keep_distinct"):
        sql.question_from_row(row, 0)
    # search pools start each worker's SQL sandbox before the worker takes tasks
    assert "verl_replay.verifiers.sql" in sql.preload


def test_sql_correct_solutions_verify_and_are_described(sql, sql_rows) -> None:
    q = sql.question_from_row(sql_rows[0], 0)
    cells = {}
    for query in (ORDER_LIMIT, SCALAR, CTE):
        text = "Sure.\n" + fenced(query)
        verdict = sql.verify(q, text)
        assert verdict.correct and verdict.reason == "ok"
        cells[query] = sql.describe(q, text)
    assert cells[ORDER_LIMIT] == ("order_by_limit", "j0|d0|OB,LIM")
    assert cells[SCALAR] == ("scalar_subquery", "j0|d1|AGG")
    assert cells[CTE] == ("cte", "j0|d1|CTE,AGG")


def test_sql_wrong_unparseable_and_writing_solutions_are_rejected(sql, sql_rows) -> None:
    q = sql.question_from_row(sql_rows[0], 0)
    db_hash = _sha(q.metadata["db_path"])
    assert sql.verify(q, fenced(WRONG)).reason == "mismatch"
    assert sql.verify(q, "I do not know.").reason == "no_sql"
    assert sql.verify(q, fenced("SELECT name FROM products WHERE")).reason == "syntax_error"
    writing = sql.verify(q, fenced("DELETE FROM products"))
    assert not writing.correct and writing.reason == "write_attempt"
    assert _sha(q.metadata["db_path"]) == db_hash  # read-only: the real file is unchanged
    for text in ("I do not know.", fenced("SELECT name FROM products WHERE"), fenced("SELECT 1; SELECT 2")):
        with pytest.raises(ValueError):
            sql.describe(q, text)


def test_sql_verdict_agrees_with_the_training_reward(sql, sql_rows) -> None:
    texts = [fenced(ORDER_LIMIT), fenced(SCALAR), fenced(WRONG), "nothing", fenced("SELECT price FROM products")]
    for index in (0, 1, 5):
        row = sql_rows[index]
        q = sql.question_from_row(row, index)
        for text in texts + [fenced(row["reward_model"]["ground_truth"])]:
            reward = compute_score(row["data_source"], text, row["reward_model"]["ground_truth"], row["extra_info"])
            assert sql.verify(q, text).correct == (reward["acc"] == 1.0), (index, text)


def test_sql_rows_with_bad_database_fields_are_refused(sql, sql_rows) -> None:
    row = dict(sql_rows[0])
    row["extra_info"] = dict(row["extra_info"], db_path="/nonexistent/x.sqlite")
    with pytest.raises(DataError, match="/nonexistent/x.sqlite"):
        sql.question_from_row(row, 3)
    row["extra_info"] = {k: v for k, v in sql_rows[0]["extra_info"].items() if k != "db_path"}
    with pytest.raises(DataError, match="row 3: missing 'extra_info.db_path'"):
        sql.question_from_row(row, 3)
    with pytest.raises(DataError, match="reward_model"):
        sql.question_from_row({k: v for k, v in sql_rows[0].items() if k != "reward_model"}, 0)


def test_archive_insert_through_the_pool_never_trusts_a_flag(sql, sql_rows) -> None:
    q = sql.question_from_row(sql_rows[0], 0)
    with VerifierPool(num_workers=2, task_timeout_s=30, preload=sql.preload, on_failure=sql.failure) as pool:
        verifier = PooledVerifier(sql, pool)
        describer = CachedDescriber(sql)
        archive = EliteArchive(
            verifier=verifier,
            describer=describer,
            token_counter=sql.token_counter,
            approaches=sql.vocabulary.names,
            seed=0,
        )
        right, wrong, longer = fenced(ORDER_LIMIT), fenced(WRONG), "Here it is:\n" + fenced(ORDER_LIMIT)
        verifier.prefetch([(q, right), (q, wrong), (q, right)])
        assert verifier.verdict(q, right).correct and not verifier.verdict(q, wrong).correct
        describer.prefetch([right])
        lying = Candidate(q.id, wrong, requested_approach="join", metadata={"correct": True, "acc": 1.0})
        assert archive.insert(q, lying).status is InsertStatus.REJECTED
        first = archive.insert(q, Candidate(q.id, right, requested_approach="join"))
        assert first.status is InsertStatus.NEW and tuple(first.cell) == ("order_by_limit", "j0|d0|OB,LIM")
        assert first.approach_miss  # requested join, achieved order_by_limit
        assert verifier.stats() == {"pooled": 2, "inline": 0}
        # not prefetched: verified on demand (still in the pool), counted as inline
        assert archive.insert(q, Candidate(q.id, longer)).status is InsertStatus.NOT_ADDED
        assert verifier.stats() == {"pooled": 2, "inline": 1}
        assert archive.elites(q.id)[0].num_tokens == sql.token_counter(right)
        verifier.clear()
        assert archive.insert(q, Candidate(q.id, fenced(SCALAR))).status is InsertStatus.NEW
        assert verifier.stats()["inline"] == 2


def test_pool_failure_is_a_failed_verdict(sql) -> None:
    # a pool that cannot finish a task returns the domain's failure verdict, never raises
    verdict = sql.failure("worker_timeout", "killed")
    assert not verdict.correct and verdict.reason == "worker_timeout"


# ----------------------------------------------------------------------------- math


def test_math_domain_verifies_and_describes(math, math_rows) -> None:
    row = math_rows[0]  # "What is 4 * 3?", ground truth 12
    q = math.question_from_row(row, 0)
    assert q.id == "tiny_math-0000" and q.metadata["golds"] == ["12"]
    good = "We multiply: 4 * 3 = 12. The answer is \\boxed{12}."
    verdict = math.verify(q, good)
    assert verdict.correct and verdict.reason == "ok"
    approach, descriptor = math.describe(q, good)
    assert approach in math.vocabulary and descriptor == "integer|L0"
    assert math.describe(q, "Solve the equation 3x = 36 by factoring, x = 12, \\boxed{12}")[0] == "algebraic"
    assert math.verify(q, "\\boxed{13}").reason == "mismatch"
    assert math.verify(q, "no idea").reason == "no_answer"
    with pytest.raises(ValueError, match="no final answer"):
        math.describe(q, "no idea")


def test_math_verification_in_a_pool(math, math_rows) -> None:
    q = math.question_from_row(math_rows[0], 0)
    with VerifierPool(
        num_workers=1, task_timeout_s=60, preload=math.preload, initializer=math.initializer, on_failure=math.failure
    ) as pool:
        verifier = PooledVerifier(math, pool)
        texts = ["\\boxed{12}", "\\boxed{\\frac{24}{2}}", "\\boxed{11}"]
        verifier.prefetch([(q, t) for t in texts])
        assert [verifier(q, t).correct for t in texts] == [True, True, False]
        assert verifier.stats() == {"pooled": 3, "inline": 0}


# ----------------------------------------------------------------------------- shared pieces


def test_token_counter_and_fingerprint(tokenizer, tiny_assets) -> None:
    from transformers import AutoTokenizer

    counter = TokenCounter(tokenizer)
    text = fenced(ORDER_LIMIT)
    assert counter(text) == len(tokenizer.encode(text, add_special_tokens=False)) > 5
    fp = hf_tokenizer_fingerprint(tokenizer)
    patched = AutoTokenizer.from_pretrained(str(tiny_assets.sql_model_dir))
    patched.pad_token = patched.eos_token  # what the HF backend / verl do; padding is masked
    assert hf_tokenizer_fingerprint(patched) == fp
    patched.chat_template = "{{ messages }}"
    assert hf_tokenizer_fingerprint(patched) != fp


def test_detect_domain_and_vocabulary_checks(sql_rows, math_rows, tokenizer) -> None:
    assert detect_domain(sql_rows) == "sql" and detect_domain(math_rows) == "math"
    with pytest.raises(DataError, match="mixes domains"):
        detect_domain(sql_rows[:1] + math_rows[:1])
    with pytest.raises(VocabularyError, match="for domain 'sql'"):
        make_domain("math", vocabulary=load_vocabulary(), token_counter=TokenCounter(tokenizer))
    with pytest.raises(ValueError, match="needs the generation backend"):
        make_domain("sql", labeler="llm", token_counter=TokenCounter(tokenizer))


def test_llm_labeler_uses_the_frozen_model_and_stays_in_the_vocabulary(tiny_assets, sql_rows) -> None:
    from verl_replay.generation import make_backend

    backend = make_backend("hf", model_path=str(tiny_assets.sql_model_dir), batch_size=8)
    domain = make_domain("sql", labeler="llm", backend=backend, token_counter=TokenCounter(backend.tokenizer))
    q = domain.question_from_row(sql_rows[0], 0)
    describer = CachedDescriber(domain)
    texts = [fenced(ORDER_LIMIT), fenced(SCALAR), "no sql"]
    describer.prefetch(texts)  # one batched labeling call for the two parseable solutions
    assert domain.labeler.num_labeled == 2 and len(domain.labeler.last_answers) == 2
    for text in texts[:2]:
        approach, descriptor = describer(q, text)
        assert approach in domain.vocabulary
    assert domain.labeler.num_labeled == 2  # served from the prefetch, no extra generation
    assert describer(q, fenced(SCALAR))[1] == "j0|d1|AGG"
