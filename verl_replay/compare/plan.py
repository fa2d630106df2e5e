"""The arms of the papers' two comparisons as recipe commands (no verl import, no side effects).

Every arm is one recipe run (``recipes/*.sh`` -> ``python -m verl_replay.main``), so the
comparison trains through the normal entry point; a seed changes the data order
(``data.seed``), the rollout sampling seed (``actor_rollout_ref.rollout.seed``) and, for the
archive arms, the archive sampler seed (``ELITE_SEED``).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from verl_replay.compare.contrasts import CONTRASTS
from verl_replay.integrations.verl.seeded_rollout import SEEDED_AGENT_LOOP

__all__ = [
    "COMPARISONS",
    "PROFILES",
    "TARGET_REPLAY_KL",
    "UNGATED_TAU",
    "Arm",
    "Plan",
    "RunSpec",
    "Profile",
    "arith_profile",
    "shapes_profile",
    "build_plan",
    "tau_from_kl",
    "tau_rule",
]

COMPARISONS = ("headroom_drift", "elite")
PROFILES = ("tiny", "arith", "shapes", "paper")

# The paper's moderate gate: replay KL of the accepted groups near 0.002 (docs/headroom_drift.md).
TARGET_REPLAY_KL = 0.002
# The Headroom-only ablation's gate: far above any drift a finite log-ratio gives, so nothing is rejected.
UNGATED_TAU = 1e9


def tau_rule(target_kl: float = TARGET_REPLAY_KL) -> float:
    """The documented a-priori gate: with the l2 drift norm, replay KL ~ D^2 / 2, so
    tau = sqrt(2 * KL_target) (0.0632 for 0.002)."""
    if not target_kl > 0:
        raise ValueError(f"target replay KL must be > 0, got {target_kl}")
    return math.sqrt(2.0 * target_kl)


def tau_from_kl(tau: float, kl_seen: float, target_kl: float = TARGET_REPLAY_KL) -> float:
    """The documented recalibration from a pilot run: tau_new = tau * sqrt(KL_target / KL_seen)."""
    if not (tau > 0 and kl_seen > 0 and target_kl > 0):
        raise ValueError(f"tau, KL seen and target KL must be > 0 (got {tau}, {kl_seen}, {target_kl})")
    return tau * math.sqrt(target_kl / kl_seen)


@dataclass(frozen=True)
class Arm:
    """One arm of a comparison: a recipe script plus the variables that make it this arm."""

    comparison: str
    name: str
    label: str
    recipe: str  # path relative to recipes/
    env: dict[str, str] = field(default_factory=dict)
    fresh_prompts: int = 0  # fresh prompts per global step (x group size = fresh responses)
    # expected run time, in on-policy GRPO runs of the addition profile (measured on CPU): side by
    # side, the runner starts a seed's longest runs first, so that the last runs are short ones
    relative_cost: float = 1.0


@dataclass(frozen=True)
class Profile:
    """Sizes of a profile. ``steps`` / ``test_freq`` are per comparison (the recipes differ: math
    500 / 50, SQL 100 / 25 at paper scale); ``prompts`` (G), ``mini_prompts``, ``group_size`` and
    ``k_rep`` define the Headroom-Drift comparison's matching; the elite arms keep their recipe's
    sizes."""

    name: str
    tiny: bool
    steps: dict[str, int]
    test_freq: dict[str, int]
    val_n: int
    group_size: int
    prompts: int  # G: fresh prompts per global step of the matched arms
    mini_prompts: int
    k_rep: int
    eval_n: int
    eval_k: str
    eval_limit: Optional[int]
    math_eval: bool  # run the recipe's eval stage for the math arms too (paper: Mean@32 / Best@32)
    tiny_task: Optional[str] = None  # the recipes' TINY_TASK (arith: the learnable tiny profile)
    # the control arm's training reward rate (rewards drawn at random at this rate); None: no control arm
    control_rate: Optional[float] = None
    # add an EliteReplay arm with mu = 0: the elite recipe with its replay term off, which exposes
    # an effect that comes from the recipe (its batches, its archive loading) rather than the replay
    elite_control: bool = False
    comparisons: tuple[str, ...] = COMPARISONS  # the comparisons the profile has a task for
    # the effect, in the primary metric's units, the main contrasts' seeds are sized for (None: not sized)
    target_effect: Optional[float] = None
    # the runs' sampled_val: every, or ends where the exact metric carries the curve (the report
    # reads sampled accuracy only before training and at the end)
    sampled_val: str = "every"
    # one evaluation before training per seed, reported by every arm of the seed (the arms start
    # from the same weights); off where a run's own step-0 draw is part of what it reports
    share_step0: bool = False
    # common random numbers: every rollout request sampled from a seed of its own (the seeded
    # agent loop), so the arms of a seed draw the same responses where their weights agree
    seeded_rollout: bool = False


def tiny_profile(steps: Optional[int] = None, test_freq: Optional[int] = None, val_n: Optional[int] = None) -> Profile:
    steps, test_freq = steps or 6, test_freq or 2
    return Profile(
        name="tiny",
        tiny=True,
        steps={c: steps for c in COMPARISONS},
        test_freq={c: test_freq for c in COMPARISONS},
        val_n=val_n or 2,
        group_size=4,
        # G = 8 groups in 2 rounds of one 4-group optimiser step, K_rep = G / 2 like
        # b256 + r128; 1.5 G = 12 in 3 rounds. 4 prompts per round, not the recipe's 2:
        # a round whose rows all have one length crashes verl's own update on this
        # stack (see docs/comparison/README.md), and 2 tiny-math prompts x 4 short
        # answers often do
        prompts=8,
        mini_prompts=4,
        k_rep=4,
        eval_n=4,
        eval_k="1,2,4",
        eval_limit=1000,  # more than the tiny validation set: every question
        math_eval=False,
    )


# Validation samples per held-out question of the learnable profiles. verl's validation costs
# ~25 ms of CPU a sample (its agent loop, reward and routing per sample), 40% of a run at 4; an
# evaluation's error bound, sqrt(p (1 - p) / questions), is per question, not per sample, and the
# paired differences between arms are dominated by training's spread over seeds, so 2 it is.
VALIDATION_SAMPLES = 2


def arith_profile(steps: Optional[int] = None, test_freq: Optional[int] = None, val_n: Optional[int] = None) -> Profile:
    """The tiny addition profile (recipes/README.md): two-digit addition, built so that GRPO has
    something to learn within 60 steps on CPU. G = 8 prompts x 8 responses in 2 rounds of one 4-group optimiser step,
    K_rep = G / 2; validation on the 256 held-out problems, 2 samples each."""
    steps, test_freq = steps or 60, test_freq or 10
    return Profile(
        name="arith",
        tiny=True,
        steps={"headroom_drift": steps},
        test_freq={"headroom_drift": test_freq},
        val_n=val_n or VALIDATION_SAMPLES,
        group_size=8,
        prompts=8,
        mini_prompts=4,
        k_rep=4,
        eval_n=4,
        eval_k="1,4",
        eval_limit=None,
        math_eval=False,
        tiny_task="arith",
        comparisons=("headroom_drift",),
        # the warm start's held-out sampled accuracy: the control sees the reward rate a real
        # run starts from, but rewards that say nothing about the answer
        control_rate=0.43,
        target_effect=0.03,  # 3 points of held-out accuracy: the papers report 1-2
        sampled_val="ends",
        share_step0=True,
        seeded_rollout=True,
    )


def shapes_profile(
    steps: Optional[int] = None, test_freq: Optional[int] = None, val_n: Optional[int] = None
) -> Profile:
    """The tiny query-shapes profile (recipes/README.md): SQL questions with three right query shapes,
    on which the base model is less reliable in its rare shapes, for GRPO vs archive replay. 8
    questions x 8 responses a global step like the addition profile; the evaluation draws 16
    answers per held-out question (pass@1/4/16, distinct right shapes)."""
    steps, test_freq = steps or 60, test_freq or 10
    return Profile(
        name="shapes",
        tiny=True,
        steps={"elite": steps},
        test_freq={"elite": test_freq},
        val_n=val_n or VALIDATION_SAMPLES,
        group_size=8,
        prompts=8,
        mini_prompts=4,
        k_rep=4,
        eval_n=16,
        eval_k="1,4,16",
        eval_limit=None,
        math_eval=False,
        tiny_task="shapes",
        comparisons=("elite",),
        elite_control=True,
        target_effect=0.2,  # distinct right query shapes per question
        seeded_rollout=True,
    )


def paper_profile(steps: Optional[int] = None, test_freq: Optional[int] = None, val_n: Optional[int] = None) -> Profile:
    # recipes/README.md: math b256 (32 x 8) + r128 (16 groups), 8 prompts per optimiser step, 500
    # steps; SQL 128 x 8, 100 steps. Validation Mean@32 / Best@32, sampled.
    return Profile(
        name="paper",
        tiny=False,
        steps={"headroom_drift": steps or 500, "elite": steps or 100},
        test_freq={"headroom_drift": test_freq or 50, "elite": test_freq or 25},
        val_n=val_n or 32,
        group_size=8,
        prompts=32,
        mini_prompts=8,
        k_rep=16,
        eval_n=128,
        eval_k="1,2,4,8,16,32,64,128",
        eval_limit=None,
        math_eval=True,
    )


@dataclass(frozen=True)
class RunSpec:
    """One (arm, seed) run: the command, its extra environment, where it writes."""

    arm: Arm
    seed: int
    run_dir: Path
    log_path: Path
    env: dict[str, str]
    argv: list[str]
    # the arm of this seed whose evaluation before training this run reports as its own (None:
    # the run evaluates before training itself): every arm of a seed starts from the same weights
    step0_from: Optional[str] = None

    @property
    def key(self) -> str:
        return f"{self.arm.comparison}/{self.arm.name}/seed{self.seed}"

    def shell(self) -> str:
        """The command as one shell line (paste it to re-run this arm and seed by hand)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"env {env} {shlex.join(self.argv)}"


