"""Test helper, run as a script in a fresh process with ``VERL_PLATFORM=cpu`` (what a Ray worker of
the CPU profile is): verl's own log-prob path on the tiny Qwen3.5 model, packed and padded.

For each case it builds rows as they reach the actor (fresh rows with the position ids verl's
agent loop computes, replayed rows rebuilt from a ``ReplayGroup``, elite rows built the way
``EliteReplayStream`` builds them), packs every field the way TransferQueue does
(``_pack_field_values``, then the consolidate + pickle round trip of a Ray call), and runs
verl's ``infer_batch`` on a real ``FSDPEngineWithLMHead`` front end (the tiny model with verl's
Qwen3.5 monkey patch, no FSDP wrapping: one process, one rank), so ``maybe_fix_3d_position_ids``,
``prepare_micro_batches``, ``prepare_model_inputs``, the forward and ``prepare_model_outputs`` are
verl's. Each row's log-probs and entropy are compared (``torch.testing.assert_close``, default
tolerances) with the row alone through transformers' own forward, computed before verl patches
the model classes. Prints one JSON object on its last line: case -> path -> {"ok", "error"}.

    python packed_path_probe.py MODEL_DIR [--cases CASE,...] [--bugs CASE,...]

``--bugs`` reruns cases with an injected bug, to show the check catches each: verl 0.9.1's own
position fix (``_ragged_idx = 2``), our earlier fix (the ragged dimension read from the storage's
shape, no rebuild), the model built without the CPU Gated DeltaNet kernels, and full attention
that runs across the packed sequences (the CPU packed attention replaced by unmasked sdpa).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from types import SimpleNamespace

import torch

CASES = {
    # name: (row kinds, token lengths, batching)
    **{f"fresh_equal_{n}": (["fresh"] * n, [23] * n, "dynamic") for n in (1, 2, 4, 8)},
    **{f"replayed_equal_{n}": (["replayed"] * n, [23] * n, "dynamic") for n in (1, 2, 4, 8)},
    **{f"elite_equal_{n}": (["elite"] * n, [23] * n, "dynamic") for n in (1, 2, 4, 8)},
    # B rows of 4B tokens: the storage [4B, L] is square, the case an earlier fix misread
    "fresh_equal_2_square": (["fresh"] * 2, [8, 8], "dynamic"),
    "mixed_kinds_mixed_lengths": (
        ["fresh", "replayed", "elite", "fresh", "replayed", "elite"],
        [23, 17, 30, 9, 23, 12],
        "dynamic",
    ),
    "several_micro_batches": (["fresh", "replayed", "elite", "fresh"] * 2, [23] * 8, "dynamic_small"),
    "fixed_micro_batches": (["fresh", "replayed", "elite", "fresh"], [23, 23, 23, 23], "fixed"),
    "fixed_micro_batches_mixed": (["fresh", "elite", "replayed", "fresh"], [23, 11, 23, 30], "fixed"),
}
BATCHING = {
    "dynamic": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 4096},
    "dynamic_small": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 50},  # ~2 rows per micro-batch
    "fixed": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2},
}
PROMPT_TOKENS = 6


def fresh_position_ids(processor, input_ids: torch.Tensor) -> torch.Tensor:
    """verl's agent loop: ``AgentLoopWorker._compute_position_ids`` for a text-only row -> (4, L)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = SimpleNamespace(processor=processor)
    ones = torch.ones_like(input_ids)[None]
    # the processor's text-only output carries mm_token_type_ids (all text), as the agent loop gets it
    inputs = {"mm_token_type_ids": torch.zeros_like(input_ids)[None]}
    return AgentLoopWorker._compute_position_ids(worker, input_ids[None], ones, inputs)[0]


