"""Where a mesh's process groups lie across nodes: the words the search uses for its meshes.

With N nodes of G ranks (ranks numbered node by node, as torchrun numbers them), a mesh
``hsdp:RxS`` puts each shard group on S consecutive ranks and each replicate group on R ranks S
apart; ``fsdp`` is one shard group of every rank. A shard group inside one node all-gathers
and reduce-scatters over the fast links; one that spans nodes pays the slow ones on every
collective. The space keeps the meshes whose shard groups span nodes too, measured like the
others (a small model can prefer them), and says which they are.
"""

from __future__ import annotations

__all__ = ["describe_mesh_nodes", "describe_world", "get_world_notes"]


def _span(size: int, ranks_per_node: int) -> str:
    if size <= ranks_per_node:
        return "in each node" if size == ranks_per_node else f"in {size} of each node's {ranks_per_node} ranks"
    return f"over {size // ranks_per_node} nodes"


def describe_mesh_nodes(mesh: str, world_size: int, ranks_per_node: int) -> str:
    """``mesh`` (``fsdp`` or ``hsdp:RxS``) in words of nodes, e.g. ``hsdp:2x8: shard in each
    node, replicate over 2 nodes``; ``world_size`` ranks, ``ranks_per_node`` to a node."""
    if mesh == "fsdp":
        return f"fsdp: shard {_span(world_size, ranks_per_node)}"
    replicate, shard = (int(x) for x in mesh.split(":")[1].split("x"))
    nodes = len({k * shard // ranks_per_node for k in range(replicate)})  # rank 0's replicate group
    across = f"over {nodes} nodes" if nodes > 1 else "in one node"
    return f"{mesh}: shard {_span(shard, ranks_per_node)}, replicate {across}"


def describe_world(world_size: int, ranks_per_node: int) -> str:
    nodes = -(-world_size // ranks_per_node)
    return f"{world_size} ranks on {nodes} node(s) of {ranks_per_node}"


def get_world_notes(pool: object) -> list[str]:
    """One line naming the nodes the trials ran on, where torchrun started the ranks (a
    :class:`~autotune.trials.nodes.NodePool`: ``nodes`` and ``placement``); none otherwise."""
    nodes = getattr(pool, "nodes", None)
    if not nodes:
        return []
    per_node = max(p["local_world_size"] for p in pool.placement)  # type: ignore[attr-defined]
    return [f"trials ran on {len(nodes)} node(s) of {per_node} rank(s), started by torchrun: {', '.join(nodes)}"]
