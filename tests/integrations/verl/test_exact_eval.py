"""The exact held-out metric's questions and sums, checked against the reward function itself:
what the enumeration calls right is what verl's reward scores right, and the metric equals the
exact-match rate of responses sampled from a known policy."""

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from verl_replay.data.tiny_arith import arith_problems, arith_rows
from verl_replay.eval.sampling import sampled_validation_due, sampling_is_plain
from verl_replay.integrations.verl import exact_eval
from verl_replay.integrations.verl.exact_eval import (
    ExactAnswerEval,
    exact_questions,
    stop_token_ids,
)
from verl_replay.integrations.verl.group_replay import replay_rows
from verl_replay.rewards import compute_score

PROBLEMS = 12


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_assets.tokenizer))


@pytest.fixture
def val_file(tmp_path):
    _, held_out = arith_problems(seed=0)
    rows = arith_rows(held_out[:PROBLEMS], "test")
    rows.append({**rows[0], "data_source": "tiny_math"})  # not an exact-answer source: left out
    path = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _questions(val_file, tokenizer, tiny_assets):
    stops = stop_token_ids(str(tiny_assets.model_dir), tokenizer)
    return exact_questions([str(val_file)], tokenizer, stop_ids=stops, max_prompt_length=256), stops


def test_questions_are_the_rollouts_prompts_and_every_right_answer_with_every_stop(val_file, tokenizer, tiny_assets):
    questions, stops = _questions(val_file, tokenizer, tiny_assets)
    assert len(questions) == PROBLEMS and {q.data_source for q in questions} == {"tiny_arith"}
    # vLLM stops on the generation config's eos ids: the tiny model has two (eos and pad)
    assert stops[0] == tokenizer.eos_token_id and len(stops) == 2
    rows = pq.read_table(val_file).to_pylist()
    for question, row in zip(questions, rows, strict=False):
        # the chat turn written out by hand, as the rollout's prompt reads
        text = f"<|im_start|>user\n{row['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
        assert list(question.prompt_ids) == tokenizer.encode(text, add_special_tokens=False)
        digits = [tokenizer.convert_tokens_to_ids(d) for d in row["reward_model"]["ground_truth"]]
        assert question.responses == tuple(tuple(digits) + (stop,) for stop in stops)


def test_what_the_enumeration_calls_right_the_reward_scores_right(val_file, tokenizer, tiny_assets):
    questions, stops = _questions(val_file, tokenizer, tiny_assets)
    rows = pq.read_table(val_file).to_pylist()
    for question, row in zip(questions, rows, strict=False):
        gold = row["reward_model"]["ground_truth"]
        for response in question.responses:
            # verl decodes the response, stop token included, without special tokens
            text = tokenizer.decode(list(response), skip_special_tokens=True)
            assert compute_score("tiny_arith", text, gold)["score"] == 1.0
        wrong = list(question.responses[0])
        wrong[0] = tokenizer.convert_tokens_to_ids(str((int(gold[0]) + 1) % 10))
        assert compute_score("tiny_arith", tokenizer.decode(wrong, skip_special_tokens=True), gold)["score"] == 0.0


class BigramPolicy:
    """A known policy: the next token's distribution depends on the previous token only. It samples
    responses (stopping at a stop token or after ``max_tokens``) and scores groups like the actor."""

    def __init__(self, vocab: int, favoured: list[int], path: tuple[int, ...] = (), seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=gen)  # [V, V]
        logits[:, favoured] += 6.0  # digits and stop tokens
        for previous, token in zip(path[:-1], path[1:], strict=True):  # the right answer: likely, not certain
            logits[previous, token] += 4.0
        self.log_probs = logits.log_softmax(-1)  # [V, V]
        self.calls = 0

    def __call__(self, groups):
        self.calls += 1
        out = []
        for group in groups:
            parts = []
            for row in replay_rows(group, uid="x", global_steps=0, media=None):
                previous = torch.cat([row["prompts"][-1:], row["responses"][:-1]])  # [R]
                parts.append(self.log_probs[previous, row["responses"]])  # [R]
            out.append(torch.cat(parts))
        return out

    def sample(self, last_prompt_token: int, count: int, stops: list[int], max_tokens: int, gen) -> list[list[int]]:
        previous = torch.full((count,), last_prompt_token)
        tokens = torch.zeros(count, max_tokens, dtype=torch.long)  # [N, T]
        done = torch.zeros(count, dtype=torch.bool)
        lengths = torch.full((count,), max_tokens)
        for t in range(max_tokens):
            nxt = torch.multinomial(self.log_probs[previous].exp(), 1, generator=gen).squeeze(1)
            tokens[:, t] = nxt
            stopped = ~done & torch.isin(nxt, torch.tensor(stops))
            lengths[stopped] = t + 1
            done |= stopped
            previous = nxt
        return [tokens[i, : lengths[i]].tolist() for i in range(count)]


