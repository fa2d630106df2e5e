"""Tiny arithmetic RL dataset (deterministic from a seed).

Small operands keep answers to one or two digits, so even a random tiny model sometimes
emits the right ``\\boxed{...}`` and GRPO groups get mixed rewards on a CPU run.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from verl_replay.data.math_benchmarks import MathExample

TINY_MATH_SOURCE = "tiny_math"
_NAMES = ("Ann", "Ben", "Cat", "Dev", "Eli", "Fay")
_ITEMS = ("apples", "pens", "books", "cards")


def _sum2(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"What is {a} + {b}?", a + b


def _product(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 5), rng.randint(2, 5)
    return f"What is {a} * {b}?", a * b


def _difference(rng: random.Random) -> tuple[str, int]:
    a = rng.randint(5, 19)
    b = rng.randint(1, a - 1)
    return f"What is {a} - {b}?", a - b


def _sum3(rng: random.Random) -> tuple[str, int]:
    a, b, c = (rng.randint(1, 6) for _ in range(3))
    return f"What is {a} + {b} + {c}?", a + b + c


def _product_plus(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(2, 4), rng.randint(2, 4), rng.randint(1, 5)
    return f"What is {a} * {b} + {c}?", a * b + c


def _story(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b


_TEMPLATES: tuple[Callable[[random.Random], tuple[str, int]], ...] = (
    _sum2,
    _product,
    _difference,
    _sum3,
    _product_plus,
    _story,
)


def tiny_math_examples(seed: int = 0, *, n_train: int = 64, n_val: int = 16) -> dict[str, list[MathExample]]:
    """``{"train": [...], "val": [...]}`` of distinct questions, round-robin over templates."""
    rng = random.Random(f"tiny-math-{seed}")
    total = n_train + n_val
    seen: set[str] = set()
    drawn: list[tuple[str, int]] = []
    attempts = 0
    while len(drawn) < total:
        attempts += 1
        if attempts > 100 * total:
            raise RuntimeError(f"could not draw {total} distinct tiny math questions")
        question, answer = _TEMPLATES[len(drawn) % len(_TEMPLATES)](rng)
        if question not in seen:
            seen.add(question)
            drawn.append((question, answer))
    rng.shuffle(drawn)
    examples = [
        MathExample(question_id=f"{TINY_MATH_SOURCE}-{i:04d}", problem=q, answer=str(a), benchmark=TINY_MATH_SOURCE)
        for i, (q, a) in enumerate(drawn)
    ]
    return {"train": examples[:n_train], "val": examples[n_train:]}
