"""The comparison plans: arms, matching of the Headroom-Drift comparison, seeds, tau rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from verl_replay.compare.plan import (
    UNGATED_TAU,
    arith_profile,
    build_plan,
    paper_profile,
    shapes_profile,
    tau_from_kl,
    tau_rule,
    tiny_profile,
)

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _plan(tmp_path, **kw):
    args = dict(
        comparisons=["headroom_drift", "elite"],
        profile=tiny_profile(),
        seeds=[1, 2, 3],
        out_dir=tmp_path,
        recipes_dir=RECIPES,
        python="python",
    )
    args.update(kw)
    return build_plan(**args)


def test_tau_rule_is_the_documented_value():
    # KL ~ D^2 / 2 at the gate: sqrt(2 * 0.002) = 0.063245...
    assert tau_rule() == pytest.approx(0.0632455532, rel=1e-9)
    assert tau_rule(0.005) == pytest.approx(0.1)
    # recalibration: a pilot that saw KL 0.0005 at tau 0.05 -> 0.05 * sqrt(4) = 0.1
    assert tau_from_kl(0.05, 0.0005) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        tau_from_kl(0.05, 0.0)
    with pytest.raises(ValueError):
        tau_rule(-1.0)


def test_headroom_drift_arms_match_fresh_budget_and_step_size(tmp_path):
    plan = _plan(tmp_path, comparisons=["headroom_drift"])
    arms = {a.name: a for a in plan.arms("headroom_drift")}
    assert list(arms) == ["grpo_matched", "grpo_larger", "naive", "headroom_drift", "headroom_only", "drift_only"]
    assert arms["grpo_matched"].fresh_prompts == 8
    assert arms["grpo_larger"].fresh_prompts == 12  # 1.5 G
    assert arms["naive"].env["K_REP"] == arms["headroom_drift"].env["K_REP"] == "4"  # K_rep = G / 2
    assert float(arms["headroom_drift"].env["TAU"]) == pytest.approx(tau_rule(), rel=1e-5)
    assert "TAU" not in arms["naive"].env
    # the ablations: Headroom ranking without the gate; the gate without the ranking (newest first)
    assert float(arms["headroom_only"].env["TAU"]) == UNGATED_TAU and "SCAN_ORDER" not in arms["headroom_only"].env
    assert (
        arms["drift_only"].env["SCAN_ORDER"] == "recency"
        and arms["drift_only"].env["TAU"] == arms["headroom_drift"].env["TAU"]
    )
    assert {arms[a].recipe for a in ("headroom_drift", "headroom_only", "drift_only")} == {"headroom_drift_math.sh"}
    for run in plan.runs:  # same optimiser-step size in every arm
        assert run.env["PPO_MINI_PROMPTS"] == "4" and run.env["GROUP_SIZE"] == "4"
        assert run.env["TINY"] == "1" and run.env["STAGES"] == "train"
    assert plan.search is None and plan.archive is None


def test_paper_profile_uses_the_paper_sizes(tmp_path):
    plan = _plan(tmp_path, profile=paper_profile(), seeds=[0])
    by = {r.arm.name: r for r in plan.runs}
    assert by["grpo_matched"].env["TRAIN_PROMPTS"] == "32" and by["grpo_larger"].env["TRAIN_PROMPTS"] == "48"
    assert by["headroom_drift"].env["K_REP"] == "16" and by["headroom_drift"].env["PPO_MINI_PROMPTS"] == "8"
    assert by["headroom_drift"].env["TOTAL_STEPS"] == "500" and by["elite"].env["TOTAL_STEPS"] == "100"
    assert by["headroom_drift"].env["STAGES"] == "train,eval"  # Mean@32 / Best@32 on the benchmarks
    # the SQL arms keep the SQL recipe's own sizes (128 x 8, 32 per optimiser step)
    assert "PPO_MINI_PROMPTS" not in by["elite"].env and "TRAIN_PROMPTS" not in by["elite"].env
    assert all("TINY" not in r.env for r in plan.runs)


def test_arith_profile_runs_the_headroom_drift_comparison_on_the_addition_task(tmp_path):
    plan = _plan(tmp_path, comparisons=["headroom_drift"], profile=arith_profile(), seeds=[1, 2])
    by = {r.arm.name: r for r in plan.runs if r.seed == 1}
    assert list(by) == [
        "grpo_matched",
        "grpo_larger",
        "naive",
        "headroom_drift",
        "headroom_only",
        "drift_only",
        "grpo_control",
    ]
    # the control: the matched arm with training rewards at random, at the warm start's accuracy
    control = by["grpo_control"]
    assert control.env["REWARD_CONTROL_RATE"] == "0.43" and control.arm.recipe == by["grpo_matched"].arm.recipe
    assert {k: v for k, v in control.env.items() if k not in ("REWARD_CONTROL_RATE", "OUTPUT_DIR", "RUN_DIR")} == {
        k: v for k, v in by["grpo_matched"].env.items() if k not in ("OUTPUT_DIR", "RUN_DIR")
    }

    def seeds_of(run):
        return [arg for arg in run.argv[2:] if "val_before_train" not in arg]

    assert seeds_of(control) == seeds_of(by["grpo_matched"])  # same seeds: same prompts, same sampler
    assert by["grpo_matched"].env["TRAIN_PROMPTS"] == "8" and by["grpo_larger"].env["TRAIN_PROMPTS"] == "12"
    assert by["naive"].env["K_REP"] == by["headroom_drift"].env["K_REP"] == "4"
    for run in plan.runs:
        assert run.env["TINY_TASK"] == "arith" and run.env["TINY"] == "1" and run.env["STAGES"] == "train"
        assert run.env["TOTAL_STEPS"] == "60" and run.env["TEST_FREQ"] == "10" and run.env["VAL_N"] == "2"
        assert run.env["GROUP_SIZE"] == "8" and run.env["PPO_MINI_PROMPTS"] == "4"
        # the exact metric carries the curve: verl samples only before training and at the end
        assert run.argv[-1] == "sampled_val=ends"
        # common random numbers: each request sampled from a seed of its own
        assert "actor_rollout_ref.rollout.agent.default_agent_loop=seeded_single_turn_agent" in run.argv
        # one evaluation before training per seed, by its reference arm; the others report it
        first = run.arm.name == "grpo_matched"
        assert f"trainer.val_before_train={'true' if first else 'false'}" in run.argv
        assert run.step0_from == (None if first else "grpo_matched")
    # the addition task has no SQL archive: the elite comparison is refused, naming what runs
    with pytest.raises(ValueError, match="arith profile has no task for elite; it runs headroom_drift"):
        _plan(tmp_path, profile=arith_profile())
    assert all("TINY_TASK" not in r.env for r in _plan(tmp_path).runs)


def test_shapes_profile_runs_the_elite_comparison_on_the_query_shapes_task(tmp_path):
    plan = _plan(tmp_path, comparisons=["elite"], profile=shapes_profile(), seeds=[1, 2])
    assert [a.name for a in plan.arms("elite")] == ["grpo", "elite_iid", "elite", "elite_mu0"]
    assert plan.search is not None and plan.search.env["TINY_TASK"] == "shapes"
    by_seed = {(r.arm.name, r.seed): r for r in plan.runs}
    for run in plan.runs:
        assert run.env["TINY_TASK"] == "shapes" and run.env["TINY"] == "1" and run.env["STAGES"] == "train,eval"
        assert run.env["TOTAL_STEPS"] == "60" and run.env["TEST_FREQ"] == "10" and run.env["VAL_N"] == "2"
        assert run.env["TRAIN_PROMPTS"] == "8" and run.env["EVAL_N"] == "16" and run.env["EVAL_K"] == "1,4,16"
        assert "EVAL_LIMIT" not in run.env  # every held-out question
    # the arms of a seed differ only in the strategy and its archive: same prompts, same sampler
    for seed in (1, 2):
        grpo, elite = by_seed[("grpo", seed)], by_seed[("elite", seed)]
        assert grpo.argv[2:] == elite.argv[2:] and f"data.seed={seed}" in grpo.argv
        assert elite.env["ARCHIVE"] == by_seed[("elite_iid", seed)].env["ARCHIVE"] and "ARCHIVE" not in grpo.env
        # the control is EliteReplay's own command with the replay term off, and nothing else changed
        control = by_seed[("elite_mu0", seed)]
        assert control.argv == elite.argv and control.env.pop("MU") == "0" and "MU" not in elite.env
        assert {k: v for k, v in control.env.items() if k not in ("OUTPUT_DIR", "RUN_DIR")} == {
            k: v for k, v in elite.env.items() if k not in ("OUTPUT_DIR", "RUN_DIR")
        }
    # the other profiles have no such arm
    assert "elite_mu0" not in [a.name for a in _plan(tmp_path, comparisons=["elite"]).arms("elite")]
    with pytest.raises(ValueError, match="shapes profile has no task for headroom_drift; it runs elite"):
        _plan(tmp_path, profile=shapes_profile())


def test_seeds_runs_and_shared_archive(tmp_path):
    plan = _plan(tmp_path)
    assert len(plan.runs) == 3 * (6 + 3)
    assert not any(r.arm.name == "grpo_control" for r in plan.runs)  # the tiny profile has no control arm
    # comparison after comparison, seed-major within one
    assert [(r.arm.comparison, r.seed) for r in plan.runs[:7]] == [("headroom_drift", 1)] * 6 + [("headroom_drift", 2)]
    assert [r.seed for r in plan.runs[18:21]] == [1, 1, 1] and plan.runs[18].arm.comparison == "elite"
    assert len({r.run_dir for r in plan.runs}) == len(plan.runs)
    for run in plan.runs:
        assert f"data.seed={run.seed}" in run.argv and f"actor_rollout_ref.rollout.seed={run.seed}" in run.argv
        assert run.argv[0] == "bash" and Path(run.argv[1]).is_file()
        if run.arm.comparison == "elite" and run.arm.name != "grpo":
            assert run.env["ARCHIVE"] == str(plan.archive) and run.env["ELITE_SEED"] == str(run.seed)
        if run.arm.name == "grpo":
            assert "ARCHIVE" not in run.env
    assert plan.search is not None and plan.search.env["STAGES"] == "search"
    assert plan.search.env["ARCHIVE"] == str(plan.archive)


def test_arms_no_main_contrast_reads_run_at_the_other_seeds_only(tmp_path):
    plan = _plan(tmp_path, seeds=[1, 2, 3, 4, 5], other_seeds=[1, 2])
    seeds = {}
    for run in plan.runs:
        seeds.setdefault((run.arm.comparison, run.arm.name), []).append(run.seed)
    main = {("headroom_drift", "grpo_matched"), ("headroom_drift", "naive"), ("headroom_drift", "headroom_drift")}
    main |= {("elite", "grpo"), ("elite", "elite_iid"), ("elite", "elite")}
    for arm, ran in seeds.items():
        assert ran == ([1, 2, 3, 4, 5] if arm in main else [1, 2]), arm
    assert seeds[("headroom_drift", "drift_only")] == [1, 2]
    with pytest.raises(ValueError, match="--other-seeds"):
        _plan(tmp_path, seeds=[1, 2], other_seeds=[3])


def test_arms_filter_and_bad_input(tmp_path):
    plan = _plan(tmp_path, arms=["grpo_matched", "headroom_drift"], seeds=[1])
    assert [r.arm.name for r in plan.runs] == ["grpo_matched", "headroom_drift"]
    with pytest.raises(ValueError, match="--arms"):
        _plan(tmp_path, arms=["nope"])
    with pytest.raises(ValueError, match="--comparison"):
        _plan(tmp_path, comparisons=["x"])
    with pytest.raises(ValueError, match="--seeds"):
        _plan(tmp_path, seeds=[1, 1])


def test_shell_line_round_trips(tmp_path):
    import shlex

    run = _plan(tmp_path, seeds=[2]).runs[0]
    words = shlex.split(run.shell())
    assert run.argv and words[0] == "env" and words[-len(run.argv) :] == run.argv
    assigned = dict(word.split("=", 1) for word in words[1 : -len(run.argv)])
    assert assigned == run.env and assigned["RUN_DIR"] == str(run.run_dir)


def test_cli_dry_run_prints_every_command(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "verl_replay.compare", "--profile", "paper", "--out", str(tmp_path)],
        env={"DRY_RUN": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("env ")]
    assert len(lines) == 1 + 3 * 9  # the archive search + every (arm, seed)
    assert not any(tmp_path.iterdir())  # nothing ran, nothing written
    bad = subprocess.run(
        [sys.executable, "-m", "verl_replay.compare", "--dry-run", "--arms", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--arms" in bad.stderr
    # the gated arms run at the documented tau; the Headroom-only arm has no gate; no other arm a tau
    gated = [line for line in lines if "recipes/headroom_drift_math.sh" in line and "TAU=1e+09 " not in line]
    assert len(gated) == 6 and all(f"TAU={tau_rule():g} " in line for line in gated), gated
    assert sum("TAU=" in line for line in lines) == 9


def test_gated_arms_are_expected_to_take_longest(tmp_path):
    plan = _plan(tmp_path, comparisons=["headroom_drift"], profile=arith_profile(), seeds=[1])
    costs = {r.arm.name: r.arm.relative_cost for r in plan.runs}
    assert costs["headroom_drift"] == costs["drift_only"] > costs["grpo_matched"] == costs["headroom_only"] == 1.0


def test_cli_dry_run_of_several_profiles(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "verl_replay.compare", "--profile", "arith,shapes", "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("env ")]
    assert len(lines) == 3 * 7 + 1 + 3 * 4  # arith's arms, shapes' archive search and arms, 3 seeds
    assert sum(f"RUN_DIR={tmp_path}/arith/runs/" in line for line in lines) == 21
    assert sum(f"RUN_DIR={tmp_path}/shapes/runs/" in line for line in lines) == 12
    for bad in (
        ["--profile", "arith,nope"],
        ["--profile", "arith,arith"],
        ["--profile", "arith,shapes", "--arms", "naive"],
    ):
        run = subprocess.run(
            [sys.executable, "-m", "verl_replay.compare", "--dry-run", *bad], capture_output=True, text=True
        )
        assert run.returncode == 2 and ("--profile" in run.stderr or "--arms" in run.stderr), run.stderr
