"""``python -m verl_replay.preflight [options] [hydra overrides]``: check the stack a training
config needs before any GPU is touched, one line per check with the fix.

The overrides are those of ``python -m verl_replay.main`` (the recipes pass their training
overrides); the config is composed and resolved the same way. Options:

    --stages search,train,eval   stages the run will do (GPU count: the training placement when
                                 ``train`` is among them, else ``--generation-gpus``)
    --generation-gpus N          GPUs of the search / evaluation vLLM engine (default 1)
    --json PATH                  also write the checks as JSON
    --memory-table               print the per-GPU memory budget of the config as Markdown
                                 (the model's config.json, else the Qwen3.5-4B shape) and exit
    --choose-attn REQUESTED      print ``IMPL USE_REMOVE_PADDING`` for ``auto`` or a name and exit

Exit status: 0 when nothing failed, 1 when a check failed, 2 for a config that does not compose.
The checks themselves live in :mod:`verl_replay.integrations.verl.preflight`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

PREFIX = "[preflight]"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m verl_replay.preflight",
        description=(
            "Check the stack a training config needs before any GPU is touched: one line per check, with the fix. "
            "Extra arguments are the Hydra overrides of python -m verl_replay.main."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--stages", default="train", help="comma-separated: search, train, eval (default: train)")
    p.add_argument("--generation-gpus", type=int, default=1, help="GPUs of the search / eval engine (default: 1)")
    p.add_argument("--json", type=Path, default=None, help="write the checks to this JSON file too")
    p.add_argument("--memory-table", action="store_true", help="print the memory budget table and exit")
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="--memory-table: usable GPU memory (default: an A100 80GB's, 79.3 GiB, the recipes' GPUs)",
    )
    p.add_argument(
        "--choose-attn",
        metavar="REQUESTED",
        default=None,
        help="print the attention implementation for REQUESTED (auto or a name) and exit",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    options, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unknown option(s) {unknown}; hydra overrides look like key=value")

    from verl_replay.integrations.verl import preflight as pf

    if options.choose_attn is not None:
        impl, packed, why = pf.choose_attention(options.choose_attn)
        print(f"{PREFIX} attention: {why}", file=sys.stderr)
        print(f"{impl} {packed}")
        return 0
    try:
        config = pf.compose_config(overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra/OmegaConf raise many types for a bad override
        print(f"{PREFIX} error: the config does not compose: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if options.memory_table:
        return _memory_table(pf, config, options.gpu_memory_gib)
    stages = [s.strip() for s in options.stages.split(",") if s.strip()]
    checks, budget = pf.run_checks(config, stages=stages, generation_gpus=options.generation_gpus)
    model = pf.config_value(config, "actor_rollout_ref.model.path", "?")
    mode = pf.config_value(config, "trainer.v1.trainer_mode", "sync")
    print(
        f"{PREFIX} trainer.device={pf.config_value(config, 'trainer.device', 'cuda')} trainer_mode={mode} "
        f"stages={','.join(stages)} model={model}",
        flush=True,
    )
    for check in checks:
        for line in check.lines():
            print(f"{PREFIX} {line}")
    if budget is not None:
        from verl_replay.memory_budget import budget_lines

        for line in budget_lines(budget):
            print(f"{PREFIX} memory: {line}")
    print(f"{PREFIX} {pf.summary(checks)}", flush=True)
    if options.json is not None:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(pf.to_json(checks), indent=1) + "\n", encoding="utf-8")
    return 1 if any(c.status == pf.FAIL for c in checks) else 0


def _memory_table(pf, config: dict, gpu_memory_gib: float | None) -> int:
    from verl_replay.memory_budget import DEFAULT_GPU, GPU_MEMORY_GIB, ModelShape, estimate, format_markdown

    path = str(pf.config_value(config, "actor_rollout_ref.model.path", ""))
    try:
        hf_config = pf.Probe().read_model_config(path)
    except (OSError, ValueError):
        hf_config = None
    shape = ModelShape.from_hf_config(hf_config) if hf_config else pf.reference_shape()
    source = (
        f"{path}/config.json" if hf_config else "the Qwen3.5-4B shape (verl_replay.memory_budget.QWEN3_5_4B_CONFIG)"
    )
    if gpu_memory_gib is None:
        name, memory = DEFAULT_GPU, GPU_MEMORY_GIB[DEFAULT_GPU]
    else:
        name, memory = f"{gpu_memory_gib:g} GiB GPU", gpu_memory_gib
    # flash attention implies flash-attn's fused cross-entropy; sdpa / eager the padded path
    budget = estimate(shape, pf.run_sizes(config, memory, gpu_name=name))
    print(f"Model shape from {source}; attention {pf.attention_of(config)}.\n")
    print(format_markdown(budget), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
