"""Device meshes kept for the life of a rank process, one per shape.

[Note: reused meshes]
Every trial shards its model over a device mesh: 1-D over all ranks (FSDP) or 2-D
``(replicate, shard)`` (HSDP). ``init_device_mesh`` makes new process groups each call, and a
new NCCL group sets up its communicators on its first collective (seconds at 8 ranks and
more, and GPU memory for each communicator's buffers); gloo's hold threads and sockets. So a
rank of a :class:`~autotune.trials.pool.RankPool` builds each shape's mesh once, on the
first trial that needs it, and every later trial of that shape reuses it: a search of
hundreds of trials has as many meshes as shapes it tried (the pool destroys every other
group a trial made: ``autotune.trials.rank``). A mesh whose groups are gone (the default group
was destroyed and made again, as tests do) is built anew. Pipeline trials build their own
meshes (:mod:`fsdp_runtime.pipeline`) and are not kept.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_runtime import RuntimeConfig, build_mesh, validate_for_world

_MESHES: dict[tuple[str, str, int, int], DeviceMesh] = {}


def get_mesh(config: RuntimeConfig, device_type: str) -> DeviceMesh:
    """The mesh of ``config``'s shape on ``device_type``: built once per rank process, then reused."""
    replicate, shard = validate_for_world(config, dist.get_world_size())
    key = (device_type, config.mesh.kind, replicate, shard)
    mesh = _MESHES.get(key)
    if mesh is None or not _is_alive(mesh):
        mesh = _MESHES[key] = build_mesh(config, device_type)
    return mesh


def get_kept_groups() -> list[object]:
    """The process groups of the kept meshes (those a finished job must not destroy)."""
    groups = []
    for mesh in _MESHES.values():
        if _is_alive(mesh):
            groups += [mesh.get_group(dim) for dim in range(mesh.ndim)]
    return groups


def _is_alive(mesh: DeviceMesh) -> bool:
    """Every group of ``mesh`` is still registered (torch has no public check: ``_world.pg_map``
    is the registry that ``destroy_process_group`` removes groups from)."""
    from torch.distributed import distributed_c10d

    live = distributed_c10d._world.pg_map
    try:
        return all(mesh.get_group(dim) in live for dim in range(mesh.ndim))
    except (RuntimeError, ValueError, KeyError):
        return False