def test_the_metric_is_the_exact_match_rate_of_sampled_responses(val_file, tokenizer, tiny_assets):
    questions, stops = _questions(val_file, tokenizer, tiny_assets)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    rows = pq.read_table(val_file).to_pylist()
    gen, samples = torch.Generator().manual_seed(1), 20_000
    for question, row in zip(questions[:3], rows, strict=False):
        policy = BigramPolicy(len(tokenizer), digits + stops, path=question.prompt_ids[-1:] + question.responses[0])
        p = ExactAnswerEval([question]).per_question(policy).item()
        responses = policy.sample(question.prompt_ids[-1], samples, stops, max_tokens=8, gen=gen)
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        gold = row["reward_model"]["ground_truth"]
        rate = sum(compute_score("tiny_arith", t, gold)["score"] for t in texts) / samples
        # the reward also accepts answers the enumeration leaves out (e.g. "57" then a special token
        # that decoding drops): the rate may exceed p by their mass, never fall below it beyond noise
        noise = 4 * math.sqrt(p * (1 - p) / samples)
        assert p > 0.05
        assert rate >= p - noise
        missed = [
            r
            for r, t in zip(responses, texts, strict=True)
            if compute_score("tiny_arith", t, gold)["score"] == 1.0 and tuple(r) not in question.responses
        ]
        # what it misses is only the documented kinds: the answer's tokens with tokens around them that
        # decode to nothing or to whitespace (a special token, a newline)
        answer = list(question.responses[0][:-1])
        for r in missed:
            assert [t for t in r if tokenizer.decode([t], skip_special_tokens=True).strip()] == answer
        assert rate - len(missed) / samples == pytest.approx(p, abs=noise)


def test_chunked_calls_give_the_one_shot_result(val_file, tokenizer, tiny_assets, monkeypatch):
    questions, stops = _questions(val_file, tokenizer, tiny_assets)
    policy = BigramPolicy(len(tokenizer), stops)
    one_shot = ExactAnswerEval(questions).per_question(policy)
    monkeypatch.setattr(exact_eval, "_CALL_GROUPS", 5)
    chunked_policy = BigramPolicy(len(tokenizer), stops)
    chunked = ExactAnswerEval(questions).per_question(chunked_policy)
    assert chunked_policy.calls == math.ceil(PROBLEMS / 5)
    assert torch.equal(one_shot, chunked)


def test_metrics_are_named_per_source(val_file, tokenizer, tiny_assets):
    questions, _ = _questions(val_file, tokenizer, tiny_assets)
    policy = BigramPolicy(len(tokenizer), [])
    evaluation = ExactAnswerEval(questions)
    metrics = evaluation.metrics(policy)
    assert list(metrics) == ["val-exact/tiny_arith/acc/expected"]
    assert metrics["val-exact/tiny_arith/acc/expected"] == pytest.approx(evaluation.per_question(policy).mean().item())


def test_m_rope_questions_get_four_position_rows(val_file, tokenizer, tiny_assets):
    questions, _ = _questions(val_file, tokenizer, tiny_assets)
    group = ExactAnswerEval(questions[:1], position_rows=(4,)).groups[0]
    row = replay_rows(group, uid="x", global_steps=0, media=None)[0]
    length = row["input_ids"].numel()
    assert row["position_ids"].shape == (4, length)
    assert torch.equal(row["position_ids"][3], torch.arange(length))


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1}, None),
        ({"do_sample": False, "temperature": 1.0}, "do_sample=false"),
        ({"do_sample": True, "top_p": 0.9}, "top_p=0.9"),
        ({"do_sample": True, "top_k": 20}, "top_k=20"),
        ({"do_sample": True, "temperature": 0.0}, "temperature=0"),
    ],
)
def test_only_plain_sampling_has_an_exact_expected_accuracy(kwargs, named):
    why = sampling_is_plain(kwargs)
    assert (why is None) if named is None else (named in why)


@pytest.mark.parametrize(
    "mode, step, exact, due",
    [
        ("every", 10, True, True),
        ("ends", 0, True, True),  # before training
        ("ends", 10, True, False),  # between: the exact metric alone
        ("ends", 60, True, True),  # the last step
        ("ends", 61, True, True),
        ("ends", 10, False, True),  # no exact metric: nothing else would measure step 10
    ],
)
def test_sampled_validation_runs_at_the_ends_only_when_the_exact_metric_covers_the_rest(mode, step, exact, due):
    assert sampled_validation_due(mode, step, 60, exact) is due
