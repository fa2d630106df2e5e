#!/usr/bin/env python
"""Overhead of the Headroom-Drift buffer manager vs buffer size (and vs a full-sort selector).

    python benchmarks/bench_headroom_buffer.py [--quick] [--sizes 1000 10000 100000]

For each buffer size N (groups of n=8 responses x 64 tokens) the buffer is filled, then
run in steady state: ``select`` (K_rep=16, chunks of 16, about half the scanned groups pass
the gate) followed by ``admit`` of 64 fresh groups (evicting the 64 oldest). The scorer is
trivial (stored log-probs + precomputed noise), so what is measured is the manager itself:

    manager ms/step = (select wall time - time inside the scorer) + admit wall time

It includes the per-scanned-group scoring arithmetic (Headroom/Drift/KL), which is
O(scanned), and the ranking bookkeeping (heap pops/pushes, FIFO), which is O(scanned log N).
The same steps are replayed with a reference selector that sorts the whole buffer every step
(O(N log N)); both must accept the same groups. Intra-op threads are set to 1: the work is
tiny tensor ops where thread wake-ups only add noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from verl_replay.headroom_drift.buffer import HeadroomDriftBuffer, ReplayGroup
from verl_replay.headroom_drift.scores import group_scores_flat, headroom_flat

N_RESP = 8
TOKENS = 64
K_REP = 16
CHUNK = 16
TAU = 0.1
FRESH_PER_STEP = 64
POOL = 256  # distinct group contents shared (read-only) by all buffered groups


class Pool:
    """Precomputed group contents and scorer noise, so filling 1e5 groups stays cheap."""

    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        L = N_RESP * TOKENS
        self.lengths = torch.full((N_RESP,), TOKENS, dtype=torch.int64)
        self.items = []
        for _ in range(POOL):
            self.items.append(dict(
                prompt_ids=torch.randint(0, 32_000, (48,), generator=gen, dtype=torch.int32),
                response_ids=torch.randint(0, 32_000, (L,), generator=gen, dtype=torch.int32),
                response_mask=torch.rand(L, generator=gen) > 0.05,
                gen_log_probs=-2.0 * torch.rand(L, generator=gen) ** 2,
                advantages=torch.randn(N_RESP, generator=gen).clamp(-2, 2),
                correct=torch.tensor([True, False] * (N_RESP // 2)),
                scores=torch.rand(N_RESP, generator=gen),
            ))
        self.noise = torch.randn(POOL, L, generator=gen)

    def group(self, k: int) -> ReplayGroup:
        it = self.items[k % POOL]
        return ReplayGroup(response_lengths=self.lengths, **it)


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
            (g.group_id, [g, g.headroom_cached, g.birth_step, g.insert_seq, g.replay_count])
            for g in buf)
        self.next_id = max(self.items) + 1 if self.items else 0

    def select(self, step: int, scorer) -> tuple[list[int], float]:
        order = sorted(self.items.values(), key=lambda it: (-it[1], -it[2], it[3]))
        accepted: list[int] = []
        forward = 0.0
        pos = 0
        while len(accepted) < self.k_rep and pos < len(order):
            chunk = order[pos: pos + self.chunk]
            t = time.perf_counter()
            outs = scorer([it[0] for it in chunk])
            forward += time.perf_counter() - t
            for it, lp in zip(chunk, outs):
                g = it[0]
                sc = group_scores_flat(lp, g.gen_log_probs, g.response_mask, g.response_lengths,
                                       g.advantages)
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
            h = float(headroom_flat(g.gen_log_probs, g.response_mask, g.response_lengths,
                                    g.advantages))
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
        rows.append({"size": size, "fill_s": time.perf_counter() - t0, "buf": buf,
                     "ref": FullSortSelector(buf), "select": [], "admit": [], "sort": [],
                     "scanned": [], "picks": []})
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
        groups = list(r["buf"])
        payload = sum(g.nbytes for g in groups)  # tensor bytes the buffer keeps per group
        stored_tokens = sum(g.num_tokens + g.prompt_ids.numel() for g in groups)
        total = [a + b for a, b in zip(r["select"], r["admit"])]
        out.append({"size": r["size"], "fill_s": r["fill_s"],
                    "select_ms": statistics.median(r["select"]),
                    "admit_ms": statistics.median(r["admit"]),
                    "heap_ms": statistics.median(total),
                    "heap_p90_ms": sorted(total)[int(0.9 * (len(total) - 1))],
                    "sort_ms": statistics.median(r["sort"]),
                    "scanned": statistics.mean(r["scanned"]), "same": r["same"],
                    "bytes_per_token": payload / max(1, stored_tokens)})
    return out


def main(argv: Sequence[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and sizes up to 3e4")
    ap.add_argument("--sizes", type=int, nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args(argv)
    sizes = args.sizes or ([1_000, 10_000, 30_000] if args.quick else [1_000, 10_000, 100_000])
    steps = args.steps or (12 if args.quick else 40)
    warmup = min(2, steps - 1)
    torch.set_num_threads(1)
    pool = Pool()
    t0 = time.perf_counter()
    rows = run(pool, sizes, steps, warmup)
    base = rows[0]["heap_ms"]
    print(f"Headroom-Drift buffer manager overhead: n={N_RESP} x {TOKENS} tokens, K_rep={K_REP}, "
          f"chunk={CHUNK}, fresh={FRESH_PER_STEP}/step, {steps - warmup} timed steps (median)")
    hdr = (f"{'groups':>8} | {'select ms':>9} | {'admit ms':>8} | {'heap ms/step':>12} | "
           f"{'p90':>6} | {'vs smallest':>11} | "
           f"{'full-sort ms/step':>17} | {'sort/heap':>9} | {'scanned':>7} | same picks | B/token | fill s")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['size']:>8} | {r['select_ms']:>9.2f} | {r['admit_ms']:>8.2f} | "
              f"{r['heap_ms']:>12.2f} | {r['heap_p90_ms']:>6.2f} | "
              f"{r['heap_ms'] / base:>10.2f}x | {r['sort_ms']:>17.2f} | "
              f"{r['sort_ms'] / r['heap_ms']:>8.2f}x | {r['scanned']:>7.1f} | "
              f"{'yes' if r['same'] else 'NO':>10} | {r['bytes_per_token']:>7.2f} | {r['fill_s']:.1f}")
    print(f"total {time.perf_counter() - t0:.1f} s; B/token = tensor bytes kept per stored token "
          "(prompt + response token ids int32, response log-probs fp32, response mask bool, per-response "
          "advantage/score/correct/length)")
    if not all(r["same"] for r in rows):
        print("ERROR: heap and full-sort selectors disagree", file=sys.stderr)
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
