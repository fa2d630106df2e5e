"""Per-GPU memory budget of a GRPO run: training GPUs (FSDP2) and rollout GPUs (vLLM).

Everything is computed from two inputs, never typed in: the model's shape (its ``config.json``,
:meth:`ModelShape.from_hf_config`) and the run's sizes (:class:`RunSizes`, which
``verl_replay.integrations.verl.preflight`` fills from the composed training config). The
result is a list of rows (what, GiB, how it was computed) for one training GPU, per pass, and one
rollout GPU, printed by the preflight and, for the recipes' defaults, in ``recipes/README.md``.
The limit is the GPU's usable memory (what CUDA reports, e.g. ~79.3 GiB on an A100 80GB, not 80).

Counting rules (bytes; ``P`` parameters, ``P_t`` / ``P_v`` text / vision parameters, ``dp``
training GPUs, ``T`` tokens of one micro-batch, ``V`` vocabulary, ``H`` hidden size, ``I`` MLP size,
``L`` layers), following verl 0.9.1's FSDP engine (``verl/workers/engine/fsdp/transformer_impl.py``):

- Resident on a training GPU: fp32 master parameters (``4P/dp``), fp32 gradients and AdamW's two
  fp32 moments (``12P/dp``), all sharded over ``dp`` ranks (0 on the GPU when offloaded). The
  vision tower counts too: verl's Qwen3.5 forward runs it on a dummy image every step and
  ``freeze_vision_tower`` is read nowhere, so its parameters get (zero) gradients and AdamW
  state. A layer is all-gathered in bf16 for compute, the next one prefetched: ``2 x 2 x``
  (largest layer); the embedding (tied LM head) stays gathered: ``2VH``. Training rank 0 sends
  the weights to the rollout GPUs (``checkpoint_engine.backend=nccl``) through two buckets of
  ``update_weights_bucket_megabytes`` allocated from cupy, whose memory pool keeps them after
  the push. A fixed 3 GiB covers the CUDA context, NCCL buffers and allocator slack (an
  assumption).
- Three passes, each on top of the resident state, never at once: the **update** (one training
  micro-batch of ``ppo_max_token_len_per_gpu`` tokens, forward + backward), the **log-prob** pass
  (old log-probs and entropy of ``log_prob_max_token_len_per_gpu`` tokens, no gradients) and
  Headroom-Drift's **scan** (the same micro-batches, no entropy).
- Logits are materialised in bf16 for the whole micro-batch: ``2TV`` (``2TV`` more for the
  temperature-scaled copy when the temperature is not 1). Packed (``use_remove_padding``, flash
  attention): flash-attn's Triton cross-entropy writes the logits' gradient in place, and the
  entropy runs in chunks upcast to fp32 (``3 x 4 x chunk x V``: the chunk, its softmax, the
  product). Padded (sdpa): verl computes the entropy on the whole padded logits
  (``entropy_from_logits``, its chunking setting is not read on this path): a softmax and a
  logsumexp / product temporary, ``4TV``; then it cuts the rows out of the padded logits into a
  new ``2TV`` tensor (after the entropy's temporaries are gone). A padded micro-batch holds
  rows x its longest row: the budget assumes rows of one length (responses at the cap), so mixed
  lengths need more. Without flash-attn verl's row-wise ``log_softmax`` keeps its outputs for
  backward and the gradient is a new tensor: ``4TV`` more in the update.
- Activations, bf16: with gradient checkpointing each layer keeps its input, ``2TH x L``, and
  the layer being recomputed holds ``(6H + 4I) x 2T`` plus as much again for its gradients;
  without checkpointing every layer holds ``(6H + 4I) x 2T``. A forward without gradients holds
  one layer's ``(6H + 4I) x 2T`` at a time (counted as if at once with the logits).
- vLLM (per rollout GPU, tensor parallel ``tp``): bf16 weights ``2P/tp``; a profiling peak of
  ``max_num_batched_tokens x (2H + 2I) x 2`` activations plus fp32 logits of ``max_num_seqs``
  sequences; the rest of ``gpu_memory_utilization x GPU`` is KV cache. Full-attention layers
  store ``2 x kv_heads x head_dim x 2`` bytes per token and layer; linear-attention layers a
  fixed recurrent + convolution state per sequence. A weight push adds two receive buckets
  outside vLLM's share.

These are estimates of the large terms (they ignore, e.g., the optimizer's temporary buffers and
fragmentation beyond the fixed reserve); the preflight compares the peak with the GPUs it sees
(or the recipes' A100 80GB) and wants ``MEMORY_MARGIN`` of it free. The module imports only the
standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_GPU",
    "GPU_MEMORY_GIB",
    "MEMORY_MARGIN",
    "QWEN3_5_4B_CONFIG",
    "BudgetRow",
    "MemoryBudget",
    "ModelShape",
    "RunSizes",
    "estimate",
    "fit_token_limit",
    "format_markdown",
]

GIB = 1024**3
CUDA_RESERVE_BYTES = 3 * GIB
# Usable memory of the GPUs the recipes name, as CUDA reports it (torch.cuda.get_device_properties
# total_memory): an A100 80GB shows ~79.3 GiB. The preflight reads the real value from the GPUs it
# sees; this table is for the docs and for machines without a GPU.
GPU_MEMORY_GIB: dict[str, float] = {"A100-80GB": 79.3}
DEFAULT_GPU = "A100-80GB"
# The share of a GPU's usable memory the recipes' defaults leave free at the peak pass (the
# preflight warns above 1 - MEMORY_MARGIN of it and fails above all of it).
MEMORY_MARGIN = 0.10

# Qwen3.5-4B as published (the text and vision shapes of its config.json): used when the model
# folder is not at hand (e.g. for the table in recipes/README.md). A model folder's own
# config.json always wins.
QWEN3_5_4B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": 2560,
        "intermediate_size": 9216,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "attn_output_gate": True,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "full_attention_interval": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 8,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": True,
    },
    "vision_config": {
        "model_type": "qwen3_5",
        "depth": 24,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 2560,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [],
    },
}


# --------------------------------------------------------------------------- model shape


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide memory, read from a Hugging Face ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    full_attention_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    attn_output_gate: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    linear_attention_layers: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    tie_word_embeddings: bool = True
    vision_params: int = 0
    architectures: tuple[str, ...] = ()

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Qwen3.5-style configs (``text_config`` + ``vision_config``) and flat decoder-only ones."""
        text = dict(config.get("text_config") or config)
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        layer_types = list(text.get("layer_types") or [])
        if not layer_types and text.get("full_attention_interval"):
            interval = int(text["full_attention_interval"])
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        if not layer_types:
            layer_types = ["full_attention"] * layers
        if len(layer_types) != layers:
            raise ValueError(f"config.json: {len(layer_types)} layer_types for num_hidden_layers={layers}")
        linear = sum(t == "linear_attention" for t in layer_types)
        model_type = str(text.get("model_type", config.get("model_type", "")))
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        vision = config.get("vision_config")
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_layers=layers,
            full_attention_layers=layers - linear,
            num_attention_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            attn_output_gate=bool(text.get("attn_output_gate", model_type.startswith("qwen3_5"))),
            attention_bias=bool(text.get("attention_bias", model_type.startswith("qwen2"))),
            qk_norm=model_type.startswith(("qwen3", "qwen3_5")),
            linear_attention_layers=linear,
            linear_num_key_heads=int(text.get("linear_num_key_heads") or 0),
            linear_num_value_heads=int(text.get("linear_num_value_heads") or 0),
            linear_key_head_dim=int(text.get("linear_key_head_dim") or 0),
            linear_value_head_dim=int(text.get("linear_value_head_dim") or 0),
            linear_conv_kernel=int(text.get("linear_conv_kernel_dim") or 0),
            tie_word_embeddings=bool(tie),
            vision_params=_vision_params(vision) if isinstance(vision, Mapping) else 0,
            architectures=tuple(str(a) for a in config.get("architectures") or ()),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelShape:
        path = Path(model_dir).expanduser() / "config.json"
        try:
            return cls.from_hf_config(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no config.json in the model folder") from None
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}: cannot read the model's shape ({exc})") from exc

    # ------------------------------------------------------------------ parameter counts

    @property
    def full_attention_layer_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        q_out = self.num_attention_heads * hd * (2 if self.attn_output_gate else 1)
        kv_out = self.num_kv_heads * hd
        params = h * q_out + 2 * h * kv_out + self.num_attention_heads * hd * h
        if self.attention_bias:
            params += q_out + 2 * kv_out
        if self.qk_norm:
            params += 2 * hd
        return params

    @property
    def linear_attention_layer_params(self) -> int:
        h = self.hidden_size
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        nv = self.linear_num_value_heads
        return (
            h * conv_dim  # in_proj_qkv
            + h * value_dim  # in_proj_z
            + 2 * h * nv  # in_proj_b, in_proj_a
            + conv_dim * self.linear_conv_kernel  # depthwise conv1d, no bias
            + 2 * nv  # dt_bias, A_log
            + self.linear_value_head_dim  # gated RMSNorm
            + value_dim * h  # out_proj
        )

    @property
    def mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def largest_layer_params(self) -> int:
        mixer = max(
            self.full_attention_layer_params if self.full_attention_layers else 0,
            self.linear_attention_layer_params if self.linear_attention_layers else 0,
        )
        return mixer + self.mlp_params + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def text_params(self) -> int:
        layers = (
            self.full_attention_layers * self.full_attention_layer_params
            + self.linear_attention_layers * self.linear_attention_layer_params
            + self.num_layers * (self.mlp_params + 2 * self.hidden_size)
        )
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + layers + self.hidden_size + lm_head

    @property
    def total_params(self) -> int:
        return self.text_params + self.vision_params

    # ------------------------------------------------------------------ inference state

    def kv_bytes_per_token(self, dtype_bytes: int = 2, tensor_parallel: int = 1) -> int:
        """K and V of every full-attention layer for one token (KV heads split over ``tp``)."""
        heads = max(1, self.num_kv_heads // tensor_parallel)
        return 2 * heads * self.head_dim * dtype_bytes * self.full_attention_layers

    def linear_state_bytes_per_sequence(self, dtype_bytes: int = 2, tensor_parallel: int = 1) -> int:
        """Recurrent (heads x d_k x d_v) + convolution state of every linear-attention layer."""
        if not self.linear_attention_layers:
            return 0
        recurrent = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        conv_dim = 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )
        conv = conv_dim * max(self.linear_conv_kernel - 1, 0)
        return (recurrent + conv) * dtype_bytes * self.linear_attention_layers // tensor_parallel


