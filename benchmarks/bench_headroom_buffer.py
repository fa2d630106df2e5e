#!/usr/bin/env python
"""Headroom-Drift buffer: manager overhead vs buffer size (vs a full-sort selector), and memory.

    python benchmarks/bench_headroom_buffer.py [--quick] [--sizes 1000 10000 100000]
                                               [--rss-size 100000] [--vocab 151936]

Groups are n=8 responses x 64 tokens with a 48-token prompt, built the way the trainer builds
them: verl-like rows (token tensors plus the dataset, agent-loop and reward fields a math row
carries) through ``rows_to_group``, so metadata is included at its real size.

**Overhead.** For each buffer size N the buffer is filled, then run in steady state:
``select`` (K_rep=16, chunks of up to 16, about half the scanned groups pass the gate) followed
by ``admit`` of 64 fresh groups (evicting the 64 oldest). The scorer is trivial (stored
log-probs + precomputed noise), so what is measured is the manager itself:

    manager ms/step = (select wall time - time inside the scorer) + admit wall time

It includes the per-scanned-group scoring arithmetic (Headroom/Drift/KL), which is
O(scanned), and the ranking bookkeeping (heap pops/pushes, FIFO), which is O(scanned log N).
The same steps are replayed with a reference selector that sorts the whole buffer every step
(O(N log N)); both must accept the same groups. Intra-op threads are set to 1: the work is
tiny tensor ops where thread wake-ups only add noise.

**Memory.** In a separate process (so nothing else the benchmark allocates is counted): the
process RSS before and after filling a buffer of ``--rss-size`` groups (every group built by
``ReplayGroup`` from decoded fields and its own metadata dict, so no storage is shared), and
again after 30 steady-state steps of select + admit with eviction; divided by the stored
response tokens (and by all stored tokens, prompt included). ``--vocab`` sets the token-id
range: the default is Qwen's 151,936 (3 bytes per id); a vocabulary below 65,536 stores ids in 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from verl_replay.headroom_drift.buffer import HeadroomDriftBuffer, ReplayGroup
from verl_replay.headroom_drift.scores import group_scores_flat, headroom_flat
from verl_replay.integrations.verl.rows import rows_to_group

N_RESP = 8
TOKENS = 64
PROMPT = 48
K_REP = 16
CHUNK = 16
TAU = 0.1
FRESH_PER_STEP = 64
POOL = 256  # distinct group contents (templates)
QWEN_VOCAB = 151_936
FIELDS = (
    "prompt_ids",
    "response_ids",
    "response_lengths",
    "response_mask",
    "gen_log_probs",
    "advantages",
    "correct",
    "scores",
)
WORDS = (
    "the of a number find let be if then sum triangle circle integer prime value real "
    "positive area length side angle point line equation solve x y z n k m function "
    "polynomial root probability coin die remainder divided digit square cube product ratio "
    "percent"
).split()


def verl_rows(k: int, vocab: int, gen: torch.Generator) -> list[dict[str, Any]]:
    """The rows of one math group as the v1 trainer holds them after the update: agent-loop
    output (tokens, rollout log-probs, metrics, extra_fields with the reward's extra info),
    RLHFDataset fields (prompt / raw_prompt messages, reward_model, extra_info, ...) and the
    trainer's old_log_probs / advantages."""
    rnd = random.Random(k)
    problem = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(25, 40))).capitalize() + "?"
    messages = [
        {
            "role": "user",
            "content": problem + "\nPlease reason step by step, and put your final answer within \\boxed{}.",
        }
    ]
    prompt = torch.randint(0, vocab, (PROMPT,), generator=gen)
    rows = []
    for s in range(N_RESP):
        response = torch.randint(0, vocab, (TOKENS,), generator=gen)
        acc = float(s % 2)
        rm_scores = torch.zeros(TOKENS)
        rm_scores[-1] = acc
        old = -2.0 * torch.rand(TOKENS, generator=gen) ** 2
        adv = torch.full((TOKENS,), (acc - 0.5) * (1 + 0.1 * rnd.random()))
        rows.append(
            {
                "prompts": prompt.clone(),
                "responses": response,
                "response_mask": torch.ones(TOKENS, dtype=torch.int64),
                "input_ids": torch.cat([prompt, response]),
                "position_ids": torch.arange(PROMPT + TOKENS),
                "loss_mask": torch.ones(TOKENS, dtype=torch.int64),
                "rm_scores": rm_scores,
                "rollout_log_probs": old + 1e-3 * torch.randn(TOKENS, generator=gen),
                "old_log_probs": old,
                "advantages": adv,
                "returns": adv.clone(),
                "uid": f"{k:08x}-uid",
                "session_id": s,
                "global_steps": 7,
                "num_turns": 2,
                "metrics": {
                    "generate_sequences": rnd.random(),
                    "tool_calls": 0.0,
                    "compute_score": rnd.random() * 1e-3,
                    "num_preempted": -1,
                },
                "extra_fields": {
                    "turn_scores": [],
                    "tool_rewards": [],
                    "reward_extra_info": {"score": acc, "acc": acc, "reason": "match" if acc else "mismatch"},
                },
                "multi_modal_inputs": {},
                "data_source": "math_dapo",
                "prompt": messages,
                "raw_prompt": messages,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(k % 997)},
                "extra_info": {
                    "split": "train",
                    "index": k,
                    "question_id": f"train-{k}",
                    "benchmark": "train",
                    "question": problem,
                },
                "dummy_tensor": torch.tensor([0], dtype=torch.uint8),
                "index": k,
                "tools_kwargs": {},
                "interaction_kwargs": {},
            }
        )
    return rows


