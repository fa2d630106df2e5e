"""benchmarks/bench_step_time.py: the arms' sizes against the recipes' own rule, the medians by hand,
and (e2e) ``--quick`` end to end, its report checked against the runs' own metrics.jsonl."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_step_time.py"
COMMON_SH = ROOT / "recipes" / "common.sh"


def _load():
    spec = importlib.util.spec_from_file_location("bench_step_time", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _load()


def _shell_replay_rounds(fresh: int, replay: int, mini: int) -> int:
    out = subprocess.run(
        ["bash", "-c", f'source "{COMMON_SH}"; replay_rounds {fresh} {replay} {mini}'],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


@pytest.mark.parametrize(
    "fresh,replay,mini",
    [(4, 2, 2), (8, 4, 2), (32, 16, 8), (32, 32, 8), (6, 3, 3), (4, 2, 1), (2, 1, 2), (12, 6, 4), (16, 8, 2)],
)
def test_replay_rounds_follow_the_recipes(fresh, replay, mini):
    assert bench.replay_rounds(fresh, replay, mini) == _shell_replay_rounds(fresh, replay, mini)


def test_default_arms_take_the_same_optimiser_steps_as_the_larger_control():
    s = bench.Settings()  # G=8, M=2: HD 8 + 4 groups in 2 rounds of 3 steps; larger 12 prompts, 6 rounds
    arms = {name: bench.build_arm(name, s) for name in bench.ARMS}
    assert arms["matched"].planned_optimizer_steps == 4 and arms["matched"].rounds == 4
    assert arms["larger"].prompts == 12 and arms["larger"].rounds == 6
    assert arms["headroom_drift"].rounds == 2 and arms["headroom_drift"].k_rep == 4
    assert arms["headroom_drift"].planned_optimizer_steps == arms["larger"].planned_optimizer_steps == 6
    hd = arms["headroom_drift"].overrides
    # verl asserts train_batch_size == rounds x ppo_mini_batch_size
    assert "data.train_batch_size=8" in hd and "actor_rollout_ref.actor.ppo_mini_batch_size=4" in hd
    assert "replay.ppo_mini_batch_size=2" in hd and "replay.strategy=headroom_drift" in hd
    naive = arms["naive"].overrides
    assert "replay.strategy=naive" in naive and not any(o.startswith("replay.tau") for o in naive)
    # every arm shares the rest: only the arm's own keys differ
    commands = [bench.arm_command(arm, s, Path("/x")) for arm in arms.values()]
    shared = set(bench.common_overrides(s))
    assert all(shared <= set(c) for c in commands)
    assert all("trainer.v1.trainer_mode=separate_async" in c for c in commands)


def test_bad_settings_are_refused_with_the_option_named():
    with pytest.raises(SystemExit, match="--fresh-groups"):
        bench.validate(bench.Settings(fresh_groups=6, mini_groups=4), ["matched"])
    with pytest.raises(SystemExit, match="--steps"):
        bench.validate(bench.Settings(steps=3, warmup=3), ["matched"])
    with pytest.raises(SystemExit, match="unknown arm"):
        bench.validate(bench.Settings(), ["grpo"])
    with pytest.raises(SystemExit, match="--max-num-seqs"):
        bench.validate(bench.Settings(max_num_seqs=-1), ["matched"])


def test_rollouts_are_generated_in_waves_of_max_num_seqs_unless_asked_otherwise():
    settings, _, _, _ = bench.parse_args([])
    assert settings.max_num_seqs == 1
    assert "actor_rollout_ref.rollout.max_num_seqs=1" in bench.common_overrides(settings)
    for argv in (["--max-num-seqs", "0"], ["--quick"]):  # verl's default: every request in one batch
        settings, _, _, _ = bench.parse_args(argv)
        assert settings.max_num_seqs is None
        assert not any("max_num_seqs" in o for o in bench.common_overrides(settings))
    settings, _, _, _ = bench.parse_args(["--max-num-seqs", "8"])
    assert "actor_rollout_ref.rollout.max_num_seqs=8" in bench.common_overrides(settings)
    assert settings.probe and not bench.parse_args(["--quick"])[0].probe
    assert bench.parse_args(["--quick", "--probe"])[0].probe and not bench.parse_args(["--no-probe"])[0].probe


def test_generation_probe_times_each_on_policy_arms_rollouts(tiny_assets):
    """The probe generates each on-policy arm's fresh rollouts (prompts x n) with the arms' settings;
    the summary gives its seconds as a share of that arm's median step."""
    s = bench.Settings(fresh_groups=2, mini_groups=1, group_size=2, response_length=8, max_num_seqs=2)
    arms = [bench.build_arm(name, s) for name in ("matched", "larger", "headroom_drift")]
    probe = bench.generation_probe(s, arms)
    assert set(probe["seconds"]) == {"matched", "larger"} and probe["max_num_seqs"] == 2
    assert all(seconds > 0 for seconds in probe["seconds"].values())
    # every rollout has 1..8 response tokens: 2 x 2 matched rows, 3 x 2 larger rows
    assert 4 <= probe["response_tokens"]["matched"] <= 4 * 8 and 6 <= probe["response_tokens"]["larger"] <= 6 * 8
    results = {"matched": {"medians": {"timing_s/step": 4.0}}, "larger": {"medians": {"timing_s/step": 5.0}}}
    share = bench.summarize(results, probe)["generation_probe"]["share_of_step"]
    assert share == pytest.approx(
        {"matched": probe["seconds"]["matched"] / 4.0, "larger": probe["seconds"]["larger"] / 5.0}
    )
    assert "generation alone (probe, max_num_seqs=2)" in bench.format_summary(bench.summarize(results, probe))


