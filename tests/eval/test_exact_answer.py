import math

import pytest
import torch

from verl_replay.eval.exact_answer import accuracy_summary, answer_sequences, expected_accuracy


def test_each_answer_is_followed_by_each_stop_token_once():
    q = answer_sequences(3, "tiny_arith", [1, 2], [[7, 8], [7, 8], [9]], stop_ids=[0, 5])
    assert q.question == 3 and q.prompt_ids == (1, 2)
    # the duplicate gold [7, 8] is kept once: its probability must not be counted twice
    assert q.responses == ((7, 8, 0), (7, 8, 5), (9, 0), (9, 5))


@pytest.mark.parametrize(
    "prompt, answers, stops, match",
    [([], [[1]], [0], "empty prompt"), ([1], [[]], [0], "at least one token"), ([1], [[2]], [], "stop_ids")],
)
def test_bad_questions_are_refused(prompt, answers, stops, match):
    with pytest.raises(ValueError, match=match):
        answer_sequences(0, "s", prompt, answers, stops)


def test_expected_accuracy_sums_sequence_probabilities_per_question():
    # question 0: two right sequences, p = 0.5 * 0.4 and 0.5 * 0.1 -> 0.25
    # question 1: one right sequence, p = 0.9 * 0.8 * 0.5 = 0.36
    # question 2: no sequence -> 0
    rows = [
        torch.tensor([math.log(0.5), math.log(0.4)]),
        torch.tensor([math.log(0.9), math.log(0.8), math.log(0.5)]),
        torch.tensor([math.log(0.5), math.log(0.1)]),
    ]
    result = expected_accuracy(rows, [0, 1, 0], count=3)
    assert result.dtype == torch.float64
    assert torch.allclose(result, torch.tensor([0.25, 0.36, 0.0], dtype=torch.float64), atol=1e-7)


def test_expected_accuracy_equals_the_sampled_rate_of_a_known_policy():
    # an independent check: sample a 2-token answer + stop from fixed per-position distributions and
    # count exact matches; the sampled rate converges to the product of the teacher-forced probabilities
    gen = torch.Generator().manual_seed(0)
    probs = [torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.2, 0.7, 0.1]), torch.tensor([0.8, 0.15, 0.05])]
    right = (0, 1, 0)
    draws = torch.stack([torch.multinomial(p, 200_000, replacement=True, generator=gen) for p in probs], dim=1)
    sampled = (draws == torch.tensor(right)).all(dim=1).double().mean().item()
    log_probs = torch.stack([probs[i][t].log() for i, t in enumerate(right)])
    exact = expected_accuracy([log_probs], [0], count=1).item()
    assert exact == pytest.approx(0.6 * 0.7 * 0.8)
    assert abs(sampled - exact) < 4 * math.sqrt(exact * (1 - exact) / 200_000)


def test_probabilities_over_one_mean_the_sequences_overlap():
    rows = [torch.tensor([math.log(0.7)]), torch.tensor([math.log(0.7)])]
    with pytest.raises(ValueError, match="total probability > 1"):
        expected_accuracy(rows, [0, 0], count=1)


@pytest.mark.parametrize("bad", [torch.tensor([0.5]), torch.tensor([float("nan")]), torch.tensor([float("-inf")])])
def test_log_probs_must_be_finite_and_not_positive(bad):
    with pytest.raises(ValueError, match="finite and <= 0"):
        expected_accuracy([bad], [0], count=1)


def test_question_indices_are_checked():
    with pytest.raises(ValueError, match="out of range"):
        expected_accuracy([torch.tensor([-0.1])], [2], count=2)
    with pytest.raises(ValueError, match="2 log-prob rows for 1"):
        expected_accuracy([torch.tensor([-0.1]), torch.tensor([-0.1])], [0], count=1)


def test_summary_is_the_mean_per_data_source():
    per_question = torch.tensor([0.2, 0.4, 1.0, 0.0], dtype=torch.float64)
    assert accuracy_summary(per_question, ["a", "a", "b", "b"]) == pytest.approx({"a": 0.3, "b": 0.5})
    with pytest.raises(ValueError, match="4 accuracies for 3"):
        accuracy_summary(per_question, ["a", "a", "b"])
