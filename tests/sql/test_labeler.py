"""Approach labelers: rule-based precedence and the LLM labeler's parsing and fallback."""

from __future__ import annotations

import re

import pytest

from verl_replay.sql.labeler import (
    SQL_RULE_PRECEDENCE,
    Labeler,
    LLMLabeler,
    RuleBasedLabeler,
    build_label_messages,
    parse_label_answer,
    sql_rule_labels,
)
from verl_replay.sql.skeleton import SQLParseError
from verl_replay.sql.vocabulary import Approach, Vocabulary, VocabularyError, load_vocabulary

EXAMPLES = {
    "plain_select": "SELECT COUNT(*) FROM t WHERE a > 1 ORDER BY a",
    "join": "SELECT t.a FROM t JOIN u ON t.id = u.tid",
    "self_join": "SELECT e.name FROM emp AS e JOIN emp AS m ON e.mgr = m.id",
    "nested_subquery": "SELECT a FROM t WHERE id IN (SELECT tid FROM u)",
    "scalar_subquery": "SELECT name FROM t WHERE age = (SELECT MAX(age) FROM t)",
    "exists": "SELECT a FROM t WHERE NOT EXISTS (SELECT 1 FROM u WHERE u.tid = t.id)",
    "cte": "WITH x AS (SELECT a FROM t) SELECT a FROM x",
    "window_function": "SELECT a, ROW_NUMBER() OVER (ORDER BY b) FROM t",
    "set_operation": "SELECT a FROM t EXCEPT SELECT a FROM u",
    "group_by_having": "SELECT a, COUNT(*) FROM t GROUP BY a HAVING COUNT(*) > 2",
    "order_by_limit": "SELECT a FROM t ORDER BY b DESC LIMIT 1",
    "case_expression": "SELECT SUM(CASE WHEN a = 1 THEN 1 ELSE 0 END) FROM t",
}


def test_default_vocabulary_matches_rule_set() -> None:
    vocab = load_vocabulary()
    assert set(vocab.names) == set(SQL_RULE_PRECEDENCE) == set(EXAMPLES)
    assert vocab.reviewed and vocab.default == "plain_select"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_rule_on_a_minimal_example(name: str) -> None:
    assert RuleBasedLabeler().label(EXAMPLES[name]) == name


def test_precedence_when_several_rules_apply() -> None:
    labeler = RuleBasedLabeler()
    sql = (
        "WITH top AS (SELECT a, COUNT(*) AS n FROM t JOIN u ON t.id = u.tid GROUP BY a ORDER BY n DESC LIMIT 3) "
        "SELECT a FROM top WHERE a IN (SELECT a FROM v)"
    )
    assert labeler.all_labels(sql) == ["cte", "nested_subquery", "order_by_limit", "group_by_having", "join"]
    assert labeler.label(sql) == "cte"
    topk = "SELECT a FROM t JOIN u ON t.id = u.tid GROUP BY a ORDER BY COUNT(*) DESC LIMIT 1"
    assert labeler.all_labels(topk) == ["order_by_limit", "group_by_having", "join"]
    assert labeler.all_labels(EXAMPLES["self_join"]) == ["self_join", "join"]


def test_subquery_roles() -> None:
    assert sql_rule_labels("SELECT x FROM (SELECT a AS x FROM t) AS s") == ["nested_subquery"]
    assert sql_rule_labels("SELECT (SELECT COUNT(*) FROM u) FROM t") == ["scalar_subquery"]
    assert sql_rule_labels("SELECT a FROM t WHERE b > ((SELECT AVG(b) FROM t))") == ["scalar_subquery"]
    assert sql_rule_labels("(SELECT a FROM t)") == ["plain_select"]
    assert sql_rule_labels("SELECT a FROM t, t AS t2 WHERE t.x = t2.y") == ["self_join", "join"]


def test_vocabulary_subset_and_default() -> None:
    small = Vocabulary(
        approaches=(Approach("join", "Joins tables."), Approach("simple", "Anything else.")),
        default="simple",
    )
    labeler = RuleBasedLabeler(small)
    assert labeler.label(EXAMPLES["self_join"]) == "join"  # self_join not in vocabulary -> next rule
    assert labeler.label(EXAMPLES["cte"]) == "simple"
    assert labeler.unlabelable == ("simple",)
    with pytest.raises(VocabularyError, match="shares no name"):
        RuleBasedLabeler(Vocabulary(approaches=(Approach("foo", "x."),), default="foo"))


def test_rule_labeler_batch_and_interface() -> None:
    labeler = RuleBasedLabeler()
    assert isinstance(labeler, Labeler)
    names = sorted(EXAMPLES)
    assert labeler.label_batch([EXAMPLES[n] for n in names]) == names
    with pytest.raises(SQLParseError):
        labeler.label("SELEC a")


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("join", "join"),
        ("  Self_Join. ", "self_join"),
        ("**nested subquery**", "nested_subquery"),
        ("`window-function`", "window_function"),
        ("Answer: exists", "exists"),
        ("The query mainly uses a self join (a join of a table with itself).", "self_join"),
        ("It uses GROUP BY with HAVING, i.e. group_by_having, plus a join", "group_by_having"),
        ("<think>maybe a join?</think>\ncte", "cte"),
        ("I cannot tell.", None),
        ("", None),
        ("joined tables", None),
    ],
)
def test_parse_label_answer(answer: str, expected: str | None) -> None:
    assert parse_label_answer(answer, load_vocabulary()) == expected


def test_llm_labeler_uses_answers_and_falls_back(scripted_backend) -> None:
    def answer(content: str) -> str:
        sql = re.search(r"```sql\n(.*)\n```", content, re.DOTALL).group(1)
        return "window function" if "OVER" in sql else "no idea"

    backend = scripted_backend(answer)
    labeler = LLMLabeler(backend, batch_size=2)
    sqls = [EXAMPLES["window_function"], EXAMPLES["cte"], EXAMPLES["join"], EXAMPLES["window_function"]]
    assert labeler.label_batch(sqls) == ["window_function", "cte", "join", "window_function"]
    assert (labeler.num_labeled, labeler.num_fallbacks) == (4, 2)
    assert labeler.fallback_rate == pytest.approx(0.5)
    assert [c["num_prompts"] for c in backend.calls] == [2, 2]  # batched prompts
    assert all(c["temperature"] == 0.0 and c["n"] == 1 for c in backend.calls)
    assert labeler.label(EXAMPLES["exists"]) == "exists"
    assert (labeler.num_labeled, labeler.num_fallbacks) == (5, 3)


def test_llm_labeler_can_answer_names_rules_never_produce(scripted_backend) -> None:
    vocab = Vocabulary(
        approaches=(Approach("join", "Joins."), Approach("argmax_lookup", "Finds the row with the largest value.")),
        default="join",
    )
    labeler = LLMLabeler(scripted_backend(lambda _: "argmax lookup"), vocab)
    assert labeler.label(EXAMPLES["order_by_limit"]) == "argmax_lookup"
    assert labeler.num_fallbacks == 0


def test_label_prompt_lists_every_approach_with_description() -> None:
    vocab = load_vocabulary()
    [message] = build_label_messages(EXAMPLES["join"], vocab)
    assert message["role"] == "user"
    for approach in vocab:
        assert f"- {approach.name}: {approach.description}" in message["content"]
    assert EXAMPLES["join"] in message["content"]
