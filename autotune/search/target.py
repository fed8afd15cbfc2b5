"""Where a search's trials run: this machine's GPUs or CPU cores, or a GPU node of a cluster profile
answered from a box without GPUs ([Note: the search plan] in :mod:`autotune.search.search_plan`)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.search.settings import SearchError

if TYPE_CHECKING:
    from autotune.search.settings import SearchSettings
    from profiles import ClusterProfile


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where the trials run: this machine, or the GPU node of ``--plan-for``'s cluster profile."""

    device_type: str
    backend: str
    world_size: int
    ranks_per_node: int
    memory_per_rank_bytes: int
    """A GPU's memory (the device's total, or the profile's), or on CPU a rank's share of host memory."""
    description: str
    cluster: ClusterProfile | None = None
    """The GPU profile the simulator prices with (``--plan-for``, ``--cluster``, or the one named
    like this machine's GPU); None on CPU."""
    planned_for: str | None = None

    @property
    def on_gpu(self) -> bool:
        return self.device_type == "cuda"

    @property
    def num_nodes(self) -> int:
        return max(1, math.ceil(self.world_size / self.ranks_per_node))

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_type": self.device_type,
            "backend": self.backend,
            "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node,
            "memory_per_rank_gib": self.memory_per_rank_bytes / 2**30,
            "description": self.description,
            "cluster": self.cluster.name if self.cluster is not None else None,
            "planned_for": self.planned_for,
        }


def get_gpu_profile(name: str, *, field_name: str) -> ClusterProfile:
    """A cluster profile with an accelerator table (h100-node, h200-node, ...), else one line naming the flag."""
    from profiles import load_cluster_profile

    cluster = load_cluster_profile(name)
    if cluster.accelerator is None or cluster.device != "cuda":
        raise SearchError(
            f"cluster profile {cluster.name!r} is not a GPU node (no [accelerator] table); use h100-node, h200-node, a100-node or a GPU profile TOML",
            field=field_name,
        )
    return cluster


def get_planned_target(cluster_name: str, world_size: int, *, memory_bytes: int | None = None) -> Target:
    """The GPU node of ``cluster_name``'s profile, answered from a box without GPUs (``--plan-for``; the GPU
    scripts' dry runs), its GPUs' memory ``memory_bytes`` where given (else the profile's)."""
    cluster = get_gpu_profile(cluster_name, field_name="plan_for")
    if memory_bytes is not None:
        cluster = dataclasses.replace(cluster, memory_per_rank_gib=memory_bytes / 2**30)
    return Target(
        device_type="cuda",
        backend="nccl",
        world_size=world_size,
        ranks_per_node=cluster.ranks_per_node,
        memory_per_rank_bytes=int(cluster.memory_per_rank_gib * 2**30),
        description=f"{cluster.name} (planned for): {cluster.ranks_per_node}x {cluster.accelerator.name}, "
        f"{cluster.memory_per_rank_gib:.1f} GiB each; answered from this box, no GPU touched",
        cluster=cluster,
        planned_for=cluster.name,
    )


def get_target(settings: SearchSettings) -> Target:
    """The machine the search's trials run on ([Note: the search plan])."""
    if settings.plan_for is not None:
        return get_planned_target(settings.plan_for, settings.world_size)
    import torch

    if torch.cuda.is_available():
        return get_this_gpu_target(
            settings.world_size, cluster=settings.cluster, across_nodes=settings.workers is not None
        )
    cores = os.cpu_count() or 1
    from autotune.search.proxy import get_available_memory_bytes

    per_node = settings.world_size
    if settings.cluster is not None:
        from profiles import load_cluster_profile

        per_node = load_cluster_profile(settings.cluster).ranks_per_node
    return Target(
        device_type="cpu",
        backend="gloo",
        world_size=settings.world_size,
        ranks_per_node=per_node,
        memory_per_rank_bytes=int(get_available_memory_bytes() * 0.6) // settings.world_size,
        description=f"this machine: {cores} CPU cores, gloo",
    )


def get_this_gpu_target(world_size: int, *, cluster: str | None = None, across_nodes: bool = False) -> Target:
    """This CUDA machine's GPUs (device 0's name and memory; ranks take devices 0..n-1, alike), priced as
    ``cluster``'s profile or the one named like the GPU."""
    import torch

    props = torch.cuda.get_device_properties(0)
    profile = _get_pricing_profile(cluster, props.name, props.total_memory)
    per_node = profile.ranks_per_node if across_nodes else max(1, torch.cuda.device_count())
    return Target(
        device_type="cuda",
        backend="nccl",
        world_size=world_size,
        ranks_per_node=per_node,
        memory_per_rank_bytes=int(props.total_memory),
        description=f"this machine: {torch.cuda.device_count()}x {props.name} ({props.total_memory / 2**30:.1f} GiB each), "
        f"priced as {profile.name}",
        cluster=profile,
    )


def _get_pricing_profile(cluster: str | None, gpu_name: str, total_memory: int) -> ClusterProfile:
    """The GPU profile the simulator prices this machine with: ``--cluster``'s, else the built-in one
    whose accelerator has this GPU's name (h100, h200, a100), else h100-node's; its memory is this GPU's."""
    from profiles import list_cluster_profiles, load_cluster_profile

    if cluster is not None:
        profile = get_gpu_profile(cluster, field_name="cluster")
    else:
        key = gpu_name.lower()
        profile = next(
            (
                p
                for p in (load_cluster_profile(n) for n in list_cluster_profiles())
                if p.accelerator is not None and _gpu_model(p.accelerator.name) in key
            ),
            None,
        ) or load_cluster_profile("h100-node")
    return dataclasses.replace(profile, memory_per_rank_gib=total_memory / 2**30)


def _gpu_model(name: str) -> str:
    """``NVIDIA H100 SXM5 80GB`` -> ``h100``."""
    words = name.lower().removeprefix("nvidia ").split()
    return words[0] if words else name.lower()
