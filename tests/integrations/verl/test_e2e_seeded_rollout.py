"""The seeded agent loop on the recipes' path (vLLM rollout, ``separate_async``): two runs of one
seed sample the same responses at their first step; a run of another seed samples others."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from verl_replay.integrations.verl.seeded_rollout import SEEDED_AGENT_LOOP

# what this file's verl runs take on 2 cores (tests/conftest.py starts the longest first)
E2E_SECONDS = 240

pytestmark = pytest.mark.e2e


def _first_step_rollouts(dump: Path) -> Counter:
    """(prompt, response) of every row verl dumped for global step 1."""
    lines = [json.loads(line) for line in (dump / "1.jsonl").read_text().splitlines() if line.strip()]
    return Counter((line["input"], line["output"]) for line in lines)


def test_runs_of_one_seed_sample_the_same_responses(run_main, tmp_path):
    rollouts = {}
    for name, seed in (("first", 1), ("again", 1), ("other", 2)):
        dump = tmp_path / f"rollouts_{name}"
        run_main(
            "replay.strategy=none",
            "trainer.total_training_steps=1",
            "data.seed=1",  # the same prompts in every run
            f"actor_rollout_ref.rollout.seed={seed}",
            f"actor_rollout_ref.rollout.agent.default_agent_loop={SEEDED_AGENT_LOOP}",
            f"trainer.rollout_data_dir={dump}",
            experiment=name,
        )
        rollouts[name] = _first_step_rollouts(dump)
    assert sum(rollouts["first"].values()) > 0
    assert rollouts["first"] == rollouts["again"]
    # the same prompts with another seed: other responses (the comparison above can fail)
    assert {p for p, _ in rollouts["other"]} == {p for p, _ in rollouts["first"]}
    assert rollouts["other"] != rollouts["first"]
    # a group's responses come from streams of their own, not one response repeated
    by_prompt = defaultdict(set)
    for prompt, response in rollouts["first"]:
        by_prompt[prompt].add(response)
    assert max(len(responses) for responses in by_prompt.values()) > 1
