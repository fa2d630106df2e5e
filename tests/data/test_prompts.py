from __future__ import annotations

import pytest

from verl_replay.data.prompts import (
    MATH_INSTRUCTION,
    SQL_INSTRUCTION,
    build_math_messages,
    build_sql_messages,
)

SCHEMA = "CREATE TABLE t (a INTEGER)"


def test_sql_messages_hold_schema_question_evidence_and_instruction():
    messages = build_sql_messages(SCHEMA, "How many rows?", "rows means records")
    assert messages == [
        {
            "role": "user",
            "content": f"Database schema:\n{SCHEMA}\n\nQuestion: How many rows?\n\n"
            f"Evidence: rows means records\n\n{SQL_INSTRUCTION}",
        }
    ]
    assert "```sql" in SQL_INSTRUCTION


def test_sql_messages_skip_empty_evidence_and_add_system_turn():
    messages = build_sql_messages(SCHEMA, "How many rows?", "  ", system_prompt="You write SQLite.")
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == "You write SQLite."
    assert "Evidence" not in messages[1]["content"]


@pytest.mark.parametrize("schema, question", [("", "q?"), (SCHEMA, " ")])
def test_sql_messages_reject_empty_parts(schema, question):
    with pytest.raises(ValueError, match="non-empty"):
        build_sql_messages(schema, question)


def test_math_messages():
    assert build_math_messages(" What is 2 + 2? ") == [
        {"role": "user", "content": f"What is 2 + 2?\n{MATH_INSTRUCTION}"}
    ]
    assert "\\boxed{}" in MATH_INSTRUCTION
    assert build_math_messages("x", instruction="Box it.")[0]["content"] == "x\nBox it."
    with pytest.raises(ValueError, match="non-empty problem"):
        build_math_messages("")
