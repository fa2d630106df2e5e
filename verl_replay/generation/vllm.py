"""vLLM offline-engine backend (GPU recipes: archive search and evaluation), written against vLLM 0.24's public API:
``vllm.LLM``, ``LLM.generate(prompts, sampling_params, use_tqdm=...)``, ``vllm.SamplingParams``,
``LLM.get_tokenizer()`` and ``RequestOutput.outputs[i]`` (``text``, ``token_ids``, ``logprobs``,
``finish_reason``).

vLLM is imported inside :class:`VLLMBackend` only, so this module imports on machines without it.
Everything that decides *what* vLLM is asked (engine arguments, the request plan with seeds,
sampling arguments, conversion of outputs) is a pure function tested on CPU.

Seeding: each of the ``n`` samples of each prompt is its own request (``SamplingParams(n=1)``)
with a per-request seed derived from ``(seed, prompt index, sample index)``. A prompt's samples
therefore do not depend on which other prompts share the call, on scheduling, or on how a vLLM
version fans out ``n > 1``.

Prefix caching: the ``n`` requests of a prompt share its whole prompt, which vLLM's automatic
prefix caching would prefill once. vLLM 0.24 enables it by default only for pure-attention
models; for hybrid models such as Qwen3.5 (Gated DeltaNet + full attention) it is experimental
and off by default (``ModelConfig.is_prefix_caching_supported``), and verl's Qwen3.5 examples
turn it off for the rollout as well. This backend keeps vLLM's default, so with Qwen3.5 every
request prefills its prompt: ``n`` times the prefill work of one. Pass
``engine_extra={"enable_prefix_caching": True}`` to opt in to vLLM's experimental hybrid cache.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

from verl_replay.generation.base import (
    Generation,
    GenerationBackend,
    Prompt,
    derive_seed,
    validate_sampling,
)

__all__ = [
    "BackendUnavailableError",
    "VLLMBackend",
    "completion_to_generation",
    "engine_kwargs",
    "plan_requests",
    "sampling_params_kwargs",
    "vllm_available",
]

VLLM_INSTALL_HINT = (
    "vLLM is not installed in this environment. Install the GPU extra "
    "(pip install 'verl-replay[gpu]', which pins vllm==0.24.0) on a CUDA machine, "
    "or use the transformers backend (backend='hf') on CPU."
)


class BackendUnavailableError(ImportError):
    """The requested generation backend's library is not installed."""


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def engine_kwargs(
    model_path: str,
    *,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    seed: int = 0,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    enforce_eager: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(...)``; ``extra`` adds or overrides engine arguments."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    kwargs: dict[str, Any] = {
        "model": str(model_path),
        "tokenizer": str(model_path),
        "tensor_parallel_size": tensor_parallel_size,
        "gpu_memory_utilization": gpu_memory_utilization,
        "seed": seed,
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "enforce_eager": enforce_eager,
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    kwargs.update(extra or {})
    return kwargs


def plan_requests(num_prompts: int, n: int, seed: int) -> list[tuple[int, int, int]]:
    """``(prompt index, sample index, request seed)`` for every request, prompt-major."""
    return [(p, s, derive_seed(seed, p, s)) for p in range(num_prompts) for s in range(n)]


def sampling_params_kwargs(
    *, temperature: float, top_p: float, max_new_tokens: int, seed: int, logprobs: bool = False
) -> dict[str, Any]:
    """Keyword arguments for one request's ``vllm.SamplingParams`` (always ``n=1``).

    ``temperature == 0`` is greedy in vLLM; top-p is then irrelevant and set to 1. top-k is left
    at vLLM's default (disabled). ``logprobs=0`` asks for the chosen token's log-prob only.
    """
    validate_sampling(n=1, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": float(temperature),
        "top_p": float(top_p) if temperature > 0 else 1.0,
        "max_tokens": int(max_new_tokens),
        "seed": int(seed),
        "skip_special_tokens": True,
    }
    if logprobs:
        kwargs["logprobs"] = 0
    return kwargs


def completion_to_generation(completion: Any, *, logprobs: bool = False) -> Generation:
    """Convert one ``vllm.CompletionOutput`` into a :class:`Generation`.

    ``completion.logprobs`` holds, per generated position, a mapping token id -> object with a
    ``.logprob`` (vLLM's ``Logprob``); only the chosen token's entry is read.
    """
    token_ids = tuple(int(t) for t in completion.token_ids)
    chosen: tuple[float, ...] | None = None
    if logprobs:
        entries = completion.logprobs
        if entries is None or len(entries) != len(token_ids):
            raise ValueError("vLLM returned no per-token logprobs although they were requested")
        chosen = tuple(float(entries[i][token].logprob) for i, token in enumerate(token_ids))
    reason = completion.finish_reason
    return Generation(
        text=completion.text,
        token_ids=token_ids,
        finish_reason=str(reason),  # "stop" (EOS / stop token) or "length"; anything else verbatim
        logprobs=chosen,
    )


class VLLMBackend(GenerationBackend):
    """``vllm.LLM`` offline engine holding the frozen base model."""

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        seed: int = 0,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        enforce_eager: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        engine_extra: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            import vllm
        except ImportError as err:
            raise BackendUnavailableError(VLLM_INSTALL_HINT) from err
        self._vllm = vllm
        self.model_path = str(model_path)
        self._max_model_len = max_model_len
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._llm = vllm.LLM(
            **engine_kwargs(
                self.model_path,
                tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                seed=seed,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                enforce_eager=enforce_eager,
                extra=engine_extra,
            )
        )

    @property
    def tokenizer(self) -> Any:
        return self._llm.get_tokenizer()

    @property
    def max_model_len(self) -> int | None:
        """The engine's context length: the one asked for, else what vLLM derived from the model."""
        if self._max_model_len is not None:
            return int(self._max_model_len)
        config = getattr(getattr(self._llm, "llm_engine", None), "model_config", None)
        value = getattr(config, "max_model_len", None)
        return int(value) if value else None

    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        seed: int = 0,
        logprobs: bool = False,
    ) -> list[list[Generation]]:
        validate_sampling(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
        prompt_ids = self.encode(prompts)
        plan = plan_requests(len(prompt_ids), n, seed)
        requests = [{"prompt_token_ids": prompt_ids[p]} for p, _, _ in plan]
        params = [
            self._vllm.SamplingParams(
                **sampling_params_kwargs(
                    temperature=temperature,
                    top_p=top_p,
                    max_new_tokens=max_new_tokens,
                    seed=request_seed,
                    logprobs=logprobs,
                )
            )
            for _, _, request_seed in plan
        ]
        outputs = self._llm.generate(requests, sampling_params=params, use_tqdm=False)
        if len(outputs) != len(plan):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(plan)} requests")
        results: list[list[Generation]] = [[] for _ in prompt_ids]
        for (prompt_index, _, _), output in zip(plan, outputs, strict=True):  # outputs follow request order
            results[prompt_index].append(completion_to_generation(output.outputs[0], logprobs=logprobs))
        return results
