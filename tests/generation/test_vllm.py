"""VLLMBackend: what is testable without vLLM (import, factory error, argument translation),
plus the backend's glue driven by a stand-in ``vllm`` module that records what it is asked."""

from __future__ import annotations

import hashlib
import sys
import types
from types import SimpleNamespace

import pytest

import verl_replay.generation.vllm as vmod
from verl_replay.generation import make_backend
from verl_replay.generation.base import Generation, derive_seed
from verl_replay.generation.vllm import (
    BackendUnavailableError,
    VLLMBackend,
    completion_to_generation,
    engine_kwargs,
    plan_requests,
    sampling_params_kwargs,
)


def test_module_imports_without_vllm(tmp_path) -> None:
    """Importing the backend module must not import vllm: in a fresh interpreter where a ``vllm``
    package is importable (a stand-in that records being imported), it stays unimported."""
    import subprocess

    stand_in = tmp_path / "vllm"
    stand_in.mkdir()
    (stand_in / "__init__.py").write_text("import os\nopen(os.environ['VLLM_IMPORTED'], 'w').close()\n")
    marker = tmp_path / "imported"
    code = "import sys, verl_replay.generation.vllm as m, verl_replay.generation as g; print('vllm' in sys.modules)"
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path), "VLLM_IMPORTED": str(marker)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False" and not marker.exists(), out.stdout + out.stderr
    assert issubclass(BackendUnavailableError, ImportError)


def test_factory_explains_missing_vllm(monkeypatch) -> None:
    monkeypatch.setattr(vmod, "vllm_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'verl-replay\[gpu\]'.*backend='hf'"):
        make_backend("vllm", model_path="/models/x")
    with pytest.raises(ValueError, match=r"unknown generation backend 'sglang'.*'hf'.*'vllm'"):
        make_backend("sglang", model_path="/models/x")


