"""What a search did not measure that it was asked to: said in one line each, in the terminal and ``search.json``.

A search that ends with fewer measured trials than ``--trials``, with failed trials, with
enqueued trials never run or without some of the presearch's calibration trials still emits a
config, but the user must know it rests on less than they asked for (a search of a
communication-heavy workload on a 2-core box with one core kept busy emitted a 1.62x calibration
config where a quiet one found 2.95x, and said nothing).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from autotune.search.calibration_trials import get_calibration_params
from autotune.search.loop import count_measured
from autotune.search.presearch import PRESEARCH_ATTR

if TYPE_CHECKING:
    from autotune.search.context import SearchContext
    from autotune.search.results import TrialRow


def get_shortfall(ctx: SearchContext, rows: list[TrialRow], stopped_because: str) -> list[str]:
    """One line per thing the search was asked to measure and did not (empty: nothing missing)."""
    lines = []
    asked, measured = ctx.settings.num_trials, count_measured(rows)
    if measured < asked:
        lines.append(f"measured {measured} of the {asked} trials asked for (stopped: {stopped_because})")
    failed = Counter(r.status for r in rows if r.state == "FAIL" and r.duplicate_of is None)
    if failed:
        kinds = ", ".join(f"{n} {status}" for status, n in sorted(failed.items()))
        lines.append(f"{sum(failed.values())} of {len(rows)} trials failed ({kinds}); their configs were not ranked")
    waiting = [r.number for r in rows if r.state == "WAITING"]
    if waiting:
        lines.append(f"{len(waiting)} enqueued trial(s) never ran (trials {', '.join(map(str, waiting))})")
    if ctx.settings.presearch is not None and PRESEARCH_ATTR in ctx.study.user_attrs:
        expected = get_calibration_params(ctx.space)
        done = {r.calibration for r in rows if r.calibration and r.state == "COMPLETE"}
        ran = {r.calibration for r in rows if r.calibration}
        missing = [name for name in expected if name not in done]
        if missing and ran:  # none ran: the budget left no room for them (said when they were skipped)
            why = {r.calibration: r.status for r in rows if r.calibration and r.state != "COMPLETE"}
            described = ", ".join(f"{name} ({why.get(name, 'not run')})" for name in missing)
            lines.append(f"the simulator was calibrated without calibration trial(s) {described}")
    return lines
