"""FSDP2's training step as a sequence of ops on streams, in the order FSDP2 issues them.

[Note: FSDP2 step schedule]
Read from torch 2.13's ``torch/distributed/fsdp/_fully_shard/`` (``_fsdp_state.py``
``FSDPState``, ``_fsdp_param_group.py`` ``FSDPParamGroup``, ``_fsdp_collectives.py``). One
microbatch, units ``b0..b{n-1}`` (blocks) and ``root``:

Forward
  1. ``FSDPState._root_pre_forward``: the all-gather streams wait for the compute stream
     (nothing of this microbatch is gathered before the previous backward/optimizer ends).
  2. Per unit, ``FSDPState._pre_forward`` -> ``FSDPParamGroup.pre_forward``:
     ``unshard`` (``foreach_all_gather``: copy-in and all-gather on the all-gather streams,
     or with ``async_op`` on the current stream; a no-op if already unsharded or already
     gathering), then ``wait_for_unshard``: in forward the all-gather streams first wait for
     the *previous* unit's copy-out event (``comm_ctx.all_gather_state``, whose buffer is
     freed then), then the compute stream waits for this all-gather and runs
     ``foreach_all_gather_copy_out``; this unit's flat buffer is kept as the new
     ``all_gather_state``. Then the unit's explicit forward-prefetch list is unsharded
     (``_prefetch_unshard``) in order. The root runs first and its ``head`` (embeddings)
     computes before block 0's pre-forward.
     Implicit prefetch is the CPU running ahead: block k+1's all-gather is issued as soon as
     the host reaches its pre-forward, and may start once block k-1's copy-out is done.
  3. Compute; ``post_forward`` -> ``reshard``: True frees the unsharded params, an int d
     keeps a 1/d slice (``to_sharded_post_forward``, a copy), False keeps them.
  4. The root's tail (norm, output, loss) computes; the root's ``_post_forward`` frees the
     last ``all_gather_state``. The root does not reshard by default (its ``_lazy_init``).
Backward
  5. The loss's grad reaches the root's output: ``FSDPState._pre_backward`` ->
     ``FSDPParamGroup.pre_backward``: unshard + ``wait_for_unshard`` (backward: the
     all-gather streams wait for this copy-out, the buffer is freed at once), then prefetch:
     the explicit backward list, else ``_backward_prefetch``, the unit before it in
     ``post_forward_order`` (root -> b{n-1} -> ... -> b0, none for b0).
  6. Compute the unit's backward, then ``post_backward`` (``RegisterPostBackwardFunction``):
     accumulate into an up-cast unsharded grad if one exists
     (``accumulate_unsharded_grad_if_needed``); with ``reduce_grads`` off (sync = last on a
     non-final microbatch) reshard if ``reshard_after_backward``, up-cast the grad to the
     reduce dtype (``to_accumulated_grad_if_needed``) and stop. Otherwise reshard if
     ``reshard_after_backward`` (always on the final microbatch: ``GradAccumulator``), then while
     ``reduce_scatter_states`` holds ``reduce_scatter_max_input_buffers`` buffers the compute
     stream waits for the oldest reduce-scatter; wait for this unit's previous post-reduce
     (``_wait_for_post_backward``); ``foreach_reduce``: ``chunk_cat`` copy-in on the compute
     stream, the reduce-scatter stream waits for it and reduce-scatters; under HSDP with
     ``all_reduce_grads`` the all-reduce stream waits for the reduce-scatter and
     all-reduces across replicas, else (``set_requires_all_reduce(False)``) the output is
     added into ``partial_reduce_output``.
  7. The root's head (embedding) backward; the root's inputs (token ids) need no grad, so
     its ``post_backward`` runs in ``_root_post_backward_final_callback``, after every block:
     its reduce-scatter is the last. ``finalize_backward`` makes the compute stream wait
     for the last post-reduce event of each stream and every retained reduce-scatter.
Optimizer step (AdamW on the sharded fp32 params) after the last microbatch.

On CPU (gloo) the streams are dummies: an all-gather blocks the host unless the unit's
unshard is async (then only ``wait_for_unshard`` waits), reduce-scatters and all-reduces
always block (``foreach_reduce`` waits: 0% overlap measured on CPU, torch 2.13.0+cpu). An async all-gather's real transfer
runs on gloo's worker thread, which shares the cores with compute: with a measured profile
(:mod:`autotune.sim.measured`) the host loses ``cpu_share`` of that transfer when it issues
it; only what a link holds beyond it (an emulated link) overlaps for free. Measured profiles
also charge the host's own work per microbatch and FSDP2's hooks per call (a pre-hook that
finds its unit unsharded, every post-backward's accumulate and reshard). On GPU ``unshard_async`` issues the
all-gather on the current stream: it starts only when the compute issued before it ends.
The GPU host runs ahead of the device except where a device profile prices its launch path
per block pass ([Note: host path] in :mod:`autotune.sim.gpu_calibrate`): a block's pass then
ends no earlier than the host has launched it, so a host-bound step (small kernels, selective
activation checkpointing's per-op policy) is the host's length.
"""

