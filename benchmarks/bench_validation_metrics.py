"""verl's validation statistics with its own bootstrap and with verl_replay's vectorised one.

    python benchmarks/bench_validation_metrics.py [--prompts 256,500] [--n 4,32] [--repeats 3]

Calls verl's ``process_validation_metrics`` (what its trainer runs after every validation) on
random scores of ``prompts`` x ``n`` samples with the three numeric variables a verl_replay
reward reports (reward, score, acc), once with verl's ``bootstrap_metric`` and once with the
vectorised one the plugin installs, side by side in this process, and prints the CPU seconds of
each, their ratio and whether the two results are equal (they must be).
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np


def _batch(prompts: int, n: int, seed: int = 0) -> tuple[list[str], list[str], dict[str, list]]:
    rng = np.random.default_rng(seed)
    acc = rng.random(prompts * n) < 0.4
    uids = [f"p{i}" for i in range(prompts) for _ in range(n)]
    infos = {"reward": [float(a) for a in acc], "score": [float(a) for a in acc], "acc": [float(a) for a in acc]}
    return ["bench"] * len(uids), uids, infos


def _cpu_seconds(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.process_time()
        result = fn()
        best = min(best, time.process_time() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="256,500")
    parser.add_argument("--n", default="4,32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import verl  # noqa: F401  (loads the plugin, which installs the vectorised bootstrap)
    from verl.trainer.ppo import metric_utils

    vectorised = metric_utils.bootstrap_metric
    original = vectorised.verl_original
    print(f"{'prompts x n':>12} {'verl s':>9} {'ours s':>9} {'ratio':>7}  equal")
    for prompts in (int(p) for p in args.prompts.split(",")):
        for n in (int(k) for k in args.n.split(",")):
            statistics = functools.partial(metric_utils.process_validation_metrics, *_batch(prompts, n))
            metric_utils.bootstrap_metric = original
            slow, reference = _cpu_seconds(statistics, args.repeats)
            metric_utils.bootstrap_metric = vectorised
            fast, result = _cpu_seconds(statistics, args.repeats)
            equal = result == reference
            print(f"{f'{prompts} x {n}':>12} {slow:9.2f} {fast:9.3f} {slow / fast:6.0f}x  {equal}")


if __name__ == "__main__":
    main()
