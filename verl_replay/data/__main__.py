"""``python -m verl_replay.data prepare DATASET --input DIR --output DIR`` (DATASET: see ``DATASETS``).

Writes verl RL parquet files from a local benchmark download (nothing is downloaded) and
prints what was written. Examples::

    python -m verl_replay.data prepare bird   --input ~/data/bird   --output data/ --split dev
    python -m verl_replay.data prepare bird   --input ~/data/bird   --output data/ --split dev \\
        --databases-dir ~/data/bird/dev_20240627/dev_databases
    python -m verl_replay.data prepare spider --input ~/data/spider --output data/ --split train --limit 1000
    python -m verl_replay.data prepare ambiqt --input ~/AmbiQT/benchmark --databases-dir ~/ambiqt_dbs --output data/
    python -m verl_replay.data prepare math   --input ~/data/math --output data/ --benchmarks math500,aime24
    python -m verl_replay.data prepare math   --input ~/data/dapo.parquet --benchmark train --output data/ \\
        --problem-field prompt_text --answer-field solution
    python -m verl_replay.data prepare search --input ~/data/flashrag --output data/ \
        --retrieval-url http://127.0.0.1:8000/retrieve      # or --corpus ~/data/wiki-18.jsonl
    python -m verl_replay.data prepare geo3k  --input ~/data/geometry3k/data --output data/
    python -m verl_replay.data prepare tiny   --output ~/.cache/verl_replay/tiny-v1
    python -m verl_replay.data prepare tiny-search        # the tiny tasks, next to the cached tiny assets
    python -m verl_replay.data prepare tiny-arith         # (tiny-search, tiny-image, tiny-arith, tiny-shapes)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from verl_replay.data import prepare as prep

TINY_TASKS = ("tiny-search", "tiny-image", "tiny-arith", "tiny-shapes")
DATASETS = ("bird", "spider", "ambiqt", "math", "search", "geo3k", "tiny", *TINY_TASKS)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m verl_replay.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="write verl RL parquet files")
    p.add_argument("dataset", choices=DATASETS)
    p.add_argument("--input", help="local download: folder (or a file for math / ambiqt); unused for tiny")
    p.add_argument("--output", help="output folder (tiny: the asset root; the tiny-<task> tasks: unused)")
    p.add_argument(
        "--split",
        help="bird/spider: train|dev (default dev); ambiqt: default validation; "
        "math: the extra_info.split value (default train for 'train', else test)",
    )
    p.add_argument("--limit", type=int, help="keep at most N examples per file")
    p.add_argument("--databases-dir", help="bird/spider: override the databases folder; ambiqt: required")
    p.add_argument("--sample-rows", type=int, default=0, help="SQL: append N sample rows per table to the schema")
    p.add_argument("--system-prompt", help="prepend a system message to every prompt")
    p.add_argument("--no-check-executable", action="store_true", help="ambiqt: keep examples whose gold SQL fails")
    p.add_argument("--benchmarks", help="math: comma-separated subset of the benchmarks found in --input")
    p.add_argument("--benchmark", help="math: name of the benchmark when --input is a single file")
    p.add_argument("--problem-field", help="math: column holding the problem")
    p.add_argument("--answer-field", help="math: column holding the final answer")
    p.add_argument("--solution-field", help="math: column whose last \\boxed{} is the answer")
    p.add_argument("--id-field", help="math: column holding the question id")
    p.add_argument("--retrieval-url", help="search: the retrieval server (python -m verl_replay.search.server)")
    p.add_argument("--corpus", help="search: a JSON-lines corpus for a local BM25 index instead of a server")
    p.add_argument("--topk", type=int, default=3, help="search: documents per search call")
    p.add_argument("--seed", type=int, default=0, help="tiny: generation seed")
    p.add_argument("--model-arch", default="qwen3_5", choices=("qwen3_5", "qwen2"), help="tiny: model class")
    p.add_argument("--force", action="store_true", help="tiny: rebuild even if cached")
    return parser


def _need_input(args: argparse.Namespace) -> str:
    if not args.input:
        raise SystemExit(f"prepare {args.dataset}: --input is required")
    return args.input


def _run(args: argparse.Namespace) -> list[prep.PreparedFile]:
    if args.dataset in TINY_TASKS:
        from verl_replay.data.tiny_tasks import build_tiny_task

        task = build_tiny_task(args.dataset.split("-")[1], seed=args.seed, force=args.force)
        counts = task.manifest()["counts"]
        print(f"{'built' if task.built_now else 'reused cached'} tiny {task.task} task; model: {task.model_dir}")
        return [
            prep.PreparedFile(task.train, counts["train"], args.dataset, "train"),
            prep.PreparedFile(task.val, counts["val"], args.dataset, "val"),
        ]
    if not args.output:
        raise SystemExit(f"prepare {args.dataset}: --output is required")
    if args.dataset == "search":
        return prep.prepare_search(
            _need_input(args),
            args.output,
            retrieval_url=args.retrieval_url,
            corpus=args.corpus,
            topk=args.topk,
            limit=args.limit,
        )
    if args.dataset == "geo3k":
        return prep.prepare_geo3k(_need_input(args), args.output, limit=args.limit)
    common = {"limit": args.limit, "with_sample_rows": args.sample_rows, "system_prompt": args.system_prompt}
    if args.dataset == "bird":
        return prep.prepare_bird(
            _need_input(args), args.output, split=args.split or "dev", databases_dir=args.databases_dir, **common
        )
    if args.dataset == "spider":
        return prep.prepare_spider(
            _need_input(args), args.output, split=args.split or "dev", databases_dir=args.databases_dir, **common
        )
    if args.dataset == "ambiqt":
        if not args.databases_dir:
            raise SystemExit("prepare ambiqt: --databases-dir is required (folder of <db_id>/<db_id>.sqlite)")
        files, skipped = prep.prepare_ambiqt(
            _need_input(args),
            args.output,
            databases_dir=args.databases_dir,
            split=args.split or "validation",
            check_executable=not args.no_check_executable,
            **common,
        )
        if skipped:
            print(f"skipped {len(skipped)} AmbiQT examples whose gold SQL does not execute; first: {skipped[0][1]}")
        return files
    if args.dataset == "math":
        fields = {
            "problem_field": args.problem_field,
            "answer_field": args.answer_field,
            "solution_field": args.solution_field,
            "id_field": args.id_field,
        }
        return prep.prepare_math(
            _need_input(args),
            args.output,
            benchmarks=args.benchmarks.split(",") if args.benchmarks else None,
            benchmark=args.benchmark,
            split=args.split,
            limit=args.limit,
            system_prompt=args.system_prompt,
            **fields,
        )
    # tiny_assets builds on prepare's row layout, so it is imported here, not from prepare.py
    from verl_replay.data.tiny_assets import build_tiny_assets

    assets = build_tiny_assets(Path(args.output), seed=args.seed, model_arch=args.model_arch, force=args.force)
    counts = assets.manifest()["counts"]
    print(f"{'built' if assets.built_now else 'reused cached'} tiny assets; model and tokenizer: {assets.model_dir}")
    return [
        prep.PreparedFile(assets.math_train, counts["math_train"], "tiny_math", "train"),
        prep.PreparedFile(assets.math_val, counts["math_val"], "tiny_math", "val"),
        prep.PreparedFile(assets.sql_train, counts["sql_train"], "tiny_sql", "train"),
        prep.PreparedFile(assets.sql_val, counts["sql_val"], "tiny_sql", "val"),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        files = _run(args)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {message}", file=sys.stderr)
        return 2
    for f in files:
        print(f"wrote {f.rows:6d} rows  {f.data_source:<14} split={f.split:<10} -> {f.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
