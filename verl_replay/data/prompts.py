"""Prompt builders shared by every dataset (tiny, BIRD, Spider, AmbiQT, math benchmarks).

All builders return verl's chat-message format: a list of ``{"role", "content"}`` dicts, which
is what the ``prompt`` column of an RL parquet holds. Keeping one builder per task means a
model sees the same instruction wording in training, evaluation and EliteReplay search.
"""

from __future__ import annotations

SQL_INSTRUCTION = "Answer with one SQLite query in a ```sql code block."
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# The tiny model's prompts must stay short (CPU GRPO runs), so its instruction is terse.
TINY_MATH_INSTRUCTION = "Put the final answer in \\boxed{}."

Message = dict[str, str]


def _with_system(user_content: str, system_prompt: str | None) -> list[Message]:
    messages: list[Message] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": user_content})
    return messages


def sql_user_prompt(schema: str, question: str, evidence: str = "", *, instruction: str = SQL_INSTRUCTION) -> str:
    """User turn of a text-to-SQL prompt: schema, optional evidence (BIRD hints), question."""
    if not schema.strip():
        raise ValueError("SQL prompt needs a non-empty schema text")
    if not question.strip():
        raise ValueError("SQL prompt needs a non-empty question")
    parts = [f"Database schema:\n{schema.strip()}", f"Question: {question.strip()}"]
    if evidence and evidence.strip():
        parts.append(f"Evidence: {evidence.strip()}")
    parts.append(instruction)
    return "\n\n".join(parts)


def build_sql_messages(
    schema: str,
    question: str,
    evidence: str = "",
    *,
    system_prompt: str | None = None,
    instruction: str = SQL_INSTRUCTION,
) -> list[Message]:
    """Chat messages for a text-to-SQL question (optional system turn + one user turn)."""
    return _with_system(sql_user_prompt(schema, question, evidence, instruction=instruction), system_prompt)


def math_user_prompt(problem: str, *, instruction: str = MATH_INSTRUCTION) -> str:
    """User turn of a math prompt: the problem followed by the boxed-answer instruction."""
    if not problem.strip():
        raise ValueError("math prompt needs a non-empty problem")
    return f"{problem.strip()}\n{instruction}"


def build_math_messages(
    problem: str, *, system_prompt: str | None = None, instruction: str = MATH_INSTRUCTION
) -> list[Message]:
    """Chat messages for a math problem (optional system turn + one user turn)."""
    return _with_system(math_user_prompt(problem, instruction=instruction), system_prompt)