class Pool:
    """Group templates (built once through rows_to_group) and precomputed scorer noise."""

    def __init__(self, vocab: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.items: list[dict[str, Any]] = []
        for k in range(POOL):
            g = rows_to_group(verl_rows(k, vocab, gen), anchor_field="old_log_probs")
            self.items.append({**{f: getattr(g, f) for f in FIELDS}, "meta": g.meta})
        self.noise = torch.randn(POOL, N_RESP * TOKENS, generator=gen)

    def group(self, k: int) -> ReplayGroup:
        """A new group with its own storage (ReplayGroup copies and encodes the metadata)."""
        return ReplayGroup(**self.items[k % POOL])


def make_scorer(pool: Pool, step: int):
    def scorer(groups: Sequence[ReplayGroup]) -> list[torch.Tensor]:
        out = []
        for g in groups:
            # drift scale 0.05..0.15 by group: about half of the groups pass tau = 0.1
            scale = 0.05 + 0.1 * (((g.group_id * 2_654_435_761 + step * 97) >> 7) % 11) / 10
            out.append(g.gen_log_probs + scale * pool.noise[(g.group_id + step) % POOL])
        return out

    return scorer


class FullSortSelector:
    """Reference manager: same semantics, but sorts all N groups at every step."""

    def __init__(self, buf: HeadroomDriftBuffer):
        self.capacity, self.k_rep, self.tau = buf.capacity, buf.k_rep, buf.tau
        self.chunk = buf.scan_chunk_groups
        # gid -> [group, cached, birth, seq, replay_count]; group objects shared read-only
        self.items: OrderedDict[int, list] = OrderedDict(
            (g.group_id, [g, g.headroom_cached, g.birth_step, g.insert_seq, g.replay_count]) for g in buf
        )
        self.next_id = max(self.items) + 1 if self.items else 0

    def select(self, step: int, scorer) -> tuple[list[int], float]:
        order = sorted(self.items.values(), key=lambda it: (-it[1], -it[2], it[3]))
        accepted: list[int] = []
        forward = 0.0
        pos = 0
        while len(accepted) < self.k_rep and pos < len(order):
            chunk = order[pos : pos + self.chunk]
            t = time.perf_counter()
            outs = scorer([it[0] for it in chunk])
            forward += time.perf_counter() - t
            for it, lp in zip(chunk, outs, strict=True):
                g = it[0]
                sc = group_scores_flat(lp, g.gen_log_probs, g.response_mask, g.response_lengths, g.advantages)
                it[1] = sc.headroom
                pos += 1
                if sc.drift <= self.tau:
                    accepted.append(g.group_id)
                    it[4] += 1
                    if len(accepted) >= self.k_rep:
                        break
        return accepted, forward

    def admit(self, groups: Sequence[ReplayGroup], step: int) -> None:
        for g in groups:
            h = float(headroom_flat(g.gen_log_probs, g.response_mask, g.response_lengths, g.advantages))
            gid = self.next_id
            self.next_id += 1
            self.items[gid] = [_with_id(g, gid), h, step, gid, 0]
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)


