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

[Note: shard cache]
Once chunked, a build's init costs its shard's draw, and on a GPU node that host draw is what a
build costs: a paired trial of models built in turn builds the same model (one seed) ``n + 2``
times, a search 80-100 times. A rank's values are a function of the draw's arguments alone (the
full shape, the rows, the seed, the first chunk and the scale), so a rank keeps each parameter's
drawn rows in a per-process :class:`ShardCache` (:data:`SHARD_CACHE`) keyed by them and the
parameter's index, and a later build of the same model restores them with one copy instead of a
draw: bitwise the same values by construction. Only the sharded build uses it ([Note: sharded
build] in :mod:`autotune.trials.training`: by default on CUDA, where its entries are pinned host
memory, so a restore is one DMA per parameter and no GPU memory a trial measures is taken; on CPU
they are plain host memory, asked for by tests and ``benchmarks/sharded_build.py``: CPU trials
build in full and measure RSS, which a cache would raise). The cache lives as long as the rank
process, so across a rank pool's trials ([Note: rank pool] in :mod:`autotune.trials.pool`), and
holds one model: a build of another model or another seed releases it first
(:meth:`ShardCache.use`). Its bound is twice the largest shard a build of that model has held on
this rank (fp32 bytes of the drawn parameters' rows), so the two sides of a structural pair fit
even where their meshes shard differently (FSDP over 8 ranks and HSDP 2x4: 1/8 + 1/4 of the
model, under twice 1/4), never more than a quarter of the host's memory over its local ranks
(``AUTOTUNE_SHARD_CACHE``: a number of bytes instead; ``0``: no cache); past it the least
recently used entries go first. Each build counts the parameters it drew and restored
(:attr:`ShardCache.counts`), which a trial records per build (``shard_inits`` in its rank metrics).
``benchmarks/sharded_build.py --mode cache`` (1 block at 8B width, 1.27B parameters; gloo, a
shared 2-core box at load 4-6.5): 3.3 s a build restored against 8.8 s drawn on 2 ranks (0.38x),
7.8 s against 18.5 s on one (0.42x). On CPU what is left is the build itself and the copy into
freshly faulted shard memory; on CUDA the copy is one pinned host-to-device transfer per parameter
(not measured here). Dropped entries go back to torch's host allocators, pinned ones to its
pinned-memory cache.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Hashable, Sequence

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


SHARD_CACHE_ENV = "AUTOTUNE_SHARD_CACHE"
"""Unset: the cache's default bound ([Note: shard cache]); ``0``: no cache; a number: its bound in bytes."""


class ShardCache:
    """Each parameter's drawn rows, kept for later builds of the same model ([Note: shard cache])."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.identity: Hashable | None = None
        """The model whose rows the cache holds (None: none yet)."""
        self.limit_bytes = 0
        """The bound now: twice the largest shard a build of this model held here (capped by ``max_bytes``)."""
        self.nbytes = 0
        self.counts = [0, 0]
        """The current (or last) build's parameters drawn and restored."""
        self._max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()

    @property
    def max_bytes(self) -> int:
        """The most the cache ever holds: ``AUTOTUNE_SHARD_CACHE`` or a quarter of the host's memory
        over its local ranks (one per GPU on CUDA); 0: no cache."""
        if self._max_bytes is not None:
            return self._max_bytes
        asked = os.environ.get(SHARD_CACHE_ENV)
        if asked is not None and asked.strip():
            try:
                return max(0, int(float(asked)))
            except ValueError:
                raise ValueError(f"{SHARD_CACHE_ENV}={asked!r}: a number of bytes (0: no cache)") from None
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or (
            torch.cuda.device_count() if torch.cuda.is_available() else 1
        )
        return _get_host_bytes() // (4 * max(1, local))

    def __len__(self) -> int:
        return len(self._entries)

    def use(self, identity: Hashable | None) -> None:
        """Make ``identity`` the model the cache holds: another one's rows are released first
        (None: a model the cache never holds, e.g. a factory's)."""
        if identity != self.identity:
            self.release()
            self.identity = identity

    def release(self) -> None:
        """Drop every entry (pinned memory goes back to torch's host allocator) and the bound."""
        self._entries.clear()
        self.identity, self.nbytes, self.limit_bytes = None, 0, 0

    def start_build(self, identity: Hashable, shard_bytes: int) -> None:
        """A build of ``identity`` whose drawn parameters' rows take ``shard_bytes`` (fp32) on this
        rank begins: the bound grows to twice that (at most :attr:`max_bytes`), the counts restart."""
        self.use(identity)
        self.limit_bytes = min(max(self.limit_bytes, 2 * shard_bytes), self.max_bytes)
        self.counts = [0, 0]
        self._evict(0)

    def fill(
        self,
        local: torch.Tensor,
        shape: Sequence[int],
        rows: tuple[int, int],
        *,
        index: int,
        seed: int,
        first_chunk: int,
        scale: float,
    ) -> int:
        """``local`` (a parameter's own rows ``rows`` of full ``shape``) given the values
        :func:`draw_rows` draws for them: restored from the cache if it holds them, else drawn (and
        kept). Returns how many numbers were drawn (0: restored)."""
        key = (index, tuple(shape), tuple(rows), seed, first_chunk, float(scale))
        kept = self._entries.get(key)
        if kept is not None:
            self._entries.move_to_end(key)
            local.copy_(kept)
            self.counts[1] += 1
            return 0
        self.counts[0] += 1
        nbytes = (rows[1] - rows[0]) * math.prod(shape[1:]) * 4
        keep = 0 < self.limit_bytes and nbytes <= self.limit_bytes
        direct = local.device.type == "cpu" and local.dtype == torch.float32 and local.is_contiguous()
        out = local if direct else (_new_host_rows(shape, rows, pinned=keep and local.device.type == "cuda"))
        values, drawn = draw_rows(shape, rows, seed=seed, first_chunk=first_chunk, scale=scale, out=out)
        if not direct:
            local.copy_(values)
        if keep:
            self._evict(nbytes)
            self._entries[key] = values.clone() if direct else values
            self.nbytes += nbytes
        return drawn

    def _evict(self, room: int) -> None:
        """Drop the least recently used entries until ``room`` more bytes fit under the bound."""
        while self._entries and self.nbytes + room > self.limit_bytes:
            _, rows = self._entries.popitem(last=False)
            self.nbytes -= rows.numel() * rows.element_size()


def _new_host_rows(shape: Sequence[int], rows: tuple[int, int], *, pinned: bool) -> torch.Tensor:
    """An fp32 host tensor for rows ``rows`` of a ``shape`` parameter: pinned if asked and possible."""
    size = (rows[1] - rows[0], *shape[1:])
    if pinned:
        try:
            return torch.empty(size, pin_memory=True)
        except RuntimeError:  # no pinned memory to be had: plain memory, as without the cache
            pass
    return torch.empty(size)


def _get_host_bytes() -> int:
    """The host's physical memory in bytes (16 GiB where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


SHARD_CACHE = ShardCache()
"""The rank process's cache ([Note: shard cache])."""
