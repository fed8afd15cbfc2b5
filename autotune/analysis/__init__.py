"""Trace analysis: step, communication and per-FSDP-unit metrics from torch.profiler traces.

    from autotune.analysis import summarize_traces
    summary = summarize_traces([Path("trial/trace_rank0.json.gz"), Path("trial/trace_rank1.json.gz")])

:class:`FsdpTraceAnalysis` is the facade (HTA style): it loads the traces once and hands
each analysis to one analyzer (``_step_analysis``, ``_unit_analysis``, ``_host_analysis``,
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
  (``cat == "kernel"``), except ``nccl*`` kernels and Memcpy/Memset, as HTA does. A
  kernel whose launch (the ``cuda_runtime``/``cuda_driver`` event with its
  ``correlation``) is not in the trace is dropped, compute or collective, as HTA drops
  it: with no launch it has no issue time, hence no step (such kernels were launched
  before the profiler started; ``RankEvents.num_unlaunched_kernels`` counts them).
- Collectives. CPU/gloo: each ``gloo:*`` span on a gloo worker thread is one
  collective; its duration is the real transfer (the main thread's ``c10d::`` op is
  only the enqueue). GPU: each ``nccl*`` kernel. A collective belongs to the step in
  which it was *issued*: the start of the ``c10d::`` op that enqueued it (CPU) or of the
  kernel launch with the same ``correlation`` id (GPU).
- Kind (all_gather / reduce_scatter / all_reduce / send_recv / other), from the name of
  the c10d op or NCCL kernel. ``send_recv`` is point-to-point traffic
  (``ncclDevKernel_SendRecv``, ``ncclKernel_SendRecv``, ``c10d::send``/``recv_``,
  ``gloo:send``/``recv``): communication like the rest (in ``comm_ms``, exposed and
  overlap figures), in a column of its own (``send_recv_ms``), not in ``other``, unless
  the analysis is given the trial's pipeline layout: then it is pipeline P2P, out of every
  collective figure ([Note: pipeline bubble]). gloo runs send/recv on the thread that posts
  them: a ``gloo:send``/``gloo:recv`` span on the training thread is one transfer, issued at
  its start, and lasts until the wait on it returns. gloo runs ``reduce_scatter`` as an all-reduce, so its spans are named
  ``gloo:all_reduce`` either way: each gloo span is paired with the c10d op that
  enqueued it, first in first out among the c10d ops that gloo runs as that span's
  name (reduce-scatter and all-reduce ops both queue for ``gloo:all_reduce``), and
  the op's kind wins. A span with no c10d op before it (enqueued before the profiled
  window) keeps the kind of its gloo name. Two process groups running the same gloo
  kind concurrently (HSDP) can swap the pairing; the totals are unaffected.
- Emulated links (``autotune trial --cluster``): the time link emulation holds a
  collective beyond its real gloo transfer is a ``linkemu::hold_<kind>`` span on the
  waiting training thread, from when the thread finds the transfer done to the modelled
  end. The hold is not a collective of its own: it extends the collective it holds, which
  then lasts from its gloo span's start to the hold's end (the link is modelled busy in
  between, hidden where the thread computes), keeps the kind, step and unit of the c10d
  op that issued it, and counts once; the hold itself, a wait, is exposed. A hold is
  paired, by kind, with a collective whose transfer ended by its start: the one issued in
  the FSDP unit of the label around the hold, else the transfer that ended within 1 ms
  before it (the thread was blocked on it), else the oldest still unpaired (waits come
  in issue order); a hold whose collective was issued before the profiled window counts
  on its own, where it starts. ``linkemu::hold_p2p`` holds a pipeline send or receive: it
  pairs with the ``send_recv`` transfers by the same rules. A collective waited for after its modelled end leaves no
  hold and counts its real transfer only, so under emulation ``comm_ms`` is a lower bound
  of the modelled communication time.
- Barriers (``c10d::barrier`` / ``gloo:barrier``) move no data: they are kept out of the
  communication figures and reported as ``barrier_ms`` (a harness that synchronizes the
  ranks inside a profiled step would otherwise show up as exposed communication). On
  GPU traces a barrier is an ordinary one-element NCCL all-reduce kernel and counts as
  ``all_reduce``.
- ``comm_ms``: union of the step's collectives; ``<kind>_ms``: union per kind
  (so ``comm_ms`` <= their sum).
- ``exposed_comm_ms``: the part of the communication union during which the training
  thread (GPU: the device) is not computing, i.e. comm minus compute. The compute that
  hides a step's collectives is that of *every* profiled step: a collective issued in
  step k that runs on under compute of step k+1 (a late reduce-scatter, a kernel queued
  behind the next step's work) is hidden there, as in HTA, which takes the unions over
  the whole trace. The step's ``compute_ms`` is still only its own compute.
  ``overlap_ratio`` = 1 - exposed / comm = the fraction of communication hidden under
  compute, per step (and per unit).
- ``overlap_ratio_time_weighted`` (per rank and in the aggregate): the same fraction over
  the whole profiled window, 1 - exposed / comm of the union of all the steps'
  collectives (aggregate: both summed over ranks). This is the headline figure: it is
  HTA's ``comp_comm_overlap_ratio`` and weighs each step by its communication time, so
  the steps that communicate most count most. The aggregate ``overlap_ratio`` stays the
  median over (rank, step) rows, robust to one odd step; both are reported. They differ
  when steps differ in how much they communicate (e.g. a gradient-sync step among
  accumulation steps), and the per-step figures can differ slightly from the window's
  when collectives of two steps overlap each other.
- Against HTA's ``get_comm_comp_overlap`` (``tests/autotune/analysis/test_hta_agreement.py``, on
  HTA's own NCCL sample traces): the time-weighted ratio per rank agrees within 1 point.
  What remains: HTA parses times into integer microseconds (truncating ``ts`` and
  ``dur``), we keep the trace's fractions; on a trace of thousands of kernels of a few
  microseconds that shortens HTA's compute union (``nccl_data.json.gz``: HTA 15.14%, we
  15.61%). HTA also keeps kernels launched before the first ``ProfilerStep#N`` (it keeps
  every launch up to the end of the last step); we count only the steps.
- ``bound_ms`` = max(compute_ms, comm_ms): no schedule can make the step shorter (comm
  and compute can at best overlap fully). ``bound_ratio`` = step_ms / bound_ms >= 1 is
  the distance to it.
- ``profiler_peak_allocated_bytes``: the largest ``Total Allocated`` of the profiler's ``[memory]``
  events in the step (device events when there are any, else CPU). On CPU the profiler
  counts only what it saw allocated while it recorded: treat it as a profiled-window
  figure, not the process peak. ``FsdpTraceAnalysis.get_allocator_peaks`` reads ``Total Reserved``
  beside it at the allocation peak (the caching allocator's fragmentation), where the trace was
  recorded with ``profile_memory=True`` (trials record without: their traces have no such events).
- Per FSDP unit: a collective belongs to the unit of the innermost ``FSDP::`` label
  around its issue point on the training thread. Labels name the unit's module FQN
  (``FSDP::pre_forward (layers.0)``, ``FSDP::backward_prefetch for layers.1``); the
  root module's labels carry none (``FSDP::all_gather``, ``FSDP::post_backward_rs_wait ()``)
  and map to ``root``. The unit's comm / kind / exposed / overlap figures use the
  definitions above on its collectives only; ``hook_ms`` is the union of the unit's
  own ``FSDP::`` labels (its hooks, including the waits inside them). Collectives
  issued outside any FSDP label (a user's loss all-reduce) count for the step, not
  for a unit.

[Note: pipeline bubble]
Given a pipeline layout (``PipelineLayout.from_config``: ``mesh.pp`` > 1; the trial passes
its config's), the ranks are placed as [Note: pipeline stages] (``fsdp_runtime/pipeline.py``)
says: rank r is pipeline rank r // dp (dp = ranks / pp) and holds stages
``r // dp + k * pp``, k < ``virtual_stages``. On a rank holding one stage everything it
does is that stage's. On a rank holding several, torch's schedules label each action
``PP:<stage><action><microbatch>`` (``PP:2F0``, ``PP:0RECV_B1``), and the label around an
event names its stage: a unit's stage is that around its collectives' issue points (else
around its FSDP labels; else the config's split of the blocks the ranks' labels name, in
model order); the root, whose hooks run in every stage of the rank, has collectives only
in the stage holding parameters (embeddings or head).

- ``p2p_ms``: the union of the step's P2P transfers (send_recv spans, each extended to the
  end of its ``linkemu::hold_p2p``), issued in the step. On gloo a span lasts from the post
  to the return of the wait on it, so this is the time transfers were outstanding (a send
  that a schedule waits for only at the end of the step is outstanding until then), an
  upper bound of the transfer time. The collectives' figures (``comm_ms``, per kind,
  exposed, overlap, ``num_collectives``) leave P2P out: ``send_recv_ms`` is 0.
- ``bubble_ms``: the time in the step the rank waits on P2P. *Idle* is the part of the
  step in which the rank (CPU: its training thread; GPU: its device) neither computes nor
  runs a collective (compute and collectives of every step, FSDP's and any other, as
  exposed communication counts them; a collective's emulated hold included). Each maximal
  idle gap [a, b) in which a P2P transfer completes (its end c, a < c <= b, the latest
  such) is a wait: [a, c), counted where a transfer is pending (the union of the spans).
  So the bubble holds the wait for the previous stage's activations (forward receive), the
  next stage's gradients (backward receive) and the completion of the rank's own sends,
  link emulation's P2P holds, and the schedule's Python in the same gap before the wait
  (posting the receive): the trace does not separate them. It does not hold idle time that
  no completion ends (Python between ops and after a wait returns, the optimizer's gaps),
  a wait on an FSDP collective (exposed communication, even while a receive is pending),
  or barriers (``barrier_ms``, kept apart, are idle to this definition but rarely meet P2P).
- Per stage, per (rank, step): ``compute_ms`` is the rank's compute inside the stage's
  action labels (all of it on a rank holding one stage; on a rank holding several, compute
  outside every action label, the optimizer step, belongs to no stage); ``fsdp_comm_ms``,
  ``exposed_fsdp_comm_ms``, ``overlap_ratio``, ``num_collectives``: the communication
  figures above over the collectives of the stage's units, hidden by the rank's compute of
  every stage and step (not only the stage's own: on a rank holding two stages, an all-gather
  of one under the other's compute is hidden, on the same cores); collectives outside every
  unit (the trial's own broadcast) count for the rank, not a stage. ``p2p_ms``: the union
  of the stage's transfers (the action label around the post names the stage);
  ``bubble_ms``: the waits whose completing transfer is the stage's, so the stages' bubbles
  of a rank add up to its bubble.
"""

