"""``all_gather`` consolidation: sharded tensors packed into buckets, one all-gather each.

[Note: all_gather consolidation]
fairscale's pull request facebookresearch/fairscale#595 replaced per-rank broadcasts of
optimizer state with all-gathers and measured 10x faster consolidation on GPUs. Here the idea is pushed one
step further: instead of one collective per tensor, each rank packs its local shards of
many tensors into one flat byte buffer (a "bucket", at most ``bucket_bytes`` of gathered
output) and the bucket is gathered with a single all-gather.

Packing. FSDP2 splits dim 0 like ``torch.chunk``: with ``n`` rows on ``W`` ranks every
rank gets ``c = ceil(n / W)`` rows except the last ones, which get fewer or none. In the
bucket each tensor gets a slot of ``c`` rows' bytes on every rank at the same offset, so
all ranks contribute equal-sized buffers (the collective's contract) and the gathered
output is ``W`` copies of the bucket layout, rank-major. Rank 0 unpacks each tensor by
copying rank ``r``'s ``rows_r`` rows of the slot into rows ``[r * c, r * c + rows_r)`` of
the full tensor (dim-0 shards of a contiguous tensor are contiguous). Padding costs at
most ``W - 1`` rows per tensor. Shards are packed as bytes, so any mix of dtypes shares a
bucket. The layout (global shape, mesh, placements) is known on every rank: no metadata
is exchanged. A tensor that fills a bucket alone and is evenly sharded skips packing: its
shard is the input and the full tensor itself is the output. Buckets are formed in a
fixed order, so every rank issues the same collectives in the same order; one input and
one output buffer, sized for the largest bucket, serve every bucket.

Why it beats broadcast, and when it does not. Broadcast issues one collective per tensor
*per source rank* (``T * W``; 117 * 4 for the 4-block "small" model at world 4), each
paying a fixed cost (Python and c10d dispatch, a rendezvous of all ranks, the backend's
per-op setup) whatever its size, and only one rank sends at a time. The packed
all-gather issues ``ceil(bytes / bucket_bytes)`` collectives with every rank sending at
once. The bytes received per rank are the same (every rank of a broadcast receives every
shard too). What the all-gather costs extra is memory and copies: ``bucket_bytes`` of
output plus ``bucket_bytes / W`` of input on *every* rank of the group, and a pack and
an unpack copy. The baseline here is a fair one: it receives each shard in place, into
the rows of the full tensor. So the all-gather wins where per-collective latency
dominates (many small tensors, more ranks) and not where memory bandwidth does. On CPU
gloo the balance tips further: gloo's all-gather allocates its own flat output and
copies it into ours on every call (``ProcessGroupGloo``'s ``AsyncAllgatherWork``), while
its broadcast writes in place. On 2 CPU cores (benchmarks/consolidation.py):
a 60 KB all-gather beats 4 broadcasts 3x at world 4, a 64 MB one loses 3x; packed
consolidation of the 4.3M-param model is ~2x faster than broadcast, of the 55M-param
model (12 MB tensors) ~2x slower. Buckets above ~32 MiB also lose on CPU because glibc
then serves gloo's per-call output with fresh pages; hence ``DEFAULT_BUCKET_BYTES`` of
16 MiB rather than the hundreds of MiB that suit NCCL.

HSDP. Replicas hold identical shards, so the gather runs over the shard dimension's
group only; with ``rank0_only`` the replica groups that do not contain rank 0 do no work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fsdp_runtime.consolidate._leaves import Leaf, as_bytes, joins

DEFAULT_BUCKET_BYTES = 16 * 2**20
"""Cap on one all-gather's output; see [Note: all_gather consolidation] for why 16 MiB."""


@dataclass(slots=True)
class _Bucket:
    group: dist.ProcessGroup
    device: torch.device
    leaves: list[Leaf] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    """Byte offset of each leaf's slot in every rank's buffer."""
    bytes_per_rank: int = 0

    @property
    def group_size(self) -> int:
        return self.leaves[0].layout.group_size

    @property
    def is_direct(self) -> bool:
        """One evenly sharded tensor: its shard is the input and the output is the full
        tensor itself (dim-0 shards in rank order), with no packing copies."""
        return len(self.leaves) == 1 and self.leaves[0].layout.is_even