@dataclass(frozen=True)
class Plan:
    profile: Profile
    tau: float
    out_dir: Path
    archive: Optional[Path]
    search: Optional[RunSpec]  # the one archive search the elite arms share
    runs: list[RunSpec]

    def arms(self, comparison: str) -> list[Arm]:
        seen: dict[str, Arm] = {}
        for run in self.runs:
            if run.arm.comparison == comparison:
                seen.setdefault(run.arm.name, run.arm)
        return list(seen.values())

    @property
    def comparisons(self) -> list[str]:
        return [c for c in COMPARISONS if any(r.arm.comparison == c for r in self.runs)]


def headroom_drift_arms(profile: Profile, tau: float) -> list[Arm]:
    larger = (3 * profile.prompts) // 2  # 1.5 G fresh groups, optimiser steps of the same size
    if 2 * larger != 3 * profile.prompts or larger % profile.mini_prompts:
        raise ValueError(f"1.5 x {profile.prompts} prompts must be a whole multiple of {profile.mini_prompts}")
    fresh = f"b{profile.prompts * profile.group_size}"
    sizes = f"{fresh}+r{profile.k_rep * profile.group_size}"
    matched = {"TRAIN_PROMPTS": str(profile.prompts)}
    replayed = {**matched, "K_REP": str(profile.k_rep)}
    gated = {**replayed, "TAU": f"{tau:.6g}"}

    def arm(
        name: str, label: str, recipe: str, env: dict[str, str], prompts: int = profile.prompts, cost: float = 1.0
    ) -> Arm:
        return Arm("headroom_drift", name, label, recipe, env, prompts, cost)

    arms = [
        arm("grpo_matched", f"GRPO on-policy {fresh}", "baselines/grpo_onpolicy_b256.sh", matched),
        arm(
            "grpo_larger",
            f"GRPO on-policy b{larger * profile.group_size}",
            "baselines/grpo_onpolicy_b384.sh",
            {"TRAIN_PROMPTS": str(larger)},
            larger,
        ),
        arm("naive", f"naive replay {sizes}", "baselines/naive_replay.sh", replayed),
        # a strict gate scans most of the buffer every step: ~2x an on-policy run (arith profile)
        arm("headroom_drift", f"Headroom-Drift {sizes} (tau {tau:.4f})", "headroom_drift_math.sh", gated, cost=2.0),
        arm(
            "headroom_only",
            f"Headroom-only {sizes} (no gate)",
            "headroom_drift_math.sh",
            {**replayed, "TAU": f"{UNGATED_TAU:g}"},
        ),
        arm(
            "drift_only",
            f"Drift-only {sizes} (newest first, tau {tau:.4f})",
            "headroom_drift_math.sh",
            {**gated, "SCAN_ORDER": "recency"},
            cost=2.0,
        ),
    ]
    if profile.control_rate is not None:
        rate = f"{profile.control_rate:g}"
        arms.append(
            arm(
                "grpo_control",
                f"control: GRPO {fresh}, random rewards (rate {rate})",
                "baselines/grpo_onpolicy_b256.sh",
                {**matched, "REWARD_CONTROL_RATE": rate},
            )
        )
    return arms