def test_constructor_explains_missing_vllm(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(BackendUnavailableError, match="vLLM is not installed"):
        VLLMBackend("/models/x")


def test_engine_kwargs() -> None:
    kwargs = engine_kwargs(
        "/models/qwen", tensor_parallel_size=2, gpu_memory_utilization=0.6, max_model_len=4096, seed=7
    )
    assert kwargs == {
        "model": "/models/qwen",
        "tokenizer": "/models/qwen",
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.6,
        "seed": 7,
        "dtype": "auto",
        "trust_remote_code": False,
        "enforce_eager": False,
        "max_model_len": 4096,
    }
    assert "max_model_len" not in engine_kwargs("/m")
    assert engine_kwargs("/m", extra={"enable_prefix_caching": True, "dtype": "bfloat16"})["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine_kwargs("/m", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        engine_kwargs("/m", tensor_parallel_size=0)


def test_plan_requests_and_seeds() -> None:
    plan = plan_requests(num_prompts=2, n=3, seed=5)
    assert [(p, s) for p, s, _ in plan] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    digest = hashlib.blake2b(b"5:1:2", digest_size=8).digest()
    assert plan[-1][2] == int.from_bytes(digest, "big") % (2**31 - 1) == derive_seed(5, 1, 2)
    assert len({seed for _, _, seed in plan}) == 6
    # A prompt's seeds do not depend on how many prompts share the call.
    assert plan_requests(num_prompts=1, n=3, seed=5) == plan[:3]
    assert plan_requests(num_prompts=2, n=3, seed=6) != plan


def test_sampling_params_kwargs() -> None:
    sampled = sampling_params_kwargs(temperature=0.8, top_p=0.95, max_new_tokens=64, seed=3)
    assert sampled == {
        "n": 1,
        "temperature": 0.8,
        "top_p": 0.95,
        "max_tokens": 64,
        "seed": 3,
        "skip_special_tokens": True,
    }
    greedy = sampling_params_kwargs(temperature=0.0, top_p=0.5, max_new_tokens=8, seed=0, logprobs=True)
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0 and greedy["logprobs"] == 0
    with pytest.raises(ValueError, match="top_p"):
        sampling_params_kwargs(temperature=1.0, top_p=0.0, max_new_tokens=8, seed=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampling_params_kwargs(temperature=1.0, top_p=1.0, max_new_tokens=0, seed=0)


def _lp(value: float) -> SimpleNamespace:
    return SimpleNamespace(logprob=value)


def test_completion_to_generation() -> None:
    completion = SimpleNamespace(
        text="hello",
        token_ids=[5, 9, 2],
        finish_reason="stop",
        logprobs=[{5: _lp(-0.5), 7: _lp(-1.0)}, {9: _lp(-0.25)}, {2: _lp(-2.0)}],
    )
    assert completion_to_generation(completion, logprobs=True) == Generation(
        text="hello", token_ids=(5, 9, 2), finish_reason="stop", logprobs=(-0.5, -0.25, -2.0)
    )
    truncated = SimpleNamespace(text="x", token_ids=(1,), finish_reason="length", logprobs=None)
    assert completion_to_generation(truncated) == Generation(text="x", token_ids=(1,), finish_reason="length")
    with pytest.raises(ValueError, match="no per-token logprobs"):
        completion_to_generation(truncated, logprobs=True)


class _StandInLLM:
    """Records the engine arguments and answers each request from its prompt and seed."""

    instances: list[_StandInLLM] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.requests: list = []
        self.params: list = []
        self._tokenizer = kwargs.pop("_tokenizer")
        _StandInLLM.instances.append(self)

    def get_tokenizer(self):
        return self._tokenizer

    def generate(self, requests, sampling_params=None, use_tqdm=True):
        self.requests.append(requests)
        self.params.append(sampling_params)
        outputs = []
        for request, params in zip(requests, sampling_params, strict=True):
            ids = [len(request["prompt_token_ids"]), params.kwargs["seed"] % 97, 2]
            completion = SimpleNamespace(
                text=f"len={ids[0]} seed={ids[1]}", token_ids=ids, finish_reason="stop", logprobs=None
            )
            outputs.append(SimpleNamespace(outputs=[completion]))
        return outputs


class _StandInSamplingParams:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


def test_backend_glue_with_stand_in_vllm(monkeypatch, tokenizer_factory) -> None:
    tokenizer = tokenizer_factory()
    fake = types.ModuleType("vllm")
    fake.LLM = lambda **kw: _StandInLLM(_tokenizer=tokenizer, **kw)
    fake.SamplingParams = _StandInSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", fake)
    backend = VLLMBackend("/models/q", tensor_parallel_size=2, max_model_len=512, seed=1)
    llm = _StandInLLM.instances[-1]
    assert llm.kwargs["tensor_parallel_size"] == 2 and llm.kwargs["max_model_len"] == 512

    chat = [{"role": "user", "content": "count the rows"}]
    out = backend.generate(["the cat", chat], n=2, temperature=0.7, top_p=0.9, max_new_tokens=16, seed=4)
    [requests] = llm.requests
    [params] = llm.params
    prompt_ids = backend.encode(["the cat", chat])
    assert requests == [{"prompt_token_ids": prompt_ids[p]} for p in (0, 0, 1, 1)]
    assert [p.kwargs["seed"] for p in params] == [seed for _, _, seed in plan_requests(2, 2, 4)]
    assert all(p.kwargs["n"] == 1 and p.kwargs["max_tokens"] == 16 and p.kwargs["top_p"] == 0.9 for p in params)
    assert [len(samples) for samples in out] == [2, 2]
    assert [g.token_ids[0] for g in out[0]] == [len(prompt_ids[0])] * 2  # grouped by prompt
    assert [g.token_ids[0] for g in out[1]] == [len(prompt_ids[1])] * 2
    assert out[0][0].token_ids != out[0][1].token_ids  # different per-request seeds
