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

from autotune.sim.margin import MemoryMargin
from autotune.sim.measured import MeasuredProfile
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
        return MemoryMargin(
            capacity_bytes=self.cluster.memory_per_rank_gib * 2**30,
            outside_allocator_bytes=self.cluster.accelerator.reserved_gib * 2**30,
        )

    def get_peak_flops(self, dtype: str) -> float:
        peaks = self.accelerator.peak_tflops
        if dtype not in peaks:
            raise SimError(
                f"cluster profile {self.cluster.name!r} gives no peak_tflops for {dtype} (it has {', '.join(peaks)})",
                field="cluster",
            )
        return peaks[dtype] * 1e12

    def get_compute_seconds(
        self, *, gemm_flops: float, attention_flops: float, memory_bytes: float, dtype: str
    ) -> float:
        """GEMMs at MAMF, causal attention (half of the counted square) at flash speed, the rest at HBM speed."""
        acc = self.accelerator
        peak = self.get_peak_flops(dtype)
        return (
            gemm_flops / (peak * acc.gemm_efficiency)
            + 0.5 * attention_flops / (peak * acc.attention_efficiency)
            + memory_bytes / (acc.hbm_gbps * 1e9 * acc.hbm_efficiency)
        )

    def get_memory_seconds(self, num_bytes: float) -> float:
        if self.measured is not None:
            return self.measured.get_memory_seconds(num_bytes)
        acc = self.accelerator
        return num_bytes / (acc.hbm_gbps * 1e9 * acc.hbm_efficiency)

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
