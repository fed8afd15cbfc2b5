"""``broadcast`` consolidation: the baseline, one collective per tensor per source rank."""

from __future__ import annotations

import torch.distributed as dist

from fsdp_runtime.consolidate._leaves import Leaf, joins


def gather_by_broadcast(leaves: list[Leaf], *, keep: bool, rank0_only: bool, to_cpu: bool) -> None:
    """Broadcast every shard of every sharded leaf from its owner; with ``keep``, each full
    tensor goes in its leaf's container, receiving shards in place where it can."""
    for leaf in leaves:
        layout = leaf.layout
        if not joins(layout.group, rank0_only):
            continue
        local = leaf.local
        full = leaf.new_full(to_cpu=to_cpu) if keep else None
        for group_rank, rows in enumerate(layout.num_rows):
            if rows == 0:
                continue
            start = layout.get_row_start(group_rank)
            target = full[start : start + rows] if full is not None else None
            if group_rank == layout.group_rank:
                shard = local.contiguous()
            elif target is not None and target.device == local.device:
                shard = target  # receive in place: dim-0 rows of a contiguous tensor are contiguous
            else:
                shard = local.new_empty((rows, *local.shape[1:]))
            dist.broadcast(shard, group=layout.group, group_src=group_rank)
            if target is not None and shard is not target:
                target.copy_(shard)
        if full is not None:
            leaf.container[leaf.key] = full
