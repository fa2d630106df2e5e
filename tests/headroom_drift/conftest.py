"""Synthetic GRPO groups and deterministic scorers for the Headroom-Drift tests."""

from __future__ import annotations

import types

import pytest
import torch

from verl_replay.headroom_drift.buffer import ReplayGroup


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    # The buffer runs many tiny tensor ops; on a shared 2-core box intra-op threads only add
    # wake-up latency. Restored after each module so other test directories are unaffected.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def random_group(gen: torch.Generator, *, max_n: int = 5, max_len: int = 7) -> ReplayGroup:
    """A small random group: ragged responses (some may be empty), masked tool tokens,
    advantages with exact zeros, and correctness bits that usually (not always) disagree."""
    n = int(torch.randint(2, max_n + 1, (1,), generator=gen))
    lengths = torch.randint(0, max_len + 1, (n,), generator=gen)
    L = int(lengths.sum())
    choices = torch.tensor([-1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0])
    adv = choices[torch.randint(0, len(choices), (n,), generator=gen)]
    return ReplayGroup(
        prompt_ids=torch.randint(0, 50, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen),
        response_ids=torch.randint(0, 100, (L,), generator=gen),
        response_lengths=lengths,
        response_mask=torch.rand(L, generator=gen) > 0.15,
        gen_log_probs=-3.0 * torch.rand(L, generator=gen),
        advantages=adv,
        correct=torch.rand(n, generator=gen) > 0.5,
        scores=torch.rand(n, generator=gen),
        meta={"uid": f"u{int(torch.randint(0, 10**6, (1,), generator=gen))}"},
    )


def step_groups(seed: int, step: int, count: int, pool: int = 12) -> list[ReplayGroup]:
    """The fresh groups of ``step``: a pure function of (seed, step), so two runs that are fed
    the same steps see identical data in separate objects. Contents are drawn from a small
    per-seed pool, so identical groups (equal Headroom) recur within and across steps and the
    tie-break rule (newer birth step, then insertion order) is exercised."""
    pick = torch.Generator().manual_seed(seed * 100_003 + step)
    keys = torch.randint(0, pool, (count,), generator=pick).tolist()
    return [random_group(torch.Generator().manual_seed(seed * 1_009 + k)) for k in keys]


def verl_like_meta(k: int) -> dict:
    """What rows_to_group stores for a math group: dataset fields shared, reward info per row."""
    problem = f"Let x be the number {k} plus the sum of the first {k % 17} primes. Find x mod 7."
    messages = [
        {
            "role": "user",
            "content": problem + "\nPlease reason step by step, and put your final answer within \\boxed{}.",
        }
    ]
    return {
        "shared": {
            "data_source": "math_dapo",
            "prompt": messages,
            "raw_prompt": messages,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(k % 7)},
            "extra_info": {
                "split": "train",
                "index": k,
                "question_id": f"train-{k}",
                "benchmark": "train",
                "question": problem,
            },
            "dummy_tensor": torch.tensor([0], dtype=torch.uint8),
            "index": k,
            "tools_kwargs": {},
            "interaction_kwargs": {},
            "num_turns": 2,
            "multi_modal_inputs": {},
        },
        "per_row": [
            {
                "metrics": {
                    "generate_sequences": 0.25 + s,
                    "tool_calls": 0.0,
                    "compute_score": 1e-3 * s,
                    "num_preempted": -1,
                },
                "extra_fields": {
                    "turn_scores": [],
                    "tool_rewards": [],
                    "reward_extra_info": {
                        "score": float(s % 2),
                        "acc": float(s % 2),
                        "reason": "match" if s % 2 else "mismatch",
                    },
                },
            }
            for s in range(8)
        ],
        "source_uid": f"uid-{k:06d}",
    }


class SynthScorer:
    """Deterministic "current policy": l_gen + noise whose scale depends on (group_id, step).

    A group's output depends only on itself and the step (not on its chunk), so chunked and
    one-by-one scans must agree exactly. Records every call's chunk size.
    """

    def __init__(self, step: int, max_scale: float = 0.6):
        self.step = step
        self.max_scale = max_scale
        self.calls: list[list[int]] = []

    def one(self, g: ReplayGroup) -> torch.Tensor:
        gen = torch.Generator().manual_seed(g.group_id * 1_000_003 + self.step)
        scale = self.max_scale * ((g.group_id * 7919 + self.step * 104_729) % 13) / 12.0
        noise = torch.randn(g.num_tokens, generator=gen)
        return (g.gen_log_probs + scale * noise).clamp(max=0.0)

    def __call__(self, groups: list[ReplayGroup]) -> list[torch.Tensor]:
        self.calls.append([g.group_id for g in groups])
        return [self.one(g) for g in groups]


@pytest.fixture(scope="session")
def synth() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        random_group=random_group,
        step_groups=step_groups,
        SynthScorer=SynthScorer,
        verl_like_meta=verl_like_meta,
    )
