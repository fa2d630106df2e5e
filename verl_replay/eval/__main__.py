"""``python -m verl_replay.eval``: sample, verify and report pass@k / Mean@n / Best@n.

Example (tiny CPU run)::

    python -m verl_replay.eval --data sql/val.parquet --model model_sql --out eval_out \\
        --n 4 --k 1,2,4 --max-new-tokens 48 --limit 3

Writes ``results.json``, ``samples.jsonl``, ``table.md`` and ``pass_at_k.png`` into ``--out``
and prints the table. ``samples.jsonl`` grows chunk by chunk while the run goes (with
``eval_state.json`` saying what is committed): the same command, rerun after an interruption,
resumes after the last committed chunk; other settings with the same ``--out`` are refused
unless ``--overwrite``. Prompts longer than ``--max-model-len - 1`` tokens are skipped and
counted in ``results.json``. Exit status 2 for a usage / data error (message on stderr).

The console shows short ``eval: ...`` lines on stderr (what is evaluated, a line per chunk when
no progress bar shows it, warnings) and the table last on stdout; ``OUT/eval.log`` keeps every log
record with its time, other libraries' included.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m verl_replay.eval",
        description="Sample k responses per question, verify them, report pass@k, Mean@n/Best@n, "
        "distinct SQL strategies and AmbiQT coverage.",
    )
    p.add_argument("--data", action="append", required=True, help="RL parquet file(s); comma-separated and/or repeated")
    p.add_argument("--model", required=True, help="model directory (or hub id for vLLM/HF caches)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--backend",
        default="hf",
        choices=["hf", "transformers", "vllm"],
        help="hf: transformers generate (CPU); vllm: GPU (default: hf)",
    )
    p.add_argument("--n", type=int, default=32, help="samples per question (default: 32)")
    p.add_argument("--k", type=_int_list, default=[1, 8, 32], help="pass@k values, e.g. 1,8,32 (k > n is skipped)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="first N questions of each benchmark")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm only")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vllm only")
    p.add_argument("--max-model-len", type=int, default=None, help="vllm only")
    p.add_argument("--batch-size", type=int, default=32, help="hf only: sequences per generate call")
    p.add_argument("--verify-workers", type=int, default=2, help="verifier processes")
    p.add_argument("--verify-timeout-s", type=float, default=5.0, help="deadline per SQL query / math check")
    p.add_argument(
        "--benchmark-key",
        default="auto",
        help="group rows by: auto (math: extra_info.benchmark, else data_source), data_source, or extra_info.<field>",
    )
    p.add_argument(
        "--chunk-questions",
        type=int,
        default=256,
        help="questions per generate call and per committed chunk of samples.jsonl (default: 256)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="start over in --out instead of resuming the evaluation found there"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the per-chunk log lines stay)")
    p.add_argument("--quiet", action="store_true", help="log warnings only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.out, quiet=args.quiet)
    from verl_replay.eval.report import format_table
    from verl_replay.eval.run import EvalConfig, evaluate

    data = [part.strip() for item in args.data for part in item.split(",") if part.strip()]
    try:
        config = EvalConfig(
            data=tuple(data),
            model=args.model,
            out=args.out,
            backend=args.backend,
            n=args.n,
            k=tuple(args.k),
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            limit=args.limit,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            hf_batch_size=args.batch_size,
            verify_workers=args.verify_workers,
            verify_timeout_s=args.verify_timeout_s,
            benchmark_key=args.benchmark_key,
            chunk_questions=args.chunk_questions,
        )
        result = evaluate(config, overwrite=args.overwrite, progress=not (args.no_progress or args.quiet))
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _flush_logs()  # every line before the table, none inside it
    print(format_table(result.to_json()), end="")
    for name, path in result.files.items():
        print(f"{name}: {path}")
    print(f"log: {Path(args.out) / LOG_FILE}")
    return 0


LOG_FILE = "eval.log"


class _ConsoleFormat(logging.Formatter):
    """``eval: ...`` (``warning: `` / ``error: `` before anything above info): short lines for a
    person; the log file keeps the timestamps and the loggers' names."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno <= logging.INFO else f"{record.levelname.lower()}: "
        return f"eval: {level}{record.getMessage().removeprefix('eval: ')}"


def setup_logging(out: str | None, *, quiet: bool) -> None:
    """The console (stderr): our info lines unless ``--quiet``, warnings always, and never a per-chunk
    line the progress bar already shows. ``OUT/eval.log``: everything, with timestamps. Other
    libraries' info lines (transformers, vLLM, httpx) go to the file only."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(_ConsoleFormat())
    console.setLevel(logging.WARNING if quiet else logging.INFO)
    console.addFilter(
        lambda r: (
            r.levelno >= logging.WARNING
            or (r.name.startswith("verl_replay") and not getattr(r, "progress_line", False))
        )
    )
    root.addHandler(console)
    if out is None:
        return
    log_file = _LogFile(Path(out) / LOG_FILE, encoding="utf-8", delay=True)
    log_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(log_file)


class _LogFile(logging.FileHandler):
    """``OUT/eval.log``, made with its folder at the first record: a refused evaluation (no record
    logged yet) leaves no folder behind; one that cannot be written is dropped quietly (the
    evaluation reports an unusable ``--out`` itself)."""

    def _open(self):  # noqa: ANN202 - logging's signature
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        logging.getLogger().removeHandler(self)


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
