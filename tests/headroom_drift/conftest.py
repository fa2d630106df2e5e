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
        prompt_ids=torch.randint(0, 50, (int(torch.randint(1, 6, (1,), generator=gen)),),
                                 generator=gen),
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
        random_group=random_group, step_groups=step_groups, SynthScorer=SynthScorer
    )