from __future__ import annotations

from autotune.sim.costs import ORIG_BYTES, MeshCosts
from autotune.sim.hardware import Hardware
from autotune.sim.knobs import Knobs
from autotune.sim.model_work import ActivationProfile
from autotune.sim.timeline import (
    ACCUMULATED,
    AG_BUFFERS,
    COMPUTE,
    GRADS,
    PARTIAL,
    POST_FORWARD,
    RS_BUFFERS,
    SHARDED_GRADS,
    UNSHARDED,
    Event,
    MemoryLedger,
    Timeline,
)

SHARD_LINK, REPLICATE_LINK, RS_LINK = "shard", "replicate", "shard_rs"
SHARDED, UNSHARDED_STATE, POST_FORWARD_STATE = 0, 1, 2


class StepSchedule:
    """Issues one training step's ops into a :class:`Timeline` and a :class:`MemoryLedger`.

    ``fork()`` copies the state, so that configs sharing a prefix (the first forward) share
    its simulation.
    """

    def __init__(
        self,
        knobs: Knobs,
        costs: MeshCosts,
        activations: ActivationProfile,
        hardware: Hardware,
        *,
        activation_checkpointing: bool,
        root_head_fraction: float = 0.0,
    ) -> None:
        self.c, self.hw, self.root_head_fraction = costs, hardware, root_head_fraction
        self.n = n = len(costs.padded) - 1
        self.cpu = hardware.cluster.device == "cpu"
        self.t = Timeline(n + 1, host_blocks=self.cpu)
        self.mem = MemoryLedger(3 * ORIG_BYTES * sum(costs.sharded))  # params + AdamW exp_avg, exp_avg_sq
        self._set_activations(activations, costs, activation_checkpointing)
        self.ag_bytes = [p * costs.param_bytes for p in costs.padded] if costs.shard > 1 else [0] * (n + 1)
        self.unsharded_bytes = [p * costs.param_bytes for p in costs.padded]
        self.rs_bytes = [p * costs.reduce_bytes for p in costs.padded]
        zeros = [0.0] * (n + 1)
        self.pre_hook_s, self.post_hook_s = costs.pre_hook_s or zeros, costs.post_hook_s or zeros
        self.ag_cpu_s = costs.all_gather_cpu_s or zeros
        self._set_knobs(knobs)
        self.state = [SHARDED] * (n + 1)
        self.pending: list[Event | None] = [None] * (n + 1)
        self.has_grad = [False] * (n + 1)
        self.grad_bytes = [0.0] * (n + 1)  # unsharded grad in the param dtype
        self.accumulated = [False] * (n + 1)  # an up-cast (reduce dtype) or flat accumulator exists
        self.partial = [False] * (n + 1)
        self.own_post: list[Event | None] = [None] * (n + 1)
        self.ag_gate = 0.0
        self.ag_state = -1
        self.ag_state_end = 0.0
        self.rs_states: list[Event] = []
        self.last_post: dict[str, Event] = {}

    def _set_activations(self, a: ActivationProfile, costs: MeshCosts, activation_checkpointing: bool) -> None:
        """Live activations at each checkpoint: a unit of k blocks keeps k blocks' saved activations
        (full checkpointing: their inputs; selective: also their matmul and attention outputs), and
        its forward and backward peak as one block's with the other k - 1 blocks' saved below."""
        n = self.n
        counts = costs.unit_num_blocks or [1] * n
        kinds = costs.unit_checkpointing or ["full" if activation_checkpointing else "none"] * n
        per_block = {
            "none": a.block_saved,
            "full": a.block_input,
            "selective": a.block_selective if a.block_selective is not None else a.block_saved,
        }
        saved = [per_block[k] for k in kinds]
        below = [0.0] * (n + 1)
        for u in range(n):
            below[u + 1] = below[u] + counts[u] * saved[u]
        self.act_head = a.head
        self.act_forward = [a.block_forward_peak + (counts[u] - 1) * saved[u] + below[u] for u in range(n)]
        self.act_backward = [a.block_backward_peak + (counts[u] - 1) * saved[u] + below[u] for u in range(n)]
        self.act_tail = a.tail_peak - a.block_saved + below[n]
        # The output head's and norm's backward come after the loss's peak: the live activations then
        # are every block's plus a backward's transients, as in the last block's backward.
        self.act_root_backward = a.block_backward_peak + (below[n] - saved[n - 1] if n else 0.0)
        self.act_saved = below[n]  # what one microbatch's blocks keep from its forward to its backward

    def _set_knobs(self, knobs: Knobs) -> None:
        self.k = knobs
        self.skip_sync = [s == "last" for s in knobs.sync]  # reduce_grads off on non-final microbatches
        self.skip_all_reduce = [s != "every" for s in knobs.sync]

    def fork(self, knobs: Knobs) -> StepSchedule:
        """A copy of this schedule's state that continues under ``knobs``."""
        other = StepSchedule.__new__(StepSchedule)
        other.__dict__.update(self.__dict__)
        for name in ("state", "pending", "has_grad", "grad_bytes", "accumulated", "partial", "own_post", "rs_states"):
            setattr(other, name, list(getattr(self, name)))
        other.t, other.mem, other.last_post = self.t.copy(), self.mem.copy(), dict(self.last_post)
        other._set_knobs(knobs)
        return other

    # -- one step ------------------------------------------------------------------------

    def run_microbatch(self, index: int) -> None:
        self.run_forward()
        self.run_backward(index == self.k.num_microbatches - 1)

    def run_optimizer(self) -> None:
        self.mem.phase = "optimizer"
        sharded = self.c.sharded
        self.t.compute(self.c.optimizer_s)
        self.mem.checkpoint(2 * ORIG_BYTES * sum(sharded))  # foreach AdamW intermediates
        self.mem.live[SHARDED_GRADS] = 0.0
        self.has_grad = [False] * (self.n + 1)

    # -- forward -------------------------------------------------------------------------

    def run_forward(self) -> None:
        c, t, mem, root = self.c, self.t, self.mem, self.n
        mem.phase = "forward"
        if c.microbatch_s:
            t.compute(c.microbatch_s)
        self.ag_gate = max(self.ag_gate, t.streams[COMPUTE])  # _root_pre_forward
        self._pre_forward(root)
        t.compute(c.head_forward_s)
        mem.checkpoint(self.act_head)
        for u in range(self.n):
            self._pre_forward(u)
            t.compute(c.forward_s[u], (), c.host_forward_s[u] if c.host_forward_s else 0.0)
            mem.checkpoint(self.act_forward[u])
            self._reshard_after_forward(u)
        t.compute(c.forward_s[root])
        self._reshard_after_forward(root)
        if self.ag_state >= 0:
            self._free_all_gather_state()

    def _pre_forward(self, u: int) -> None:
        self._unshard(u)
        if not self._wait_for_unshard(u, forward=True) and self.pre_hook_s[u]:
            self.t.compute(self.pre_hook_s[u])
        for v in self.k.forward_prefetch[u] or ():
            self._unshard(v)

    def _reshard_after_forward(self, u: int) -> None:
        raf = self.k.reshard_after_forward[u]
        if raf is False or self.state[u] != UNSHARDED_STATE:
            return
        self._free_unsharded(u)
        if raf is True:
            return
        self.t.compute(self.c.get_post_forward(u, raf, self.hw)[0])  # to_sharded_post_forward: a clone
        self.state[u] = POST_FORWARD_STATE
        self.mem.live[POST_FORWARD] += self.c.padded[u] // raf * self.c.param_bytes

    # -- unshard -------------------------------------------------------------------------

    def _unshard(self, u: int) -> None:
        if self.pending[u] is not None or self.state[u] == UNSHARDED_STATE or not self.c.padded[u]:
            return  # a unit without parameters (a middle pipeline stage's root) has no param group
        c, t = self.c, self.t
        seconds = c.all_gather_s[u]
        if self.state[u] == POST_FORWARD_STATE:
            seconds = c.get_post_forward(u, self.k.reshard_after_forward[u], self.hw)[1]
        self.mem.live[AG_BUFFERS] += self.ag_bytes[u]
        if self.cpu:  # dummy streams: blocking unless async (gloo's worker thread, which takes CPU from compute)
            self.pending[u] = t.collective("all_gather" if self.k.unshard_async else COMPUTE, seconds, SHARD_LINK, u)
            if self.k.unshard_async and self.ag_cpu_s[u]:
                t.compute(self.ag_cpu_s[u])
        elif self.k.unshard_async:  # on the current stream: NCCL waits for the compute issued so far
            self.pending[u] = t.collective("all_gather_async", seconds, SHARD_LINK, u, after=t.streams[COMPUTE])
        else:
            self.pending[u] = t.collective("all_gather", seconds, SHARD_LINK, u, after=self.ag_gate)

    def _wait_for_unshard(self, u: int, *, forward: bool) -> bool:
        """Copy out the unit's pending all-gather; False when it has none (already unsharded)."""
        ag = self.pending[u]
        if ag is None:
            return False
        c, t, live = self.c, self.t, self.mem.live
        if forward and self.ag_state >= 0:
            self._free_all_gather_state()
        t.compute(c.copy_out_s[u], (ag,))
        copy_end = t.streams[COMPUTE]
        if self.state[u] == POST_FORWARD_STATE:
            live[POST_FORWARD] -= c.padded[u] // self.k.reshard_after_forward[u] * c.param_bytes
        live[UNSHARDED] += self.unsharded_bytes[u]
        self.state[u], self.pending[u] = UNSHARDED_STATE, None
        if forward and not self.k.unshard_async:
            self.ag_state, self.ag_state_end = u, copy_end
        else:
            self.ag_gate = max(self.ag_gate, copy_end)
            live[AG_BUFFERS] -= self.ag_bytes[u]
        return True

    def _free_all_gather_state(self) -> None:
        self.ag_gate = max(self.ag_gate, self.ag_state_end)
        self.mem.live[AG_BUFFERS] -= self.ag_bytes[self.ag_state]
        self.ag_state = -1

    def _free_unsharded(self, u: int) -> None:
        self.state[u] = SHARDED
        self.mem.live[UNSHARDED] -= self.unsharded_bytes[u]

    # -- backward ------------------------------------------------------------------------

    def run_backward(self, is_last: bool, *, finalize: bool = True) -> None:
        """One microbatch's backward; ``finalize``: then wait for its reductions (``finalize_backward``;
        a pipeline stage skips it but on its last backward: [Note: pipeline schedules] in
        :mod:`autotune.sim.pipeline`)."""
        c, root = self.c, self.n
        self.mem.phase = "backward"
        self.mem.checkpoint(self.act_tail)  # the loss's backward, before the root's pre-backward hook
        self._pre_backward(root)
        self._compute_backward(root, self.act_root_backward, share=1.0 - self.root_head_fraction)
        for u in range(self.n - 1, -1, -1):
            self._pre_backward(u)
            self._compute_backward(u, self.act_backward[u])
            self._post_backward(u, is_last)
        self.t.compute(c.head_backward_s)
        if self.grad_bytes[root] < self.unsharded_bytes[root]:  # the embeddings' gradients
            self.mem.live[GRADS] += self.unsharded_bytes[root] - self.grad_bytes[root]
            self.grad_bytes[root] = self.unsharded_bytes[root]
        self.mem.checkpoint(self.act_head)
        self._post_backward(root, is_last)  # from _root_post_backward_final_callback
        if finalize:
            self.finalize_backward()

    def finalize_backward(self) -> None:
        """The compute stream waits for the last post-reduce of each stream and every retained reduce-scatter."""
        self.t.compute(0.0, (*self.last_post.values(), *self.rs_states))
        for _, v, _ in self.rs_states:
            self.mem.live[RS_BUFFERS] -= self.rs_bytes[v]
        self.rs_states = []
        self.last_post = {}

    def _pre_backward(self, u: int) -> None:
        self._unshard(u)
        if not self._wait_for_unshard(u, forward=False) and self.pre_hook_s[u]:
            self.t.compute(self.pre_hook_s[u])
        targets = self.k.backward_prefetch[u]
        if targets is None:  # _backward_prefetch: the previous unit in post-forward order
            previous = self.n - 1 if u == self.n else u - 1
            targets = (previous,) if previous >= 0 else ()
        for v in targets:
            self._unshard(v)

    def _compute_backward(self, u: int, activations: float, *, share: float = 1.0) -> None:
        """A unit's backward; ``share`` of its parameters get their gradients here (the root's
        tail first, its head at the end)."""
        c = self.c
        self.t.compute(c.backward_s[u], (), c.host_backward_s[u] if c.host_backward_s else 0.0)
        if self.grad_bytes[u] < share * self.unsharded_bytes[u]:
            grown = share * self.unsharded_bytes[u] - self.grad_bytes[u]
            self.grad_bytes[u] += grown
            self.mem.live[GRADS] += grown
        elif self.c.accumulate_s:  # autograd accumulates into the grad a non-sync microbatch left
            self.t.compute(share * self.c.accumulate_s[u])
        self.mem.checkpoint(activations)

    def _drop_grad(self, u: int) -> None:
        self.mem.live[GRADS] -= self.grad_bytes[u]
        self.grad_bytes[u] = 0.0

    def _post_backward(self, u: int, is_last: bool) -> None:
        c, t, live = self.c, self.t, self.mem.live
        if not c.padded[u]:
            return
        if self.post_hook_s[u]:  # post_backward_accumulate and _reshard
            t.compute(self.post_hook_s[u])
        if not is_last and self.skip_sync[u]:  # reduce_grads off: accumulate unsharded
            if self.k.reshard_after_backward[u] and self.state[u] == UNSHARDED_STATE:
                self._free_unsharded(u)
            self._accumulate(u)
            return
        if self.state[u] == UNSHARDED_STATE and (is_last or self.k.reshard_after_backward[u]):
            self._free_unsharded(u)  # FSDP2 honours reshard_after_backward when it reduces too
        rs_states = self.rs_states
        waits: tuple[Event, ...] = ()
        if len(rs_states) >= self.k.max_rs_buffers:  # the reduce-scatter input buffer limit
            cut = len(rs_states) - self.k.max_rs_buffers + 1
            waits = tuple(rs_states[:cut])
            del rs_states[:cut]
            for _, v, _ in waits:
                live[RS_BUFFERS] -= self.rs_bytes[v]
        if self.own_post[u] is not None:  # _wait_for_post_backward
            waits += (self.own_post[u],)
        seconds = c.copy_in_s[u]
        if self.accumulated[u]:  # add the last grad into the accumulator (or restore the eager flat one)
            seconds += c.upcast_s[u] if self.k.defer_concat[u] else c.restore_s[u]
            self.accumulated[u] = False
            live[ACCUMULATED] -= self.rs_bytes[u]
        t.compute(seconds, waits)
        live[RS_BUFFERS] += self.rs_bytes[u]
        live[GRADS] -= self.grad_bytes[u]
        self.grad_bytes[u] = 0.0
        self._reduce(u, is_last)

    def _reduce(self, u: int, is_last: bool) -> None:
        k, c, t, live = self.k, self.c, self.t, self.mem.live
        copied = t.streams[COMPUTE]  # the reduce-scatter stream waits for the copy-in
        # its own process group: queued on a communicator of its own, not behind the all-gathers
        link = RS_LINK if k.get_method("separate_reduce_scatter_group") else SHARD_LINK
        rs = t.collective(COMPUTE if self.cpu else "reduce_scatter", c.reduce_scatter_s[u], link, u, after=copied)
        post, post_stream = rs, "reduce_scatter"
        if k.hsdp and not is_last and self.skip_all_reduce[u]:  # set_requires_all_reduce(False)
            if not self.partial[u]:
                self.partial[u] = True
                live[PARTIAL] += c.sharded[u] * c.reduce_bytes
        else:
            if k.hsdp:
                if self.partial[u]:
                    self.partial[u] = False
                    live[PARTIAL] -= c.sharded[u] * c.reduce_bytes
                post_stream = "all_reduce"
                post = t.collective(
                    COMPUTE if self.cpu else post_stream, c.all_reduce_s[u], REPLICATE_LINK, u, after=rs[0]
                )
            if not self.has_grad[u]:
                self.has_grad[u] = True
                live[SHARDED_GRADS] += c.sharded[u] * ORIG_BYTES
        self.last_post[post_stream] = post
        self.own_post[u] = post
        self.rs_states.append(rs)

    def _accumulate(self, u: int) -> None:
        """A non-sync microbatch's grads: up-cast into (or added to) the reduce-dtype accumulator,
        concatenated into a flat one (defer_concat = False), or, same dtype and deferred, kept
        where autograd accumulates in place."""
        c = self.c
        upcast = c.param_bytes != c.reduce_bytes
        if not upcast and self.k.defer_concat[u]:
            return
        self.t.compute((c.upcast_s[u] if upcast else 0.0) + (0.0 if self.k.defer_concat[u] else c.concat_s[u]))
        self._drop_grad(u)
        if not self.accumulated[u]:
            self.accumulated[u] = True
            self.mem.live[ACCUMULATED] += self.rs_bytes[u]
