"""verl's weight push into vLLM, proven from outside: after each global step's push the rollout engine
scores its sequences as the trainer's weights of that step do, and not as the step before's.

The run: GRPO on the split placement (verl's ``separate_async`` trainer, 2 update rounds per global
step, verl's vLLM server on vLLM's CPU build, the trainer's weights pushed every global step through
the CPU weight-sync engine), a learning rate that moves the
weights well past the engine's bf16 floor per step, and the update audit (``replay.audit_dir``),
which records the weights every optimiser step was taken at. Independent source: a plain
transformers forward (fp32) of each recorded weight version over the tokens vLLM sampled; vLLM's
own log-probs of those tokens (``rollout_log_probs``, what verl stores as the anchor) must match one
version within the engine floor, and that version must be far from its predecessor. A push aborts
the requests in flight and verl resumes them on the new weights (partial rollout): such a row's
tokens match one version up to the push and the next one after it.

The control: the same run with a checkpoint engine that receives every push after the first and
drops it (``muted_push``): the engine then keeps the first weights, the rows of later steps match no
recent version, and the same checks fail.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from independent_checks import read_gradient_records, rows_log_probs, tiny_model
from replay_audit import FRESH, AuditedRow, read_audit
from split_checks import SPLIT_OVERRIDES

# Mean |vLLM bf16 log-prob - transformers fp32 log-prob| per token of a row, at the weights vLLM
# holds: measured 0.005-0.007 on the tiny model (docs/cpu_stack.md); a row far above it was sampled
# from other weights.
ENGINE_FLOOR = 0.03
# The weights of the step before must be this many times further off than the matching version.
STALE_FACTOR = 3.0
STEPS = 4
LEARNING_RATE = 3e-3  # the tiny model moves ~0.1 nat per token per step: 20x the engine floor
MUTED_PUSH_DIR = str(Path(__file__).parent)  # muted_push.py, imported by the Ray workers


def _run(run_main, tmp_path: Path, *extra: str, experiment: str):
    audit = tmp_path / f"audit_{experiment}"
    run_main(
        *SPLIT_OVERRIDES,
        "replay.strategy=none",
        f"trainer.total_training_steps={STEPS}",
        f"actor_rollout_ref.actor.optim.lr={LEARNING_RATE}",
        f"replay.audit_dir={audit}",
        *extra,
        experiment=experiment,
    )
    return audit


def weight_versions(audit: Path) -> list[dict[str, torch.Tensor]]:
    """The trainer's weights after each global step, from the weights each optimiser step was taken
    at: version v = before the first optimiser step of global step v + 1 (v = 0: the base model)."""
    first_of_step: dict[int, dict[str, torch.Tensor]] = {}
    for record in read_gradient_records(audit):
        first_of_step.setdefault(int(record["replay_global_step"]), record["weights"])
    steps = sorted(first_of_step)
    assert steps == list(range(1, len(steps) + 1)), steps
    return [first_of_step[step] for step in steps]


def token_distances(audit: Path, model_dir: Path) -> tuple[list[AuditedRow], list[torch.Tensor]]:
    """Fresh rows of the run and, per row, |vLLM - fp32| of each token under each recorded weight
    version: ``[T, V]`` per row, version v = the weights after v global steps."""
    rows = [row for row in read_audit(audit) if row.source == FRESH and row.rollout_log_probs is not None]
    assert rows, "no fresh row recorded vLLM's log-probs (rollout.calculate_log_probs)"
    pairs = [row.tokens for row in rows]
    versions = weight_versions(audit)
    per_version: list[list[torch.Tensor]] = []  # [V][R] of [T]
    with torch.no_grad():
        for weights in versions:
            model = tiny_model(model_dir, weights, torch.float32)
            ours = rows_log_probs(model, pairs)
            per_version.append([(row.rollout_log_probs.float() - lp).abs() for row, lp in zip(rows, ours, strict=True)])
    return rows, [torch.stack([per_version[v][r] for v in range(len(versions))], dim=1) for r in range(len(rows))]


@dataclass(frozen=True)
class VersionFit:
    """The weights a row was sampled from: tokens ``[:split]`` from ``first``, the rest from
    ``first + 1`` (``split`` = the row's length: all from ``first``), and the fit's mean error."""

    first: int
    split: int
    error: float
    length: int

    @property
    def last(self) -> int:
        return self.first if self.split == self.length else self.first + 1


def fit_versions(distances: torch.Tensor) -> VersionFit:  # distances: [T, V]
    """One version if one fits within the floor; else the best prefix/suffix pair of consecutive
    versions: verl aborts the requests in flight at a push and resumes them on the new weights
    (partial rollout), so a row's later tokens may come from the next version."""
    length, n_versions = distances.shape
    whole = distances.mean(dim=0)  # [V]
    best = int(whole.argmin())
    if float(whole[best]) < ENGINE_FLOOR or n_versions == 1:
        return VersionFit(best, length, float(whole[best]), length)
    before = torch.cat([torch.zeros(1, n_versions), distances.cumsum(dim=0)])  # [T+1, V]: sum of tokens < s
    after = before[-1:] - before  # [T+1, V]: sum of tokens >= s
    splits = (before[:, :-1] + after[:, 1:]) / length  # [T+1, V-1]: first v before s, v + 1 from s on
    flat = int(splits[1:-1].argmin()) if length > 1 else 0
    split, first = divmod(flat, n_versions - 1)
    error = float(splits[1:-1].reshape(-1)[flat]) if length > 1 else float("inf")
    if error < float(whole[best]):
        return VersionFit(first, split + 1, error, length)
    return VersionFit(best, length, float(whole[best]), length)


def check_pushes_reach_the_engine(rows: list[AuditedRow], distances: list[torch.Tensor]) -> list[VersionFit]:
    """Each row matches one weight version (or a prefix of one and the rest of the next) within the
    floor, a whole-row match clearly apart from the version before it; the versions the engine
    sampled from advance with the global steps. Returns the fit per row."""
    fits = [fit_versions(d) for d in distances]
    for row, d, fit in zip(rows, distances, fits, strict=True):
        assert fit.error < ENGINE_FLOOR, (
            f"row of step {row.global_step}: no weight version within the floor ({fit.error:.4f}); "
            f"mean distance per version {[round(float(x), 4) for x in d.mean(dim=0)]}, "
            f"vLLM's log-probs {row.rollout_log_probs.tolist()}"
        )
        if fit.split == fit.length and fit.first > 0:
            stale = float(d[:, fit.first - 1].mean())
            assert stale > STALE_FACTOR * fit.error, (
                f"row of step {row.global_step}: version {fit.first} ({fit.error:.4f}) "
                f"not apart from version {fit.first - 1} ({stale:.4f})"
            )
        # rolled out before its own update, with weights at most one push old (separate_async). A row
        # of confident tokens can sit as close to an older version as to its own: it is against the
        # window only if no version inside the window fits within the floor too
        window = range(max(row.global_step - 2, 0), min(row.global_step, d.shape[1]))
        if not row.global_step - 2 <= fit.first <= fit.last <= row.global_step - 1:
            inside = min((float(d[:, v].mean()) for v in window), default=float("inf"))
            assert inside < ENGINE_FLOOR, (row.global_step, fit, [round(float(x), 4) for x in d.mean(dim=0)])
    last_step = max(row.global_step for row in rows)
    assert max(fit.last for fit in fits) >= last_step - 2 >= 1, "the engine never sampled from pushed weights"
    return fits


def test_a_row_resumed_after_a_push_fits_two_versions():
    """The fit itself, on hand-made distances: 3 tokens near version 1, then 2 near version 2."""
    near, far = 0.001, 0.5
    d = torch.tensor([[far, near, far]] * 3 + [[far, far, near]] * 2)  # [T=5, V=3]
    assert fit_versions(d) == VersionFit(first=1, split=3, error=pytest.approx(near, rel=1e-4), length=5)
    assert fit_versions(d[:3]) == VersionFit(first=1, split=3, error=pytest.approx(near, rel=1e-4), length=3)
    assert fit_versions(d[:, [2, 1, 0]]).error > ENGINE_FLOOR  # the next version first: no fit


@pytest.mark.e2e
def test_each_push_reaches_vllm(run_main, tiny_assets, tmp_path):
    audit = _run(run_main, tmp_path, experiment="weight_sync")
    rows, distances = token_distances(audit, tiny_assets.model_dir)
    fits = check_pushes_reach_the_engine(rows, distances)
    assert max(fit.last for fit in fits) >= 2
    resumed = sum(fit.split < fit.length for fit in fits)
    print(f"{len(fits)} rows, {resumed} resumed across a push")


@pytest.mark.e2e
def test_a_push_that_does_nothing_fails_the_check(run_main, tiny_assets, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [MUTED_PUSH_DIR, os.environ.get("PYTHONPATH")])))
    audit = _run(
        run_main,
        tmp_path,
        "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo_muted",
        "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=muted_push",
        experiment="muted",
    )
    rows, distances = token_distances(audit, tiny_assets.model_dir)
    with pytest.raises(AssertionError):
        check_pushes_reach_the_engine(rows, distances)
    # and why: every row was sampled from the first push's weights (the base model, version 0)
    assert {fit_versions(d).last for d in distances} == {0}