from autotune.analysis._errors import TraceError
from autotune.analysis._facade import FsdpTraceAnalysis
from autotune.analysis._host_analysis import HOST_BOUND_SHARE
from autotune.analysis._hta_overlap import open_hta_analysis
from autotune.analysis._kernels import KERNEL_CLASSES, get_kernel_class
from autotune.analysis._pipeline import PipelineLayout
from autotune.analysis._summary import SUMMARY_SCHEMA_VERSION, check_summary

__all__ = [
    "HOST_BOUND_SHARE",
    "KERNEL_CLASSES",
    "SUMMARY_SCHEMA_VERSION",
    "FsdpTraceAnalysis",
    "PipelineLayout",
    "TraceError",
    "check_summary",
    "get_kernel_class",
    "open_hta_analysis",
    "summarize_traces",
]


def summarize_traces(trace_paths: list, *, pipeline: PipelineLayout | None = None) -> dict:
    """The JSON-able trace metrics of one trial (schema in ``autotune/analysis/_summary.py``).

    ``trace_paths``: one chrome trace per rank (``.json`` or ``.json.gz``); ``pipeline``: the
    trial's pipeline layout, if any ([Note: pipeline bubble]). Raises :class:`TraceError` (an
    ``AutotuneError``, one line) for a missing or unusable file.
    """
    return FsdpTraceAnalysis(trace_paths, pipeline=pipeline).summarize()
