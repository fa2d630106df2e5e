"""The vectorised bootstrap gives verl's own validation statistics, exactly, in a fraction of the time."""

from __future__ import annotations

import importlib
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
from load_tolerant import per_call_cpu_seconds

from verl_replay.integrations.verl import validation_metrics


def _verl_original():
    """verl's own bootstrap_metric (the plugin rebound the module's name on `import verl`)."""
    module = importlib.import_module(validation_metrics.METRIC_UTILS_MODULE)
    return module, module.bootstrap_metric.verl_original


@pytest.mark.parametrize("module_name, attribute", validation_metrics.PRIVATE_API_PATCHES)
def test_patched_names_exist_in_pinned_verl(module_name, attribute):
    assert hasattr(importlib.import_module(module_name), attribute), f"verl moved {module_name}.{attribute}"


def test_hand_computed_case():
    # data [0, 1]: each draw of 2 is one of (0,0) (0,1) (1,0) (1,1); best@2 is 1 unless both are 0
    _, original = _verl_original()
    np.random.seed(42)
    draws = np.random.choice(2, size=(1000, 2), replace=True)
    best = (draws.max(axis=1) == 1).astype(float)
    [(best_mean, best_std), (worst_mean, _)] = validation_metrics.vectorized_bootstrap([0.0, 1.0], 2, [np.max, np.min])
    assert best_mean == pytest.approx(best.mean()) and best_std == pytest.approx(best.std())
    assert 0.7 < best_mean < 0.8 and 0.2 < worst_mean < 0.3  # 3/4 and 1/4 in expectation
    assert [(best_mean, best_std), (worst_mean, _)] == original([0.0, 1.0], 2, [np.max, np.min])


@pytest.mark.parametrize(
    "data",
    [[0.25, 1.0, 0.0, 0.5], [1, 0, 0, 1, 1, 0, 0, 0], [True, False, 0.5], list(np.random.default_rng(3).random(32))],
)
@pytest.mark.parametrize("subset_size", [2, 4, 32])
def test_equals_verls_bootstrap_and_leaves_numpys_generator_as_verl_does(data, subset_size):
    _, original = _verl_original()
    fast = validation_metrics.vectorized_bootstrap(data, subset_size, [np.max, np.min], n_bootstrap=500, seed=7)
    after_fast = np.random.random()
    assert fast == original(data, subset_size, [np.max, np.min], n_bootstrap=500, seed=7)
    assert np.random.random() == after_fast


@pytest.mark.parametrize(
    "data, reduce_fns",
    [
        ([0.5, float("nan")], [np.max]),  # NaN: object max and float max disagree
        ([0.5, None], [np.max]),
        (["a", "b"], [np.max]),
        ([0.5, 1.0], [np.mean]),  # a reduction verl does not pass for best/worst
        ([{"val": 1.0, "pred": "a"}], [lambda rows: rows[0]["val"]]),
    ],
)
def test_other_calls_are_left_to_verl(data, reduce_fns):
    assert validation_metrics.vectorized_bootstrap(data, 2, reduce_fns) is None


def _validation_batch(rng: np.random.Generator, prompts: int, n: int):
    sources = ["tiny_arith" if i % 3 else "math500" for i in range(prompts) for _ in range(n)]
    uids = [f"p{i}" for i in range(prompts) for _ in range(n)]
    acc = rng.random(prompts * n) < 0.4
    infos = {
        "reward": [float(a) for a in acc],
        "score": [float(a) - 0.1 * rng.random() for a in acc],
        "acc": [bool(a) for a in acc],
        "pred": [str(rng.integers(3)) for _ in acc],  # majority voting: verl's own bootstrap
        "reason": ["ok"] * len(acc),  # strings: skipped by verl
    }
    return sources, uids, infos


def test_verls_validation_statistics_are_unchanged():
    """verl's entry point (``process_validation_metrics``, as its trainer calls it) gives the same
    nested dict with the vectorised bootstrap as with verl's own, for every source, variable and k."""
    module, original = _verl_original()
    sources, uids, infos = _validation_batch(np.random.default_rng(0), prompts=12, n=8)
    fast = module.process_validation_metrics(sources, uids, infos)
    patched = module.bootstrap_metric
    module.bootstrap_metric = original
    try:
        reference = module.process_validation_metrics(sources, uids, infos)
    finally:
        module.bootstrap_metric = patched
    as_dict = lambda d: {s: {v: dict(m) for v, m in vs.items()} for s, vs in d.items()}  # noqa: E731
    assert as_dict(fast) == as_dict(reference)
    assert "best@8/mean" in fast["tiny_arith"]["acc"] and "maj@8/mean" in fast["tiny_arith"]["acc"]


def test_costs_a_fraction_of_verls_cpu_time():
    """The same call, this process's CPU time of each (a ratio, so machine load cannot fail it)."""
    _, original = _verl_original()
    data = list(np.random.default_rng(1).random(4))
    slow = per_call_cpu_seconds(lambda: original(data, 4, [np.max, np.min]))
    fast = per_call_cpu_seconds(lambda: validation_metrics.vectorized_bootstrap(data, 4, [np.max, np.min]))
    assert fast * 10 < slow, (fast, slow)  # 35x on a quiet machine


def test_installed_in_a_fresh_process_that_only_imports_verl():
    code = (
        "import verl\n"
        "from verl.trainer.ppo import metric_utils as m\n"
        "import numpy as np\n"
        "print(hasattr(m.bootstrap_metric, 'verl_original'), m.bootstrap_metric([0.0, 1.0], 2, [np.max])[0][0] > 0.5)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "True True"


def test_partial_of_verls_majority_vote_goes_to_verl():
    module, _ = _verl_original()
    vote = partial(module.calc_maj_val, vote_key="pred", val_key="val")
    assert validation_metrics.vectorized_bootstrap([{"val": 1.0, "pred": "a"}] * 2, 2, [vote]) is None
