"""The tiny addition task: its problems, held-out split, noisy teacher and warm-start batches."""

from __future__ import annotations

import random

import pytest

from verl_replay.data import tiny_arith as ta
from verl_replay.rewards import compute_score


def test_problems_are_distinct_two_digit_pairs_and_the_held_out_ones_are_apart():
    train, held_out = ta.arith_problems()
    assert len(train) == ta.TRAIN_PROMPTS and len(held_out) == ta.HELD_OUT_PROMPTS
    everything = train + held_out
    assert len(set(everything)) == len(everything)
    assert all(10 <= a <= 99 and 10 <= b <= 99 for a, b in everything)
    assert ta.arith_problems() == (train, held_out) and ta.arith_problems(seed=1) != (train, held_out)


def test_rows_ask_the_question_and_hold_the_sum():
    (row,) = ta.arith_rows([(123, 989)], "val")
    assert row["prompt"] == [{"role": "user", "content": "123+989="}]
    assert row["reward_model"]["ground_truth"] == "1112" and row["data_source"] == ta.TINY_ARITH_SOURCE
    # the reward of the row's own source: the whole response, exactly
    assert compute_score(row["data_source"], "1112", "1112")["acc"] == 1.0
    assert compute_score(row["data_source"], " 1112\n", "1112")["score"] == 1.0
    for wrong in ("1111", "11120", "x1112", "", "1,112", "1112.0"):
        result = compute_score(row["data_source"], wrong, "1112")
        assert result["acc"] == result["score"] == 0.0, (wrong, result)


def test_the_noisy_teacher_replaces_each_digit_at_its_rate():
    rng = random.Random(0)
    problem, draws = (456, 321), 20_000  # 777: a replaced digit is still right with probability 1/10
    wrong = sum(d != "7" for _ in range(draws) for d in ta.noisy_answer(problem, rng, 0.3))
    assert wrong / (3 * draws) == pytest.approx(0.3 * 0.9, abs=0.01)
    assert ta.noisy_answer(problem, rng, 0.0) == "777"


def test_warm_start_batches_train_on_answer_and_eos_never_on_a_held_out_problem():
    _, held_out = ta.arith_problems()
    seen = []

    def encode_prompt(question: str) -> list[int]:
        seen.append(question)
        return [1, 2] + [ord(c) for c in question] + [3]

    batches = list(
        ta.warm_start_batches(
            encode_prompt,
            lambda text: [ord(c) for c in text],
            eos_id=9,
            pad_id=0,
            held_out=held_out,
            seed=0,
            steps=3,
            batch_size=5,
            noise=0.0,
        )
    )
    assert len(batches) == 3 and all(b["input_ids"].shape[0] == 5 for b in batches)
    questions = {ta.arith_question(p) for p in held_out}
    assert len(seen) == 15 and not questions & set(seen)
    first = batches[0]
    row = first["attention_mask"][0].bool()
    trained = first["labels"][0][first["labels"][0] != -100].tolist()
    left, right = (int(x) for x in seen[0].rstrip("=").split("+"))
    assert trained == [ord(c) for c in str(left + right)] + [9]  # noise 0: the true sum, then eos
    assert first["input_ids"][0][row].tolist()[-len(trained) :] == trained
    # padding is neither attended nor trained
    assert (first["labels"][~first["attention_mask"].bool()] == -100).all()


def test_the_control_reward_ignores_correctness_on_training_rows_only():
    rows = ta.arith_rows(ta.arith_problems()[0][:2000], "train")
    right = [
        compute_score(
            r["data_source"],
            r["reward_model"]["ground_truth"],
            r["reward_model"]["ground_truth"],
            r["extra_info"],
            control_reward_rate=0.3,
        )
        for r in rows
    ]
    wrong = [
        compute_score(
            r["data_source"], "0", r["reward_model"]["ground_truth"], r["extra_info"], control_reward_rate=0.3
        )
        for r in rows
    ]
    # the same rate for right and wrong answers (2000 draws each: 3 standard errors ~ 0.031)
    assert sum(x["score"] for x in right) / 2000 == pytest.approx(0.3, abs=0.031)
    assert sum(x["score"] for x in wrong) / 2000 == pytest.approx(0.3, abs=0.031)
    assert all(x["acc"] == x["score"] and x["reason"] == "control" for x in right + wrong)
    assert {x["task_acc"] for x in right} == {1.0} and {x["task_acc"] for x in wrong} == {0.0}
    row = rows[0]
    args = (row["data_source"], "0", row["reward_model"]["ground_truth"], row["extra_info"])
    assert compute_score(*args, control_reward_rate=0.3) == compute_score(*args, control_reward_rate=0.3)
    assert compute_score(*args, control_reward_rate=1.0)["score"] == 1.0
    assert compute_score(*args, control_reward_rate=0.0)["score"] == 0.0
    with pytest.raises(ValueError, match="control_reward_rate must be a probability"):
        compute_score(*args, control_reward_rate=1.5)
    # validation rows keep the task's reward: the control run's validation measures the task
    (val,) = ta.arith_rows([(100, 200)], "val")
    gold = val["reward_model"]["ground_truth"]
    assert compute_score(val["data_source"], "300", gold, val["extra_info"], control_reward_rate=0.0)["acc"] == 1.0
