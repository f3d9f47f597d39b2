"""The statistics of the credit audit and the ablation: rank correlation, AUC, paired bootstrap.

Plain numpy, float64, written for small samples (a few thousand tokens, a handful of seeds):

- [`spearman`][integration.statistics.spearman]: Spearman's rank correlation, ties given their average rank (the Pearson
  correlation of the ranks); NaN when either input is constant;
- [`auc`][integration.statistics.auc]: the probability that a positive's score exceeds a negative's, ties counting one
  half (the Mann-Whitney U statistic over ``n_pos * n_neg``); NaN without both classes;
- [`bootstrap_ci`][integration.statistics.bootstrap_ci]: a percentile bootstrap interval of the mean of paired differences, from a
  fixed generator seed so that a report is reproducible.
"""
from __future__ import annotations

import numpy as np


def _vector(values, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} must be finite")
    return array


def _pair(x, y) -> tuple[np.ndarray, np.ndarray]:
    x, y = _vector(x, "x"), _vector(y, "y")
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same length, got {x.size} and {y.size}")
    return x, y


def average_ranks(values) -> np.ndarray:
    """1-based ranks of ``values`` (1-D), ties given the mean of the ranks they span."""
    values = _vector(values, "values")
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    # Runs of equal values: [starts[k], ends[k]) in sorted order share the rank (starts + ends + 1) / 2.
    boundaries = np.flatnonzero(np.diff(sorted_values)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [values.size]])
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def spearman(x, y) -> float:
    """Spearman's rank correlation of two equal-length 1-D samples (NaN if either is constant)."""
    x, y = _pair(x, y)
    if x.size < 2:
        return float("nan")
    rx, ry = average_ranks(x) - (x.size + 1) / 2, average_ranks(y) - (y.size + 1) / 2
    denominator = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / denominator) if denominator > 0 else float("nan")


def auc(scores, labels) -> float:
    """P(score of a positive > score of a negative), ties counting 1/2; ``labels`` are 0/1 (or
    bools). NaN unless both classes occur."""
    scores, labels = _pair(scores, labels)
    if not np.isin(labels, (0.0, 1.0)).all():
        raise ValueError("labels must be 0 or 1")
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    rank_sum = average_ranks(scores)[labels == 1].sum()
    return float((rank_sum - positives * (positives + 1) / 2) / (positives * negatives))


def bootstrap_ci(differences, *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``differences`` (one per seed, already paired):
    ``resamples`` draws of ``len(differences)`` values with replacement from ``numpy``'s
    generator seeded with ``seed``."""
    differences = _vector(differences, "differences")
    if differences.size == 0:
        raise ValueError("differences must not be empty")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be an int >= 1, got {resamples!r}")
    rng = np.random.default_rng(seed)
    means = differences[rng.integers(0, differences.size, size=(resamples, differences.size))].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)
