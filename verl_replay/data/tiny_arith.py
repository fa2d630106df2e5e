"""Tiny two-digit addition: a CPU task built so that GRPO has something to learn in minutes.

A prompt is the user turn ``aa+bb=`` (operands 10-99); the answer is the sum's digits and the
end of the turn, scored by exact match (``verl_replay.rewards``, data source ``tiny_arith``). The
tiny tokenizer spells numbers digit by digit, so an answer is 2-3 tokens and eos.

Why two digits: on the tiny Qwen3.5 model (and on a plain two-layer decoder with learned
positions), 2,500 noisy-teacher steps on three-digit sums left greedy answers right under 10% of
the time; two-digit sums reach ~90% greedy within 1,000 steps.

Why it can learn: the warm start is supervised on a *noisy teacher* that replaces every answer digit
by a uniformly random digit with probability ``TEACHER_NOISE``. The model learns the right digit as
its most likely one (greedy answers are mostly right) but also the teacher's noise, so answers
sampled at temperature 1 are right far less often. That gap between the sampled and the greedy
answer is what a few dozen GRPO steps close; a warm start stopped early on clean answers leaves
no such gap, and GRPO on it barely moves.

``HELD_OUT_PROMPTS`` problems form the validation set. They are never trained on: not by the warm
start, not in the RL training rows.

This module builds data only (stdlib and torch); the model and its cache live in
:mod:`verl_replay.data.tiny_tasks`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

TINY_ARITH_SOURCE = "tiny_arith"
OPERANDS = range(10, 100)
HELD_OUT_PROMPTS = 256
TRAIN_PROMPTS = 4096
TEACHER_NOISE = 0.3

Problem = tuple[int, int]


def arith_question(problem: Problem) -> str:
    left, right = problem
    return f"{left}+{right}="


def arith_answer(problem: Problem) -> str:
    return str(sum(problem))


def _random_problem(rng: random.Random) -> Problem:
    return rng.choice(OPERANDS), rng.choice(OPERANDS)


def arith_problems(seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """(training problems, held-out problems): distinct, deterministic from ``seed``."""
    rng = random.Random(f"tiny-arith-{seed}")
    seen: set[Problem] = set()
    ordered: list[Problem] = []
    while len(ordered) < TRAIN_PROMPTS + HELD_OUT_PROMPTS:
        problem = _random_problem(rng)
        if problem not in seen:
            seen.add(problem)
            ordered.append(problem)
    return ordered[:TRAIN_PROMPTS], ordered[TRAIN_PROMPTS:]


def arith_rows(problems: Sequence[Problem], split: str) -> list[dict[str, Any]]:
    """verl RL rows: one user turn, the sum as ground truth."""
    return [
        {
            "data_source": TINY_ARITH_SOURCE,
            "prompt": [{"role": "user", "content": arith_question(problem)}],
            "ability": "arith",
            "reward_model": {"style": "rule", "ground_truth": arith_answer(problem)},
            "extra_info": {"split": split, "index": index},
        }
        for index, problem in enumerate(problems)
    ]


def noisy_answer(problem: Problem, rng: random.Random, noise: float = TEACHER_NOISE) -> str:
    """The teacher's answer: each digit of the sum replaced by a random digit with probability ``noise``."""
    return "".join(str(rng.randrange(10)) if rng.random() < noise else digit for digit in arith_answer(problem))


def teacher_problems(held_out: Sequence[Problem], rng: random.Random) -> Iterator[Problem]:
    """Endless random problems for the warm start, never one of ``held_out``."""
    excluded = set(held_out)
    while True:
        problem = _random_problem(rng)
        if problem not in excluded:
            yield problem


def answer_batch(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, Any]:
    """One supervised batch of ``(prompt ids, answer ids)`` rows, right-padded, the loss on the answer."""
    import torch

    width = max(len(prompt) + len(answer) for prompt, answer in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, W]
    attention_mask = torch.zeros_like(input_ids)  # [B, W]
    labels = torch.full_like(input_ids, -100)  # [B, W]
    for row, (prompt, answer) in enumerate(rows):
        end = len(prompt) + len(answer)
        input_ids[row, :end] = torch.tensor(prompt + answer)
        attention_mask[row, :end] = 1
        labels[row, len(prompt) : end] = torch.tensor(answer)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def warm_start_batches(
    encode_prompt: Callable[[str], list[int]],
    encode_answer: Callable[[str], list[int]],
    *,
    eos_id: int,
    pad_id: int,
    held_out: Sequence[Problem],
    seed: int,
    steps: int,
    batch_size: int,
    noise: float = TEACHER_NOISE,
) -> Iterator[dict[str, Any]]:
    """``steps`` supervised batches of prompt + noisy answer + eos, the loss on answer and eos.

    ``encode_prompt`` maps a question to the token ids of the whole prompt as the rollout sees it
    (the chat template with the generation prompt); ``encode_answer`` maps answer text to ids.
    """
    rng = random.Random(f"tiny-arith-teacher-{seed}")
    problems = teacher_problems(held_out, rng)
    for _ in range(steps):
        rows = []
        for _ in range(batch_size):
            problem = next(problems)
            answer = encode_answer(noisy_answer(problem, rng, noise)) + [eos_id]
            rows.append((encode_prompt(arith_question(problem)), answer))
        yield answer_batch(rows, pad_id)
