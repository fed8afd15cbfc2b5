"""What one microbatch asks of a rank, measured on fake tensors: FLOPs, bytes and activation memory.

The model is the profile's :class:`profiles.Llama` run by the trials' loss
(``autotune.trials.workload.compute_loss``: logits cast to float32, cross-entropy). It is
built with one block under ``FakeTensorMode`` (nothing is allocated, any shape traces in
about a second) in the unsharded parameter dtype, so every activation is what the
``MixedPrecisionPolicy`` produces. All blocks of a Llama are alike, so one block stands for
each; the root unit is two *segments*: ``head`` (what runs before the first block:
embeddings, RoPE tables) and ``tail`` (final norm, output head, loss).

- Work, per segment and pass, from a dispatch mode under torch's ``ModTracker``: matmul
  FLOPs by ``torch.utils.flop_counter``'s formulas, attention FLOPs by its SDPA formulas
  (the whole causal square, as ``FlopCounterMode`` counts; the hardware model charges
  half), and for every other non-view op the bytes it reads and writes (memory-bound).
  On fake CPU tensors SDPA takes the flash kernel, as CUDA does, so the activations saved
  for attention are ``out`` and ``logsumexp``, not the score matrix.
- Activation memory, from torch's ``MemTracker``: live activation and temporary bytes at
  the block's boundaries and peaks, and the global peak (in the loss), from which
  :class:`ActivationProfile` extrapolates to any number of blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from fsdp_runtime import ROOT_UNIT, find_block_names
from profiles import Llama, ModelProfile

SEGMENTS = ("head", "block", "tail")
_ATTENTION_FORWARD = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"}
_ATTENTION_BACKWARD = {f"{name}_backward" for name in _ATTENTION_FORWARD}
_VIEWS = {"_unsafe_view", "detach", "lift_fresh"}


@dataclass(frozen=True, slots=True)
class PassWork:
    """The work of one segment in one pass (forward or backward) of one microbatch."""

    gemm_flops: float = 0.0
    attention_flops: float = 0.0
    memory_bytes: float = 0.0
    """Bytes read and written by the memory-bound (non-matmul, non-view) ops."""

    @property
    def flops(self) -> float:
        return self.gemm_flops + self.attention_flops


@dataclass(frozen=True, slots=True)
class ActivationProfile:
    """Live activation + temporary bytes of one rank at the points that can be its peak.

    With ``k`` blocks below the running one and per-block saved bytes ``s``: a block's
    forward peaks at ``block_forward_peak + k s``, its backward at ``block_backward_peak + k s``
    and the loss region at ``tail_peak + (n - 1) s``; ``head`` is what is live when the
    first block starts.
    """

    head: float
    block_saved: float
    block_input: float
    """Bytes of a block's input: all a block keeps under full activation checkpointing."""
    block_forward_peak: float
    block_backward_peak: float
    tail_peak: float


@dataclass(frozen=True)
class ModelWork:
    """Everything the simulator needs from the model, for one microbatch on one rank."""

    name: str
    tokens: int
    """Tokens per microbatch per rank (``batch_size x seq_len``)."""
    dtype: str
    """Compute dtype (the unsharded parameter dtype)."""
    block_names: tuple[str, ...]
    param_shapes: dict[str, tuple[tuple[int, ...], ...]]
    """Per unit (``root`` included), the shapes of its parameters."""
    root_head_fraction: float
    """Share of the root's parameter elements used only by its head (embeddings): their
    gradients appear at the end of the backward, the rest's (output head, norm) at its start."""
    work: dict[tuple[str, str], PassWork]
    """``(segment, "forward" | "backward")`` -> work."""
    activations: ActivationProfile

    def get_flops_per_microbatch(self) -> float:
        """Model FLOPs of one microbatch (forward + backward, every unit), as FlopCounterMode counts them."""
        block = self.work["block", "forward"].flops + self.work["block", "backward"].flops
        root = sum(self.work[seg, p].flops for seg in ("head", "tail") for p in ("forward", "backward"))
        return len(self.block_names) * block + root


@functools.lru_cache(maxsize=16)
def get_model_work(profile: ModelProfile, dtype: str = "bfloat16") -> ModelWork:
    """Trace ``profile`` (cached per profile and dtype)."""
    torch_dtype = getattr(torch, dtype)
    one_block = profile.with_overrides(num_layers=1)
    with torch.device("meta"):
        full = Llama(profile.shape)
    block_names = tuple(find_block_names(full))
    return ModelWork(
        name=profile.name,
        tokens=profile.batch_size * profile.seq_len,
        dtype=dtype,
        block_names=block_names,
        param_shapes=_get_param_shapes(full, block_names),
        root_head_fraction=_get_root_head_fraction(full, block_names),
        work=_trace_work(one_block, torch_dtype),
        activations=_trace_activations(one_block, torch_dtype),
    )


