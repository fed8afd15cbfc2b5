"""A normal init drawn in row chunks, so that a rank draws only the rows of its own shards.

[Note: chunked init]
A sharded build ([Note: sharded build] in :mod:`autotune.trials.training`) must give each rank
its shard of the very values a full build has. Drawing every full parameter from one generator
in the build's order and keeping the shard made every rank pay the whole model's draw on every
build (a model in turn is built ``n + 2`` times per trial: [Note: models built in turn]). So each
parameter is drawn in chunks of ``get_chunk_rows`` rows along dim 0 (about ``CHUNK_NUMEL``
numbers each, fixed by the parameter's full shape alone), each chunk from a generator of its own
whose seed comes from the init's seed and the chunk's number in the model (its parameter's index
and its own: :func:`get_chunk_seed`). A rank draws the chunks that overlap its dim-0 rows and
slices them; a full build draws them all. A chunk is always drawn whole (``normal_`` on the
chunk's shape, whatever the rank keeps of it), so its values do not depend on the world size,
the mesh or the slice: full and sharded builds agree bitwise, and a rank's draw costs its
shard's rows plus at most one partial chunk at each end of each shard.

The rows a rank holds follow FSDP2's sharding (``fully_shard``: ``Shard(0)`` over the shard mesh
dim, ``Replicate()`` over HSDP's replicate dim): ``torch.chunk`` semantics, ``ceil(rows / n)``
rows per shard, the last shards shorter or empty (:func:`get_shard_rows`, from the DTensor's
public ``placements`` and ``device_mesh.get_coordinate()``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

CHUNK_NUMEL = 1 << 20
"""About how many numbers one chunk holds (whole rows; at least one row)."""
_MASK32 = 0xFFFFFFFF


def get_chunk_rows(shape: Sequence[int]) -> int:
    """Rows per chunk of a parameter of full shape ``shape`` (the same on every rank)."""
    return max(1, CHUNK_NUMEL // max(1, math.prod(shape[1:])))


def count_chunks(shape: Sequence[int]) -> int:
    """Chunks a parameter of full shape ``shape`` is drawn in."""
    rows = shape[0] if shape else 1
    return -(-rows // get_chunk_rows(shape))


def _fmix32(x: int) -> int:
    """MurmurHash3's finaliser: a bijection of 32-bit integers that scatters neighbours."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def get_chunk_seed(seed: int, chunk: int) -> int:
    """The seed of chunk number ``chunk`` of the model (counted over its drawn parameters in order).
    The CPU generator keeps a seed's low 32 bits only, so the chunk counter is added to a 32-bit
    key of ``seed`` and scattered by a bijection: two chunks of one init never share a seed."""
    key = _fmix32((seed ^ (seed >> 32)) & _MASK32)
    return _fmix32((key + chunk) & _MASK32)


def get_shard_rows(num_rows: int, shards: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 that a rank holds: ``shards`` is, per mesh dim that
    shards dim 0 (in mesh order), its size and the rank's coordinate; each splits the rows left
    by the one before as ``torch.chunk`` does (``ceil(rows / n)`` rows a shard, the last ones
    shorter or empty)."""
    start, stop = 0, num_rows
    for size, coordinate in shards:
        rows = stop - start
        step = -(-rows // size)
        start, stop = start + min(coordinate * step, rows), start + min((coordinate + 1) * step, rows)
    return start, stop


def get_local_rows(param: torch.Tensor) -> tuple[int, int]:
    """The dim-0 rows of the full parameter that ``param`` holds here: all of them unless it is a
    DTensor, then its ``Shard(0)`` placements at this rank's mesh coordinate."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    coordinate = param.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the parameter's mesh: it holds nothing
        return 0, 0
    shards = []
    for mesh_dim, placement in enumerate(param.placements):
        if type(placement) is Shard and placement.dim == 0:  # not a subclass (strided shards order rows otherwise)
            shards.append((param.device_mesh.size(mesh_dim), coordinate[mesh_dim]))
        elif not isinstance(placement, Replicate):
            raise NotImplementedError(f"chunked init: placement {placement} (FSDP2 shards dim 0 only)")
    rows = get_shard_rows(param.shape[0], shards)
    local = param.to_local().shape[0]
    if rows[1] - rows[0] != local:  # a sharding other than torch.chunk's would give other values
        raise RuntimeError(f"chunked init: rows {rows} of {param.shape[0]} do not match the local shard's {local}")
    return rows


def draw_rows(
    shape: Sequence[int],
    rows: tuple[int, int],
    *,
    seed: int,
    first_chunk: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Rows ``rows`` of a full ``shape`` parameter drawn ``N(0, scale^2)`` on the host: every
    chunk overlapping them drawn whole from its own generator (chunk ``c`` of this parameter is
    chunk ``first_chunk + c`` of the model), then sliced, into ``out`` (a contiguous fp32 host
    tensor of the rows' shape, e.g. the rank's own shard; default: a new one). Returns the rows
    and how many numbers were drawn (the chunks' sizes)."""
    start, stop = rows
    if out is None:
        out = torch.empty((stop - start, *shape[1:]))
    per_chunk, row = get_chunk_rows(shape), math.prod(shape[1:])
    drawn = 0
    for chunk in range(start // per_chunk, -(-stop // per_chunk)):
        lo, hi = chunk * per_chunk, min((chunk + 1) * per_chunk, shape[0])
        gen = torch.Generator().manual_seed(get_chunk_seed(seed, first_chunk + chunk))
        dest = out[max(start, lo) - start : min(stop, hi) - start]
        # normal_ scales as it draws: one pass over the rows (randn, then a multiply, made two)
        if start <= lo and hi <= stop:  # a whole chunk, drawn in place: the same contiguous draw as below
            dest.normal_(0.0, scale, generator=gen)
        else:
            whole = torch.empty((hi - lo, *shape[1:])).normal_(0.0, scale, generator=gen)
            dest.copy_(whole[max(start, lo) - lo : min(stop, hi) - lo])
        drawn += (hi - lo) * row
    return out, drawn
