"""A scripted generation backend: answers come from a function of the prompt's user message."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from verl_replay.generation.base import Generation, GenerationBackend, Prompt


class ScriptedBackend(GenerationBackend):
    def __init__(self, answer: Callable[[str], str]) -> None:
        self.answer = answer
        self.calls: list[dict] = []

    @property
    def tokenizer(self) -> None:
        return None

    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        seed: int = 0,
        logprobs: bool = False,
    ) -> list[list[Generation]]:
        self.calls.append({"num_prompts": len(prompts), "n": n, "temperature": temperature, "seed": seed})
        out = []
        for prompt in prompts:
            content = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            text = self.answer(content)
            out.append([Generation(text=text, token_ids=tuple(range(len(text.split()))), finish_reason="stop")] * n)
        return out


@pytest.fixture
def scripted_backend() -> type[ScriptedBackend]:
    return ScriptedBackend
