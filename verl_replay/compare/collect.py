"""What one finished run measured, read from the files it wrote (no verl import).

* ``<run_dir>/metrics.jsonl`` (``{"step": N, "data": {...}}`` per line): verl's validation
  metrics ``val-core/<data_source>/acc/mean@n`` and ``.../best@n/mean`` (verl's
  ``process_validation_metrics``: best@n is the mean of bootstrapped best-of-n), ``timing_s/step``,
  and the replay metrics (``replay/acceptance_rate``, ``replay/token_share``,
  ``replay/elite/token_share``, ``replay/replay_kl_accepted/mean``);
* ``<run_dir>/config.yaml``: fresh prompts per step and group size (fresh responses used);
* ``<run_dir>/eval/results.json`` (``python -m verl_replay.eval``): pass@k and distinct correct
  strategies, macro-averaged over benchmarks.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping, Optional

from verl_replay.compare.paired import curve_auc, post_training_mean

__all__ = [
    "RunResultError",
    "borrow_step0",
    "collect_run",
    "read_metrics",
    "read_run_metrics",
    "time_split",
    "val_curve",
]

_MEAN = re.compile(r"^val-core/(?P<src>.+)/(?:acc|reward)/mean@(?P<n>\d+)$")
_BEST = re.compile(r"^val-core/(?P<src>.+)/(?:acc|reward)/best@(?P<n>\d+)/mean$")
# the exact expected accuracy (verl_replay.integrations.verl.exact_eval): no sample count, n = 0
_EXACT = re.compile(r"^val-exact/(?P<src>.+)/acc/expected$")


class RunResultError(ValueError):
    """A run's files are missing or not what a finished run writes."""