def _get_param_shapes(model: torch.nn.Module, block_names: tuple[str, ...]) -> dict[str, tuple[tuple[int, ...], ...]]:
    shapes: dict[str, list[tuple[int, ...]]] = {name: [] for name in (*block_names, ROOT_UNIT)}
    for fqn, param in model.named_parameters():
        unit = next((b for b in block_names if fqn.startswith(b + ".")), ROOT_UNIT)
        shapes[unit].append(tuple(param.shape))
    return {unit: tuple(s) for unit, s in shapes.items()}


def _get_root_head_fraction(model: torch.nn.Module, block_names: tuple[str, ...]) -> float:
    """Root parameters registered (in module order) before the first block, and not shared
    with a module after it (tied embeddings), count as the head's."""
    first_block = next(i for i, (name, _) in enumerate(model.named_modules()) if name == block_names[0])
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    where: dict[int, set[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if not any(fqn.startswith(b + ".") for b in block_names):
            where.setdefault(id(param), set()).add("head" if order[fqn.rpartition(".")[0]] < first_block else "tail")
    sizes = {id(p): p.numel() for p in model.parameters()}
    total = sum(sizes[i] for i in where)
    return sum(sizes[i] for i, places in where.items() if places == {"head"}) / total if total else 0.0


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    # The trials' loss (autotune.trials.workload.compute_loss), restated to keep sim free of trials.
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _build_fake(profile: ModelProfile, dtype: torch.dtype) -> tuple[Llama, torch.Tensor]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cpu"):
            model = Llama(profile.shape)
    finally:
        torch.set_default_dtype(previous)
    tokens = torch.randint(0, profile.shape.vocab_size, (profile.batch_size, profile.seq_len + 1))
    return model, tokens


class _WorkCounter(TorchDispatchMode):
    """Sums :class:`PassWork` per ``(segment, pass)``, the segment told by torch's ModTracker."""

    def __init__(self, tracker, block_fqn: str) -> None:
        super().__init__()
        self.tracker = tracker
        self.block_fqn = block_fqn
        self.seen_block = {"forward": False, "backward": False}
        self.sums: dict[tuple[str, str], list[float]] = {(s, p): [0.0, 0.0, 0.0] for s in SEGMENTS for p in ("forward", "backward")}

    def _get_key(self) -> tuple[str, str]:
        phase = "backward" if self.tracker.is_bw else "forward"
        if any(p == self.block_fqn or p.startswith(self.block_fqn + ".") for p in self.tracker.parents):
            self.seen_block[phase] = True
            return "block", phase
        after_block = self.seen_block[phase]
        if phase == "forward":
            return ("tail" if after_block else "head"), phase
        return ("head" if after_block else "tail"), phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        sums = self.sums[self._get_key()]
        name = func._overloadpacket.__name__
        if name in _ATTENTION_FORWARD:
            q, k, v = args[:3]
            sums[1] += sdpa_flop_count(q.shape, k.shape, v.shape)
        elif name in _ATTENTION_BACKWARD:
            grad_out, q, k, v = args[:4]
            sums[1] += sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)
        elif func._overloadpacket in flop_registry:
            sums[0] += flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        elif name == "embedding":  # reads the indexed rows only, not the whole table
            sums[2] += 2 * out.numel() * out.element_size()
        elif _moves_data(func, out):
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            sums[2] += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _moves_data(func, out) -> bool:
    """False for views, metadata queries (``prim.device``) and ops that return no tensor."""
    if func._overloadpacket.__name__ in _VIEWS or not any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
        return False
    returns = func._schema.returns
    return not (returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns))


def _trace_work(profile: ModelProfile, dtype: torch.dtype) -> dict[tuple[str, str], PassWork]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mod_tracker import ModTracker

    with FakeTensorMode():
        model, tokens = _build_fake(profile, dtype)
        block_fqn = f"{type(model).__name__}.{find_block_names(model)[0]}"
        tracker = ModTracker()
        with tracker, _WorkCounter(tracker, block_fqn) as counter:
            _loss(model, tokens).backward()
    return {key: PassWork(*values) for key, values in counter.sums.items()}


def _trace_activations(profile: ModelProfile, dtype: torch.dtype) -> ActivationProfile:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    with FakeTensorMode():
        model, tokens = _build_fake(profile, dtype)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            _loss(model, tokens).backward()
        block = model.get_submodule(find_block_names(model)[0])
        snapshots = tracker.memory_tracking[block].snapshots

        def live(state) -> float:
            totals = next(iter(snapshots[state][0].values()))
            return float(sum(v for k, v in totals.items() if str(k).endswith(("ACT", "TEMP"))))

        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
        global_peak = float(sum(v for k, v in peak.items() if str(k).endswith(("ACT", "TEMP"))))
    head = live(_ModState.PRE_FW)
    saved = live(_ModState.POST_FW) - head
    return ActivationProfile(
        head=head,
        block_saved=saved,
        block_input=float(profile.batch_size * profile.seq_len * profile.shape.dim * torch.finfo(dtype).bits // 8),
        block_forward_peak=live(_ModState.PEAK_FW),
        block_backward_peak=live(_ModState.PEAK_BW),
        tail_peak=global_peak,
    )
