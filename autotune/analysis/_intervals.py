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


def subtract(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The part of set ``a`` not covered by set ``b``."""
    if len(a) == 0 or len(b) == 0:
        return a.copy()
    out: list[tuple[float, float]] = []
    first_after = np.searchsorted(b[:, 1], a[:, 0], side="right")  # first b ending after a's start
    last_before = np.searchsorted(b[:, 0], a[:, 1], side="left")  # b starting before a's end
    for (start, end), i, j in zip(a, first_after, last_before):
        cursor = start
        for b_start, b_end in b[i:j]:
            if b_start > cursor:
                out.append((cursor, b_start))
            cursor = max(cursor, b_end)
        if cursor < end:
            out.append((cursor, end))
    return np.array(out, dtype=float).reshape(-1, 2)


def intersect(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The part of set ``a`` also covered by set ``b``."""
    return subtract(a, subtract(a, b))


def total(intervals: np.ndarray) -> float:
    """Total length of a set."""
    return float((intervals[:, 1] - intervals[:, 0]).sum()) if len(intervals) else 0.0
