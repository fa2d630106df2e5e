"""The exact held-out metric on the recipes' path (vLLM rollout, ``separate_async``), checked
against two independent sources: a plain transformers forward of the same weights, and the
sampled accuracy verl's own validation measures on the same questions.

The validation set is the tiny math model's own questions, relabelled as an exact-answer source
whose one right response is ``\\boxed{n}`` (what the model was warm-started to write), so the right
answer has a probability far from 0. The learning rate is 0: the actor that scores and the rollout
that samples hold the same weights, the starting ones.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from verl_replay.rewards import is_exact_answer_source

# what this file's verl run takes on 2 cores (tests/conftest.py starts the longest first)
E2E_SECONDS = 165
SAMPLES = 16  # validation responses per question

pytestmark = pytest.mark.e2e


def _exact_answer_rows(tiny_assets) -> list[dict]:
    rows = pq.read_table(str(tiny_assets.math_val)).to_pylist()
    assert is_exact_answer_source("tiny_arith")
    return [
        {**row, "data_source": "tiny_arith", "reward_model": {"style": "rule", "ground_truth": f"\\boxed{{{gold}}}"}}
        for row, gold in ((row, row["reward_model"]["ground_truth"]) for row in rows)
    ]


def _transformers_reference(tiny_assets, rows: list[dict]) -> list[float]:
    """Per question, P(right answer, then eos or pad) under the starting weights at temperature 1,
    from an unpacked transformers forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_assets.tokenizer))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets.model_dir), torch_dtype=torch.float32).eval()
    per_question = []
    for row in rows:
        total = 0.0
        prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        answer = tok.encode(row["reward_model"]["ground_truth"], add_special_tokens=False)
        for stop in (tok.eos_token_id, tok.pad_token_id):
            ids = torch.tensor([prompt + answer + [stop]])  # [1, T]
            with torch.no_grad():
                log_probs = model(ids).logits[0, :-1].float().log_softmax(-1)  # [T-1, V]
            targets = ids[0, 1:]
            picked = log_probs[torch.arange(targets.numel()), targets][len(prompt) - 1 :]  # [answer + 1]
            total += picked.sum().exp().item()
        per_question.append(total)
    return per_question


def test_the_exact_metric_matches_a_plain_forward_and_the_sampled_accuracy(run_main, tiny_assets, tmp_path):
    rows = _exact_answer_rows(tiny_assets)
    val_file = tmp_path / "exact_val.parquet"
    pq.write_table(pa.Table.from_pylist(rows), val_file)
    run = run_main(
        "replay.strategy=none",
        f"data.val_files={val_file}",
        "exact_eval=true",
        "actor_rollout_ref.actor.optim.lr=0",
        "trainer.total_training_steps=2",
        "trainer.test_freq=1",
        "sampled_val=ends",  # step 1: the exact metric alone; step 2 (the last): both
        f"actor_rollout_ref.rollout.val_kwargs.n={SAMPLES}",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        experiment="exact",
    )
    validated = [m for m in run.metrics if "val-exact/tiny_arith/acc/expected" in m]
    assert len(validated) == 2, [sorted(k for k in m if k.startswith("val")) for m in run.metrics]
    between, metrics = validated
    assert not any(k.startswith(("val-core/", "val-aux/")) for k in between)  # sampled only at the ends
    exact = metrics["val-exact/tiny_arith/acc/expected"]
    assert between["val-exact/tiny_arith/acc/expected"] == pytest.approx(exact, rel=1e-5)  # lr 0: the same weights
    sampled = metrics[f"val-core/tiny_arith/acc/mean@{SAMPLES}"]
    per_question = _transformers_reference(tiny_assets, rows)
    reference = sum(per_question) / len(rows)
    assert reference > 0.05  # the checks below have something to see
    # the same weights through verl's packed forward and through an unpacked transformers forward
    assert exact == pytest.approx(reference, rel=1e-3, abs=1e-5)
    # verl's sampled accuracy estimates the same number: within 4 of its standard errors
    noise = 4 * math.sqrt(sum(p * (1 - p) for p in per_question) / SAMPLES) / len(rows)
    assert abs(sampled - exact) < noise, (sampled, exact, noise)
    assert 0 < metrics["timing_s/exact_eval"] < 60
