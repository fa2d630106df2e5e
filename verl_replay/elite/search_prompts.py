"""Mutation prompts of the MAP-Elites search.

A mutation prompt is the question's own dataset prompt (for SQL it already holds the schema,
the question, the evidence and the answer-format instruction) with a *mutation block*
appended to its last user turn:

* the target approach: its name and its one-line description from the reviewed vocabulary;
* the parent: a verified solution of the same question (usually of another approach), shown
  as reference together with its achieved approach -- or nothing, when the question has no
  elite yet;
* the answer-format instruction again, last, so the format request is the final thing the
  model reads.

Keeping the dataset prompt verbatim means the model sees the instruction wording it saw in
training, and the elite's response is a valid response to the *original* prompt too (that is
the prompt it is replayed with).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["build_mutation_block", "build_mutation_prompt"]

_FENCES = {"sql": "sql", "math": ""}


def build_mutation_block(
    *,
    target_approach: str,
    target_description: str,
    format_instruction: str,
    parent_solution: str | None = None,
    parent_approach: str | None = None,
    domain: str = "sql",
    solution_noun: str = "solution",
) -> str:
    """The text appended to the question: target approach, optional parent, format line."""
    if domain not in _FENCES:
        raise ValueError(f"unknown domain {domain!r}; choose one of {sorted(_FENCES)}")
    if not target_approach or not target_description.strip():
        raise ValueError("a mutation prompt needs the target approach's name and description")
    parts = [f"Write a {solution_noun} that uses the approach `{target_approach}`: {target_description.strip()}"]
    if parent_solution is not None and parent_solution.strip():
        fence = _FENCES[domain]
        used = f" (it uses the approach `{parent_approach}`)" if parent_approach else ""
        parts.append(
            f"Here is a correct {solution_noun} for this question{used}:\n"
            f"```{fence}\n{parent_solution.strip()}\n```\n"
            f"Write a different {solution_noun} that uses the approach `{target_approach}` and gives the same answer."
        )
    parts.append(format_instruction.strip())
    return "\n\n".join(parts)


def build_mutation_prompt(
    prompt: str | Sequence[Mapping[str, str]],
    *,
    target_approach: str,
    target_description: str,
    format_instruction: str,
    parent_solution: str | None = None,
    parent_approach: str | None = None,
    domain: str = "sql",
    solution_noun: str = "solution",
) -> str | list[dict[str, str]]:
    """The question's prompt with the mutation block appended (see the module docstring).

    ``prompt``: chat messages (the block goes at the end of the last user message; earlier
    messages are copied unchanged) or a plain string (the block is appended). The input is
    never modified. ``parent_solution`` is shown as given (for SQL pass the extracted query).
    """
    block = build_mutation_block(
        target_approach=target_approach,
        target_description=target_description,
        format_instruction=format_instruction,
        parent_solution=parent_solution,
        parent_approach=parent_approach,
        domain=domain,
        solution_noun=solution_noun,
    )
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the question prompt is empty")
        return f"{prompt.rstrip()}\n\n{block}"
    messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError("the question prompt has no user message to extend")
    last = users[-1]
    messages[last]["content"] = f"{messages[last]['content'].rstrip()}\n\n{block}"
    return messages
