"""Trace analysis: step, communication and per-FSDP-unit metrics from torch.profiler traces.

    from autotune.analysis import summarize_traces
    summary = summarize_traces([Path("trial/trace_rank0.json.gz"), Path("trial/trace_rank1.json.gz")])

:class:`FsdpTraceAnalysis` is the facade (HTA style): it loads the traces once and hands
each analysis to one analyzer (``_step_analysis``, ``_unit_analysis``,
``_timeline_analysis``, ``_hta_overlap``); results are DataFrames with explicit columns.
:func:`summarize_traces` turns them into the JSON summary documented in ``_summary``.

[Note: trace metrics]
Every quantity is computed per rank and per profiled step, a step being one
``ProfilerStep#N`` span of the *training thread* (the thread that holds those spans).
Times are interval unions: overlapping events are counted once.

- ``step_ms``: duration of the ``ProfilerStep#N`` span.
- ``compute_ms``: how long the training thread was busy with non-communication work.
  CPU traces: the union of the training thread's ``cpu_op`` events (nesting makes this
  the union of its top-level ops), minus the union of the ops that only issue or wait
  for collectives (names starting ``c10d::``, ``c10d_functional::``, ``gloo:``,
  ``nccl:``, ``record_param_comms``, or containing ``wait``), clipped to the step.
  ``FSDP::`` and other ``record_function`` labels are not ops: the time inside them but
  outside any op is the thread waiting (e.g. the all-gather wait hidden in
  ``FSDP::all_gather_copy_out``) or running Python between ops, and neither counts
  as compute. GPU traces: the union of the device kernels launched during the step
  (``cat == "kernel"``), except ``nccl*`` kernels and Memcpy/Memset, as HTA does.
- Collectives. CPU/gloo: each ``gloo:*`` span on a gloo worker thread is one
  collective; its duration is the real transfer (the main thread's ``c10d::`` op is
  only the enqueue). GPU: each ``nccl*`` kernel. A collective belongs to the step in
  which it was *issued*: the start of the ``c10d::`` op that enqueued it (CPU) or of the
  kernel launch with the same ``correlation`` id (GPU).
- Kind (all_gather / reduce_scatter / all_reduce / other), from the name of the c10d op
  or NCCL kernel. gloo runs ``reduce_scatter`` as an all-reduce, so its spans are named
  ``gloo:all_reduce`` either way: each gloo span is paired with the c10d op that
  enqueued it, first in first out among the c10d ops that gloo runs as that span's
  name (reduce-scatter and all-reduce ops both queue for ``gloo:all_reduce``), and
  the op's kind wins. A span with no c10d op before it (enqueued before the profiled
  window) keeps the kind of its gloo name. Two process groups running the same gloo
  kind concurrently (HSDP) can swap the pairing; the totals are unaffected.
- Emulated links (``autotune trial --cluster``): the time link emulation holds a
  collective beyond its real gloo transfer is a ``linkemu::hold_<kind>`` span on the
  waiting training thread; it counts as communication of that kind (and, being a wait,
  as exposed). Emulated link time that elapsed under compute leaves no span, so under
  emulation ``comm_ms`` is a lower bound of the modelled communication time.
- Barriers (``c10d::barrier`` / ``gloo:barrier``) move no data: they are kept out of the
  communication figures and reported as ``barrier_ms`` (a harness that synchronizes the
  ranks inside a profiled step would otherwise show up as exposed communication). On
  GPU traces a barrier is an ordinary one-element NCCL all-reduce kernel and counts as
  ``all_reduce``.
- ``comm_ms``: union of the step's collectives; ``<kind>_ms``: union per kind
  (so ``comm_ms`` <= their sum).
- ``exposed_comm_ms``: the part of the communication union during which the training
  thread (GPU: the device) is not computing, i.e. comm minus compute.
  ``overlap_ratio`` = 1 - exposed / comm = the fraction of communication hidden under
  compute; HTA's ``comp_comm_overlap_ratio`` is the same quantity on GPU kernels.
- ``bound_ms`` = max(compute_ms, comm_ms): no schedule can make the step shorter (comm
  and compute can at best overlap fully). ``bound_ratio`` = step_ms / bound_ms >= 1 is
  the distance to it.
- ``profiler_peak_allocated_bytes``: the largest ``Total Allocated`` of the profiler's ``[memory]``
  events in the step (device events when there are any, else CPU). On CPU the profiler
  counts only what it saw allocated while it recorded: treat it as a profiled-window
  figure, not the process peak.
- Per FSDP unit: a collective belongs to the unit of the innermost ``FSDP::`` label
  around its issue point on the training thread. Labels name the unit's module FQN
  (``FSDP::pre_forward (layers.0)``, ``FSDP::backward_prefetch for layers.1``); the
  root module's labels carry none (``FSDP::all_gather``, ``FSDP::post_backward_rs_wait ()``)
  and map to ``root``. The unit's comm / kind / exposed / overlap figures use the
  definitions above on its collectives only; ``hook_ms`` is the union of the unit's
  own ``FSDP::`` labels (its hooks, including the waits inside them). Collectives
  issued outside any FSDP label (a user's loss all-reduce) count for the step, not
  for a unit.
"""

from autotune.analysis._errors import TraceError
from autotune.analysis._facade import FsdpTraceAnalysis
from autotune.analysis._summary import SUMMARY_SCHEMA_VERSION, check_summary

__all__ = ["SUMMARY_SCHEMA_VERSION", "FsdpTraceAnalysis", "TraceError", "check_summary", "summarize_traces"]


def summarize_traces(trace_paths: list) -> dict:
    """The JSON-able trace metrics of one trial (schema in ``autotune/analysis/_summary.py``).

    ``trace_paths``: one chrome trace per rank (``.json`` or ``.json.gz``). Raises
    :class:`TraceError` (an ``AutotuneError``, one line) for a missing or unusable file.
    """
    return FsdpTraceAnalysis(trace_paths).summarize()
