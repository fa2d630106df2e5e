#!/usr/bin/env python3
"""Rewrite the memory tables of recipes/README.md from the recipes themselves.

Each table sits between ``<!-- memory-table:NAME:start -->`` and ``<!-- memory-table:NAME:end -->``
and is exactly what ``DRY_RUN=1 PREFLIGHT=table bash recipes/RECIPE [with ENV]`` prints on any
machine (the Qwen3.5-4B shape, an A100 80GB); ``tests/recipes/test_recipes.py`` checks that
every block still equals it.

    python scripts/update_memory_tables.py           # rewrite the blocks in place
    python scripts/update_memory_tables.py --check   # exit 1 when a block is out of date
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "recipes" / "README.md"
# block name -> (recipe, extra environment)
TABLES: dict[str, tuple[str, dict[str, str]]] = {
    "elite": ("elite_replay_qwen4b.sh", {}),
    "math": ("headroom_drift_math.sh", {}),
    "elite-sdpa": ("elite_replay_qwen4b.sh", {"ATTN_IMPL": "sdpa"}),
}
INPUTS = ("bird_train", "bird_dev", "spider_dev", "math_train", "math_math500")


def table(recipe: str, env: dict[str, str], root: Path) -> str:
    """What the recipe prints with DRY_RUN=1 PREFLIGHT=table (dummy inputs: only the shape is read)."""
    full = {k: v for k, v in os.environ.items() if k not in ("TINY", "RAY_ADDRESS", "MODEL_PATH", "ATTN_IMPL")}
    full.update(
        DRY_RUN="1",
        PREFLIGHT="table",
        PYTHON=sys.executable,
        DATA_DIR=str(root / "data"),
        MODEL_PATH=str(root / "Qwen3.5-4B"),
        OUTPUT_DIR=str(root / "outputs"),
        **env,
    )
    result = subprocess.run(
        ["bash", str(REPO / "recipes" / recipe)], env=full, cwd=root, capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0:
        raise SystemExit(f"{recipe} {env}: exit {result.returncode}\n{result.stderr[-3000:]}")
    return result.stdout.strip()


def render(text: str, tables: dict[str, str]) -> str:
    for name, body in tables.items():
        start, end = f"<!-- memory-table:{name}:start -->", f"<!-- memory-table:{name}:end -->"
        if start not in text or end not in text:
            raise SystemExit(f"{README}: no {start} ... {end} block")
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{body}\n{end}{tail}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a block differs")
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "data").mkdir()
        (root / "Qwen3.5-4B").mkdir()
        for name in INPUTS:
            (root / "data" / f"{name}.parquet").write_bytes(b"")
        tables = {name: table(recipe, env, root) for name, (recipe, env) in TABLES.items()}
    text = README.read_text(encoding="utf-8")
    updated = render(text, tables)
    if options.check:
        print("up to date" if updated == text else f"{README} is out of date: run {Path(__file__).name}")
        return 0 if updated == text else 1
    README.write_text(updated, encoding="utf-8")
    print(f"{README}: {', '.join(tables)} rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