def build_rows(kinds: list[str], lengths: list[int], processor, vocab: int, seed: int) -> list[dict]:
    from verl_replay.data.tiny_assets import SPECIAL_TOKENS
    from verl_replay.integrations.verl import elite_replay
    from verl_replay.integrations.verl.rows import group_to_rows, rows_to_group, text_position_ids

    gen = torch.Generator().manual_seed(seed)
    tokenizer = processor.tokenizer
    special = set(tokenizer.all_special_ids) | set(tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)))
    text_tokens = torch.tensor([t for t in range(vocab) if t not in special])  # no vision placeholders
    rows = []
    for kind, length in zip(kinds, lengths, strict=True):
        prompt_len = min(PROMPT_TOKENS, length - 1)
        input_ids = text_tokens[torch.randint(0, text_tokens.numel(), (length,), generator=gen)]
        prompt, response = input_ids[:prompt_len], input_ids[prompt_len:]
        fresh = {
            "prompts": prompt,
            "responses": response,
            "input_ids": input_ids,
            "position_ids": fresh_position_ids(processor, input_ids),
            "response_mask": torch.ones_like(response),
            "loss_mask": torch.ones_like(response),
            "rm_scores": torch.zeros(response.numel()),
            "rollout_log_probs": torch.zeros(response.numel()),
            "advantages": torch.ones(response.numel()),
            "extra_fields": {"reward_extra_info": {"acc": 1.0}},
        }
        if kind == "replayed":  # through the buffer's compact group and back, as an injected replay row
            group = rows_to_group([fresh], anchor_field="rollout_log_probs")
            row = group_to_rows(group, uid="u", global_steps=1)[0]
        elif kind == "elite":  # EliteReplayStream._row: the fresh rows' position layout, text positions
            row = dict(fresh)
            row["position_ids"] = text_position_ids(length, elite_replay._leading_shape(fresh["position_ids"]))
            row["loss_mask"] = torch.zeros_like(response)
        else:
            row = fresh
        rows.append({k: row[k] for k in ("input_ids", "position_ids", "loss_mask", "responses", "response_mask")})
    return rows


def transfer_queue_batch(rows: list[dict]):
    """The TensorDict a worker gets: TransferQueue packs each field, then a Ray call pickles it."""
    from tensordict import TensorDict
    from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager

    fields = {name: AsyncSimpleStorageManager._pack_field_values([r[name] for r in rows]) for name in rows[0]}
    data = TensorDict(fields, batch_size=len(rows))
    return pickle.loads(pickle.dumps(data.consolidate()))


def alone(model, row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each next token and entropies of one row through transformers' own forward."""
    with torch.no_grad():
        logits = model(
            input_ids=row["input_ids"][None], position_ids=row["position_ids"][:, None], use_cache=False
        ).logits[0]  # [L, V]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    labels = torch.roll(row["input_ids"], shifts=-1)
    token = log_probs.gather(-1, labels[:, None])[:, 0]  # [L]
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # [L]
    return token, entropy


def make_engine(model):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)  # the front end only: no FSDP, one rank
    engine.module = model
    engine.pad_to_length, engine.pad_to_length_bucket = False, 1024
    engine.ulysses_sequence_parallel_size, engine.use_ulysses_sp = 1, False
    engine.pass_packed_cu_seqlens = "cu_seqlens" in __import__("inspect").signature(model.forward).parameters
    engine._autocast_dtype, engine.scaler = torch.float32, None
    engine.engine_config = SimpleNamespace(
        entropy_checkpointing=False, entropy_from_logits_with_chunking=True, entropy_from_logits_chunk_size=8
    )
    from verl.utils import torch_functional as verl_F

    engine.compute_entropy_from_logits = verl_F.entropy_from_logits_with_chunking
    engine.get_data_parallel_group = lambda: None
    engine.get_data_parallel_size = lambda: 1
    engine.get_data_parallel_rank = lambda: 0
    engine.is_mp_src_rank_with_outputs = lambda: True
    return engine


def run_case(engine, reference, rows, packed: bool, batching: str) -> dict:
    from verl.utils import tensordict_utils as tu

    data = transfer_queue_batch(rows)
    tu.assign_non_tensor(data, use_remove_padding=packed, temperature=1.0, calculate_entropy=True, **BATCHING[batching])
    try:
        output = engine.infer_batch(data)
        model_output = output["model_output"]
        for i, (log_probs, entropy) in enumerate(reference):
            # the last position's label is the next packed row's first token (verl rolls the packed
            # tokens once), never a trained-on token: compare every position before it
            ours = model_output["log_probs"][i][:-1]
            torch.testing.assert_close(ours, log_probs[:-1], msg=lambda m, i=i: f"row {i}: {m}")
            torch.testing.assert_close(model_output["entropy"][i], entropy, msg=lambda m, i=i: f"row {i} entropy: {m}")
    except Exception as exc:  # noqa: BLE001 - the report carries any failure
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    return {"ok": True, "error": ""}


