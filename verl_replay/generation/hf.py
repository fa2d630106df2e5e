"""transformers ``generate`` backend: CPU tests and small local runs.

Sampling is exactly temperature + top-p (top-k off, no repetition penalty): the model's own
``generation_config`` defaults (e.g. Qwen's top_k=20, repetition_penalty=1.05) are replaced at
load time so that HF and vLLM sample from the same distribution for the same arguments; only
its EOS/BOS/pad token ids are kept. Prompts of a call are split into chunks of at most
``batch_size`` sequences (``prompts_per_chunk * n``), left-padded, and each chunk is sampled
under its own torch seed derived from ``(seed, first prompt index)`` inside a forked RNG, so the
global RNG is untouched and a call is reproducible for the same prompts, seed and batch_size.
(HF ``generate`` draws all rows of a batch from one generator, so a prompt's samples depend on
its chunk-mates; vLLM's per-request seeds do not.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from verl_replay.generation.base import (
    Generation,
    GenerationBackend,
    Prompt,
    derive_seed,
    validate_sampling,
)

__all__ = ["HFBackend"]


class HFBackend(GenerationBackend):
    """``transformers`` generative model in eval mode, no gradients (frozen base model)."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: Any = "float32",
        batch_size: int = 8,
        chat_template_kwargs: dict[str, Any] | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        import torch
        from transformers import AutoTokenizer, GenerationConfig

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

        tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            if tokenizer.eos_token_id is None:
                raise ValueError(f"{self.model_path}: tokenizer has neither a pad nor an eos token")
            tokenizer.pad_token = tokenizer.eos_token  # padding is masked, any id works
        self._tokenizer = tokenizer

        with quiet_transformers():
            model = _load_model(self.model_path, _torch_dtype(dtype), trust_remote_code)
        model.to(self.device)
        model.eval()
        model.requires_grad_(False)
        self.eos_token_ids = _eos_ids(model.generation_config.eos_token_id, tokenizer.eos_token_id)
        if not self.eos_token_ids:
            raise ValueError(f"{self.model_path}: no eos token id in the tokenizer or generation config")
        model.generation_config = GenerationConfig(
            eos_token_id=list(self.eos_token_ids),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=model.generation_config.bos_token_id,
        )
        self.model = model

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

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
        per_chunk = max(1, self.batch_size // (n if temperature > 0 else 1))  # greedy decodes once
        results: list[list[Generation]] = []
        for start in range(0, len(prompt_ids), per_chunk):
            results.extend(
                self._generate_chunk(
                    prompt_ids[start : start + per_chunk],
                    n=n,
                    temperature=temperature,
                    top_p=top_p,
                    max_new_tokens=max_new_tokens,
                    seed=derive_seed(seed, start),
                    logprobs=logprobs,
                )
            )
        return results

    def _generate_chunk(
        self,
        chunk: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
        logprobs: bool,
    ) -> list[list[Generation]]:
        import torch
        from transformers import GenerationConfig

        pad_id = self._tokenizer.pad_token_id
        width = max(len(ids) for ids in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)  # [B, P]
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)  # [B, P]
        for row, ids in enumerate(chunk):  # left padding: the last prompt token is at column P-1
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1

        sampling = temperature > 0
        # Greedy decoding gives n identical completions; HF refuses num_return_sequences > 1
        # without sampling, so decode once and repeat (vLLM returns n identical ones too).
        draws = n if sampling else 1
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            num_return_sequences=draws,
            do_sample=sampling,
            eos_token_id=list(self.eos_token_ids),
            pad_token_id=pad_id,
            return_dict_in_generate=True,
            output_logits=logprobs,
            **({"temperature": temperature, "top_p": top_p, "top_k": 0} if sampling else {}),
        )
        # Fork (save/restore) the RNG of the CPU and of the GPU we sample on, not the caller's.
        fork_devices = []
        if self.device.type == "cuda":
            fork_devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()]
        with torch.random.fork_rng(devices=fork_devices), torch.inference_mode():
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
            )
            completions = out.sequences[:, width:].cpu()  # [B*draws, T]; rows are prompt-major
            chosen_logprobs = _chosen_logprobs(out.logits, completions) if logprobs else None  # [B*draws, T]

        eos = torch.tensor(self.eos_token_ids, dtype=torch.long)
        is_eos = torch.isin(completions, eos)  # [B*draws, T]
        grouped: list[list[Generation]] = [[] for _ in chunk]
        for row in range(completions.shape[0]):
            eos_positions = is_eos[row].nonzero()
            stopped = eos_positions.numel() > 0
            # Everything after the first EOS is padding added by generate.
            length = int(eos_positions[0]) + 1 if stopped else completions.shape[1]
            ids = tuple(int(t) for t in completions[row, :length])
            generation = Generation(
                text=self._tokenizer.decode(list(ids), skip_special_tokens=True),
                token_ids=ids,
                finish_reason="stop" if stopped else "length",
                logprobs=None if chosen_logprobs is None else tuple(float(x) for x in chosen_logprobs[row, :length]),
            )
            grouped[row // draws].extend([generation] * (n // draws))
        return grouped


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own output off while a model loads: its weight-loading bar, and warnings such
    as Qwen3.5's "fast path is not available" (this backend runs the torch kernels on purpose: it
    is the CPU / test path; GPU runs generate with vLLM). Errors still show."""
    from transformers.utils import logging as hf_logging

    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def _load_model(model_path: str, dtype: Any, trust_remote_code: bool) -> Any:
    """The checkpoint's own class (``config.architectures[0]``) when transformers has it, else
    ``AutoModelForCausalLM``. A vision-language checkpoint such as Qwen3.5-4B is a
    ``...ForConditionalGeneration``; ``AutoModelForCausalLM`` would build a text-only class with
    other module names, not the model verl trains and vLLM serves."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    architectures = getattr(config, "architectures", None) or []
    model_cls = getattr(transformers, architectures[0], None) if architectures else None
    if model_cls is None or not hasattr(model_cls, "generate"):
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
    return model_cls.from_pretrained(model_path, dtype=dtype)


def _chosen_logprobs(step_logits: Sequence[Any], tokens: Any) -> Any:
    """log softmax of the raw logits at the chosen tokens: [R, T] from T tensors of [R, V]."""
    import torch

    columns = []
    for t, logits in enumerate(step_logits):
        logp = torch.log_softmax(logits.float().cpu(), dim=-1)  # [R, V]
        columns.append(logp.gather(1, tokens[:, t : t + 1]).squeeze(1))  # [R]
    return torch.stack(columns, dim=1)  # [R, T]


def _eos_ids(config_eos: Any, tokenizer_eos: int | None) -> tuple[int, ...]:
    ids: list[int] = []
    for value in ([config_eos] if isinstance(config_eos, int) else list(config_eos or [])) + [tokenizer_eos]:
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16', 'float16' or 'auto'")
    return value
