"""The shared generation record and helpers."""

from __future__ import annotations

import pytest

from verl_replay.generation.base import Generation, derive_seed, validate_sampling


def test_generation_record_normalises_and_checks() -> None:
    g = Generation(text="a b", token_ids=[4, 5])
    assert g.token_ids == (4, 5) and g.num_tokens == 2 and g.finish_reason is None and g.logprobs is None
    assert Generation(text="a", token_ids=[1], logprobs=[-0.5]).logprobs == (-0.5,)
    with pytest.raises(ValueError, match="1 logprobs for 2 token ids"):
        Generation(text="a b", token_ids=[1, 2], logprobs=[-0.5])


def test_derive_seed_is_stable_and_in_range() -> None:
    assert derive_seed(3, 1) == derive_seed(3, 1)
    assert derive_seed(3, 1) != derive_seed(3, 2) != derive_seed(4, 2)
    assert all(0 <= derive_seed(s, i) < 2**31 - 1 for s in range(5) for i in range(5))


def test_validate_sampling_accepts_greedy_and_boundaries() -> None:
    validate_sampling(n=1, temperature=0.0, top_p=1.0, max_new_tokens=1)
    with pytest.raises(ValueError, match="n must be"):
        validate_sampling(n=2.5, temperature=1.0, top_p=1.0, max_new_tokens=1)  # type: ignore[arg-type]
