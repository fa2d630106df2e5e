"""Per-GPU memory budget of a GRPO run: training GPUs (FSDP2) and rollout GPUs (vLLM).

Everything is computed from two inputs, never typed in: the model's shape (its ``config.json``,
:meth:`ModelShape.from_hf_config`) and the run's sizes (:class:`RunSizes`, which
``verl_replay.integrations.verl.preflight`` fills from the composed training config). The
result is a list of rows (what, GiB, how it was computed) for one training GPU and one rollout
GPU, printed by the preflight and, for the recipes' defaults, in ``recipes/README.md``.

Counting rules (bytes; ``P`` parameters, ``dp`` training GPUs, ``T`` tokens of one micro-batch,
``V`` vocabulary, ``H`` hidden size, ``I`` MLP size, ``L`` layers):

- FSDP2 keeps fp32 master parameters (``4P/dp`` per rank), fp32 gradients (``4P_t/dp``) and
  AdamW's two fp32 moments (``8P_t/dp``), all sharded over ``dp`` ranks (0 on the GPU when
  offloaded). ``P_t`` counts the text model only: on text-only data a vision tower gets no
  gradient, so neither a gradient nor AdamW state is ever allocated for it. A layer is all-gathered
  in bf16 for compute, the next one prefetched:
  ``2 x 2 x`` (largest layer). The embedding (tied LM head) is the root module's and stays
  gathered through forward and backward: ``2VH``.
- Logits are materialised in bf16 for the whole micro-batch: ``2TV`` (``2TV`` more for the
  temperature-scaled copy when the temperature is not 1). In the training pass flash-attn's
  Triton cross-entropy writes the logits' gradient in place; without flash-attn verl's
  row-wise ``log_softmax`` keeps its outputs for backward and the gradient is a new tensor:
  ``4TV`` more. Entropy upcasts to fp32: ``8TV`` at once, or ``8 x chunk x V`` with
  ``entropy_from_logits_with_chunking``.
- Activations, bf16: with gradient checkpointing each layer keeps its input, ``2TH x L``, and
  the layer being recomputed holds ``(6H + 4I) x 2T`` plus as much again for its gradients;
  without checkpointing every layer holds ``(6H + 4I) x 2T``. The log-prob pass (no gradients)
  holds one layer's ``(6H + 4I) x 2T`` at a time.
- A fixed 3 GiB covers the CUDA context, NCCL buffers and allocator slack (an assumption).
- vLLM (per rollout GPU, tensor parallel ``tp``): bf16 weights ``2P/tp``; a profiling peak of
  ``max_num_batched_tokens x (2H + 2I) x 2`` activations plus fp32 logits of ``max_num_seqs``
  sequences; the rest of ``gpu_memory_utilization x GPU`` is KV cache. Full-attention layers
  store ``2 x kv_heads x head_dim x 2`` bytes per token and layer; linear-attention layers a
  fixed recurrent + convolution state per sequence.

These are estimates of the large terms (they ignore, e.g., the optimizer's temporary buffers and
fragmentation beyond the fixed reserve); the preflight compares their total with the GPUs it
sees. The module imports only the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "QWEN3_5_4B_CONFIG",
    "BudgetRow",
    "MemoryBudget",
    "ModelShape",
    "RunSizes",
    "estimate",
    "format_markdown",
]

GIB = 1024**3
CUDA_RESERVE_BYTES = 3 * GIB

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
    log_prob_max_token_len_per_gpu: int  # tokens of one log-prob micro-batch
    max_model_len: int  # prompt + response
    gradient_checkpointing: bool = True
    param_offload: bool = False
    optimizer_offload: bool = False
    entropy_chunking: bool = True
    entropy_chunk_size: int = 2048
    fused_cross_entropy: bool = True  # flash-attn installed: its in-place Triton cross-entropy
    temperature: float = 1.0
    parameter_sync_step: int = 1  # separate_async update rounds per weight push
    rollout_gpu_memory_gib: float = 80.0
    train_gpu_memory_gib: float = 80.0
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


@dataclass(frozen=True)
class BudgetRow:
    what: str
    bytes: int
    how: str

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass
class MemoryBudget:
    model: ModelShape
    sizes: RunSizes
    resident: list[BudgetRow] = field(default_factory=list)  # held through the whole step
    update_pass: list[BudgetRow] = field(default_factory=list)  # a training micro-batch, on top
    logprob_pass: list[BudgetRow] = field(default_factory=list)  # a log-prob micro-batch, on top
    rollout: list[BudgetRow] = field(default_factory=list)
    host: list[BudgetRow] = field(default_factory=list)  # host RAM per training GPU
    kv_tokens: int = 0
    kv_sequences: int = 0

    @property
    def update_total(self) -> int:
        return sum(r.bytes for r in self.resident + self.update_pass)

    @property
    def logprob_total(self) -> int:
        return sum(r.bytes for r in self.resident + self.logprob_pass)

    @property
    def training_total(self) -> int:
        """Peak of a training GPU: resident state plus the larger of the two passes."""
        return max(self.update_total, self.logprob_total)

    @property
    def training_pass(self) -> str:
        return "update micro-batch" if self.update_total >= self.logprob_total else "log-prob micro-batch"

    @property
    def rollout_total(self) -> int:
        return sum(r.bytes for r in self.rollout)


def _layer_activation_bytes(model: ModelShape, tokens: int) -> int:
    """bf16 tensors one decoder layer keeps for backward: norms, projections, MLP gate/up/act."""
    return (6 * model.hidden_size + 4 * model.intermediate_size) * 2 * tokens


def estimate(model: ModelShape, sizes: RunSizes) -> MemoryBudget:
    """The budget rows of one training GPU, one rollout GPU and the host (see the module rules)."""
    budget = MemoryBudget(model, sizes)
    p, dp, v = model.total_params, sizes.train_gpus, model.vocab_size
    pt = model.text_params  # trained on text: the vision tower gets no gradient
    resident = [
        BudgetRow(
            "fp32 parameters (FSDP shard)",
            0 if sizes.param_offload else 4 * p // dp,
            "offloaded to CPU" if sizes.param_offload else f"4 B x {p / 1e9:.2f}B params / {dp} GPUs",
        ),
        BudgetRow(
            "fp32 gradients (FSDP shard)",
            0 if sizes.param_offload else 4 * pt // dp,
            "offloaded to CPU" if sizes.param_offload else f"4 B x {pt / 1e9:.2f}B text params / {dp}",
        ),
        BudgetRow(
            "AdamW moments (fp32, shard)",
            0 if sizes.optimizer_offload else 8 * pt // dp,
            "offloaded to CPU" if sizes.optimizer_offload else f"8 B x text params / {dp}",
        ),
        BudgetRow(
            "bf16 all-gather buffers",
            2 * 2 * model.largest_layer_params + 2 * model.embedding_params,
            "current + prefetched layer, and the embedding / tied LM head",
        ),
        BudgetRow("CUDA context, NCCL, allocator slack", CUDA_RESERVE_BYTES, "fixed reserve (assumption)"),
    ]
    entropy_rows = (
        min(sizes.entropy_chunk_size, sizes.ppo_max_token_len_per_gpu)
        if sizes.entropy_chunking
        else sizes.ppo_max_token_len_per_gpu
    )
    t = sizes.ppo_max_token_len_per_gpu
    if sizes.gradient_checkpointing:
        activations = 2 * t * model.hidden_size * model.num_layers + 2 * _layer_activation_bytes(model, t)
        activation_how = f"checkpoints 2 B x {t} tok x H x {model.num_layers} layers + one layer recomputed (x2 grads)"
    else:
        activations = _layer_activation_bytes(model, t) * model.num_layers
        activation_how = f"(6H + 4I) x 2 B x {t} tok x {model.num_layers} layers (no checkpointing)"
    scaled = 0 if sizes.temperature == 1 else 1  # logits / temperature is a copy
    train_pass = [
        BudgetRow("activations (training micro-batch)", activations, activation_how),
        BudgetRow(
            "logits (bf16)",
            (1 + scaled) * 2 * t * v,
            f"{1 + scaled} x 2 B x {t} tok x {v} vocab" + (" (+ temperature copy)" if scaled else ""),
        ),
        BudgetRow(
            "logits gradient",
            0 if sizes.fused_cross_entropy else 2 * 2 * t * v,
            "in place (flash-attn cross-entropy)"
            if sizes.fused_cross_entropy
            else "saved log_softmax + gradient, 2 x 2 B x tok x vocab (no flash-attn)",
        ),
        BudgetRow(
            "entropy (fp32 upcast)",
            8 * entropy_rows * v,
            f"8 B x {entropy_rows} rows x vocab" + (" (chunked)" if sizes.entropy_chunking else " (not chunked)"),
        ),
    ]
    t_lp = sizes.log_prob_max_token_len_per_gpu
    lp_rows = min(sizes.entropy_chunk_size, t_lp) if sizes.entropy_chunking else t_lp
    logprob_pass = [
        BudgetRow(
            "activations (log-prob micro-batch)",
            _layer_activation_bytes(model, t_lp),
            f"one layer at a time, {t_lp} tok, no gradients",
        ),
        BudgetRow(
            "logits (bf16)",
            (1 + scaled) * 2 * t_lp * v,
            f"{1 + scaled} x 2 B x {t_lp} tok x {v} vocab" + (" (+ temperature copy)" if scaled else ""),
        ),
        BudgetRow(
            "entropy (fp32 upcast)",
            8 * lp_rows * v,
            f"8 B x {lp_rows} rows x vocab" + (" (chunked)" if sizes.entropy_chunking else " (not chunked)"),
        ),
    ]
    budget.resident, budget.update_pass, budget.logprob_pass = resident, train_pass, logprob_pass

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
            BudgetRow("offloaded parameters + gradients", (4 * p + 4 * pt) // dp, "4 B x (params + text params) / dp")
        )
    if sizes.optimizer_offload:
        budget.host.append(BudgetRow("offloaded AdamW moments", 8 * pt // dp, "8 B x text params / dp"))
    return budget


# --------------------------------------------------------------------------- output


def _gib(value: int) -> str:
    return f"{value / GIB:.1f}"


def format_markdown(budget: MemoryBudget) -> str:
    """A Markdown table: a training GPU (resident state + each pass), a rollout GPU, the host."""
    s, m = budget.sizes, budget.model
    lines = [
        f"Model: {m.total_params / 1e9:.2f}B parameters ({m.text_params / 1e9:.2f}B text + "
        f"{m.vision_params / 1e9:.2f}B vision), vocabulary {m.vocab_size}, {m.num_layers} layers "
        f"({m.full_attention_layers} full attention, {m.linear_attention_layers} linear attention).",
        "",
        "| GPU | phase | item | GiB | how |",
        "|---|---|---|---:|---|",
    ]
    for phase, rows in (
        ("resident", budget.resident),
        ("update pass", budget.update_pass),
        ("log-prob pass", budget.logprob_pass),
    ):
        for row in rows:
            lines.append(f"| training | {phase} | {row.what} | {_gib(row.bytes)} | {row.how} |")
    for phase, total in (("update pass", budget.update_total), ("log-prob pass", budget.logprob_total)):
        lines.append(
            f"| training | {phase} | **total** (resident + {phase}) | **{_gib(total)}** "
            f"| of {s.train_gpu_memory_gib:g} GiB |"
        )
    for row in budget.rollout:
        lines.append(f"| rollout | serving | {row.what} | {_gib(row.bytes)} | {row.how} |")
    lines.append(
        f"| rollout | serving | **total** | **{_gib(budget.rollout_total)}** | "
        f"gpu_memory_utilization x {s.rollout_gpu_memory_gib:g} GiB |"
    )
    for row in budget.host:
        lines.append(f"| host RAM | per training GPU | {row.what} | {_gib(row.bytes)} | {row.how} |")
    return "\n".join(lines) + "\n"


def budget_lines(budget: MemoryBudget) -> list[str]:
    """Short lines for a console report."""
    s = budget.sizes
    return [
        f"training GPU: {_gib(budget.training_total)} GiB of {s.train_gpu_memory_gib:g} GiB "
        f"at the {budget.training_pass} ({s.ppo_max_token_len_per_gpu} / {s.log_prob_max_token_len_per_gpu} "
        "tokens per update / log-prob micro-batch)",
        f"rollout GPU: {_gib(budget.rollout[0].bytes)} GiB weights, {_gib(budget.rollout[-1].bytes)} GiB KV cache "
        f"({budget.kv_sequences} sequences of {s.max_model_len} tokens at once)",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_replay.memory_budget", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder with config.json (default: the Qwen3.5-4B shape)")
    parser.add_argument("--train-gpus", type=int, default=2)
    parser.add_argument("--ppo-max-token-len", type=int, default=20480)
    parser.add_argument("--log-prob-max-token-len", type=int, default=40960)
    parser.add_argument("--max-model-len", type=int, default=20480)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0)
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--max-num-batched-tokens", type=int, default=20480)
    parser.add_argument("--offload", action="store_true", help="FSDP parameter + optimizer offload")
    parser.add_argument("--no-flash-attn", action="store_true", help="verl's torch cross-entropy (no flash-attn)")
    args = parser.parse_args(argv)
    model = ModelShape.from_model_dir(args.model) if args.model else ModelShape.from_hf_config(QWEN3_5_4B_CONFIG)
    sizes = RunSizes(
        train_gpus=args.train_gpus,
        ppo_max_token_len_per_gpu=args.ppo_max_token_len,
        log_prob_max_token_len_per_gpu=args.log_prob_max_token_len,
        max_model_len=args.max_model_len,
        param_offload=args.offload,
        optimizer_offload=args.offload,
        train_gpu_memory_gib=args.gpu_memory_gib,
        rollout_gpu_memory_gib=args.gpu_memory_gib,
        rollout_tensor_parallel=args.rollout_tp,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        fused_cross_entropy=not args.no_flash_attn,
    )
    print(format_markdown(estimate(model, sizes)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
