"""Offline approach-vocabulary induction: the frozen model names the strategy of each
seed solution; names are normalised, merged and counted; the result is written as YAML with
``reviewed: false`` for a human to edit before it is used.

    python -m verl_replay.sql.induce_vocabulary --seeds seeds.jsonl --backend hf \
        --model PATH --out vocab.yaml [--max-approaches 16]

``seeds.jsonl`` holds one JSON object per line with the solution in ``--field`` (default
``sql``). Tests call :func:`main` with an injected ``backend``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verl_replay.sql.vocabulary import induce_vocabulary, iter_jsonl_field, write_induced_vocabulary

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m verl_replay.sql.induce_vocabulary",
        description="Induce an approach vocabulary from seed solutions with a frozen model.",
    )
    parser.add_argument("--seeds", required=True, type=Path, help="JSONL file of seed solutions")
    parser.add_argument("--out", required=True, type=Path, help="YAML file to write (reviewed: false)")
    parser.add_argument("--backend", default="hf", help="generation backend: hf | vllm (default: hf)")
    parser.add_argument("--model", help="model path (required unless a backend is injected)")
    parser.add_argument("--field", default="sql", help="JSON field holding the solution (default: sql)")
    parser.add_argument("--domain", default="sql", choices=["sql", "math"], help="words the prompt")
    parser.add_argument("--max-approaches", type=int, default=16)
    parser.add_argument("--examples-per-approach", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per generate call")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="hf backend only")
    parser.add_argument("--dtype", default=None, help="model dtype (hf default float32, vllm default auto)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm backend only")
    parser.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        default=None,
        help="JSON passed to the chat template, e.g. '{\"enable_thinking\": false}'",
    )
    return parser


def _make_backend(args: argparse.Namespace) -> Any:
    from verl_replay.generation import make_backend

    if not args.model:
        raise SystemExit("--model is required to build a generation backend")
    kwargs: dict[str, Any] = {"model_path": args.model, "chat_template_kwargs": args.chat_template_kwargs}
    if args.backend.lower() in ("hf", "transformers"):
        kwargs.update(device=args.device, dtype=args.dtype or "float32")
    else:
        kwargs.update(tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype or "auto")
    return make_backend(args.backend, **kwargs)


def main(argv: Sequence[str] | None = None, *, backend: Any = None) -> int:
    """Run the CLI; ``backend`` (a GenerationBackend) replaces ``--backend/--model`` when given."""
    args = build_parser().parse_args(argv)
    with args.seeds.open(encoding="utf-8") as handle:
        items = list(iter_jsonl_field(handle, args.field, source=str(args.seeds)))
    if not items:
        raise SystemExit(f"{args.seeds}: no seed solutions found")
    if backend is None:
        backend = _make_backend(args)
    result = induce_vocabulary(
        items,
        backend,
        domain=args.domain,
        max_approaches=args.max_approaches,
        examples_per_approach=args.examples_per_approach,
        batch_size=args.batch_size,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    extra = {"seeds_file": str(args.seeds), "model": args.model, "backend": args.backend, "seed": args.seed}
    path = write_induced_vocabulary(result, args.out, extra=extra)
    print(
        f"wrote {len(result.vocabulary)} approaches from {result.num_items} seeds "
        f"({result.unparsed} unparsed answers, {len(result.dropped)} names dropped) to {path}; "
        "review it and set 'reviewed: true'",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
