"""The one generation interface shared by the transformers (CPU) and vLLM (GPU) backends.

A prompt is either a plain string (used verbatim, tokenized with the tokenizer's special tokens,
e.g. BOS) or a list of chat messages ``[{"role": ..., "content": ...}, ...]`` rendered with the
tokenizer's chat template (``add_generation_prompt=True``; the rendered text already holds its
special tokens, so it is tokenized without adding more). Both backends tokenize prompts here,
so the same prompt gives the same prompt token ids on CPU and GPU.

``generate`` returns, per prompt, ``n`` :class:`Generation` objects. ``token_ids`` are the
completion tokens only and include the terminating EOS token when the model stopped on it
(``finish_reason == "stop"``), as vLLM reports them; ``text`` is decoded without special
tokens. ``temperature == 0`` means greedy decoding. Per-token ``logprobs`` (on request) are
log-probabilities of the chosen tokens under the model's *unmodified* distribution (before
temperature / top-p), which is vLLM's default ``raw_logprobs`` mode.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ChatMessages",
    "Generation",
    "GenerationBackend",
    "Prompt",
    "derive_seed",
    "encode_prompts",
    "render_prompt",
    "validate_sampling",
]

ChatMessages = Sequence[Mapping[str, str]]
Prompt = str | ChatMessages


@dataclass(frozen=True)
class Generation:
    """One sampled completion."""

    text: str
    token_ids: tuple[int, ...]  # completion only; lists are accepted and stored as a tuple
    logprobs: tuple[float, ...] | None = None  # one per token id when requested
    finish_reason: str | None = None  # backends set "stop" (EOS) or "length" (max_new_tokens)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
            if len(self.logprobs) != len(self.token_ids):
                raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.token_ids)} token ids")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class GenerationBackend(abc.ABC):
    """Batched sampling from a frozen causal LM."""

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer the backend encodes and decodes with."""

    @abc.abstractmethod
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
        """``n`` completions for each prompt, in prompt order; deterministic for a fixed seed."""

    def encode(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """Prompt token ids, see the module docstring."""
        return encode_prompts(self.tokenizer, prompts, chat_template_kwargs=getattr(self, "chat_template_kwargs", None))

    def apply_chat_template(self, messages: ChatMessages) -> str:
        """Render chat messages (with the generation prompt) as text."""
        return render_prompt(self.tokenizer, messages, chat_template_kwargs=getattr(self, "chat_template_kwargs", None))


def render_prompt(tokenizer: Any, prompt: Prompt, *, chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """A string prompt unchanged; chat messages through the tokenizer's chat template."""
    if isinstance(prompt, str):
        return prompt
    messages = [dict(m) for m in prompt]
    if not messages or not all("role" in m and "content" in m for m in messages):
        raise ValueError("a chat prompt must be a non-empty list of {'role': ..., 'content': ...} messages")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat messages were given but the tokenizer has no chat template; pass plain string "
            "prompts or use a model/tokenizer that defines one"
        )
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **dict(chat_template_kwargs or {})
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def encode_prompts(
    tokenizer: Any, prompts: Sequence[Prompt], *, chat_template_kwargs: Mapping[str, Any] | None = None
) -> list[list[int]]:
    """Token ids of each prompt (chat templates carry their own special tokens)."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of prompts, not a single string")
    encoded: list[list[int]] = []
    for prompt in prompts:
        text = render_prompt(tokenizer, prompt, chat_template_kwargs=chat_template_kwargs)
        ids = tokenizer(text, add_special_tokens=isinstance(prompt, str))["input_ids"]
        if not ids:
            raise ValueError(f"prompt {len(encoded)} encodes to zero tokens")
        encoded.append(list(ids))
    return encoded


def validate_sampling(*, n: int, temperature: float, top_p: float, max_new_tokens: int) -> None:
    """Reject sampling arguments both backends would mishandle, naming the argument."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def derive_seed(seed: int, *parts: int) -> int:
    """A 31-bit seed derived from ``seed`` and indices, stable across processes and platforms."""
    blob = ":".join(str(int(x)) for x in (seed, *parts)).encode("ascii")
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "big") % (2**31 - 1)
