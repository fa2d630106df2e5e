#!/usr/bin/env python
"""Step time of replay against on-policy GRPO, side by side, on the tiny CPU task.

    python benchmarks/bench_step_time.py [--quick] [--out DIR] [--steps 12] [--warmup 3]
                                         [--fresh-groups 8] [--mini-groups 2] [--group-size 4]
                                         [--task sql] [--response-length 96] [--max-num-seqs 1]
                                         [--no-probe]
                                         [--arms matched,larger,headroom_drift,naive]
                                         [--set KEY=VALUE ...]

One ``python -m verl_replay.main`` subprocess per arm, one after the other, all with the same
settings (task, seed, group size, lengths, learning rate) except what the arm is about, on verl's
split placement (``trainer.v1.trainer_mode=separate_async``, one training and one rollout worker,
weights pushed over ``cpu_gloo`` once per global step: the TINY recipes' path). With G fresh groups
per global step and optimiser steps of M groups:

    matched         on-policy GRPO, G fresh groups, G/M rounds (one optimiser step each)
    larger          on-policy GRPO, 1.5 G fresh groups, 1.5 G/M rounds: the same optimiser steps as
                    the replay arms, with 1.5x the rollouts (the paper's b384 control)
    headroom_drift  G fresh + up to G/2 replayed groups (Headroom-Drift selection, scan forward)
    naive           G fresh + the latest G/2 groups (no ranking, no gate, no scan)

The replay arms split the global step into the rounds the recipes choose (``replay_rounds`` in
``recipes/common.sh``); replayed groups add optimiser steps of M groups.

Generation-realistic: at scale a rollout engine is throughput-bound, so 1.5x the rollouts cost
about 1.5x the generation time; that cost is what replay saves. The tiny model on CPU is not: a
decode step costs about the same for 1 row as for 32 (Python-bound), so one batch of 48 rows takes
little longer than one of 32. ``--max-num-seqs`` sets verl's ``rollout.max_num_seqs``, which the
hf rollout reads as vLLM does (the most sequences decoded at once). The default, 1, is the cap at
which generation time is proportional to the number of rollouts (measured with the probe below
on 32 and 48 rollouts of the tiny SQL task: 1.27x at a cap of 4, 1.60x at 2, 1.47x at 1).
In the split placement generation overlaps training, so the runs' ``timing_s/gen`` is only
the trainer's wait; before the arms, a probe (``--no-probe`` skips it) times the hf rollout alone,
on one thread, generating each on-policy arm's fresh rollouts, and prints that as a share of the
arm's median step: the setting is generation-realistic when it is at least half.

From each run's ``metrics.jsonl`` the first ``--warmup`` global steps are dropped (Ray and model
warm-up; the replay buffer is empty at step 1) and the median over the remaining steps is taken of
``timing_s/step`` and of every stage (verl's ``timing_s/*``; ``replay/select_seconds``,
``replay/scan_forward_seconds``, ``replay/overhead_seconds``, ``replay/inject_seconds``). Printed:
the step-time ratios HD / larger, HD / matched, naive / matched; the stage table; the share of the
on-policy step that the trainer spends waiting for generation (``timing_s/gen``: in the split
placement generation overlaps training, so this is a lower bound on generation's share); replay
overhead outside the scan forward as a share of the HD step. ``<out>/report.json`` holds all of it,
the commands, and the per-step values.

``--quick``: matched and headroom_drift only, 3 global steps, 1 warm-up step, small sizes (the CI
smoke test, ``tests/benchmarks/test_bench_step_time.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ARMS = ("matched", "larger", "headroom_drift", "naive")
REPLAY_ARMS = {"headroom_drift": "headroom_drift", "naive": "naive"}
# the stage columns, in pipeline order; other timing_s/* keys found in the runs are appended
STAGES = (
    "timing_s/step",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "replay/select_seconds",
    "replay/scan_forward_seconds",
    "replay/inject_seconds",
    "replay/overhead_seconds",
)
COUNTS = (
    "replay/accepted",
    "replay/scanned",
    "replay/scan_forward_rows",
    "replay/optimizer_steps",
    "response_length/mean",
    "response_length/max",
)
RATIOS = (("headroom_drift", "larger"), ("headroom_drift", "matched"), ("naive", "matched"), ("larger", "matched"))
TARGET_HD_VS_LARGER = 0.85
TARGET_OVERHEAD_SHARE = 0.05


@dataclass(frozen=True)
class Settings:
    """What every arm shares."""

    fresh_groups: int = 8  # G
    mini_groups: int = 2  # M: groups per optimiser step
    group_size: int = 4  # n
    task: str = "sql"
    response_length: int = 96
    steps: int = 12
    warmup: int = 3
    # The toy's lr (1e-4, 100x the recipes') moves the policy 0.1-0.3 RMS log-ratio per step, so
    # tau=0.08 refuses every group and HD would be timed replaying nothing. tau=1.0 lets the scanned
    # groups through: HD pays its full cost (scan + K replayed groups trained every step).
    tau: float = 1.0
    scan_chunk_groups: int = 16
    max_num_seqs: int | None = 1  # rollout.max_num_seqs (None: verl's default, every request at once)
    probe: bool = True  # time generation alone first (generation_probe)
    extra: tuple[str, ...] = ()  # Hydra overrides for every arm

    @property
    def replay_groups(self) -> int:
        return self.fresh_groups // 2


@dataclass
class Arm:
    name: str
    strategy: str
    prompts: int  # fresh prompts per global step
    rounds: int  # update rounds per global step (trainer.v1.separate_async.parameter_sync_step)
    k_rep: int = 0
    planned_optimizer_steps: int = 0
    overrides: list[str] = field(default_factory=list)


def replay_rounds(fresh: int, replay: int, mini: int) -> int:
    """Update rounds of a global step with ``fresh`` + ``replay`` groups and optimiser steps of ``mini``
    groups: the rule of ``replay_rounds`` in recipes/common.sh (the most rounds that split both evenly
    and give every round whole optimiser steps, if >= 2; else 2 when both split evenly; else 1)."""
    for rounds in range(fresh // mini, 0, -1):
        if fresh % rounds == 0 and replay % rounds == 0 and ((fresh + replay) // rounds) % mini == 0:
            if rounds >= 2:
                return rounds
            break
    return 2 if fresh % 2 == 0 and replay % 2 == 0 and fresh // 2 >= 1 else 1


def validate(settings: Settings, arms: list[str]) -> None:
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    if not arms:
        raise SystemExit("--arms is empty")
    g, m = settings.fresh_groups, settings.mini_groups
    if g < 2 or g % 2 or g % m:
        raise SystemExit(f"--fresh-groups ({g}) must be even and a multiple of --mini-groups ({m})")
    if "larger" in arms and (3 * g // 2) % m:
        raise SystemExit(
            f"--fresh-groups: 1.5 x {g} = {3 * g // 2} larger-arm prompts must be a multiple of "
            f"--mini-groups ({m}) (one optimiser step per round)"
        )
    if settings.warmup < 0 or settings.steps <= settings.warmup:
        raise SystemExit(
            f"--steps ({settings.steps}) must exceed --warmup ({settings.warmup}): the medians need steady-state steps"
        )
    if settings.max_num_seqs is not None and settings.max_num_seqs < 1:
        raise SystemExit(f"--max-num-seqs ({settings.max_num_seqs}) must be >= 1, or 0 for verl's default")
    for item in settings.extra:
        if "=" not in item:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE (a Hydra override)")


def build_arm(name: str, s: Settings) -> Arm:
    """The arm's own settings; everything else comes from ``common_overrides``."""
    g, m = s.fresh_groups, s.mini_groups
    if name in ("matched", "larger"):
        prompts = g if name == "matched" else 3 * g // 2
        rounds = prompts // m
        arm = Arm(name, "none", prompts, rounds, planned_optimizer_steps=rounds)
        arm.overrides = [f"actor_rollout_ref.actor.ppo_mini_batch_size={m}"]
    else:
        k = s.replay_groups
        rounds = replay_rounds(g, k, m)
        # accepted groups spread over the rounds, shares differing by at most one (all K accepted)
        shares = [k // rounds + (1 if r < k % rounds else 0) for r in range(rounds)]
        steps = sum(math.ceil((g // rounds + share) / m) for share in shares)
        arm = Arm(name, REPLAY_ARMS[name], g, rounds, k_rep=k, planned_optimizer_steps=steps)
        arm.overrides = [
            f"actor_rollout_ref.actor.ppo_mini_batch_size={g // rounds}",  # verl: one round's fresh prompts
            f"replay.ppo_mini_batch_size={m}",
            f"replay.k_rep={k}",
        ]
        if name == "headroom_drift":
            arm.overrides += [f"replay.tau={s.tau}", f"replay.scan_chunk_groups={s.scan_chunk_groups}"]
    arm.overrides = [
        f"replay.strategy={arm.strategy}",
        f"data.train_batch_size={arm.prompts}",
        f"trainer.v1.separate_async.parameter_sync_step={arm.rounds}",
        *arm.overrides,
    ]
    return arm


def common_overrides(s: Settings) -> list[str]:
    return [
        "platform=cpu_tiny",
        f"tiny_task={s.task}",
        # the split placement of the TINY recipes (recipes/common.sh placement_overrides)
        "trainer.v1.trainer_mode=separate_async",
        "actor_rollout_ref.hybrid_engine=False",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo",
        f"actor_rollout_ref.rollout.n={s.group_size}",
        f"data.max_response_length={s.response_length}",
        *([f"actor_rollout_ref.rollout.max_num_seqs={s.max_num_seqs}"] if s.max_num_seqs else []),
        f"trainer.total_training_steps={s.steps}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        *s.extra,
    ]


def arm_command(arm: Arm, s: Settings, run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "verl_replay.main",
        *common_overrides(s),
        *arm.overrides,
        f"trainer.experiment_name=bench_{arm.name}",
        f"run_dir={run_dir}",
    ]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: the run wrote no metrics")
    return [json.loads(line)["data"] for line in path.read_text().splitlines() if line.strip()]


def steady_medians(metrics: list[dict[str, Any]], warmup: int) -> tuple[dict[str, float], list[int]]:
    """Median of every numeric key over the global steps after the first ``warmup``."""
    steady = [m for m in metrics if int(m["training/global_step"]) > warmup]
    if not steady:
        raise RuntimeError(f"no steady-state steps: {len(metrics)} steps logged, warm-up {warmup}")
    keys = sorted({k for m in steady for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    medians = {k: statistics.median(float(m[k]) for m in steady if k in m) for k in keys}
    return medians, [int(m["training/global_step"]) for m in steady]


def run_arm(arm: Arm, s: Settings, out: Path, timeout_s: int) -> dict[str, Any]:
    run_dir = out / "runs" / arm.name
    command = arm_command(arm, s, run_dir)
    env = dict(os.environ, VERL_REPLAY_OUTPUT_DIR=str(out / "runs"), PYTHONUNBUFFERED="1")
    env.pop("VERL_FILE_LOGGER_PATH", None)
    print(
        f"[bench] {arm.name}: {arm.prompts} fresh groups"
        + (f" + up to {arm.k_rep} replayed" if arm.k_rep else "")
        + f", {arm.rounds} rounds, {arm.planned_optimizer_steps} optimiser steps per global step",
        flush=True,
    )
    started = time.monotonic()
    log_path = out / f"{arm.name}.console.log"
    with (
        log_path.open("w") as log,
        subprocess.Popen(
            command, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as process,
    ):
        assert process.stdout is not None
        try:
            for line in process.stdout:  # verl_replay's console: one line per step
                log.write(line)
                if line.startswith("step "):
                    print(f"[bench]   {arm.name} {line.rstrip()}", flush=True)
            returncode = process.wait(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
        except BaseException:
            stop(process)
            raise
    wall = time.monotonic() - started
    if returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(
            f"arm {arm.name} failed (exit {returncode}); console in {log_path}, verl's log in "
            f"{run_dir / 'verl.log'}:\n{tail}"
        )
    metrics = read_metrics(run_dir)
    medians, steady_steps = steady_medians(metrics, s.warmup)
    print(f"[bench] {arm.name}: done in {wall:.0f} s, median step {medians['timing_s/step']:.2f} s", flush=True)
    return {
        "arm": asdict(arm),
        "command": shlex.join(command),
        "run_dir": str(run_dir),
        "wall_seconds": wall,
        "steady_steps": steady_steps,
        "medians": medians,
        "per_step": {k: [m.get(k) for m in metrics] for k in (*STAGES, *COUNTS) if any(k in m for m in metrics)},
    }


def generation_probe(s: Settings, arms: list[Arm]) -> dict[str, Any]:
    """Seconds the hf rollout takes to generate each arm's fresh rollouts, alone in this process on
    one thread (as in its Ray actor), with the arms' sampling settings and ``max_num_seqs``.

    In the split placement generation overlaps training, so the runs' ``timing_s/gen`` only shows
    the trainer's wait; this measures generation itself, to say whether the setting is
    generation-realistic (generation at least half of the on-policy step)."""
    import asyncio

    import pandas as pd
    import torch
    from verl.workers.config import HFModelConfig, RolloutConfig

    from verl_replay.data.tiny_assets import build_tiny_assets
    from verl_replay.integrations.verl.hf_rollout import HFRolloutServer
    from verl_replay.integrations.verl.vl_processor import allow_vl_processor_without_torchvision

    assets = build_tiny_assets()
    model_dir, train = (
        (assets.sql_model_dir, assets.sql_train) if s.task == "sql" else (assets.model_dir, assets.math_train)
    )
    allow_vl_processor_without_torchvision()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = RolloutConfig(
            name="hf",
            prompt_length=256,
            response_length=s.response_length,
            tensor_model_parallel_size=1,
            max_num_seqs=s.max_num_seqs or 1024,
        )
        server = HFRolloutServer(config=config, model_config=HFModelConfig(path=str(model_dir)), replica_rank=0)
        tokenizer = server.model_config_tokenizer
        messages = [list(m) for m in pd.read_parquet(train)["prompt"]]
        prompts = [
            tokenizer.apply_chat_template(
                [dict(x) for x in m], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for m in messages
        ]
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}

        async def generate_all(requests: list[list[int]]) -> list[Any]:
            return await asyncio.gather(
                *[
                    server.generate(prompt_ids=r, sampling_params=dict(params), request_id=str(i))
                    for i, r in enumerate(requests)
                ]
            )

        asyncio.run(server.set_global_steps(0))
        asyncio.run(generate_all(prompts[:2]))  # warm-up: the first generate call pays one-time set-up
        seconds, tokens = {}, {}
        for arm in arms:
            if arm.name not in ("matched", "larger"):
                continue
            requests = [prompts[i % len(prompts)] for i in range(arm.prompts) for _ in range(s.group_size)]
            asyncio.run(server.set_global_steps(1))
            started = time.perf_counter()
            outputs = asyncio.run(generate_all(requests))
            seconds[arm.name] = time.perf_counter() - started
            tokens[arm.name] = sum(len(o.token_ids) for o in outputs)
    finally:
        torch.set_num_threads(threads)
    return {"max_num_seqs": s.max_num_seqs, "threads": 1, "seconds": seconds, "response_tokens": tokens}


def stop(process: subprocess.Popen) -> None:
    """Interrupt a run the way Ctrl-C does, so it stops its Ray cluster; kill it if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM (e.g. `timeout`): stop the running arm cleanly


def summarize(results: dict[str, dict[str, Any]], probe: dict[str, Any] | None = None) -> dict[str, Any]:
    step = {name: r["medians"]["timing_s/step"] for name, r in results.items()}
    ratios = {f"{a}/{b}": step[a] / step[b] for a, b in RATIOS if a in step and b in step}
    summary: dict[str, Any] = {"median_step_seconds": step, "ratios": ratios}
    if probe is not None:
        summary["generation_probe"] = dict(
            probe,
            share_of_step={name: seconds / step[name] for name, seconds in probe["seconds"].items() if name in step},
        )
    onpolicy = next((n for n in ("matched", "larger") if n in results), None)
    if onpolicy is not None:
        med = results[onpolicy]["medians"]
        summary["generation_wait_share"] = {
            "arm": onpolicy,
            "share": med.get("timing_s/gen", 0.0) / med["timing_s/step"],
        }
    if "headroom_drift" in results:
        med = results["headroom_drift"]["medians"]
        summary["hd_overhead_share"] = med.get("replay/overhead_seconds", 0.0) / med["timing_s/step"]
        summary["hd_scan_forward_share"] = med.get("replay/scan_forward_seconds", 0.0) / med["timing_s/step"]
        summary["targets"] = {
            "hd/larger <= 0.85": (
                ratios["headroom_drift/larger"] <= TARGET_HD_VS_LARGER if "headroom_drift/larger" in ratios else None
            ),
            "overhead <= 5% of HD step": summary["hd_overhead_share"] <= TARGET_OVERHEAD_SHARE,
        }
    return summary


def format_table(results: dict[str, dict[str, Any]]) -> str:
    names = list(results)
    found = {k for r in results.values() for k in r["medians"]}
    extra = sorted(k for k in found if k.startswith("timing_s/") and k not in STAGES)
    rows = [k for k in (*STAGES, *extra) if k in found] + [k for k in COUNTS if k in found]
    width = max(len(k) for k in rows) + 2
    lines = ["median over steady-state steps".ljust(width) + "".join(f"{n:>16}" for n in names)]
    for key in rows:
        cells = "".join(
            f"{results[n]['medians'][key]:>16.3f}" if key in results[n]["medians"] else f"{'-':>16}" for n in names
        )
        lines.append(key.ljust(width) + cells)
    return "\n".join(lines)


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"{name} {value:.3f}" for name, value in summary["ratios"].items()]
    for name, share in summary.get("generation_probe", {}).get("share_of_step", {}).items():
        probe = summary["generation_probe"]
        lines.append(
            f"generation alone (probe, max_num_seqs={probe['max_num_seqs']}): {probe['seconds'][name]:.2f} s "
            f"for the {name} rollouts = {100 * share:.0f}% of the {name} step"
        )
    if "generation_wait_share" in summary:
        g = summary["generation_wait_share"]
        lines.append(f"trainer waiting on generation: {100 * g['share']:.1f}% of the {g['arm']} step")
    if "hd_overhead_share" in summary:
        lines.append(
            f"HD replay overhead outside the scan forward: {100 * summary['hd_overhead_share']:.1f}% of the HD step "
            f"(scan forward {100 * summary['hd_scan_forward_share']:.1f}%)"
        )
        for target, met in summary["targets"].items():
            if met is not None:
                lines.append(f"target {target}: {'met' if met else 'NOT met'}")
    return "\n".join(lines)


def load_line() -> str | None:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return None


def parse_args(argv: list[str] | None) -> tuple[Settings, list[str], Path | None, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke: matched + headroom_drift, 3 steps")
    parser.add_argument("--out", type=Path, help="output folder (new or empty; default: a new temp folder)")
    parser.add_argument("--arms", help=f"comma-separated subset of {','.join(ARMS)}")
    parser.add_argument("--steps", type=int, help="global steps per arm (default 12)")
    parser.add_argument("--warmup", type=int, help="global steps left out of the medians (default 3)")
    parser.add_argument("--fresh-groups", type=int, help="G: fresh groups per global step (default 8)")
    parser.add_argument("--mini-groups", type=int, help="groups per optimiser step (default 2)")
    parser.add_argument("--group-size", type=int, help="responses per group, rollout.n (default 4)")
    parser.add_argument("--task", choices=("sql", "math"), help="tiny task (default sql)")
    parser.add_argument("--response-length", type=int, help="data.max_response_length (default 96: tiny sql's cap)")
    parser.add_argument("--tau", type=float, help="Headroom-Drift gate (default 1.0, see Settings.tau)")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        help="rollout.max_num_seqs: sequences decoded at once (default 1; 0: verl's default)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a Hydra override for every arm (repeatable)"
    )
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per arm before it is killed")
    parser.add_argument(
        "--probe",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time generation alone before the arms (default: on, off with --quick)",
    )
    args = parser.parse_args(argv)
    base = (
        Settings(fresh_groups=4, steps=3, warmup=1, scan_chunk_groups=16, max_num_seqs=None)
        if args.quick
        else Settings()
    )
    given = {
        "fresh_groups": args.fresh_groups,
        "mini_groups": args.mini_groups,
        "group_size": args.group_size,
        "task": args.task,
        "response_length": args.response_length,
        "steps": args.steps,
        "warmup": args.warmup,
        "tau": args.tau,
        "max_num_seqs": args.max_num_seqs,
    }
    settings = Settings(
        **{**asdict(base), **{k: v for k, v in given.items() if v is not None}, "extra": tuple(args.set)}
    )
    if settings.max_num_seqs == 0:
        settings = replace(settings, max_num_seqs=None)
    default_arms = "matched,headroom_drift" if args.quick else ",".join(ARMS)
    arms = [a.strip() for a in (args.arms or default_arms).split(",") if a.strip()]
    settings = replace(settings, probe=args.probe if args.probe is not None else not args.quick)
    return settings, arms, args.out, args.timeout


def main(argv: list[str] | None = None) -> int:
    settings, arm_names, out, timeout_s = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    validate(settings, arm_names)
    out = (out or Path(tempfile.mkdtemp(prefix="bench_step_time."))).absolute()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {out} is not empty: choose a new folder (each arm needs a fresh run dir)")
    out.mkdir(parents=True, exist_ok=True)
    arms = [build_arm(name, settings) for name in arm_names]
    load_before = load_line()
    print(
        f"[bench] {len(arms)} arms x {settings.steps} global steps (medians over steps "
        f"{settings.warmup + 1}..{settings.steps}), task {settings.task}, n={settings.group_size}, "
        f"max_response_length={settings.response_length}; load {load_before}; output {out}",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    path = out / "report.json"
    probe = None
    if settings.probe and any(arm.name in ("matched", "larger") for arm in arms):
        probe = generation_probe(settings, arms)
        print(
            "[bench] generation alone (probe): "
            + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in probe["seconds"].items()),
            flush=True,
        )

    def write_report() -> dict[str, Any]:
        # after every arm, so an interrupted benchmark keeps the arms it finished
        report = {
            "settings": asdict(settings),
            "argv": sys.argv,
            "load_before": load_before,
            "load_after": load_line(),
            "complete": len(results) == len(arms),
            "summary": summarize(results, probe),
            "arms": results,
        }
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(path)
        return report

    try:
        for arm in arms:
            results[arm.name] = run_arm(arm, settings, out, timeout_s)
            report = write_report()
    except RuntimeError as error:
        print(f"[bench] error: {error}", file=sys.stderr)
        return 1
    summary = report["summary"]
    print(format_table(results))
    print(format_summary(summary))
    print(f"[bench] load after: {report['load_after']}; report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
