"""Ground truth for the trace analysis: rank programs whose figures are known by construction.

The cases of ``_truth_programs`` (read its docstring) run once, on 2 real gloo ranks under
``torch.profiler``, each a collective of known duration D against compute of known duration
C; the analysis of their traces must recover D, C and what follows from them (exposed
communication, overlap) as [Note: trace metrics] defines them.

Tolerance, on the median over the middle profiled steps (the first and the last are left
out: a collective issued in the profiler's untraced warm-up step, or one still in flight
when the window closes, belongs to no traced step there): times within ``±max(10 ms, 15%)``
of the expected value, ratios within ``±0.15``, counts exact. Why: the ranks share 2 cores
with whatever else runs on the box, and every "known" duration ends with a sleep whose
wake-up the scheduler may delay. Measured at load average 5.6-7.2 (other processes' work):
single steps ran up to 10 ms long (a 40 ms collective measured 50.2 ms), the medians over
5 steps stayed within 1.2 ms of the construction; 10 ms is still far below the gaps the
cases tell apart (D = 40 ms against 0, C = 80 ms against D). Compute is an op that sleeps
(``truth::compute``) rather than spins: with both ranks spinning on the 2 cores, the
medians were off by up to 36 ms (rank 1's wake-ups came late) and the noise was our own.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from _truth_programs import C_LONG_MS, C_SHORT_MS, C_STEP_MS, CASES, D_MS, ISSUE_LABEL, WAIT_LABEL

from autotune.analysis import FsdpTraceAnalysis, summarize_traces
from autotune.analysis._events import get_label_unit

pytestmark = pytest.mark.multirank

TIMEOUT_S = 90
"""Hard wall-clock limit of the one job that runs every case (the pool kills every rank's tree)."""
ABS_MS, REL, RATIO = 10.0, 0.15, 0.15


@pytest.fixture(scope="module")
def traces(tmp_path_factory, pool2) -> Path:
    # One retry, for a rank killed by a signal only: CI saw rank 0 die of SIGSEGV, then of SIGABRT
    # ("corrupted double-linked list"), inside torch 2.13's CPU profiler when a case left a gloo
    # collective in flight as the profiler stopped (1 launch in 6 of 20 crossing cases here; the
    # programs now drain it first: 0 in 20, see _truth_programs._drain). These tests check the
    # analysis of the traces, not that crash, and a second one still fails them.
    for attempt in range(2):
        out = tmp_path_factory.mktemp("truth")
        run = pool2.run("_truth_programs:run_cases", {"out_dir": str(out), "cases": list(CASES)}, timeout_s=TIMEOUT_S)
        if run.ok or "killed by SIG" not in run.reason or attempt == 1:
            break
    assert run.ok, f"{run.status}: {run.reason}\n" + "\n".join(run.stderr_tails)
    return out


def _paths(traces: Path, case: str) -> list[Path]:
    return sorted((traces / case).glob("trace_rank*.json"))


def _middle(rows: list[dict]) -> list[dict]:
    steps = sorted(r["step"] for r in rows)
    return [r for r in rows if steps[0] < r["step"] < steps[-1]]


def get_steps(traces: Path, case: str, rank: int) -> list[dict]:
    """The middle steps' rows of one rank, as trials store them (``summarize_traces``)."""
    return _middle(summarize_traces(_paths(traces, case))["per_rank"][rank]["steps"])


def check(rows: list[dict], **expected: float) -> None:
    """Each field's median over ``rows`` within the tolerance of the expected value (all fields reported)."""
    failures = []
    for field, want in expected.items():
        values = [r[field] for r in rows]
        got = statistics.median(values)
        tolerance = RATIO if field == "overlap_ratio" else max(ABS_MS, REL * want)
        if not abs(got - want) <= tolerance:
            failures.append(
                f"{field}: median {got:.2f}, expected {want:.2f} ± {tolerance:.2f} (steps: {', '.join(f'{v:.2f}' for v in values)})"
            )
    assert not failures, "\n".join(failures)


def test_blocking_collective_then_compute_is_fully_exposed(traces):
    rank0 = get_steps(traces, "exposed", 0)
    check(rank0, comm_ms=D_MS, all_reduce_ms=D_MS, exposed_comm_ms=D_MS, overlap_ratio=0.0, compute_ms=C_SHORT_MS)
    assert all(r["num_collectives"] == 1 for r in rank0)
    # Rank 1 joined last: its transfer was over at once, and it slept (neither compute nor comm) before.
    check(get_steps(traces, "exposed", 1), comm_ms=0.0, exposed_comm_ms=0.0, compute_ms=C_SHORT_MS)


def test_async_collective_under_longer_compute_is_hidden(traces):
    check(get_steps(traces, "hidden", 0), comm_ms=D_MS, exposed_comm_ms=0.0, overlap_ratio=1.0, compute_ms=C_LONG_MS)


def test_async_collective_under_shorter_compute_is_partly_exposed(traces):
    rows = get_steps(traces, "partial", 0)
    check(rows, comm_ms=D_MS, exposed_comm_ms=D_MS - C_SHORT_MS, overlap_ratio=C_SHORT_MS / D_MS, compute_ms=C_SHORT_MS)


def test_collective_crossing_a_step_boundary_counts_whole_in_its_issuing_step(traces):
    """Issued as the last thing of a step and over D into the next: per the Note it belongs to
    the step that issued it, whole (not clipped at the boundary), and the next step has none of it."""
    rows = get_steps(traces, "crossing", 0)
    check(rows, comm_ms=D_MS, compute_ms=C_LONG_MS + C_STEP_MS)
    assert all(r["num_collectives"] == 1 for r in rows)


def test_crossing_collective_hidden_by_the_next_steps_compute_is_not_exposed(traces):
    """The Note: exposed is communication "during which the training thread is not computing",
    whichever step that compute belongs to. The next step's compute C > D covers the
    crossing collective: nothing of it is exposed."""
    check(get_steps(traces, "crossing", 0), exposed_comm_ms=0.0, overlap_ratio=1.0)


def test_emulated_hold_is_one_exposed_collective_of_its_kind(traces):
    """A blocking reduce-scatter held to D: on rank 0 half of D is the real gloo transfer
    (rank 1 joins D/2 late) and half the hold; the two are one collective, D long, of the
    reduce-scatter's kind (gloo ran it as an all-reduce), and exposed: the thread waits."""
    events = FsdpTraceAnalysis(_paths(traces, "emulated")).traces[0].events
    holds = events[events["name"] == "linkemu::hold_reduce_scatter"]
    transfers = events[events["name"] == "gloo:all_reduce"]
    long_transfers = (transfers["end"] - transfers["ts"] > D_MS / 4 * 1000).sum()
    assert len(holds) >= 3 and long_transfers >= 3, "the case no longer splits D between transfer and hold"
    for rank in (0, 1):
        rows = get_steps(traces, "emulated", rank)
        check(
            rows,
            comm_ms=D_MS,
            reduce_scatter_ms=D_MS,
            exposed_comm_ms=D_MS,
            overlap_ratio=0.0,
            compute_ms=2 * C_STEP_MS,
        )
        assert all(r["num_collectives"] == 1 and r["all_reduce_ms"] == 0.0 for r in rows), rows


def test_emulated_link_time_under_compute_is_hidden_communication(traces):
    """An async all-reduce held to D with compute C < D before its wait: the real transfer is
    short, the hold is D - C; the link is busy for D from the issue, C of it under compute."""
    for rank in (0, 1):
        rows = get_steps(traces, "emulated_partial", rank)
        check(
            rows,
            comm_ms=D_MS,
            exposed_comm_ms=D_MS - C_SHORT_MS,
            overlap_ratio=C_SHORT_MS / D_MS,
            compute_ms=C_SHORT_MS,
        )
        assert all(r["num_collectives"] == 1 for r in rows), rows


def test_emulated_hold_belongs_to_the_op_that_issued_it(traces):
    """Issued last thing in a step inside unit layers.0's label, held through the start of
    the next step (inside layers.1's label): the whole D is the issuing step's and unit's."""
    issuer, waiter = get_label_unit(ISSUE_LABEL)[1], get_label_unit(WAIT_LABEL)[1]
    analysis = FsdpTraceAnalysis(_paths(traces, "emulated_crossing"))
    units = analysis.get_unit_metrics()
    for rank in (0, 1):
        rows = get_steps(traces, "emulated_crossing", rank)
        check(rows, comm_ms=D_MS, exposed_comm_ms=D_MS, overlap_ratio=0.0)
        assert all(r["num_collectives"] == 1 for r in rows), rows
        middle = {r["step"] for r in rows}
        mine = units[(units["rank"] == rank) & units["step"].isin(middle)].set_index(["unit", "step"])
        check(mine.loc[issuer].to_dict("records"), comm_ms=D_MS, exposed_comm_ms=D_MS)
        assert (mine.loc[waiter, "num_collectives"] == 0).all() and (mine.loc[waiter, "comm_ms"] == 0).all()
