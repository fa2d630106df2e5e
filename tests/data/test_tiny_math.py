from __future__ import annotations

from verl_replay.data.tiny_math import TINY_MATH_SOURCE, tiny_math_examples


def test_sizes_ids_and_distinct_questions():
    splits = tiny_math_examples(0)
    assert (len(splits["train"]), len(splits["val"])) == (64, 16)
    examples = splits["train"] + splits["val"]
    assert len({e.problem for e in examples}) == 80
    assert len({e.question_id for e in examples}) == 80
    assert all(e.benchmark == TINY_MATH_SOURCE for e in examples)
    # Answers stay small so a tiny model can hit them by chance.
    assert all(e.answer.isdigit() and int(e.answer) <= 30 for e in examples)


def test_same_seed_same_examples_other_seed_different():
    assert tiny_math_examples(3) == tiny_math_examples(3)
    assert tiny_math_examples(3)["train"] != tiny_math_examples(4)["train"]
    custom = tiny_math_examples(0, n_train=5, n_val=2)
    assert (len(custom["train"]), len(custom["val"])) == (5, 2)
