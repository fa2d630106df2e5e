"""verl's packed log-prob forward on CPU, with verl_replay's CPU kernels and with transformers' and
verl's own CPU paths, side by side in one process.

    python benchmarks/bench_packed_forward.py [--rows 128,384] [--lengths 10-14] [--repeats 5]

What a Headroom-Drift scan pass (and verl's ``old_log_prob``) runs on the CPU profile: verl's
``infer_batch`` (micro-batching, ``prepare_model_inputs``, the patched Qwen3.5 forward on one
packed row, ``prepare_model_outputs``) on the addition profile's model, ``rows`` answers of
``lengths`` tokens, one thread. Two settings, same rows, same weights:

- ``own``: transformers' sdpa over the whole pack under its dense ``[T, T]`` mask, the torch Gated
  DeltaNet fallback in its default 64-token chunks, verl's one-logsumexp-per-token log-probs;
- ``ours``: the installed CPU kernels (packed attention within each sequence and no dense mask,
  16-token chunks, log-probs in row blocks).

Both use the batched packed convolution (its per-sequence predecessor is gone). Prints the best
wall time of each, their ratio, and the largest log-prob difference between the two (float32
rounding: the arithmetic is the same, blocked differently).
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager
from types import SimpleNamespace


def _rows(count: int, lengths: tuple[int, int], vocab: int, seed: int = 0) -> list[dict]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        input_ids = torch.randint(10, vocab, (length,), generator=gen)
        prompt = 7
        rows.append(
            {
                "prompts": input_ids[:prompt],
                "responses": input_ids[prompt:],
                "input_ids": input_ids,
                "position_ids": torch.arange(length).expand(4, length).clone(),  # [4, L]: text-only M-RoPE
                "response_mask": torch.ones(length - prompt, dtype=torch.int64),
                "loss_mask": torch.ones(length - prompt, dtype=torch.int64),
            }
        )
    return rows


def _engine(model):
    import torch
    from verl.utils import torch_functional as verl_F
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)  # the front end on one rank, no FSDP
    engine.module = model
    engine.pad_to_length, engine.pad_to_length_bucket = False, 1024
    engine.ulysses_sequence_parallel_size, engine.use_ulysses_sp = 1, False
    engine.pass_packed_cu_seqlens = True
    engine._autocast_dtype, engine.scaler = torch.float32, None
    engine.engine_config = SimpleNamespace(
        entropy_checkpointing=False, entropy_from_logits_with_chunking=True, entropy_from_logits_chunk_size=8
    )
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits_with_chunking
    engine.get_data_parallel_group = lambda: None
    engine.get_data_parallel_size = lambda: 1
    engine.get_data_parallel_rank = lambda: 0
    engine.is_mp_src_rank_with_outputs = lambda: True
    return engine


@contextmanager
def _own_paths():
    """transformers' sdpa and mask, its 64-token chunks, verl's per-token log-probs, for the block."""
    from transformers.integrations import sdpa_attention
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from verl.workers.engine.fsdp import transformer_impl

    from verl_replay.integrations.verl import cpu_linear_attention

    saved = (
        AttentionInterface._global_mapping["sdpa"],
        modeling_qwen3_5.create_causal_mask,
        cpu_linear_attention.PACKED_CHUNK,
        transformer_impl.logprobs_from_logits,
    )
    AttentionInterface._global_mapping["sdpa"] = sdpa_attention.sdpa_attention_forward
    modeling_qwen3_5.create_causal_mask = modeling_qwen3_5.create_causal_mask.__wrapped__
    cpu_linear_attention.PACKED_CHUNK = 64
    transformer_impl.logprobs_from_logits = transformer_impl.logprobs_from_logits.__wrapped__
    try:
        yield
    finally:
        AttentionInterface._global_mapping["sdpa"] = saved[0]
        modeling_qwen3_5.create_causal_mask = saved[1]
        cpu_linear_attention.PACKED_CHUNK = saved[2]
        transformer_impl.logprobs_from_logits = saved[3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="128,384", help="answers per forward (a scan pass: 16 groups x 8 = 128)")
    parser.add_argument("--lengths", default="10-14", help="tokens per answer, prompt included (addition: 10-14)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="model dir (default: the addition profile's warm start)")
    args = parser.parse_args()
    os.environ.setdefault("VERL_PLATFORM", "cpu")  # the plugin installs the CPU support on import

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForImageTextToText
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import tensordict_utils as tu

    from verl_replay.data.tiny_tasks import build_tiny_task

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    model_dir = args.model or str(build_tiny_task("arith").model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    apply_monkey_patch(model=model, use_remove_padding=True)
    engine = _engine(model)
    low, high = (int(n) for n in args.lengths.split("-"))
    print(f"{'rows':>6} {'own ms':>9} {'ours ms':>9} {'ratio':>6}  max |log-prob diff|")
    for count in (int(n) for n in args.rows.split(",")):
        rows = _rows(count, (low, high), model.config.text_config.vocab_size)

        def forward(rows=rows):
            data = tu.list_of_dict_to_tensordict(rows)
            tu.assign_non_tensor(
                data,
                use_remove_padding=True,
                temperature=1.0,
                calculate_entropy=False,
                use_dynamic_bsz=True,
                max_token_len_per_gpu=32768,
            )
            with torch.no_grad():
                return engine.infer_batch(data)["model_output"]["log_probs"]

        def best(fn):
            fn()  # warm-up
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                out = fn()
                times.append(time.perf_counter() - start)
            return min(times), out

        with _own_paths():
            own_s, own = best(forward)
        ours_s, ours = best(forward)
        diff = max(float((a - b).abs().max()) for a, b in zip(own.unbind(), ours.unbind(), strict=True))
        print(f"{count:6d} {1000 * own_s:9.1f} {1000 * ours_s:9.1f} {own_s / ours_s:5.1f}x  {diff:.1e}")


if __name__ == "__main__":
    main()
