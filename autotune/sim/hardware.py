"""What a cluster charges: compute time from FLOPs and bytes, collective time from bytes and placement.

[Note: collective cost model]
A collective runs over one process group of a data-parallel mesh. Ranks are laid out as
``init_device_mesh`` lays them out, row-major: rank = replicate_index x shard + shard_index,
and ``rank // ranks_per_node`` is the node. So a shard group is ``shard`` consecutive ranks
and a replicate group is ``replicate`` ranks ``shard`` apart. A group is *intra-node* when
all its ranks share a node, else *inter-node*; it has ``members_per_node`` ranks on each of
the nodes it spans.

- ``flat`` profiles (the CPU link-emulation profiles): seconds = latency + buffer bytes /
  bandwidth, the rule :mod:`autotune.trials.linkemu` holds each collective to.
- ``ring`` profiles (GPU nodes): NCCL's ring moves (n-1)/n of the buffer through every
  rank's link, so seconds = latency + buffer x (n-1)/n / busbw for an all-gather or a
  reduce-scatter (buffer = the all-gather output, the reduce-scatter input) and twice both
  terms for an all-reduce (a reduce-scatter then an all-gather). busbw is the link class's
  ``bandwidth_gbps x efficiency``; an inter-node group runs one ring channel per member
  NIC (one NIC per GPU, as on DGX/HGX nodes), so its busbw is the inter-node figure times
  ``members_per_node``, capped by the intra-node busbw the ring also crosses.
- *measured* (a :class:`~autotune.sim.measured.MeasuredProfile` from trials on this machine):
  the fitted real transfer (latency + bytes x (n-1)/n / bandwidth at the fitted group size),
  held to the ``flat`` price of an emulated link where the cluster emulates one:
  ``max(real, latency + bytes / bandwidth)``, what :mod:`autotune.trials.linkemu` enforces.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.sim.device_profile import DeviceProfile
from autotune.sim.margin import MemoryMargin, get_margin_parts
from autotune.sim.measured import MeasuredProfile
from autotune.sim.model_work import PassWork, get_optimizer_bytes_per_element
from fsdp_runtime.errors import AutotuneError
from profiles import AcceleratorSpec, ClusterProfile, LinkClass

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


class SimError(AutotuneError):
    """Bad input to the simulator (an unknown cluster capability, a mesh the cluster cannot hold)."""


def get_dtype_bytes(name: str) -> int:
    return _DTYPE_BYTES[name]


@dataclass(frozen=True, slots=True)
class Group:
    """One process group's placement: how many ranks, on how many nodes."""

    size: int
    num_nodes: int
    members_per_node: int

    @property
    def link_name(self) -> str:
        return "intra_node" if self.num_nodes <= 1 else "inter_node"