def gather_packed(leaves: list[Leaf], *, keep: bool, rank0_only: bool, to_cpu: bool, bucket_bytes: int) -> None:
    """Gather every sharded leaf in packed buckets; with ``keep``, put each full tensor in
    its leaf's container. See [Note: all_gather consolidation]."""
    buckets = [b for b in _plan_buckets(leaves, bucket_bytes) if joins(b.group, rank0_only)]
    buffers = _allocate_buffers(buckets)
    for bucket in buckets:
        inputs, outputs = buffers[bucket.device]
        if bucket.is_direct:
            _gather_direct(bucket.leaves[0], outputs, keep=keep, to_cpu=to_cpu)
            continue
        packed = _pack(bucket, inputs)
        gathered = outputs[: packed.numel() * bucket.group_size]
        _all_gather_single(gathered, packed, group=bucket.group)
        if keep:
            _unpack(bucket, gathered, to_cpu=to_cpu)


def _plan_buckets(leaves: list[Leaf], bucket_bytes: int) -> list[_Bucket]:
    """Group sharded tensors into buckets of at most ``bucket_bytes`` of gathered output.

    Shards are packed as bytes, so tensors of any dtype share a bucket; a tensor larger
    than the cap gets a bucket of its own. Buckets are per (process group, device) and
    closed in an order that is the same on every rank.
    """
    open_buckets: dict[tuple[int, torch.device], _Bucket] = {}
    closed: list[_Bucket] = []
    for leaf in leaves:
        device = leaf.local.device
        key = (id(leaf.layout.group), device)
        bucket = open_buckets.get(key)
        if bucket is not None and (bucket.bytes_per_rank + leaf.slot_bytes) * leaf.layout.group_size > bucket_bytes:
            closed.append(bucket)
            bucket = None
        if bucket is None:
            bucket = open_buckets[key] = _Bucket(group=leaf.layout.group, device=device)
        bucket.leaves.append(leaf)
        bucket.offsets.append(bucket.bytes_per_rank)
        bucket.bytes_per_rank += leaf.slot_bytes
    return closed + list(open_buckets.values())


def _pack(bucket: _Bucket, flat: torch.Tensor) -> torch.Tensor:
    """Fill this rank's input: each local shard's bytes at its slot's offset."""
    flat = flat[: bucket.bytes_per_rank]
    for leaf, offset in zip(bucket.leaves, bucket.offsets):
        shard = as_bytes(leaf.local.contiguous())
        flat[offset : offset + shard.numel()].copy_(shard)
    return flat


def _unpack(bucket: _Bucket, gathered: torch.Tensor, *, to_cpu: bool) -> None:
    """Assemble each full tensor from the ``(group size, bytes_per_rank)`` gathered buffer."""
    per_rank = gathered.view(bucket.group_size, bucket.bytes_per_rank)
    for leaf, offset in zip(bucket.leaves, bucket.offsets):
        full = leaf.new_full(to_cpu=to_cpu)
        full_bytes = as_bytes(full)
        layout, row_bytes = leaf.layout, leaf.row_bytes
        for group_rank, rows in enumerate(layout.num_rows):
            size = rows * row_bytes
            start = layout.get_row_start(group_rank) * row_bytes
            full_bytes[start : start + size].copy_(per_rank[group_rank, offset : offset + size])
        leaf.container[leaf.key] = full


def _gather_direct(leaf: Leaf, outputs: torch.Tensor, *, keep: bool, to_cpu: bool) -> None:
    """All-gather one evenly sharded tensor straight into its full tensor (when on its device)."""
    local = leaf.local.contiguous()
    full = leaf.new_full(to_cpu=to_cpu) if keep else None
    in_place = full is not None and full.device == local.device
    gathered = as_bytes(full) if in_place else outputs[: local.numel() * local.element_size() * leaf.layout.group_size]
    _all_gather_single(gathered, as_bytes(local), group=leaf.layout.group)
    if full is not None:
        if not in_place:
            as_bytes(full).copy_(gathered)
        leaf.container[leaf.key] = full


def _allocate_buffers(buckets: list[_Bucket]) -> dict[torch.device, tuple[torch.Tensor, torch.Tensor]]:
    """One (input, output) byte buffer pair per device, sized for its largest bucket.

    Reused by every bucket: fresh pages cost more than the copies into them (a page
    fault per 4 KiB on CPU). Direct buckets need no input buffer; their output buffer
    is only used where the full tensor is not kept or lives on another device.
    """
    sizes: dict[torch.device, tuple[int, int]] = {}
    for b in buckets:
        num_in, num_out = sizes.get(b.device, (0, 0))
        sizes[b.device] = (
            num_in if b.is_direct else max(num_in, b.bytes_per_rank),
            max(num_out, b.bytes_per_rank * b.group_size),
        )
    return {
        d: (torch.zeros(i, dtype=torch.uint8, device=d), torch.empty(o, dtype=torch.uint8, device=d))
        for d, (i, o) in sizes.items()
    }


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup) -> None:
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(output, input, group=group)
