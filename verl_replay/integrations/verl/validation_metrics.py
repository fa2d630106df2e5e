"""verl's validation statistics, the same numbers without a Python loop per bootstrap draw.

After every validation verl's ``process_validation_metrics`` calls ``bootstrap_metric`` once per
prompt, numeric variable and subset size (2, 4, ..., n) to estimate best@k / worst@k: it draws
1,000 index subsets and reduces each with ``np.max`` / ``np.min`` in a Python loop over an object
array. For 256 prompts x 4 samples x 3 variables that is ~16 s of the driver's CPU per validation
(half of a tiny run's validation); at MATH-500 x 32 samples it is minutes.

:func:`bootstrap_metric` below draws the same indices from the same generator (``np.random.seed``
then ``np.random.choice``, so numpy's global state is left as verl leaves it) and reduces the
``[n_bootstrap, k]`` matrix in one call: for numeric data it returns exactly verl's floats. Any
other call (majority voting's ``calc_maj_val``, non-numeric or NaN data) goes to verl's own
function unchanged. Installed by the plugin in every process (post-import, like ``verl_fixes``);
tests/integrations/verl/test_validation_metrics.py compares the two on verl's own entry point.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Sequence

import numpy as np

METRIC_UTILS_MODULE = "verl.trainer.ppo.metric_utils"
# (module, attribute) of the verl name this module rebinds
PRIVATE_API_PATCHES: tuple[tuple[str, str], ...] = ((METRIC_UTILS_MODULE, "bootstrap_metric"),)

# the reductions verl's best@k / worst@k pass (each also reduces a matrix row by row with axis=1)
_ROW_REDUCTIONS: tuple[Callable[..., Any], ...] = (np.max, np.min)


def _numeric(data: Sequence[Any]) -> np.ndarray | None:
    """``data`` as float64 when every value is a real number and none is NaN, else None."""
    if not all(isinstance(value, numbers.Real) for value in data):
        return None
    values = np.asarray(data, dtype=np.float64)
    return None if np.isnan(values).any() else values


def vectorized_bootstrap(
    data: Sequence[Any],
    subset_size: int,
    reduce_fns: Sequence[Callable[..., Any]],
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> list[tuple[float, float]] | None:
    """verl's ``bootstrap_metric`` for numeric data reduced by ``np.max`` / ``np.min``; None when
    the call is of another kind (the caller then runs verl's own)."""
    if not reduce_fns or any(fn not in _ROW_REDUCTIONS for fn in reduce_fns):
        return None
    values = _numeric(data)
    if values is None:
        return None
    np.random.seed(seed)
    draws = np.random.choice(len(values), size=(n_bootstrap, subset_size), replace=True)  # [n_bootstrap, k]
    samples = values[draws]  # [n_bootstrap, k]
    results = []
    for fn in reduce_fns:
        reduced = fn(samples, axis=1)  # [n_bootstrap]
        results.append((float(np.mean(reduced)), float(np.std(reduced))))
    return results


Bootstrap = Callable[..., list[tuple[float, float]]]


def make_bootstrap_metric(original: Bootstrap) -> Bootstrap:
    def bootstrap_metric(
        data: list[Any],
        subset_size: int,
        reduce_fns: list[Callable[[np.ndarray], float]],
        n_bootstrap: int = 1000,
        seed: int = 42,
    ) -> list[tuple[float, float]]:
        fast = vectorized_bootstrap(data, subset_size, reduce_fns, n_bootstrap=n_bootstrap, seed=seed)
        if fast is not None:
            return fast
        return original(data, subset_size, reduce_fns, n_bootstrap=n_bootstrap, seed=seed)

    bootstrap_metric.verl_original = original  # type: ignore[attr-defined]
    bootstrap_metric.__doc__ = original.__doc__
    return bootstrap_metric


def use_vectorized_bootstrap(module: Any) -> None:
    original = getattr(module, "bootstrap_metric", None)
    if original is None:
        raise RuntimeError(
            f"verl_replay speeds up {module.__name__}.bootstrap_metric, which this verl version does not have"
        )
    if not hasattr(original, "verl_original"):
        module.bootstrap_metric = make_bootstrap_metric(original)
