"""An ``hf`` rollout for verl: token-in/token-out sampling with transformers on CPU.

verl 0.9.1 registers only vLLM, SGLang and TensorRT-LLM rollouts, none of which runs on a CPU.
This backend keeps verl's server architecture: an :class:`HFReplica` launches one
:class:`HFRolloutServer` Ray actor per replica, verl's agent loop sends it token ids through
``LLMServerClient.generate``, and the colocated :class:`HFServerAdapter` (inside each actor
worker) pushes the trainer's weights to it every step, exactly where vLLM's adapter would.

Numerics: the server holds the class verl's actor trains (for Qwen3.5 the vision-language
``Qwen3_5ForConditionalGeneration``; text prompts get M-RoPE positions t = h = w = token index,
as verl's agent loop computes them for the actor), and the returned per-token log-probs are
``log_softmax(logits / temperature)`` of the sampled token, the quantity verl's actor recomputes
as ``old_log_probs``, so rollout-vs-actor log-prob differences only measure the engines' numerics.
Sampling is seeded per request from
``(seed, weight version, prompt ids, occurrence of that prompt)`` so a run is reproducible
whatever order concurrent requests arrive in.

A text response never contains the model's media placeholders (``<|image_pad|>``,
``<|video_pad|>``, ``<|vision_start|>`` ...) nor ids past the tokenizer's vocabulary (the padded
tail of the embedding matrix): verl's agent loop hands every response back to the processor, whose
M-RoPE index reads a placeholder as an image with no grid and fails, and verl then drops the rollout
and pads the batch with a synthetic row. A trained model never samples them; a tiny random one
does, so they are excluded from sampling (:func:`unsampleable_token_ids`). The reported log-probs
stay those of the full distribution, the quantity verl's actor recomputes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Optional, Sequence

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

HF_ROLLOUT_NAME = "hf"
# Requests arriving within this window are generated in one batch.
BATCH_WINDOW_S = 0.02
# verl's RolloutConfig.max_num_seqs default, for configs that do not carry the key
DEFAULT_MAX_NUM_SEQS = 1024
# A model config's placeholder ids for media inside a prompt (Qwen-VL family, Qwen3.5 included):
# a text response must never contain one.
MEDIA_TOKEN_ID_KEYS = (
    "image_token_id",
    "video_token_id",
    "audio_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "vision_token_id",
    "audio_start_token_id",
    "audio_end_token_id",
)


def unsampleable_token_ids(model_config: Any, tokenizer_size: int, logits_size: int) -> list[int]:
    """Ids a text response must not contain: the media placeholders the model config names and
    the ids from the tokenizer's size up to the logits' width (no token behind them)."""
    ids = {int(v) for v in (getattr(model_config, key, None) for key in MEDIA_TOKEN_ID_KEYS) if v is not None}
    ids.update(range(int(tokenizer_size), int(logits_size)))
    return sorted(i for i in ids if 0 <= i < logits_size)


def request_seed(base_seed: int, weight_version: Optional[int], prompt_ids: list[int], occurrence: int) -> int:
    """A 63-bit seed that depends only on what is sampled, not on arrival order or batching."""
    digest = hashlib.sha256(
        f"{base_seed}|{weight_version}|{occurrence}|".encode() + bytes(str(prompt_ids), "ascii")
    ).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k / nucleus set with -inf. ``logits``: ``[B, V]``."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True, dim=-1)  # [B, V]
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        remove_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


class SeededSampler:
    """A logits processor that samples each row with its own generator and records log-probs.

    transformers' sampling draws from one global RNG, so results would depend on which requests
    share a batch. Here the processor draws the token itself and returns a one-hot score, and
    ``generate`` runs greedy decoding over it, which picks exactly that token.
    """

    def __init__(
        self,
        generators: list[torch.Generator],
        temperature: float,
        top_k: int,
        top_p: float,
        banned_ids: Sequence[int] = (),
    ):
        self.generators = generators
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.banned_ids = torch.tensor(sorted(set(banned_ids)), dtype=torch.long)  # never sampled
        self.step_log_probs: list[torch.Tensor] = []  # each [B]

    def _allowed(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill(-1, self.banned_ids, float("-inf")) if len(self.banned_ids) else logits

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores.float()  # [B, V]
        if self.temperature <= 0:
            chosen = self._allowed(logits).argmax(dim=-1)  # [B]
            log_probs = torch.log_softmax(logits, dim=-1)
        else:
            scaled = logits / self.temperature
            log_probs = torch.log_softmax(scaled, dim=-1)  # [B, V], of the full distribution
            probs = torch.softmax(filter_top_k_top_p(self._allowed(scaled), self.top_k, self.top_p), dim=-1)
            chosen = torch.stack(
                [torch.multinomial(probs[row], 1, generator=gen)[0] for row, gen in enumerate(self.generators)]
            )  # [B]
        self.step_log_probs.append(log_probs.gather(-1, chosen[:, None])[:, 0])
        one_hot = torch.full_like(scores, float("-inf"))
        return one_hot.scatter(-1, chosen[:, None], 0.0)


def concurrent_sequences(config: Any) -> int:
    """Rows generated together: verl's ``rollout.max_num_seqs``, which vLLM reads as the most
    sequences it decodes at once. Requests beyond it wait for the next batch, so generation time
    grows with the number of rollouts as it does on a throughput-bound engine."""
    value = getattr(config, "max_num_seqs", None)
    if value is None:
        return DEFAULT_MAX_NUM_SEQS
    if int(value) < 1:
        raise ValueError(
            f"actor_rollout_ref.rollout.max_num_seqs={value}: the hf rollout needs >= 1 sequence per batch"
        )
    return int(value)


@dataclass
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    future: asyncio.Future = field(repr=False)
    # verl's tool agent loop adds its tool parser's stop tokens (sampling_params["stop_token_ids"])
    stop_token_ids: tuple[int, ...] = ()
    # the prompt's images as the model takes them (pixel_values, image_grid_thw, mm_token_type_ids)
    vision: Optional[dict[str, torch.Tensor]] = field(default=None, repr=False)

    @property
    def batch_key(self) -> tuple:
        # A request with images is generated on its own: M-RoPE positions per prompt, no padding.
        return (
            self.temperature,
            self.top_k,
            self.top_p,
            self.max_tokens,
            self.stop_token_ids,
            id(self) if self.vision else 0,
        )


class HFRolloutServer:
    """Ray actor holding a transformers copy of the policy; verl's rollout server interface."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int, max_batch_size: Optional[int] = None) -> None:
        from verl.utils.config import omega_conf_to_dataclass
        from verl.utils.model import get_hf_auto_model_class
        from verl.workers.config import HFModelConfig

        config = omega_conf_to_dataclass(config)
        model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.config = config
        self.replica_rank = replica_rank
        self.max_batch_size = max_batch_size or concurrent_sequences(config)
        self.global_steps: Optional[int] = None
        self.base_seed = int(getattr(config, "seed", 0) or 0) + replica_rank
        override = dict(getattr(model_config, "override_config", {}) or {})
        attn_impl = override.get("attn_implementation", "sdpa")
        # The class verl's actor builds for this checkpoint (Qwen3.5: the vision-language
        # Qwen3_5ForConditionalGeneration, not the text-only class AutoModelForCausalLM picks),
        # so weight names match the actor's and log-probs come from the same modules.
        model_cls = get_hf_auto_model_class(hf_config=model_config.hf_config)
        self.model = model_cls.from_pretrained(
            model_config.local_path, dtype=torch.float32, attn_implementation=attn_impl
        )
        self.model.eval()
        tokenizer = model_config.tokenizer
        self.model_config_tokenizer = tokenizer
        self.model_config_processor = getattr(model_config, "processor", None)
        self.eos_token_ids = self._eos_ids(self.model, tokenizer)
        self.banned_ids = unsampleable_token_ids(
            self.model.config, len(tokenizer), self.model.get_output_embeddings().weight.shape[0]
        )
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self._occurrences: dict[tuple, int] = defaultdict(int)
        self._pending: list[_Request] = []
        self._batcher: Optional[asyncio.Task] = None
        self._generate_lock = asyncio.Lock()

    @staticmethod
    def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
        ids = model.generation_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
            ids.append(tokenizer.eos_token_id)
        if not ids:
            raise ValueError("hf rollout: the model and tokenizer define no eos token id")
        return ids

    # ----------------------------------------------------------------------------- generation

    def _max_tokens(self, prompt_len: int, sampling_params: dict[str, Any]) -> int:
        budget = self.config.prompt_length + self.config.response_length - prompt_len
        requested = sampling_params.pop("max_tokens", sampling_params.pop("max_new_tokens", None))
        limit = self.config.response_length if requested is None else int(requested)
        return max(1, min(limit, budget, self.config.response_length))

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **kwargs: Any
    ) -> TokenOutput:
        if kwargs.get("video_data") or kwargs.get("audio_data"):
            raise ValueError("hf rollout supports text and image prompts (no video or audio)")
        prompt_ids = [int(t) for t in prompt_ids]
        params = dict(sampling_params)
        vision = self._vision_inputs(prompt_ids, kwargs.get("image_data")) if kwargs.get("image_data") else None
        occurrence_key = (self.global_steps, tuple(prompt_ids))
        occurrence = self._occurrences[occurrence_key]
        self._occurrences[occurrence_key] += 1
        top_k = params.get("top_k", -1)
        request = _Request(
            prompt_ids=prompt_ids,
            max_tokens=self._max_tokens(len(prompt_ids), params),
            temperature=float(params.get("temperature", 1.0)),
            top_k=int(top_k) if top_k is not None else -1,
            top_p=float(params.get("top_p", 1.0)),
            seed=request_seed(self.base_seed, self.global_steps, prompt_ids, occurrence),
            future=asyncio.get_running_loop().create_future(),
            stop_token_ids=tuple(sorted({int(t) for t in params.get("stop_token_ids") or []})),
            vision=vision,
        )
        self._pending.append(request)
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._drain())
        token_ids, log_probs = await request.future
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def _vision_inputs(self, prompt_ids: list[int], images: list[Any]) -> dict[str, torch.Tensor]:
        """The image processor's patches of ``images`` for a prompt whose image placeholders verl's
        agent loop has already expanded (one ``<|image_pad|>`` per merged patch)."""
        processor = getattr(self.model_config_processor, "image_processor", None)
        if processor is None:
            raise ValueError("hf rollout: an image prompt needs the checkpoint's processor (none was loaded)")
        features = processor(images=list(images), return_tensors="pt")
        image_token_id = self.model.config.image_token_id
        ids = torch.tensor(prompt_ids)
        merge = int(processor.merge_size) ** 2
        expected = int(features["image_grid_thw"].prod(dim=-1).sum()) // merge
        if int((ids == image_token_id).sum()) != expected:
            raise ValueError(
                f"hf rollout: the prompt has {int((ids == image_token_id).sum())} image tokens, its images "
                f"{expected} merged patches"
            )
        return {
            "pixel_values": features["pixel_values"],
            "image_grid_thw": features["image_grid_thw"],
            "mm_token_type_ids": (ids == image_token_id).to(torch.int64)[None, :],
        }

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(BATCH_WINDOW_S)
            batch, self._pending = self._pending[: self.max_batch_size], self._pending[self.max_batch_size :]
            by_key: dict[tuple, list[_Request]] = defaultdict(list)
            for request in batch:
                by_key[request.batch_key].append(request)
            for requests in by_key.values():
                async with self._generate_lock:
                    try:
                        results = await asyncio.to_thread(self._generate_batch, requests)
                    except Exception as error:  # surface the error on every waiting request
                        for request in requests:
                            if not request.future.done():
                                request.future.set_exception(error)
                        continue
                for request, result in zip(requests, results, strict=True):
                    if not request.future.done():
                        request.future.set_result(result)

    @torch.no_grad()
    def _generate_batch(self, requests: list[_Request]) -> list[tuple[list[int], list[float]]]:
        longest = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((len(requests), longest), self.pad_token_id, dtype=torch.long)  # [B, P]
        attention_mask = torch.zeros_like(input_ids)  # [B, P], left padded
        for row, request in enumerate(requests):
            input_ids[row, longest - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            attention_mask[row, longest - len(request.prompt_ids) :] = 1
        first = requests[0]
        sampler = SeededSampler(
            generators=[torch.Generator().manual_seed(r.seed) for r in requests],
            temperature=first.temperature,
            top_k=first.top_k,
            top_p=first.top_p,
            banned_ids=self.banned_ids,
        )
        from transformers import GenerationConfig, LogitsProcessorList

        stops = self.eos_token_ids + [t for t in first.stop_token_ids if t not in self.eos_token_ids]
        generation_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=first.max_tokens,
            eos_token_id=stops,
            pad_token_id=self.pad_token_id,
        )
        output = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=generation_config,
            logits_processor=LogitsProcessorList([sampler]),
            **(first.vision or {}),  # a request with images is a batch of one (see batch_key)
        )
        generated = output[:, longest:]  # [B, R]
        step_log_probs = torch.stack(sampler.step_log_probs, dim=1)  # [B, R]
        return [self._trim(generated[row], step_log_probs[row], stops) for row in range(len(requests))]

    def _trim(
        self, tokens: torch.Tensor, log_probs: torch.Tensor, stops: Optional[list[int]] = None
    ) -> tuple[list[int], list[float]]:
        """Cut a generated row after its first eos or stop token (kept, as vLLM keeps it)."""
        stops = self.eos_token_ids if stops is None else stops
        token_list = tokens.tolist()
        end = len(token_list)
        for index, token in enumerate(token_list):
            if token in stops:
                end = index + 1
                break
        return token_list[:end], log_probs[:end].tolist()

    # ----------------------------------------------------------------------------- weights

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        tied = {"lm_head.weight"} if self.model.config.get_text_config().tie_word_embeddings else set()
        missing = [name for name in missing if name not in tied]
        if missing or unexpected:
            raise RuntimeError(
                f"hf rollout weight sync does not match the model: missing={missing[:5]} unexpected={unexpected[:5]}"
            )
        if tied:
            self.model.tie_weights()
        return len(state_dict)

    async def set_global_steps(self, global_steps: int) -> None:
        if global_steps != self.global_steps:
            self._occurrences.clear()
        self.global_steps = global_steps

    # ----------------------------------------------------------------------------- lifecycle
    # The CPU copy holds no accelerator memory, so sleep/wake and cache control have nothing to
    # free; they exist because verl's checkpoint manager calls them on every replica.

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        while self._pending or (self._batcher is not None and not self._batcher.done()):
            await asyncio.sleep(BATCH_WINDOW_S)

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        # Requests are short and not resumable; let them finish instead of aborting.
        await self.wait_for_requests_to_drain()
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class HFReplica(RolloutReplica):
    """One transformers rollout server per replica, in its own Ray actor (no accelerator)."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    def _server_name(self) -> str:
        return f"{HF_ROLLOUT_NAME}_server_{self.replica_rank}_0{self.name_suffix}"

    async def launch_servers(self) -> None:
        server_cls = ray.remote(HFRolloutServer)
        server = server_cls.options(
            name=self._server_name(),
            num_cpus=0,
            max_concurrency=self.max_concurrency,
        ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{HF_ROLLOUT_NAME}://replica-{self.replica_rank}"

    async def sleep(self) -> None:
        await asyncio.gather(*[server.sleep.remote() for server in self.servers])


async def _iterate(weights: Iterable | AsyncIterator) -> AsyncIterator:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


class HFServerAdapter(BaseRollout):
    """Lives in each actor worker (hybrid mode); pushes the trainer's weights to its server."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self._has_server = rank % rollout_world_size == 0
        self.server_handle: Optional[ray.actor.ActorHandle] = None

    def _server(self) -> Optional[ray.actor.ActorHandle]:
        if not self._has_server:
            return None
        if self.server_handle is None:
            self.server_handle = ray.get_actor(f"{HF_ROLLOUT_NAME}_server_{self.replica_rank}_0")
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    @torch.no_grad()
    async def update_weights(
        self, weights: Any, global_steps: Optional[int] = None, wire_format: str = "named_tensors", **kwargs: Any
    ) -> None:
        if wire_format != "named_tensors":
            raise ValueError(
                f"hf rollout receives full tensors only (wire_format='named_tensors'), got {wire_format!r}"
            )
        if kwargs.get("peft_config") is not None:
            raise ValueError("hf rollout does not take LoRA adapters; set actor_rollout_ref.model.lora.merge=True")
        state_dict: dict[str, torch.Tensor] = {}
        # Every rank must drain the generator: FSDP all-gathers each tensor collectively.
        async for name, tensor in _iterate(weights):
            state_dict[name] = tensor.detach().to("cpu", dtype=torch.float32, copy=True)
        server = self._server()
        if server is None:
            return
        await server.load_weights.remote(ray.put(state_dict))
        if global_steps is not None:
            await server.set_global_steps.remote(global_steps)
