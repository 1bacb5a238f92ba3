"""95 % intervals of means from `scipy.stats`: Wilson for hit-or-miss scores, percentile bootstrap otherwise, paired
bootstrap for differences, each over independent units.

* a mean of hit-or-miss scores (a metric declared ``binary``, e.g. NIAH's substring match) gets the **Wilson score
  interval** (``scipy.stats.binomtest(...).proportion_ci(method="wilson")``);
* any other mean (RULER's string_match_all fractions, PPL deltas, KL, fidelity) gets a **percentile bootstrap**
  (``scipy.stats.bootstrap``, 2,000 resamples, fixed seed); with fewer than 2 values, or all equal, the interval is
  the single value;
* a difference (a variant against its plain base, any policy against the best base) is a **paired bootstrap** of
  the per-unit differences (same units, same budget), which is much tighter than two independent intervals.

The unit is whatever is independent: an example, or a text's essay (two excerpts of one essay are averaged first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BOOTSTRAP_RESAMPLES = 2000


def wilson_interval(successes: float, n: int) -> tuple[float, float]:
    """95 % Wilson score interval of a binomial proportion ``successes / n``."""
    from scipy.stats import binomtest  # the eval extra; importing it costs a moment

    if n <= 0:
        return (math.nan, math.nan)
    interval = binomtest(int(round(successes)), n).proportion_ci(confidence_level=0.95, method="wilson")
    p = successes / n  # keep the estimate inside despite rounding
    return (max(0.0, min(p, float(interval.low))), min(1.0, max(p, float(interval.high))))


def bootstrap_interval(
    values: list[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values``."""
    import numpy as np
    from scipy.stats import bootstrap

    if not values:
        return (math.nan, math.nan)
    if len(values) == 1 or min(values) == max(values):
        return (values[0], values[0])
    result = bootstrap(
        (np.asarray(values, dtype=np.float64),),
        np.mean,
        n_resamples=resamples,
        confidence_level=level,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return (float(result.confidence_interval.low), float(result.confidence_interval.high))


@dataclass
class Estimate:
    """A mean with its 95 % interval and how the interval was computed."""

    mean: float
    low: float
    high: float
    n: int
    method: str

    def cell(self, digits: int = 2) -> str:
        if self.n == 0 or math.isnan(self.mean):
            return "–"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def estimate(values: list[float], binary: bool | None = None) -> Estimate:
    """Mean and 95 % interval: Wilson for 0/1 scores (``binary``; by default: every value is 0 or 1), else the
    percentile bootstrap. Pass ``binary=False`` for continuous measures that happen to be 0 (the full cache's KL)."""
    values = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(values)
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, 0, "none")
    mean = sum(values) / n
    if binary is None:
        binary = all(v in (0.0, 1.0) for v in values)
    if binary:
        low, high = wilson_interval(sum(values), n)
        return Estimate(mean, low, high, n, "wilson")
    low, high = bootstrap_interval(values)
    return Estimate(mean, low, high, n, "bootstrap")


def paired_difference(treated: dict[str, float], control: dict[str, float]) -> Estimate:
    """Mean of ``treated[id] - control[id]`` over the shared ids, with a percentile-bootstrap 95 % interval."""
    shared = sorted(set(treated) & set(control))
    differences = [treated[key] - control[key] for key in shared]
    if not differences:
        return Estimate(math.nan, math.nan, math.nan, 0, "none")
    low, high = bootstrap_interval(differences)
    return Estimate(sum(differences) / len(differences), low, high, len(differences), "paired bootstrap")