def get_group(size: int, stride: int, ranks_per_node: int) -> Group:
    """Placement of a group of ``size`` ranks, ``stride`` apart, starting at a node boundary."""
    if size <= 1:
        return Group(1, 1, 1)
    nodes = {(i * stride) // ranks_per_node for i in range(size)}
    return Group(size, len(nodes), size // len(nodes))


@dataclass(frozen=True)
class Hardware:
    """A cluster of ``num_nodes`` nodes of one profile, priced for the simulator: from its
    datasheet figures, or from ``measured`` prices (a calibrated profile of this machine)."""

    cluster: ClusterProfile
    num_nodes: int = 1
    num_ranks: int | None = None
    """The world size when it is not ``nodes x ranks_per_node`` (a CPU box running 2 or 4 ranks)."""
    measured: MeasuredProfile | None = None
    device: DeviceProfile | None = None
    """A GPU measured by ``autotune calibrate`` ([Note: device profile]): its rates replace the
    accelerator's datasheet ones (compute, copies, optimizer, host floor); links stay the cluster's."""

    @property
    def world_size(self) -> int:
        return self.num_ranks or self.cluster.ranks_per_node * self.num_nodes

    @property
    def accelerator(self) -> AcceleratorSpec:
        if self.cluster.accelerator is None:
            raise SimError(
                f"cluster profile {self.cluster.name!r} has no accelerator table: the simulator needs device FLOP/s and memory bandwidth "
                "(use a GPU profile such as h100-node, h200-node, a100-node)",
                field="cluster",
            )
        return self.cluster.accelerator

    @property
    def usable_memory_bytes(self) -> float:
        reserved = self.accelerator.reserved_gib if self.cluster.accelerator else 0.0
        return (self.cluster.memory_per_rank_gib - reserved) * 2**30

    @property
    def memory_margin(self) -> MemoryMargin | None:
        """How far below the usable memory a predicted peak is safe ([Note: memory margin]); None
        without an accelerator table (a CPU box: no caching allocator to fragment)."""
        if self.cluster.accelerator is None:
            return None
        device = self.device
        return MemoryMargin(
            capacity_bytes=self.cluster.memory_per_rank_gib * 2**30,
            outside_allocator_bytes=self.cluster.accelerator.reserved_gib * 2**30,
            parts=get_margin_parts(device.allocator_fragmentation, device.allocator_fragmentation_source)
            if device is not None
            else get_margin_parts(),
        )

    def get_peak_flops(self, dtype: str) -> float:
        peaks = self.accelerator.peak_tflops
        if dtype not in peaks:
            raise SimError(
                f"cluster profile {self.cluster.name!r} gives no peak_tflops for {dtype} (it has {', '.join(peaks)})",
                field="cluster",
            )
        return peaks[dtype] * 1e12

    def get_pass_seconds(self, work: PassWork, *, part: str, phase: str, head_dim: int, dtype: str) -> float:
        """Seconds of one segment's pass: GEMMs, causal attention (half of the counted square) at
        ``head_dim`` and the memory-bound ops; ``part`` is ``block`` or ``root`` (head and tail)."""
        return (
            work.gemm_flops / self.get_gemm_flops_per_s(dtype)
            + 0.5 * work.attention_flops / self.get_attention_flops_per_s(phase, head_dim, dtype)
            + work.memory_bytes / self.get_elementwise_bytes_per_s(part, phase)
        )

    def get_gemm_flops_per_s(self, dtype: str) -> float:
        if self.device is not None:
            return self.device.gemm_tflops * 1e12
        return self.get_peak_flops(dtype) * self.accelerator.gemm_efficiency

    def get_attention_flops_per_s(self, phase: str, head_dim: int, dtype: str) -> float:
        """Causal attention FLOPs per second in ``phase`` at ``head_dim``: see [Note: attention and head dim].

        [Note: attention and head dim]
        Fused attention spends, per element of the score matrix, 4 x head_dim matmul FLOPs in
        forward (QK^T and PV) and 10 x head_dim in backward (2.5x, as torch's flop counter counts
        it), and one exponential either way (the backward recomputes P). Exponentials run on the
        special-function units, 256x slower than the tensor cores on an H100 (989 against 3.9
        TFLOPS: FA3 paper, Shah et al. 2024), and FlashAttention-2-style kernels (cuDNN's, SDPA's)
        do not hide them behind the matmuls. So a FLOP costs ``1/(peak x e) + 1/(k x d x S)``
        (k = 4 or 10, d the head dim, S the special-function rate): ``e`` follows from the rate
        measured at one head dim (the accelerator's ``attention_head_dim``, or a device profile's)
        and the formula gives any other. Checked on one H200 (``tests/data/gpu_traces``): calibrated on
        head dim 128 (578 TFLOP/s forward, 467 backward), it predicts head dim 64 at 448 and 427
        where the trace measured 437 and 404.
        """
        acc = self.accelerator
        if self.device is not None:
            rate = self.device.attention_forward_tflops if phase == "forward" else self.device.attention_backward_tflops
            rate, at = rate * 1e12, self.device.attention_head_dim
        else:
            efficiency = acc.attention_efficiency
            if phase == "backward" and acc.attention_backward_efficiency is not None:
                efficiency = acc.attention_backward_efficiency
            rate, at = self.get_peak_flops(dtype) * efficiency, acc.attention_head_dim
        if not head_dim or head_dim == at or acc.special_function_tflops is None:
            return rate
        per_score = 4.0 if phase == "forward" else 10.0
        special = acc.special_function_tflops * 1e12
        matmul = max(1.0 / rate - 1.0 / (per_score * at * special), 0.1 / rate)  # the tensor cores' share
        return 1.0 / (matmul + 1.0 / (per_score * head_dim * special))

    def get_elementwise_bytes_per_s(self, part: str, phase: str) -> float:
        if self.device is not None:
            return self.device.elementwise_gbps["root" if part != "block" else f"block_{phase}"] * 1e9
        acc = self.accelerator
        return acc.hbm_gbps * 1e9 * acc.hbm_efficiency

    def get_host_floor_s(self, key: str) -> float:
        """Device idle per call while the host launches (``block_forward``, ``block_backward``, ``microbatch``, ``step``):
        the gaps a device-bound step shows; a host-bound one is priced by the host path (:meth:`get_host_path_s`)."""
        if self.device is not None:
            return self.device.host_floor_us.get(key, 0.0) * 1e-6
        if self.cluster.accelerator is None:
            return 0.0
        return self.accelerator.host_floor_us.get(key, 0.0) * 1e-6

    def get_host_path_s(self, key: str) -> float:
        """The host's launch path of one block pass (a ``HOST_PATH_KEYS`` key; 0: not priced, the device is the bound)."""
        return self.device.host_path_us.get(key, 0.0) * 1e-6 if self.device is not None else 0.0

    def get_optimizer_seconds(self, num_elements: float) -> float:
        """AdamW over ``num_elements`` float32 sharded elements: measured per element, else its traced bytes at HBM speed."""
        if self.device is not None:
            return self.device.optimizer_ps_per_element * 1e-12 * num_elements
        return self.get_memory_seconds(get_optimizer_bytes_per_element() * num_elements)

    def get_memory_seconds(self, num_bytes: float) -> float:
        """Copies and casts (FSDP2's, the optimizer's on the datasheet): measured speed where a profile has one."""
        if self.measured is not None:
            return self.measured.get_memory_seconds(num_bytes)
        if self.device is not None:
            return num_bytes / (self.device.copy_gbps * 1e9)
        acc = self.accelerator
        return num_bytes / (acc.hbm_gbps * 1e9 * acc.hbm_efficiency)

    def describe_prices(self) -> list[str]:
        """Where each price comes from: measured (a device profile) or the cluster profile's datasheet."""
        cluster = self.cluster.name
        if self.device is None:
            return [
                f"prices: all from {cluster}'s datasheet figures ({self.accelerator.name}); `autotune calibrate` on a GPU trial measures them"
            ]
        d = self.device
        on = d.measured_on
        return [
            f"prices measured on {d.device} (torch {d.torch}; {on.get('model')}, {on.get('param_dtype')}/{on.get('reduce_dtype')}, "
            f"{on.get('num_microbatches')} microbatches; {', '.join(d.sources)}): GEMM {d.gemm_tflops:.0f} TFLOP/s, attention "
            f"{d.attention_forward_tflops:.0f}/{d.attention_backward_tflops:.0f} TFLOP/s (forward/backward at head dim {d.attention_head_dim}), "
            f"elementwise {', '.join(f'{k} {v:,.0f}' for k, v in d.elementwise_gbps.items())} GB/s, FSDP2 copies {d.copy_gbps:,.0f} GB/s, "
            f"optimizer {d.optimizer_ps_per_element:.1f} ps/element, host floor "
            f"{', '.join(f'{k} {v:.0f}' for k, v in d.host_floor_us.items())} us"
            + (
                f", host path per block {', '.join(f'{k} {v:,.0f}' for k, v in d.host_path_us.items())} us"
                if d.host_path_us
                else ""
            ),
            f"prices from {cluster}'s datasheet: collectives (links {', '.join(self.cluster.links)}), memory capacity, "
            f"peak FLOP/s for MFU, the special-function rate for other head dims ([Note: attention and head dim])",
        ]

    def get_mesh_groups(self, replicate: int, shard: int) -> tuple[Group, Group]:
        """(shard group, replicate group) placements of a (replicate, shard) mesh over this cluster."""
        if replicate * shard != self.world_size:
            raise SimError(f"mesh {replicate}x{shard} does not cover the world size {self.world_size}", field="mesh")
        rpn = self.cluster.ranks_per_node
        return get_group(shard, 1, rpn), get_group(replicate, shard, rpn)

    def get_collective_seconds(self, kind: str, num_bytes: float, group: Group) -> float:
        """Seconds of one collective; see [Note: collective cost model]."""
        if group.size <= 1:
            return 0.0
        if self.measured is not None:
            link = self.cluster.links.get(group.link_name)
            modelled = link.get_seconds(int(num_bytes)) if link is not None and link.emulated else 0.0
            return max(self.get_real_collective_seconds(kind, num_bytes, group), modelled) + self.measured.sync_s
        return _get_seconds(self.cluster, kind, num_bytes, group)

    def get_p2p_seconds(self, num_bytes: float, *, inter_node: bool) -> float:
        """One point-to-point transfer (a pipeline stage's activations or their gradients): latency +
        bytes over one rank's link (its NVLink port, or its NIC across nodes) at the link's efficiency."""
        link = _get_link(self.cluster, "inter_node" if inter_node else "intra_node")
        bandwidth = link.bandwidth_gbps * link.efficiency * 1e9
        return link.latency_us * 1e-6 + (num_bytes / bandwidth if bandwidth > 0 else 0.0)

    def get_real_collective_seconds(self, kind: str, num_bytes: float, group: Group) -> float:
        """The part of a collective that moves data through this machine's cores (measured profiles only; else 0)."""
        if self.measured is None or group.size <= 1:
            return 0.0
        return self.measured.get_real_seconds(kind, num_bytes, group.size)


def _get_link(cluster: ClusterProfile, name: str) -> LinkClass:
    link = cluster.links.get(name)
    if link is None:
        raise SimError(f"cluster profile {cluster.name!r} has no links.{name} table", field="cluster")
    return link


def _get_ring_busbw(cluster: ClusterProfile, group: Group) -> float:
    intra = _get_link(cluster, "intra_node")
    intra_bw = intra.bandwidth_gbps * intra.efficiency * 1e9
    if group.num_nodes <= 1:
        return intra_bw
    inter = _get_link(cluster, "inter_node")
    return min(intra_bw, inter.bandwidth_gbps * inter.efficiency * 1e9 * group.members_per_node)


def _get_seconds(cluster: ClusterProfile, kind: str, num_bytes: float, group: Group) -> float:
    link = _get_link(cluster, group.link_name)
    if cluster.collective_model == "flat":
        if link.bandwidth_gbps <= 0:
            raise SimError(
                f"cluster profile {cluster.name!r}: links.{group.link_name} has no bandwidth to price a collective with",
                field="cluster",
            )
        return link.get_seconds(int(num_bytes))
    passes = 2 if kind == "all_reduce" else 1
    ring_bytes = num_bytes * (group.size - 1) / group.size
    return passes * (link.latency_us * 1e-6 + ring_bytes / _get_ring_busbw(cluster, group))