def elite_arms(profile: Profile) -> list[Arm]:
    prompts = None if not profile.tiny else profile.prompts  # paper: the recipe's 128 questions
    env = {} if prompts is None else {"TRAIN_PROMPTS": str(prompts)}
    fresh = prompts or 128
    cost = 1.3  # SQL answers are longer than additions, and each run ends with an evaluation
    arms = [
        Arm("elite", "grpo", "GRPO", "baselines/grpo_sql.sh", dict(env), fresh, cost),
        Arm("elite", "elite_iid", "IID archive replay", "baselines/iid_archive_replay.sh", dict(env), fresh, cost),
        Arm("elite", "elite", "EliteReplay", "elite_replay_qwen4b.sh", dict(env), fresh, cost),
    ]
    if profile.elite_control:
        label = "control: EliteReplay, mu = 0 (replay term off)"
        arms.append(Arm("elite", "elite_mu0", label, "elite_replay_qwen4b.sh", {**env, "MU": "0"}, fresh, cost))
    return arms


def _common_env(profile: Profile, comparison: str, python: str) -> dict[str, str]:
    steps = profile.steps[comparison]
    env = {
        "PYTHON": python,
        "TOTAL_STEPS": str(steps),
        "TEST_FREQ": str(profile.test_freq[comparison]),
        "VAL_N": str(profile.val_n),
    }
    if comparison == "headroom_drift":
        env["PPO_MINI_PROMPTS"] = str(profile.mini_prompts)
        env["GROUP_SIZE"] = str(profile.group_size)
    if profile.tiny:
        # one checkpoint, at the end (the evaluation's input); the preflight checks a GPU stack
        env.update({"TINY": "1", "SAVE_FREQ": str(steps), "PREFLIGHT": "0"})
    if profile.tiny_task is not None:
        env["TINY_TASK"] = profile.tiny_task
    return env


