"""EliteReplay through verl's real GRPO loop on CPU, with an archive built by the search command.

The archive comes from ``python -m verl_replay.elite.search`` on the tiny SQL dataset with the
frozen tiny SQL model. Training with ``replay.strategy=elite`` records, from inside the real actor
update, each micro-batch's replay term; the first optimiser step runs on the initial weights, so
its per-response NLL is checked against a separate forward pass of the same model.
"""

from __future__ import annotations

import math

import pytest
import torch

# what this file's verl runs take on 2 cores (tests/conftest.py starts the longest first)
E2E_SECONDS = 115

pytestmark = pytest.mark.e2e


def test_elite_replay_end_to_end(run_main, tiny_archive, tiny_assets, tmp_path):
    from transformers import AutoModelForCausalLM

    audit = tmp_path / "audit"
    mu = 0.05
    run = run_main(
        "tiny_task=sql", "replay.strategy=elite", f"replay.elite.archive={tiny_archive}",
        "replay.elite.batch_size=4", f"replay.elite.mu={mu}", "trainer.total_training_steps=4",
        f"replay.audit_dir={audit}", experiment="elite",
    )
    metrics = run.metrics
    assert len(metrics) == 4
    for step in metrics:
        for key in ("replay/elite/nll", "replay/elite/token_share", "actor/pg_loss", "actor/grad_norm"):
            assert math.isfinite(step[key]), (key, step)
        assert step["replay/elite/examples"] == 4
        assert step["replay/elite/question_spread"] <= 1 and step["replay/elite/cell_spread"] <= 1
        assert step["replay/elite/nll"] > 0

    records = [torch.load(path) for path in sorted(audit.glob("*.pt"))]
    elite_records = [r for r in records if "elite_row_nll" in r]
    assert elite_records
    model = AutoModelForCausalLM.from_pretrained(tiny_assets.sql_model_dir).eval()
    by_step: dict[int, list[dict]] = {}
    for record in elite_records:
        by_step.setdefault(record["replay_optimizer_step"], []).append(record)
        # the loss the update backpropagated is exactly the mixed loss of its two terms
        torch.testing.assert_close(
            torch.tensor(record["loss"]), torch.tensor((1 - mu) * record["grpo_loss"] + mu * record["replay_term"])
        )
        torch.testing.assert_close(
            torch.tensor(record["replay_term"]),
            record["elite_row_nll"].sum() * record["dp_size"] / record["elite_rows_global"],
        )
    for step, step_records in by_step.items():
        # the normaliser is the number of elite responses of the whole mini-batch
        assert sum(len(r["elite_row_nll"]) for r in step_records) == step_records[0]["elite_rows_global"]
    # Optimiser step 0 runs on the initial weights: recompute its elite NLL independently.
    checked = 0
    for record in by_step[0]:
        elite_rows = (record["replay_source"] == 2).nonzero().flatten().tolist()
        for position, row in enumerate(elite_rows):
            valid = int(record["response_mask"][row].sum())
            response = record["responses"][row][:valid]
            prompt = record["prompts"][row]
            with torch.no_grad():
                logits = model(torch.cat([prompt, response])[None]).logits[0, prompt.numel() - 1 : -1].float()
            nll = -torch.log_softmax(logits, dim=-1).gather(-1, response[:, None]).mean()
            torch.testing.assert_close(record["elite_row_nll"][position], nll, rtol=1e-4, atol=1e-5)
            checked += 1
    assert checked > 0


def test_archive_mismatch_fails_at_start_up(run_main, tiny_archive, tmp_path):
    # training on the math data with an archive built from the SQL data
    run = run_main("tiny_task=math", "replay.strategy=elite", f"replay.elite.archive={tiny_archive}",
                   experiment="mismatch", check=False, timeout=600)
    assert run.returncode != 0
    assert "was built from" in run.output and "build the archive from the training parquet" in run.output
