"""Sets of time intervals as sorted, disjoint ``(n, 2)`` float arrays of ``[start, end)``.

Every function returns a *merged* set (sorted by start, pairwise disjoint, no empty
intervals); the set operations expect merged inputs.
"""

from __future__ import annotations

import numpy as np

EMPTY = np.empty((0, 2), dtype=float)


def union(intervals: np.ndarray) -> np.ndarray:
    """Merge any ``(n, 2)`` array of intervals (overlapping or touching) into a set."""
    iv = np.asarray(intervals, dtype=float).reshape(-1, 2)
    iv = iv[iv[:, 1] > iv[:, 0]]
    if len(iv) == 0:
        return EMPTY.copy()
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    running_end = np.maximum.accumulate(iv[:, 1])
    starts_group = np.ones(len(iv), dtype=bool)
    starts_group[1:] = iv[1:, 0] > running_end[:-1]
    first = np.flatnonzero(starts_group)
    return np.column_stack([iv[first, 0], np.maximum.reduceat(iv[:, 1], first)])


def clip(intervals: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """The part of a set inside ``[lo, hi)``."""
    iv = np.clip(intervals, lo, hi)
    return iv[iv[:, 1] > iv[:, 0]]


def _sweep(a: np.ndarray, b: np.ndarray, *, keep_b: bool) -> np.ndarray:
    """The part of set ``a`` covered (``keep_b``) or not covered by set ``b``, by one sorted sweep.

    Every boundary moves a 0/1 coverage count of its set; between two consecutive
    boundaries the coverage is constant, so a piece is kept or not as a whole.
    """
    lo, hi = np.searchsorted(b[:, 1], a[0, 0], side="right"), np.searchsorted(b[:, 0], a[-1, 1], side="left")
    b = b[lo:hi]  # only the part of b that can meet a
    if len(b) == 0:
        return a.copy() if not keep_b else EMPTY.copy()
    n, m = len(a), len(b)
    points = np.concatenate([a[:, 0], a[:, 1], b[:, 0], b[:, 1]])
    in_a = np.concatenate([np.ones(n), -np.ones(n), np.zeros(2 * m)])
    in_b = np.concatenate([np.zeros(2 * n), np.ones(m), -np.ones(m)])
    order = np.argsort(points, kind="stable")
    points, in_a, in_b = points[order], np.cumsum(in_a[order]), np.cumsum(in_b[order])
    kept = (in_a[:-1] > 0) & ((in_b[:-1] > 0) if keep_b else (in_b[:-1] <= 0))
    return union(np.column_stack([points[:-1][kept], points[1:][kept]]))


def subtract(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The part of set ``a`` not covered by set ``b``."""
    if len(a) == 0 or len(b) == 0:
        return a.copy()
    return _sweep(a, b, keep_b=False)


def intersect(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The part of set ``a`` also covered by set ``b``."""
    if len(a) == 0 or len(b) == 0:
        return EMPTY.copy()
    return _sweep(a, b, keep_b=True)


def total(intervals: np.ndarray) -> float:
    """Total length of a set."""
    return float((intervals[:, 1] - intervals[:, 0]).sum()) if len(intervals) else 0.0
