"""Mutation prompt builder: question kept verbatim, target approach + parent appended."""

from __future__ import annotations

import copy

import pytest

from verl_replay.elite.search_prompts import build_mutation_block, build_mutation_prompt

SQL_FORMAT = "Answer with one SQLite query in a ```sql code block."
QUESTION = (
    "Database schema:\nCREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, price INTEGER)\n\n"
    "Question: What is the most expensive product?\n\n" + SQL_FORMAT
)
MESSAGES = [
    {"role": "system", "content": "You write SQL."},
    {"role": "user", "content": QUESTION},
]
PARENT = "SELECT name FROM products ORDER BY price DESC LIMIT 1"
TARGET = ("scalar_subquery", "Compares with a single value computed by a subquery.")


def _prompt(**kwargs):
    defaults = dict(
        target_approach=TARGET[0],
        target_description=TARGET[1],
        format_instruction=SQL_FORMAT,
        domain="sql",
        solution_noun="SQLite query",
    )
    defaults.update(kwargs)
    return build_mutation_prompt(MESSAGES, **defaults)


def test_target_and_parent_appear_after_the_question() -> None:
    out = _prompt(parent_solution=PARENT, parent_approach="order_by_limit")
    assert out[0] == MESSAGES[0]  # the system turn is untouched
    content = out[1]["content"]
    assert content.startswith(QUESTION)  # dataset prompt (schema, question) verbatim first
    block = content[len(QUESTION) :]
    assert "`scalar_subquery`" in block and TARGET[1] in block
    assert f"```sql\n{PARENT}\n```" in block
    assert "`order_by_limit`" in block  # the parent's achieved approach is named
    assert block.index(PARENT) < block.rindex("`scalar_subquery`")  # the request comes after the reference
    assert content.rstrip().endswith(SQL_FORMAT)  # the format instruction is the last thing read


def test_no_parent_means_no_reference_solution() -> None:
    out = _prompt()
    block = out[1]["content"][len(QUESTION) :]
    assert "`scalar_subquery`" in block and TARGET[1] in block
    assert "```" not in block.replace(SQL_FORMAT, "")  # no code block besides the format line
    assert "correct" not in block
    assert _prompt(parent_solution="   ")[1]["content"] == out[1]["content"]  # blank parent = none


def test_input_is_not_modified_and_result_is_plain_messages() -> None:
    before = copy.deepcopy(MESSAGES)
    out = _prompt(parent_solution=PARENT)
    assert MESSAGES == before
    assert out is not MESSAGES and all(set(m) == {"role", "content"} for m in out)


def test_last_user_turn_gets_the_block() -> None:
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    out = build_mutation_prompt(
        messages,
        target_approach="algebraic",
        target_description="Sets up equations.",
        format_instruction="Put the final answer in \\boxed{}.",
        parent_solution="2 + 3 = 5, so \\boxed{5}",
        domain="math",
    )
    assert out[0]["content"] == "first" and out[1]["content"] == "ok"
    assert out[2]["content"].startswith("What is 2 + 3?\n\n")
    assert "```\n2 + 3 = 5, so \\boxed{5}\n```" in out[2]["content"]  # math: no sql fence


def test_string_prompt() -> None:
    out = build_mutation_prompt(
        "Q: 1+1?", target_approach="a", target_description="desc a", format_instruction="Box it."
    )
    assert isinstance(out, str) and out.startswith("Q: 1+1?\n\n") and "`a`: desc a" in out and out.endswith("Box it.")


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="no user message"):
        build_mutation_prompt(
            [{"role": "system", "content": "x"}], target_approach="a", target_description="d", format_instruction="f"
        )
    with pytest.raises(ValueError, match="description"):
        _prompt(target_description=" ")
    with pytest.raises(ValueError, match="unknown domain"):
        build_mutation_block(target_approach="a", target_description="d", format_instruction="f", domain="code")
    with pytest.raises(ValueError, match="empty"):
        build_mutation_prompt(" ", target_approach="a", target_description="d", format_instruction="f")