def test_steady_medians_skip_the_warmup_steps():
    metrics = [
        {"training/global_step": i, "timing_s/step": t, "flag": True}
        for i, t in enumerate([50.0, 9.0, 3.0, 5.0, 4.0], start=1)
    ]
    medians, steps = bench.steady_medians(metrics, warmup=2)
    assert steps == [3, 4, 5] and medians["timing_s/step"] == 4.0
    assert "flag" not in medians  # booleans are not timings
    with pytest.raises(RuntimeError, match="no steady-state steps"):
        bench.steady_medians(metrics, warmup=5)


def test_summary_ratios_are_ratios_of_the_median_steps():
    results = {
        name: {
            "medians": {
                "timing_s/step": t,
                "timing_s/gen": t / 4,
                "replay/overhead_seconds": 0.1,
                "replay/scan_forward_seconds": 0.2,
            }
        }
        for name, t in [("matched", 2.0), ("larger", 3.0), ("headroom_drift", 2.5), ("naive", 2.2)]
    }
    summary = bench.summarize(results)
    assert summary["ratios"]["headroom_drift/larger"] == pytest.approx(2.5 / 3.0)
    assert summary["ratios"]["naive/matched"] == pytest.approx(1.1)
    assert summary["generation_wait_share"] == {"arm": "matched", "share": 0.25}
    assert summary["hd_overhead_share"] == pytest.approx(0.04)
    assert summary["targets"] == {"hd/larger <= 0.85": True, "overhead <= 5% of HD step": True}


@pytest.mark.e2e
@pytest.mark.benchmark  # two training start-ups (~4 min): selected with -m benchmark, not in the default suite
def test_quick_mode_writes_a_report_that_matches_the_runs(tmp_path):
    out = tmp_path / "bench"
    env = {k: v for k, v in os.environ.items() if k != "VERL_FILE_LOGGER_PATH"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "headroom_drift/matched" in proc.stdout and "timing_s/update_actor" in proc.stdout

    report = json.loads((out / "report.json").read_text())
    assert list(report["arms"]) == ["matched", "headroom_drift"]
    for name, arm in report["arms"].items():
        lines = (Path(arm["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line)["data"] for line in lines if line.strip()]
        assert [m["training/global_step"] for m in metrics] == [1, 2, 3]
        assert arm["steady_steps"] == [2, 3]
        for key in ("timing_s/step", "timing_s/gen", "timing_s/update_actor"):
            assert arm["medians"][key] == pytest.approx(statistics.median(m[key] for m in metrics[1:]))
        assert arm["medians"]["timing_s/step"] > 0
    hd = report["arms"]["headroom_drift"]
    hd_metrics = [json.loads(line)["data"] for line in (Path(hd["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    # the arm really replayed under the split placement, with its planned optimiser steps
    assert sum(m["replay/accepted"] for m in hd_metrics) > 0
    assert hd["arm"]["rounds"] == 2 and hd["arm"]["planned_optimizer_steps"] == 4
    for m in hd_metrics:  # 2 rounds of 2 fresh groups + their share of the accepted, steps of 2 groups
        accepted = int(m["replay/accepted"])
        shares = [accepted // 2 + accepted % 2, accepted // 2]
        assert m["replay/optimizer_steps"] == sum(-(-(2 + share) // 2) for share in shares)
    ratio = report["summary"]["ratios"]["headroom_drift/matched"]
    assert ratio == pytest.approx(
        hd["medians"]["timing_s/step"] / report["arms"]["matched"]["medians"]["timing_s/step"]
    )
