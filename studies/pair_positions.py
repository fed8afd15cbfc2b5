"""Prints the final round of one or more searches pair by pair and by position in the ABBA sequence.

    .venv/bin/python studies/pair_positions.py runs/search [runs/other ...]

For each finalist of each search's ``search.json``: its pair ratios at odd and even positions
(pairs 1, 3, 5, ... run the reference first; 2, 4, 6, ... the candidate first; each window of
a contested finalist starts again at pair 1), the median of each, the gap between them, and
the figure the search ranked it by with its interquartile range; then the emitted speedup
with its interquartile range and that range's width over the median. Reads search.json of any
version (before v7 the figures are medians of single pairs; from v7 of ABBA blocks measured
after settle steps, [Note: switch cost] in ``autotune/trials/paired.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.search import SearchRecord  # noqa: E402


def _windows(finalist: dict) -> list[list[float]]:
    """The pair ratios of each measurement window (a pooled finalist holds two, back to back)."""
    pairs = list(finalist.get("pair_ratios", []))
    if finalist.get("windows", 1) == 2 and pairs:
        half = len(pairs) // 2
        return [pairs[:half], pairs[half:]]
    return [pairs]


def describe(path: Path) -> None:
    record = SearchRecord.read(path / "search.json")
    conf = record.confirmation or {}
    print(f"== {path}: final round, estimator {conf.get('estimator', 'pairs (v6 or older)')}")
    for f in sorted(conf.get("finalists", []), key=lambda f: f.get("ratio") or 9):
        windows = _windows(f)
        odd = [r for w in windows for r in w[0::2]]
        even = [r for w in windows for r in w[1::2]]
        if not odd:
            print(f"  trial {f['trial']}: {f.get('status')} {f.get('reason', '')[:80]}")
            continue
        gap = statistics.median(odd) / statistics.median(even) - 1 if even else float("nan")
        print(
            f"  trial {f['trial']}{' (emitted)' if f['trial'] == conf.get('winner') else ''}: "
            f"ratio {f['ratio']:.3f} (IQR {f['ratio_q25']:.3f}-{f['ratio_q75']:.3f}); "
            f"pairs 1,3,5..: {' '.join(f'{r:.2f}' for r in odd)} (median {statistics.median(odd):.3f}); "
            f"pairs 2,4,6..: {' '.join(f'{r:.2f}' for r in even)} (median {statistics.median(even):.3f}); "
            f"gap {100 * gap:+.1f}%"
            + (
                f"; switch cost c/r {f['switch_cost']['candidate']:+.1%} / {f['switch_cost']['reference']:+.1%}"
                if (f.get("switch_cost") or {}).get("candidate") is not None
                else ""
            )
        )
    if conf.get("speedup_median") is not None:
        median, q25, q75 = conf["speedup_median"], conf.get("speedup_q25"), conf.get("speedup_q75")
        width = f", IQR width {(q75 - q25) / median:.1%} of the median" if q25 and q75 else ""
        print(f"  emitted {conf.get('emitted')}: {median:.3f}x the defaults (IQR {q25:.3f}-{q75:.3f}{width})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    for path in parser.parse_args().dirs:
        describe(path)


if __name__ == "__main__":
    main()
