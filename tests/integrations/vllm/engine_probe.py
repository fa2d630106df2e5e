"""One vLLM engine (vLLM's CPU build, the cpu_tiny settings) on the tiny model, measured against a
plain transformers forward; run as a script (vLLM spawns its engine process: a ``__main__`` guard).

    python engine_probe.py MODEL_DIR OUT_JSON [--stale-nan-only]

Writes, per check, the numbers test_cpu_engine.py asserts on:

- ``stale_nan``: every full-attention KV-cache block filled with NaN (what a cut sequence or a model
  mid-update can leave behind), then greedy generation: are the log-probs finite, and do they match
  the fp32 forward?
- ``temperature``: sampled-token log-probs at T=0.7 (verl's default ``logprobs_mode``,
  ``processed_logprobs``) against log_softmax(logits / 0.7) and against log_softmax(logits);
- ``top_k``: the same at T=1 with top_k=3, against the log-softmax renormalised over the top 3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

PROMPTS = [f"What is {a} + {b}?" for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4))]
MAX_TOKENS = 12


def _fill_full_attention_caches_with_nan(worker) -> int:
    from verl_replay.integrations.vllm.cpu_kv_zeroing import full_attention_targets

    targets = full_attention_targets(worker.model_runner)
    for target in targets:
        target.cache.fill_(float("nan"))
    return len(targets)


def _reference(model, prompt_ids: list[int], response_ids: list[int]):
    import torch

    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()  # [L, V]
    start = len(prompt_ids) - 1
    return logits[start : start + len(response_ids)], torch.tensor(response_ids)  # [T, V], [T]


def _distances(model, outputs, transform) -> list[float]:
    """|vLLM's log-prob - transform(logits)[token]| for every sampled token of ``outputs``."""
    import torch

    out = []
    for result in outputs:
        completion = result.outputs[0]
        tokens = list(completion.token_ids)
        ours = torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)])
        logits, targets = _reference(model, list(result.prompt_token_ids), tokens)
        reference = transform(logits).gather(-1, targets[:, None])[:, 0]
        out += (ours - reference).abs().tolist()
    return out


def _summary(values: list[float]) -> dict:
    finite = [v for v in values if v == v]
    return {
        "tokens": len(values),
        "nan": len(values) - len(finite),
        "median": statistics.median(finite) if finite else None,
        "mean": statistics.fmean(finite) if finite else None,
        "max": max(finite) if finite else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--stale-nan-only", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function

    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS
    ]
    llm = LLM(  # the cpu_tiny profile's engine settings
        args.model,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        mamba_ssm_cache_dtype="float32",
        max_model_len=256,
        seed=0,
        logprobs_mode="processed_logprobs",
    )
    model = AutoModelForImageTextToText.from_pretrained(args.model).eval()
    report: dict = {}

    poisoned = llm.collective_rpc(_fill_full_attention_caches_with_nan)[0]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True))
    report["stale_nan"] = {
        "caches_poisoned": poisoned,
        **_summary(_distances(model, greedy, lambda logits: torch.log_softmax(logits, -1))),
    }
    if not args.stale_nan_only:
        hot = llm.generate(prompts, SamplingParams(temperature=0.7, max_tokens=MAX_TOKENS, logprobs=0, seed=1))
        report["temperature"] = {
            "scaled": _summary(_distances(model, hot, lambda logits: torch.log_softmax(logits / 0.7, -1))),
            "unscaled": _summary(_distances(model, hot, lambda logits: torch.log_softmax(logits, -1))),
        }

        def top3(logits):
            kept = logits.topk(3, dim=-1)
            masked = torch.full_like(logits, float("-inf")).scatter(-1, kept.indices, kept.values)
            return torch.log_softmax(masked, -1)

        top_k = SamplingParams(temperature=1.0, top_k=3, max_tokens=MAX_TOKENS, logprobs=0, seed=2)
        narrow = llm.generate(prompts, top_k)
        report["top_k"] = {
            "renormalised": _summary(_distances(model, narrow, top3)),
            "full": _summary(_distances(model, narrow, lambda logits: torch.log_softmax(logits, -1))),
        }
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
