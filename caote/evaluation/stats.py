"""95 % intervals of means: Wilson for hit-or-miss scores, percentile bootstrap otherwise, paired bootstrap for
differences.

* a mean of hit-or-miss scores (a metric declared ``binary``, e.g. NIAH's substring match) gets the **Wilson score
  interval**;
* any other mean (RULER's string_match_all fractions, PPL deltas, KL, fidelity) gets a **percentile bootstrap** over
  examples (2,000 resamples, fixed seed); with fewer than 2 examples the interval is the single value;
* a variant against its plain base is a **paired bootstrap** of the per-example differences (same examples, same
  budget), which is much tighter than comparing two independent intervals.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

Z95 = 1.959963984540054
BOOTSTRAP_RESAMPLES = 2000


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``successes / n``."""
    if n <= 0:
        return (math.nan, math.nan)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # clamp to [0, 1] and keep the estimate inside despite rounding (p = 1 gives a high end of 0.9999...)
    return (max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half)))


def bootstrap_interval(
    values: list[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values``."""
    n = len(values)
    if n == 0:
        return (math.nan, math.nan)
    if n == 1:
        return (values[0], values[0])
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    low_index = int(math.floor((1 - level) / 2 * resamples))
    high_index = min(resamples - 1, int(math.ceil((1 + level) / 2 * resamples)) - 1)
    return (means[low_index], means[high_index])


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