def _vision_params(vision: Mapping[str, Any]) -> int:
    """Qwen3-VL / Qwen3.5 vision tower: patch embedding, position table, ViT blocks, mergers."""
    h = int(vision["hidden_size"])
    inter = int(vision["intermediate_size"])
    depth = int(vision["depth"])
    patch = int(vision.get("patch_size", 16))
    temporal = int(vision.get("temporal_patch_size", 2))
    channels = int(vision.get("in_channels", 3))
    merge = int(vision.get("spatial_merge_size", 2))
    out = int(vision.get("out_hidden_size", h))
    positions = int(vision.get("num_position_embeddings", 0))
    patch_embed = channels * temporal * patch * patch * h + h
    block = 2 * (2 * h) + (h * 3 * h + 3 * h) + (h * h + h) + (h * inter + inter) + (inter * h + h)
    merged = h * merge * merge

    def merger(norm_dim: int) -> int:
        return 2 * norm_dim + (merged * merged + merged) + (merged * out + out)

    deepstack = len(vision.get("deepstack_visual_indexes") or [])
    return patch_embed + positions * h + depth * block + merger(h) + deepstack * merger(merged)


# --------------------------------------------------------------------------- run sizes


@dataclass(frozen=True)
class RunSizes:
    """The run settings that decide memory (names follow verl's config keys)."""

    train_gpus: int  # trainer.nnodes x trainer.n_gpus_per_node (FSDP data parallel size)
    ppo_max_token_len_per_gpu: int  # tokens of one training micro-batch
    log_prob_max_token_len_per_gpu: int  # tokens of one log-prob micro-batch (old log-probs, drift scan)
    max_model_len: int  # prompt + response
    gradient_checkpointing: bool = True
    param_offload: bool = False
    optimizer_offload: bool = False
    packed: bool = True  # use_remove_padding: padding-free packing (flash attention); False: padded rows
    entropy_chunking: bool = True  # entropy_from_logits_with_chunking (read on the packed path only)
    entropy_chunk_size: int = 2048
    update_entropy: bool = False  # entropy in the update pass (entropy_coeff != 0 or calculate_entropy)
    fused_cross_entropy: bool = True  # flash-attn installed: its in-place Triton cross-entropy
    temperature: float = 1.0
    scan: bool = False  # Headroom-Drift's teacher-forced drift scan (log-prob micro-batches, no entropy)
    parameter_sync_step: int = 1  # separate_async update rounds per weight push
    weight_sync_bucket_bytes: int = 0  # nccl weight push: update_weights_bucket_megabytes << 20 (0: none)
    gpu_name: str = DEFAULT_GPU
    train_gpu_memory_gib: float = GPU_MEMORY_GIB[DEFAULT_GPU]
    rollout_gpu_memory_gib: float = GPU_MEMORY_GIB[DEFAULT_GPU]
    rollout_tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.85
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 1024

    def __post_init__(self) -> None:
        for name in (
            "train_gpus",
            "ppo_max_token_len_per_gpu",
            "log_prob_max_token_len_per_gpu",
            "max_model_len",
            "rollout_tensor_parallel",
            "max_num_batched_tokens",
            "max_num_seqs",
            "entropy_chunk_size",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.weight_sync_bucket_bytes < 0:
            raise ValueError(f"weight_sync_bucket_bytes must be >= 0, got {self.weight_sync_bucket_bytes!r}")


@dataclass(frozen=True)
class BudgetRow:
    what: str
    bytes: int
    how: str
    # Transient rows of a pass exist one after the other, never together: the pass holds the
    # largest of them on top of its other rows.
    transient: bool = False

    @property
    def gib(self) -> float:
        return self.bytes / GIB


def pass_bytes(rows: Sequence[BudgetRow]) -> int:
    """What a pass holds at its peak: its rows, and the largest of its transient rows."""
    held = sum(r.bytes for r in rows if not r.transient)
    return held + max((r.bytes for r in rows if r.transient), default=0)


@dataclass
class MemoryBudget:
    model: ModelShape
    sizes: RunSizes
    resident: list[BudgetRow] = field(default_factory=list)  # held through the whole step
    passes: dict[str, list[BudgetRow]] = field(default_factory=dict)  # per pass, on top of resident
    rollout: list[BudgetRow] = field(default_factory=list)
    host: list[BudgetRow] = field(default_factory=list)  # host RAM per training GPU
    kv_tokens: int = 0
    kv_sequences: int = 0

    @property
    def resident_total(self) -> int:
        return sum(r.bytes for r in self.resident)

    def pass_total(self, name: str) -> int:
        """Peak of a training GPU during ``name``: resident state plus that pass."""
        return self.resident_total + pass_bytes(self.passes[name])

    @property
    def update_pass(self) -> list[BudgetRow]:
        return self.passes[UPDATE]

    @property
    def logprob_pass(self) -> list[BudgetRow]:
        return self.passes[LOG_PROB]

    @property
    def update_total(self) -> int:
        return self.pass_total(UPDATE)

    @property
    def logprob_total(self) -> int:
        return self.pass_total(LOG_PROB)

    @property
    def training_total(self) -> int:
        """Peak of a training GPU: resident state plus the largest pass."""
        return max(self.pass_total(name) for name in self.passes)

    @property
    def training_pass(self) -> str:
        """The pass at the peak."""
        return max(self.passes, key=self.pass_total)

    @property
    def train_limit(self) -> int:
        return int(self.sizes.train_gpu_memory_gib * GIB)

    @property
    def rollout_limit(self) -> int:
        return int(self.sizes.rollout_gpu_memory_gib * GIB)

    @property
    def rollout_total(self) -> int:
        return sum(r.bytes for r in self.rollout)


UPDATE, LOG_PROB, SCAN = "update pass", "log-prob pass", "scan pass"


def _layer_activation_bytes(model: ModelShape, tokens: int) -> int:
    """bf16 tensors one decoder layer keeps for backward: norms, projections, MLP gate/up/act."""
    return (6 * model.hidden_size + 4 * model.intermediate_size) * 2 * tokens


def _logits_row(tokens: int, vocab: int, temperature: float) -> BudgetRow:
    copies = 1 if temperature == 1 else 2  # logits / temperature is a second tensor
    how = f"{copies} x 2 B x {tokens} tok x {vocab} vocab" + (" (+ the temperature-scaled copy)" if copies > 1 else "")
    return BudgetRow("logits (bf16)", copies * 2 * tokens * vocab, how)


def _entropy_row(sizes: RunSizes, tokens: int, vocab: int, transient: bool = False) -> BudgetRow:
    if sizes.packed and sizes.entropy_chunking:
        rows = min(sizes.entropy_chunk_size, tokens)
        return BudgetRow(
            "entropy (chunked, fp32)",
            3 * 4 * rows * vocab,
            f"3 fp32 tensors x {rows} rows x vocab (upcast chunk, softmax, product)",
            transient,
        )
    why = "verl's padded path ignores entropy_from_logits_with_chunking" if not sizes.packed else "not chunked"
    return BudgetRow(
        "entropy (whole micro-batch, bf16)",
        2 * 2 * tokens * vocab,
        f"2 x 2 B x {tokens} tok x vocab: softmax + the logsumexp / product temporary ({why})",
        transient,
    )


def _unpadded_copy_row(tokens: int, vocab: int, transient: bool) -> BudgetRow:
    return BudgetRow(
        "unpadded copy of the logits (padded path)",
        2 * tokens * vocab,
        f"2 B x {tokens} tok x vocab: the rows cut out of the padded logits and concatenated"
        + (", after the entropy's temporaries are freed" if transient else ""),
        transient,
    )


def estimate(model: ModelShape, sizes: RunSizes) -> MemoryBudget:
    """The budget rows of one training GPU, one rollout GPU and the host (see the module rules)."""
    budget = MemoryBudget(model, sizes)
    p, dp, v = model.total_params, sizes.train_gpus, model.vocab_size
    pt, pv = model.text_params, model.vision_params
    on_gpu = not sizes.param_offload
    resident = [
        BudgetRow(
            "fp32 parameters (FSDP shard)",
            4 * p // dp if on_gpu else 0,
            f"4 B x {p / 1e9:.2f}B params / {dp} GPUs" if on_gpu else "offloaded to CPU",
        ),
        BudgetRow(
            "fp32 gradients, text model (FSDP shard)",
            4 * pt // dp if on_gpu else 0,
            f"4 B x {pt / 1e9:.2f}B text params / {dp}" if on_gpu else "offloaded to CPU",
        ),
        BudgetRow(
            "AdamW moments, text model (fp32, shard)",
            0 if sizes.optimizer_offload else 8 * pt // dp,
            "offloaded to CPU" if sizes.optimizer_offload else f"8 B x text params / {dp}",
        ),
    ]
    if pv:
        vision = (4 * pv if on_gpu else 0) + (0 if sizes.optimizer_offload else 8 * pv)
        resident.append(
            BudgetRow(
                "vision tower: gradients + AdamW moments (shard)",
                vision // dp,
                f"{'4 B + ' if on_gpu else ''}{'8 B' if not sizes.optimizer_offload else '0 B'} x "
                f"{pv / 1e9:.2f}B vision params / {dp}: verl runs the tower on a dummy image every forward",
            )
        )
    resident.append(
        BudgetRow(
            "bf16 all-gather buffers",
            2 * 2 * model.largest_layer_params + 2 * model.embedding_params,
            "current + prefetched layer, and the embedding / tied LM head",
        )
    )
    if sizes.weight_sync_bucket_bytes:
        resident.append(
            BudgetRow(
                "weight-sync buffers (training rank 0)",
                2 * sizes.weight_sync_bucket_bytes,
                f"2 x {sizes.weight_sync_bucket_bytes >> 20} MiB nccl send / receive buckets, kept by cupy's pool",
            )
        )
    resident.append(BudgetRow("CUDA context, NCCL, allocator slack", CUDA_RESERVE_BYTES, "fixed reserve (assumption)"))
    budget.resident = resident

    # update pass: one training micro-batch, forward + backward
    t = sizes.ppo_max_token_len_per_gpu
    if sizes.gradient_checkpointing:
        activations = 2 * t * model.hidden_size * model.num_layers + 2 * _layer_activation_bytes(model, t)
        activation_how = f"checkpoints 2 B x {t} tok x H x {model.num_layers} layers + one layer recomputed (x2 grads)"
    else:
        activations = _layer_activation_bytes(model, t) * model.num_layers
        activation_how = f"(6H + 4I) x 2 B x {t} tok x {model.num_layers} layers (no checkpointing)"
    update = [BudgetRow("activations (training micro-batch)", activations, activation_how), _logits_row(t, v, 1.0)]
    if sizes.temperature != 1:
        update[-1] = _logits_row(t, v, sizes.temperature)
    if not sizes.fused_cross_entropy:
        update.append(
            BudgetRow(
                "log-prob backward",
                2 * 2 * t * v,
                "2 x 2 B x tok x vocab: the saved log_softmax and its gradient (no flash-attn cross-entropy)",
            )
        )
    elif not sizes.packed:
        update.append(
            BudgetRow(
                "log-prob backward",
                2 * t * v,
                "2 B x tok x vocab: the unpadded copy of the logits that the in-place cross-entropy keeps",
            )
        )
    else:
        update.append(BudgetRow("log-prob backward", 0, "in place (flash-attn cross-entropy on the packed logits)"))
    if sizes.update_entropy:
        update.append(_entropy_row(sizes, t, v))
    budget.passes[UPDATE] = update

    # log-prob pass: old log-probs with entropy, no gradients; the scan pass: the same without entropy
    t_lp = sizes.log_prob_max_token_len_per_gpu
    forward = [
        BudgetRow(
            "activations (log-prob micro-batch)",
            _layer_activation_bytes(model, t_lp),
            f"one layer at a time, {t_lp} tok, no gradients",
        ),
        _logits_row(t_lp, v, sizes.temperature),
    ]
    logprob = [*forward, _entropy_row(sizes, t_lp, v, transient=not sizes.packed)]
    if not sizes.packed:
        logprob.append(_unpadded_copy_row(t_lp, v, transient=True))
    budget.passes[LOG_PROB] = logprob
    if sizes.scan:
        budget.passes[SCAN] = [*forward] + ([_unpadded_copy_row(t_lp, v, transient=False)] if not sizes.packed else [])

    tp = sizes.rollout_tensor_parallel
    usable = int(sizes.gpu_memory_utilization * sizes.rollout_gpu_memory_gib * GIB)
    weights = 2 * p // tp
    peak = sizes.max_num_batched_tokens * (2 * model.hidden_size + 2 * model.intermediate_size) * 2 // tp
    peak += sizes.max_num_seqs * v * 4
    kv = max(usable - weights - peak, 0)
    per_token = model.kv_bytes_per_token(tensor_parallel=tp)
    per_sequence = sizes.max_model_len * per_token + model.linear_state_bytes_per_sequence(tensor_parallel=tp)
    budget.kv_tokens = kv // per_token if per_token else 0
    budget.kv_sequences = kv // per_sequence if per_sequence else 0
    budget.rollout = [
        BudgetRow("bf16 weights", weights, f"2 B x params / TP {tp}"),
        BudgetRow(
            "profiling peak (activations + sampler logits)",
            peak,
            f"{sizes.max_num_batched_tokens} batched tok x (2H + 2I) x 2 B + {sizes.max_num_seqs} seqs x vocab x 4 B",
        ),
        BudgetRow(
            "KV cache + linear-attention state",
            kv,
            f"rest of {sizes.gpu_memory_utilization:g} x {sizes.rollout_gpu_memory_gib:g} GiB: "
            f"{per_token // 1024} KiB/token, {budget.kv_sequences} sequences of {sizes.max_model_len} tokens",
        ),
    ]
    if sizes.weight_sync_bucket_bytes:
        budget.rollout.append(
            BudgetRow(
                "weight-sync buffers (during a push)",
                2 * sizes.weight_sync_bucket_bytes,
                f"2 x {sizes.weight_sync_bucket_bytes >> 20} MiB receive buckets, outside vLLM's share",
            )
        )

    copies = 2 if sizes.parameter_sync_step > 1 else 1
    budget.host = [
        BudgetRow(
            "pi_old / current weight copies (separate_async)",
            copies * 4 * p // dp,
            f"{copies} x fp32 shard (save_model_to_cpu)",
        ),
    ]
    if sizes.param_offload:
        budget.host.append(
            BudgetRow("offloaded parameters + gradients", (4 * p + 4 * p) // dp, "4 B x params, twice, / dp")
        )
    if sizes.optimizer_offload:
        budget.host.append(BudgetRow("offloaded AdamW moments", 8 * p // dp, "8 B x params / dp"))
    return budget


def fit_token_limit(
    model: ModelShape, sizes: RunSizes, key: str, limit_bytes: int, step: int = 1024, floor: int = 1
) -> int:
    """The largest value of ``key`` (``ppo_max_token_len_per_gpu`` or ``log_prob_max_token_len_per_gpu``),
    a multiple of ``step`` and at least ``floor``, whose passes stay within ``limit_bytes`` (0: none)."""
    if key not in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"):
        raise ValueError(f"cannot fit {key}")
    passes = (UPDATE,) if key == "ppo_max_token_len_per_gpu" else (LOG_PROB, SCAN)

    def fits(tokens: int) -> bool:
        budget = estimate(model, replace(sizes, **{key: tokens}))
        return all(budget.pass_total(name) <= limit_bytes for name in passes if name in budget.passes)

    low = max(step, -(-floor // step) * step)
    if not fits(low):
        return 0
    high = low
    while fits(high * 2):
        high *= 2
        if high > 1 << 24:
            return high
    lo, hi = high, high * 2  # fits(lo), not fits(hi)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --------------------------------------------------------------------------- output


def _gib(value: int) -> str:
    return f"{value / GIB:.1f}"


def _margin(total: int, limit: int) -> str:
    return f"of {limit / GIB:.1f} GiB ({(limit - total) / GIB:.1f} GiB / {(limit - total) / limit:.0%} free)"


def format_markdown(budget: MemoryBudget) -> str:
    """A Markdown table: a training GPU (resident state + each pass), a rollout GPU, the host."""
    s, m = budget.sizes, budget.model
    lines = [
        f"Model: {m.total_params / 1e9:.2f}B parameters ({m.text_params / 1e9:.2f}B text + "
        f"{m.vision_params / 1e9:.2f}B vision), vocabulary {m.vocab_size}, {m.num_layers} layers "
        f"({m.full_attention_layers} full attention, {m.linear_attention_layers} linear attention). "
        f"GPU: {s.gpu_name}, {s.train_gpu_memory_gib:g} GiB usable; "
        + ("padding-free packing" if s.packed else "padded micro-batches (rows of one length assumed)")
        + ".",
        "",
        "| GPU | phase | item | GiB | how |",
        "|---|---|---|---:|---|",
    ]
    for row in budget.resident:
        lines.append(f"| training | resident | {row.what} | {_gib(row.bytes)} | {row.how} |")
    for name, rows in budget.passes.items():
        for row in rows:
            marker = " (one of the transient rows: the largest counts)" if row.transient else ""
            lines.append(f"| training | {name} | {row.what} | {_gib(row.bytes)} | {row.how}{marker} |")
    for name in budget.passes:
        total = budget.pass_total(name)
        lines.append(
            f"| training | {name} | **total** (resident + {name}) | **{_gib(total)}** "
            f"| {_margin(total, budget.train_limit)} |"
        )
    for row in budget.rollout:
        lines.append(f"| rollout | serving | {row.what} | {_gib(row.bytes)} | {row.how} |")
    lines.append(
        f"| rollout | serving | **total** | **{_gib(budget.rollout_total)}** | "
        f"{_margin(budget.rollout_total, budget.rollout_limit)} |"
    )
    for row in budget.host:
        lines.append(f"| host RAM | per training GPU | {row.what} | {_gib(row.bytes)} | {row.how} |")
    return "\n".join(lines) + "\n"


def budget_lines(budget: MemoryBudget) -> list[str]:
    """Short lines for a console report."""
    s = budget.sizes
    passes = ", ".join(f"{name} {_gib(budget.pass_total(name))}" for name in budget.passes)
    return [
        f"training GPU: {_gib(budget.training_total)} GiB of {s.train_gpu_memory_gib:g} GiB at the "
        f"{budget.training_pass} ({passes} GiB; {s.ppo_max_token_len_per_gpu} / {s.log_prob_max_token_len_per_gpu} "
        "tokens per update / log-prob micro-batch)",
        f"rollout GPU: {_gib(budget.rollout_total)} GiB of {s.rollout_gpu_memory_gib:g} GiB: "
        f"{_gib(budget.rollout[0].bytes)} GiB weights, {_gib(budget.rollout[2].bytes)} GiB KV cache "
        f"({budget.kv_sequences} sequences of {s.max_model_len} tokens at once)",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_replay.memory_budget", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder with config.json (default: the Qwen3.5-4B shape)")
    parser.add_argument("--train-gpus", type=int, default=2)
    parser.add_argument("--ppo-max-token-len", type=int, default=20480)
    parser.add_argument("--log-prob-max-token-len", type=int, default=32768)
    parser.add_argument("--max-model-len", type=int, default=20480)
    parser.add_argument("--gpu", choices=sorted(GPU_MEMORY_GIB), default=DEFAULT_GPU, help="GPU model (its memory)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="usable GPU memory (overrides --gpu)")
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--max-num-batched-tokens", type=int, default=20480)
    parser.add_argument("--bucket-mb", type=int, default=2048, help="nccl weight-sync bucket (0: no weight push)")
    parser.add_argument("--offload", action="store_true", help="FSDP parameter + optimizer offload")
    parser.add_argument("--padded", action="store_true", help="verl's padded path (sdpa, use_remove_padding=False)")
    parser.add_argument("--no-flash-attn", action="store_true", help="verl's torch cross-entropy (no flash-attn)")
    parser.add_argument("--scan", action="store_true", help="Headroom-Drift's drift scan pass")
    args = parser.parse_args(argv)
    model = ModelShape.from_model_dir(args.model) if args.model else ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)
    memory = args.gpu_memory_gib if args.gpu_memory_gib is not None else GPU_MEMORY_GIB[args.gpu]
    sizes = RunSizes(
        train_gpus=args.train_gpus,
        ppo_max_token_len_per_gpu=args.ppo_max_token_len,
        log_prob_max_token_len_per_gpu=args.log_prob_max_token_len,
        max_model_len=args.max_model_len,
        param_offload=args.offload,
        optimizer_offload=args.offload,
        packed=not args.padded,
        scan=args.scan,
        weight_sync_bucket_bytes=args.bucket_mb << 20,
        gpu_name=args.gpu if args.gpu_memory_gib is None else f"{memory:g} GiB GPU",
        train_gpu_memory_gib=memory,
        rollout_gpu_memory_gib=memory,
        rollout_tensor_parallel=args.rollout_tp,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        fused_cross_entropy=not args.no_flash_attn,
    )
    print(format_markdown(estimate(model, sizes)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
