"""Exact expected accuracy of a sampling policy on questions with enumerable right answers.

When a response is right exactly when it is one of a few known token sequences (the tiny addition
task: the sum's digits, then a token that ends generation), the probability that one sampled
response is right is the sum, over those sequences, of the policy's probability of generating
each one at the sampling temperature. A teacher-forced forward gives every such probability at
once, so the expected accuracy of a sampled evaluation is computed without sampling: the number a
Mean@n evaluation estimates, without its binomial noise (sd sqrt(p(1-p)/n) per question).

It is exact for the sequences it enumerates and a lower bound otherwise: a response the reward
also accepts but that is not enumerated (an answer with surrounding whitespace, an answer
followed by a special token that decoding drops) adds to the sampled accuracy only. Runs report
both numbers, so that gap is visible.

Pure functions over ids and tensors (torch only). The verl side that runs the forward is
:mod:`verl_replay.integrations.verl.exact_eval`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["AnswerSequences", "answer_sequences", "expected_accuracy", "accuracy_summary"]


@dataclass(frozen=True)
class AnswerSequences:
    """The right responses of one question, as the token sequences the policy would generate."""

    question: int  # index in the evaluated set
    data_source: str
    prompt_ids: tuple[int, ...]
    responses: tuple[tuple[int, ...], ...]  # distinct, each ends with a stop token


def answer_sequences(
    question: int,
    data_source: str,
    prompt_ids: Sequence[int],
    answers: Sequence[Sequence[int]],
    stop_ids: Sequence[int],
) -> AnswerSequences:
    """Every ``answer + stop`` sequence of one question: each right answer's tokens followed by
    each token that ends generation. Duplicates (two golds that tokenize alike) are kept once,
    so no probability is counted twice."""
    if not prompt_ids:
        raise ValueError(f"question {question}: empty prompt")
    if not answers or any(len(answer) == 0 for answer in answers):
        raise ValueError(f"question {question}: every right answer needs at least one token")
    if not stop_ids:
        raise ValueError("stop_ids: at least one token must end generation")
    responses = dict.fromkeys(tuple(int(t) for t in answer) + (int(stop),) for answer in answers for stop in stop_ids)
    return AnswerSequences(question, data_source, tuple(int(t) for t in prompt_ids), tuple(responses))


def expected_accuracy(response_log_probs: Sequence[torch.Tensor], questions: Sequence[int], count: int) -> torch.Tensor:
    """Per question, the probability that one sampled response is one of its right sequences.

    ``response_log_probs[r]`` holds the per-token log-probs (at the sampling temperature) of right
    sequence r, which belongs to question ``questions[r]``; the result is ``[count]`` float64:
    sum over a question's sequences of exp(sum of the sequence's log-probs). Questions without a
    sequence get 0."""
    if len(response_log_probs) != len(questions):
        raise ValueError(f"{len(response_log_probs)} log-prob rows for {len(questions)} question indices")
    totals = torch.zeros(count, dtype=torch.float64)  # [Q]
    if not questions:
        return totals
    sequence = torch.stack([row.double().sum() for row in response_log_probs])  # [R]
    if not torch.isfinite(sequence).all() or (sequence > 1e-6).any():
        raise ValueError("sequence log-probs must be finite and <= 0")
    index = torch.as_tensor(list(questions), dtype=torch.int64)  # [R]
    if index.min() < 0 or index.max() >= count:
        raise ValueError(f"question index out of range [0, {count})")
    totals.index_add_(0, index, sequence.exp())
    if (totals > 1 + 1e-6).any():
        raise ValueError("a question's right sequences have total probability > 1: they overlap or are not distinct")
    return totals


def accuracy_summary(per_question: torch.Tensor, data_sources: Sequence[str]) -> dict[str, float]:
    """``{data_source: mean expected accuracy}`` over the questions of each source."""
    if per_question.numel() != len(data_sources):
        raise ValueError(f"{per_question.numel()} accuracies for {len(data_sources)} questions")
    sums: dict[str, list[float]] = {}
    for value, source in zip(per_question.tolist(), data_sources, strict=True):
        entry = sums.setdefault(source, [0.0, 0.0])
        entry[0] += value
        entry[1] += 1
    return {source: total / n for source, (total, n) in sums.items() if n and math.isfinite(total)}
