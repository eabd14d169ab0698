"""The one statistic the scores use: a mean with its 95% interval, the error from the values' spread.

Of one model's per-problem results it is the score's interval; of two models' per-problem differences
on the same problems it is the paired interval of the gain, narrower than one from the two scores'
own errors by what the problems they share explain. Its own module, so that the stages using it
(training metrics, evaluations) do not depend on each other's code.
"""

from __future__ import annotations

import math

Z95 = 1.959964  # two-sided 95% normal quantile


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """(mean, 95% interval half-width, standard error) of ``values`` (sample variance)."""
    n, mean = len(values), sum(values) / len(values)
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else 0.0
    return mean, Z95 * se, se