def read_metrics(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """``(step, data)`` per line of a metrics.jsonl, in file order; a later line for the same
    step (a resumed run) replaces the earlier one. An unfinished last line (no newline: a run of an
    older version killed while it wrote) is skipped; a bad line anywhere else is an error."""
    if not path.is_file():
        raise RunResultError(f"{path}: no metrics file (did the run start?)")
    by_step: dict[int, dict[str, Any]] = {}
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step, data = int(record["step"]), record["data"]
        except (ValueError, KeyError, TypeError) as exc:
            if number == len(lines) and not text.endswith("\n"):
                break  # a last line an older version's killed run left unfinished
            raise RunResultError(f"{path}:{number}: not a metrics line ({exc})") from None
        if not isinstance(data, dict):
            raise RunResultError(f"{path}:{number}: 'data' is not an object")
        by_step[step] = data
    return sorted(by_step.items())


def read_run_metrics(run_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    """A run's metrics over all its segments: a resumed run moved each earlier ``metrics.jsonl``
    aside to ``metrics.<k>.jsonl`` (k = 1, 2, ... in order); they are read first. A later
    segment's metrics for a step override an earlier one's key by key: a run resumed from the
    checkpoint of step k validates again at step k, a line without that step's training metrics."""
    run_dir = Path(run_dir)
    kept = []
    for path in run_dir.glob("metrics.*.jsonl"):
        index = path.name[len("metrics.") : -len(".jsonl")]
        if index.isdigit():
            kept.append((int(index), path))
    by_step: dict[int, dict[str, Any]] = {}
    for path in [path for _, path in sorted(kept)] + [run_dir / "metrics.jsonl"]:
        for step, data in read_metrics(path):
            by_step.setdefault(step, {}).update(data)
    return sorted(by_step.items())


def _macro(data: dict[str, Any], pattern: re.Pattern[str]) -> Optional[tuple[float, int]]:
    """Mean over data sources of the matching metric, and its n (all sources share one n)."""
    values, ns = [], set()
    for key, value in data.items():
        match = pattern.match(key)
        if match and isinstance(value, (int, float)) and math.isfinite(value):
            values.append(float(value))
            ns.add(int(match.groupdict().get("n") or 0))
    if not values:
        return None
    if len(ns) != 1:
        raise RunResultError(f"validation metrics with different n {sorted(ns)}")
    return sum(values) / len(values), ns.pop()


def val_curve(metrics: list[tuple[int, dict[str, Any]]]) -> list[dict[str, float]]:
    """``[{"step", "mean", "best", "n"}]`` for every step that validated, with ``"exact"`` (the
    exact expected accuracy) where the run computed it; a validation that measured only the exact
    metric (``sampled_val=ends``) has ``mean``, ``best`` and ``n`` None."""
    curve = []
    for step, data in metrics:
        mean, best, exact = _macro(data, _MEAN), _macro(data, _BEST), _macro(data, _EXACT)
        if mean is None and exact is None:
            continue
        point: dict[str, Any] = {"step": step, "mean": None, "best": None, "n": None}
        if mean is not None:
            point.update(mean=mean[0], n=mean[1])
            point["best"] = best[0] if best is not None else mean[0]  # n = 1: best@1 == mean@1
        if exact is not None:
            point["exact"] = exact[0]
        curve.append(point)
    return curve


def _last_sampled(curve: list[dict[str, Any]]) -> dict[str, Any]:
    """The last point with verl's sampled metrics (the curve's last point, unless that validation
    measured only the exact metric)."""
    return next((p for p in reversed(curve) if p["mean"] is not None), curve[-1])


def _avg(values: list[float]) -> Optional[float]:
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _ratio(numerator: float, denominator: float) -> Optional[float]:
    return numerator / denominator if denominator > 0 else None


def _series(metrics: list[tuple[int, dict[str, Any]]], key: str, *, where: Optional[str] = None) -> list[float]:
    out = []
    for step, data in metrics:
        if step < 1 or key not in data:
            continue
        if where is not None and not float(data.get(where, 0) or 0) > 0:
            continue
        out.append(float(data[key]))
    return out


def time_split(metrics: list[tuple[int, dict[str, Any]]], validations: int) -> dict[str, Optional[float]]:
    """Where a run's time went, in seconds: its training steps (verl's ``timing_s/step``; the
    Headroom-Drift scan inside them, ``replay/scan_forward_seconds``) and its ``validations``
    validations. verl_replay times every validation, the one before training too
    (``timing_s/validation``); a run written before that has only verl's ``timing_s/testing`` of
    the validations between steps, and its first is counted at their mean. None where the run
    recorded no such time."""

    def total(key: str) -> Optional[float]:
        values = [float(data[key]) for _, data in metrics if key in data]
        return sum(values) if values else None

    own = [float(data["timing_s/validation"]) for _, data in metrics if "timing_s/validation" in data]
    timed = [float(data["timing_s/testing"]) for _, data in metrics if "timing_s/testing" in data]
    if own and len(own) >= validations:
        validation: Optional[float] = sum(own)
    else:
        validation = sum(timed) / len(timed) * validations if timed else None
    return {
        "steps_s": total("timing_s/step"),
        "scan_s": total("replay/scan_forward_seconds"),
        "validation_s": validation,
    }


def _run_config(run_dir: Path) -> dict[str, Any]:
    import yaml  # PyYAML comes with hydra / omegaconf

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise RunResultError(f"{path}: missing (the run's resolved config)")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _config_sizes(config: dict[str, Any], run_dir: Path) -> tuple[int, int]:
    try:
        return int(config["data"]["train_batch_size"]), int(config["actor_rollout_ref"]["rollout"]["n"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RunResultError(
            f"{run_dir / 'config.yaml'}: no data.train_batch_size / actor_rollout_ref.rollout.n ({exc})"
        ) from None


# A locally built task (verl_replay.data prepare) lists the sha256 of every file in this manifest.
TASK_MANIFEST = "MANIFEST.json"


def starting_model(config: dict[str, Any]) -> dict[str, Optional[str]]:
    """The model a run started from: its path and, for a locally built task, the sha256 of its weights
    from the task's manifest (two builds of one task on two machines need not be the same weights,
    so comparisons record which one they ran). ``sha256`` is None for a model without a manifest."""
    try:
        path = Path(str(config["actor_rollout_ref"]["model"]["path"])).expanduser()
    except (KeyError, TypeError):
        return {"path": None, "sha256": None}
    digest = None
    manifest = path.parent / TASK_MANIFEST
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text(encoding="utf-8")).get("files", {})
            digest = files.get(f"{path.name}/model.safetensors")
        except (ValueError, AttributeError):
            digest = None
    return {"path": str(path), "sha256": digest}


def _eval_metrics(run_dir: Path) -> Optional[dict[str, float]]:
    path = run_dir / "eval" / "results.json"
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        macro = doc["averages"]["macro"]
    except (ValueError, KeyError, TypeError) as exc:
        raise RunResultError(f"{path}: not a verl_replay.eval results document ({exc})") from None
    keep = {
        k: float(v)
        for k, v in macro.items()
        if (k.startswith("pass@") or k in ("distinct_strategies", "mean@n", "best@n")) and v is not None
    }
    return keep


def collect_run(run_dir: Path, expected_steps: Optional[int] = None) -> dict[str, Any]:
    """The numbers the comparison reports for one finished run."""
    run_dir = Path(run_dir)
    metrics = read_run_metrics(run_dir)
    train_steps = [step for step, data in metrics if step >= 1 and "timing_s/step" in data]
    if not train_steps:
        raise RunResultError(f"{run_dir}/metrics.jsonl: no training step recorded")
    if expected_steps is not None and max(train_steps) < expected_steps:
        raise RunResultError(f"{run_dir}: stopped at step {max(train_steps)} of {expected_steps}")
    config = _run_config(run_dir)
    prompts, group = _config_sizes(config, run_dir)
    curve = val_curve(metrics)
    if not curve:
        raise RunResultError(f"{run_dir}/metrics.jsonl: no val-core/* metrics (trainer.test_freq off?)")
    for point in curve:  # the validation of step s ran after s global steps of fresh rollouts
        point["fresh_responses"] = prompts * group * point["step"]
    step_times = _series(metrics, "timing_s/step")
    result: dict[str, Any] = {
        "steps": max(train_steps),
        "fresh_responses": prompts * group * len(train_steps),
        "step_time_s": _avg(step_times),
        # the first global step carries start-up work (first weight push, compilation of nothing
        # on CPU but cold caches): reported separately so it does not dominate short runs
        "step_time_s_after_first": _avg(step_times[1:]) if len(step_times) > 1 else None,
        "val_curve": curve,
        "final_mean": _last_sampled(curve)["mean"],
        "final_best": _last_sampled(curve)["best"],
        "auc_mean": curve_auc(curve, "mean"),
        "post_mean": post_training_mean(curve, "mean"),
        # the exact expected accuracy, where the run computed it (None otherwise)
        "final_exact": curve[-1].get("exact"),
        "post_exact": post_training_mean(curve, "exact"),
        "val_n": _last_sampled(curve)["n"],
        # over the steps that scanned / replayed anything (the first step has an empty buffer)
        # accepted over scanned groups of the whole run (a mean of per-step rates would weigh a
        # step that scanned 2 groups like one that scanned 200)
        "replay_acceptance": _ratio(
            sum(_series(metrics, "replay/accepted", where="replay/scanned")),
            sum(_series(metrics, "replay/scanned", where="replay/scanned")),
        ),
        "replay_token_share": _avg(_series(metrics, "replay/token_share", where="replay/candidates")),
        "replay_kl_accepted": _avg(_series(metrics, "replay/replay_kl_accepted/mean", where="replay/accepted")),
        "elite_token_share": _avg(_series(metrics, "replay/elite/token_share")),
    }
    result["time"] = time_split(metrics, len(curve))
    result["eval"] = _eval_metrics(run_dir)
    result["model"] = starting_model(config)
    return result


def borrow_step0(result: dict[str, Any], source: Mapping[str, Any], source_arm: str) -> bool:
    """Give a run that did not evaluate before training the evaluation of its seed's ``source``
    run (every arm of a seed starts from the same weights), marked ``shared_from``; the numbers
    that read step 0 follow. False (nothing changed) when the run has its own or the source none."""
    curve, source_curve = result.get("val_curve") or [], source.get("val_curve") or []
    if not source_curve or int(source_curve[0]["step"]) != 0 or (curve and int(curve[0]["step"]) == 0):
        return False
    start = {**source_curve[0], "shared_from": source_arm}
    result["val_curve"] = [start, *curve]
    result["auc_mean"] = curve_auc(result["val_curve"], "mean")
    return True