def verls_own_fix(data) -> None:
    """verl 0.9.1's ``maybe_fix_3d_position_ids``: ``_ragged_idx = 2`` on every 3-D nested tensor."""
    if "position_ids" in data.keys() and data["position_ids"].dim() == 3 and data["position_ids"].is_nested:
        data["position_ids"]._ragged_idx = 2


def layout_only_fix(data) -> None:
    """Our earlier fix: the ragged dimension read from the storage's shape alone, no rebuild."""
    if "position_ids" in data.keys() and data["position_ids"].dim() == 3 and data["position_ids"].is_nested:
        positions = data["position_ids"]
        values, total = positions.values(), int(positions.offsets()[-1])
        positions._ragged_idx = 1 if values.shape[0] == total and values.shape[1] != total else 2


def unmasked_attention(module, query, key, value, attention_mask, **kwargs):
    """The bug the CPU packed attention must not have: causal attention over the whole pack."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("position_ids", None)
    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument(
        "--bugs",
        default="",
        help="also run these cases with an injected bug: CASE,... for verl's own position fix, our earlier "
        "layout-only fix and transformers' own Gated DeltaNet kernels (no CPU kernels)",
    )
    options = parser.parse_args()
    assert os.environ.get("VERL_PLATFORM") == "cpu", "run with VERL_PLATFORM=cpu, as a CPU Ray worker"
    import torch.distributed as dist
    from transformers import AutoModelForImageTextToText
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import hf_processor
    from verl.workers.engine import base as engine_base

    from verl_replay.integrations.verl import verl_fixes

    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    processor = hf_processor(options.model_dir)
    model = AutoModelForImageTextToText.from_pretrained(options.model_dir, dtype=torch.float32).eval()
    installed = (modeling_qwen3_5.causal_conv1d_fn, modeling_qwen3_5.chunk_gated_delta_rule)
    modeling_qwen3_5.causal_conv1d_fn = modeling_qwen3_5.chunk_gated_delta_rule = None  # the bare CPU stack
    bare = AutoModelForImageTextToText.from_pretrained(options.model_dir, dtype=torch.float32).eval()
    modeling_qwen3_5.causal_conv1d_fn, modeling_qwen3_5.chunk_gated_delta_rule = installed
    vocab = model.config.text_config.vocab_size
    names = [n for n in options.cases.split(",") if n] or list(CASES)
    bugs = [n for n in options.bugs.split(",") if n]
    cases = {name: build_rows(*CASES[name][:2], processor, vocab, seed=i) for i, name in enumerate(names + bugs)}
    references = {name: [alone(model, row) for row in rows] for name, rows in cases.items()}
    apply_monkey_patch(model=model, use_remove_padding=True)  # what verl's FSDP engine does when it builds the model
    assert engine_base.maybe_fix_3d_position_ids is verl_fixes.fix_3d_position_ids_by_layout  # the plugin's fix
    variants = {"ours": (model, verl_fixes.fix_3d_position_ids_by_layout, names)}
    if bugs:
        variants.update(
            {
                "verl_position_fix": (model, verls_own_fix, bugs),
                "layout_only_position_fix": (model, layout_only_fix, bugs),
                "no_cpu_kernels": (bare, verl_fixes.fix_3d_position_ids_by_layout, bugs),
            }
        )
        variants["attention_across_sequences"] = (model, verl_fixes.fix_3d_position_ids_by_layout, bugs)
    report = {}
    packed_attention = AttentionInterface._global_mapping["sdpa"]
    for variant, (module, fix, variant_cases) in variants.items():
        engine_base.maybe_fix_3d_position_ids = fix
        attention = unmasked_attention if variant == "attention_across_sequences" else packed_attention
        AttentionInterface.register("sdpa", attention)
        engine = make_engine(module)
        report[variant] = {
            name: {
                path: run_case(engine, references[name], cases[name], path == "packed", CASES[name][2])
                for path in ("packed", "padded")
            }
            for name in variant_cases
        }
    AttentionInterface.register("sdpa", packed_attention)
    layer = model.model.language_model.layers[0].linear_attn
    report["kernels"] = {
        "chunk_gated_delta_rule": getattr(layer.chunk_gated_delta_rule, "__name__", "?"),
        "causal_conv1d_fn": getattr(layer.causal_conv1d_fn, "__name__", None),
        "attention": packed_attention.__name__,
        "pass_packed_cu_seqlens": make_engine(model).pass_packed_cu_seqlens,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
