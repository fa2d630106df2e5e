#!/usr/bin/env python
"""Build (or find cached) the tiny local assets and print their paths.

    python scripts/build_tiny_assets.py [--root DIR] [--seed N] [--model-arch qwen3_5|qwen2] [--force]

Default root: $VERL_REPLAY_CACHE/tiny-v<version> (VERL_REPLAY_CACHE defaults to ~/.cache/verl_replay).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from verl_replay.data.tiny_assets import DEFAULT_MODEL_ARCH, MODEL_ARCHS, build_tiny_assets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--root", help="asset directory (default: versioned cache directory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-arch", choices=MODEL_ARCHS, default=DEFAULT_MODEL_ARCH)
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    args = parser.parse_args()
    start = time.perf_counter()
    assets = build_tiny_assets(args.root, seed=args.seed, force=args.force, model_arch=args.model_arch)
    manifest = assets.manifest()
    for name in ("root", "model_dir", "tokenizer", "math_train", "math_val", "sql_train", "sql_val", "sql_db_root"):
        print(f"{name:12s} {getattr(assets, name)}")
    model = manifest["model"]
    processor = f", processor {model['processor']}" if model.get("processor") else ""
    print(
        f"{'model':12s} {model['class']} ({model['num_parameters']} parameters){processor}, "
        f"vocab {manifest['vocab_size']}"
    )
    print(f"{'prompts':12s} {json.dumps(manifest['prompt_tokens'])}")
    print(f"{'seconds':12s} {time.perf_counter() - start:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