def build_plan(
    *,
    comparisons: Sequence[str],
    profile: Profile,
    seeds: Sequence[int],
    out_dir: Path,
    recipes_dir: Path,
    python: str,
    arms: Optional[Sequence[str]] = None,
    tau: Optional[float] = None,
    other_seeds: Optional[Sequence[int]] = None,
) -> Plan:
    """Every (arm, seed) run of the chosen comparisons, in run order: one comparison after the
    other, seed-major within each (a partial run has whole seeds of every arm of a comparison).
    ``other_seeds`` (a subset of ``seeds``): the seeds of the arms no main contrast reads (the
    larger on-policy batch, the ablations, the controls); None: every seed for every arm."""
    unknown = [c for c in comparisons if c not in COMPARISONS]
    if unknown or not comparisons:
        raise ValueError(f"--comparison: expected some of {', '.join(COMPARISONS)}, got {list(comparisons)}")
    without_task = [c for c in comparisons if c not in profile.comparisons]
    if without_task:
        raise ValueError(
            f"--comparison: the {profile.name} profile has no task for {', '.join(without_task)}; "
            f"it runs {', '.join(profile.comparisons)}"
        )
    if not seeds or len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise ValueError(f"--seeds: expected distinct non-negative integers, got {list(seeds)}")
    if other_seeds is not None and (not other_seeds or not set(other_seeds) <= set(seeds)):
        raise ValueError(f"--other-seeds: expected some of the seeds {list(seeds)}, got {list(other_seeds)}")
    tau = tau_rule() if tau is None else tau
    out_dir = Path(out_dir).absolute()
    all_arms: list[Arm] = []
    if "headroom_drift" in comparisons:
        all_arms += headroom_drift_arms(profile, tau)
    if "elite" in comparisons:
        all_arms += elite_arms(profile)
    if arms:
        names = {a.name for a in all_arms}
        missing = [a for a in arms if a not in names]
        if missing:
            raise ValueError(f"--arms: unknown arm(s) {missing}; the chosen comparisons have {sorted(names)}")
        all_arms = [a for a in all_arms if a.name in arms]
    archive = out_dir / "archive" / "elite_archive.parquet" if any(a.comparison == "elite" for a in all_arms) else None
    search = None
    if archive is not None and any(a.name != "grpo" for a in all_arms if a.comparison == "elite"):
        search_env = {
            **_common_env(profile, "elite", python),
            "STAGES": "search",
            "ARCHIVE": str(archive),
            "STRATEGY": "elite",
            "OUTPUT_DIR": str(out_dir / "archive"),
            "RUN_DIR": str(out_dir / "archive" / "unused_run"),
        }
        search = RunSpec(
            Arm("elite", "search", "archive search", "elite_replay_qwen4b.sh"),
            0,
            out_dir / "archive",
            out_dir / "logs" / "elite-search.log",
            search_env,
            ["bash", str(recipes_dir / "elite_replay_qwen4b.sh")],
        )
    main_arms = {(c.comparison, name) for c in CONTRASTS if c.main for name in (c.arm, c.reference)}

    def runs_at(arm: Arm, seed: int) -> bool:
        return other_seeds is None or (arm.comparison, arm.name) in main_arms or seed in other_seeds

    runs: list[RunSpec] = []
    step0_arm: dict[tuple[str, int], str] = {}  # (comparison, seed) -> the arm that evaluates step 0
    for arm, seed in (
        (arm, seed)
        for comparison in COMPARISONS
        for seed in seeds
        for arm in all_arms
        if arm.comparison == comparison and runs_at(arm, seed)
    ):
        run_dir = out_dir / "runs" / arm.comparison / arm.name / f"seed{seed}"
        env = {
            **_common_env(profile, arm.comparison, python),
            **arm.env,
            "OUTPUT_DIR": str(run_dir.parent),
            "RUN_DIR": str(run_dir),
        }
        # the evaluation before training (the curves' start): once per seed, by the seed's first arm
        # (the reference); the others report its values (every arm of a seed starts from the same
        # weights), which saves one validation a run
        source = step0_arm.setdefault((arm.comparison, seed), arm.name)
        shared = profile.share_step0 and source != arm.name
        overrides = [
            f"data.seed={seed}",
            f"actor_rollout_ref.rollout.seed={seed}",
            f"trainer.val_before_train={'false' if shared else 'true'}",
        ]
        if profile.seeded_rollout:
            overrides.append(f"actor_rollout_ref.rollout.agent.default_agent_loop={SEEDED_AGENT_LOOP}")
        if profile.sampled_val != "every":  # the exact metric carries the curve; sampled only where read
            overrides.append(f"sampled_val={profile.sampled_val}")
        if arm.comparison == "elite":
            # the SQL recipe validates greedily; sampled like the math recipe, for Mean@n / Best@n
            overrides += [
                "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
                "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
            ]
            env["STAGES"] = "train,eval"
            env["EVAL_N"] = str(profile.eval_n)
            env["EVAL_K"] = profile.eval_k
            if profile.eval_limit is not None:
                env["EVAL_LIMIT"] = str(profile.eval_limit)
            if arm.name != "grpo":
                env["ARCHIVE"] = str(archive)
                env["ELITE_SEED"] = str(seed)
        else:
            env["STAGES"] = "train,eval" if profile.math_eval else "train"
        runs.append(
            RunSpec(
                arm,
                seed,
                run_dir,
                out_dir / "logs" / f"{arm.comparison}-{arm.name}-seed{seed}.log",
                env,
                ["bash", str(recipes_dir / arm.recipe), *overrides],
                step0_from=source if shared else None,
            )
        )
    return Plan(profile=profile, tau=tau, out_dir=out_dir, archive=archive, search=search, runs=runs)