def _with_id(g: ReplayGroup, gid: int) -> ReplayGroup:
    g.group_id = gid  # the scorer keys its noise on group_id
    return g


def fill(pool: Pool, size: int) -> HeadroomDriftBuffer:
    buf = HeadroomDriftBuffer(capacity=size, k_rep=K_REP, tau=TAU, scan_chunk_groups=CHUNK)
    per = max(FRESH_PER_STEP, size // 100)  # ~100 pseudo-steps of history: a spread of ages
    step = -((size + per - 1) // per)
    k = 0
    while len(buf) < size:
        buf.admit([pool.group(k + i) for i in range(per)], step)
        k += per
        step += 1
    return buf


def _fresh(pool: Pool, step: int) -> list[ReplayGroup]:
    base = 10_000_000 + step * FRESH_PER_STEP  # the same fresh stream for every manager
    return [pool.group(base + i) for i in range(FRESH_PER_STEP)]


def run(pool: Pool, sizes: Sequence[int], steps: int, warmup: int) -> list[dict]:
    """All sizes side by side: each step runs every buffer in turn (round-robin), so load
    changes on a shared machine hit all sizes alike; then the full-sort references likewise."""
    rows = []
    for size in sizes:
        t0 = time.perf_counter()
        buf = fill(pool, size)
        rows.append(
            {
                "size": size,
                "fill_s": time.perf_counter() - t0,
                "buf": buf,
                "ref": FullSortSelector(buf),
                "select": [],
                "admit": [],
                "sort": [],
                "scanned": [],
                "scored": [],
                "picks": [],
            }
        )
    for step in range(steps):
        for r in rows:
            fresh = _fresh(pool, step)
            t = time.perf_counter()
            res = r["buf"].select(step, make_scorer(pool, step))
            ta = time.perf_counter()
            r["buf"].admit(fresh, step)
            t_end = time.perf_counter()
            r["picks"].append(res.accepted_ids)
            if step >= warmup:
                r["select"].append(1e3 * ((ta - t) - res.stats["scan_forward_seconds"]))
                r["admit"].append(1e3 * (t_end - ta))
                r["scanned"].append(res.stats["scanned"])
                r["scored"].append(res.scored_groups)
    for step in range(steps):
        for r in rows:
            fresh = _fresh(pool, step)
            t = time.perf_counter()
            acc, fwd = r["ref"].select(step, make_scorer(pool, step))
            ta = time.perf_counter()
            r["ref"].admit(fresh, step)
            t_end = time.perf_counter()
            r.setdefault("same", True)
            r["same"] &= acc == r["picks"][step]
            if step >= warmup:
                r["sort"].append(1e3 * ((ta - t) - fwd + (t_end - ta)))
    out = []
    for r in rows:
        total = [a + b for a, b in zip(r["select"], r["admit"], strict=True)]
        out.append(
            {
                "size": r["size"],
                "fill_s": r["fill_s"],
                "select_ms": statistics.median(r["select"]),
                "admit_ms": statistics.median(r["admit"]),
                "heap_ms": statistics.median(total),
                "heap_p90_ms": sorted(total)[int(0.9 * (len(total) - 1))],
                "sort_ms": statistics.median(r["sort"]),
                "scanned": statistics.mean(r["scanned"]),
                "scored": statistics.mean(r["scored"]),
                "same": r["same"],
            }
        )
    return out


# ----------------------------------------------------------------------------- memory


def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS missing from /proc/self/status")


def rss_child(size: int, vocab: int, steps: int) -> dict[str, float]:
    """Run in a fresh process: RSS of a buffer of ``size`` groups, after fill and steady state."""
    torch.set_num_threads(1)
    pool = Pool(vocab)
    pool.group(0)  # warm up every code path that allocates once per process
    gc.collect()
    base = _rss_bytes()
    t0 = time.perf_counter()
    buf = fill(pool, size)
    fill_s = time.perf_counter() - t0
    gc.collect()
    after_fill = _rss_bytes()
    for step in range(steps):
        buf.select(step, make_scorer(pool, step))
        buf.admit(_fresh(pool, step), step)
    gc.collect()
    after_steady = _rss_bytes()
    groups = list(buf)
    response = sum(g.num_tokens for g in groups)
    stored = response + sum(g.prompt_ids.numel() for g in groups)
    packed = sum(g.nbytes for g in groups)
    return {
        "size": size,
        "vocab": vocab,
        "fill_s": fill_s,
        "response_tokens": response,
        "stored_tokens": stored,
        "packed_per_response_token": packed / response,
        "rss_fill_per_response_token": (after_fill - base) / response,
        "rss_per_response_token": (after_steady - base) / response,
        "rss_per_stored_token": (after_steady - base) / stored,
        "rss_mb": (after_steady - base) / 1e6,
    }


def measure_rss(size: int, vocab: int, steps: int = 30) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child", str(size), "--vocab", str(vocab), "--steps", str(steps)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, sizes up to 3e4")
    ap.add_argument("--sizes", type=int, nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument(
        "--rss-size",
        type=int,
        default=None,
        help="groups for the RSS measurement (default 1e5; 3e4 with --quick; 0 skips it)",
    )
    ap.add_argument("--vocab", type=int, default=QWEN_VOCAB, help="token-id range")
    ap.add_argument("--rss-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rss_child is not None:
        print(json.dumps(rss_child(args.rss_child, args.vocab, args.steps or 30)))
        return []
    sizes = args.sizes or ([1_000, 10_000, 30_000] if args.quick else [1_000, 10_000, 100_000])
    steps = args.steps or (12 if args.quick else 40)
    rss_size = args.rss_size if args.rss_size is not None else (30_000 if args.quick else 100_000)
    warmup = min(2, steps - 1)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    pool = Pool(args.vocab)
    rows = run(pool, sizes, steps, warmup)
    base = rows[0]["heap_ms"]
    print(
        f"Headroom-Drift buffer manager overhead: n={N_RESP} x {TOKENS} tokens, K_rep={K_REP}, "
        f"chunk<={CHUNK}, fresh={FRESH_PER_STEP}/step, {steps - warmup} timed steps (median)"
    )
    hdr = (
        f"{'groups':>8} | {'select ms':>9} | {'admit ms':>8} | {'heap ms/step':>12} | "
        f"{'p90':>6} | {'vs smallest':>11} | {'full-sort ms/step':>17} | {'sort/heap':>9} | "
        f"{'scanned':>7} | {'scored':>6} | same picks | fill s"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['size']:>8} | {r['select_ms']:>9.2f} | {r['admit_ms']:>8.2f} | "
            f"{r['heap_ms']:>12.2f} | {r['heap_p90_ms']:>6.2f} | "
            f"{r['heap_ms'] / base:>10.2f}x | {r['sort_ms']:>17.2f} | "
            f"{r['sort_ms'] / r['heap_ms']:>8.2f}x | {r['scanned']:>7.1f} | "
            f"{r['scored']:>6.1f} | {'yes' if r['same'] else 'NO':>10} | {r['fill_s']:.1f}"
        )
    print(
        "scanned = groups scanned per step; scored = groups given to the scorer (chunks hold "
        "about the acceptances still needed over the recent acceptance rate)"
    )
    if rss_size:
        m = measure_rss(rss_size, args.vocab)
        print(
            f"memory at {m['size']} groups (separate process, vocab {m['vocab']}, verl-like "
            f"metadata): {m['rss_mb']:.0f} MB RSS = {m['rss_per_response_token']:.2f} B per "
            f"stored response token ({m['rss_per_stored_token']:.2f} B per stored token incl. "
            f"prompt; {m['rss_fill_per_response_token']:.2f} right after the fill); packed "
            f"storage {m['packed_per_response_token']:.2f} B per response token; fill "
            f"{m['fill_s']:.0f} s"
        )
        rows.append({"rss": m})
    print(f"total {time.perf_counter() - t0:.1f} s")
    if not all(r.get("same", True) for r in rows):
        print("ERROR: heap and full-sort selectors disagree", file=sys.stderr)
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
