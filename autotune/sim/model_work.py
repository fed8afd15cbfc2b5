"""What one microbatch asks of a rank, measured on fake tensors: FLOPs, bytes and activation memory.

The model is whatever ``--model`` names (:mod:`profiles.sources`: a Llama profile, a Hugging
Face config, a factory) run by the trials' loss (:func:`profiles.factory.compute_loss`:
the model's own ``compute_autotune_loss``, its ``.loss``, or float32 cross-entropy of its
logits). It is built under ``FakeTensorMode`` (nothing is allocated, any shape traces in
about a second) in the unsharded parameter dtype, so every activation is what the
``MixedPrecisionPolicy`` produces. The blocks of a transformer are alike, so one block stands
for each: a Llama profile and an HF config are traced with one block (``num_layers`` /
``num_hidden_layers = 1``); a factory, which cannot be resized, whole, its blocks' work
averaged. The root unit is two *segments*: ``head`` (what runs before the first block:
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

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from fsdp_runtime import ROOT_UNIT, SAVED_OP_NAMES, find_block_names
from profiles import BATCH_HOOK, Llama, ModelProfile, compute_loss
from profiles.sources import ModelSource

SEGMENTS = ("head", "block", "tail")
_ATTENTION_FORWARD = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
}
_ATTENTION_BACKWARD = {f"{name}_backward" for name in _ATTENTION_FORWARD}
_VIEWS = {"_unsafe_view", "detach", "lift_fresh"}
_SELECTIVE_SAVED = set(SAVED_OP_NAMES)
"""The ops whose outputs selective activation checkpointing saves (``fsdp_runtime.SAVED_OP_NAMES``)."""


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
    block_selective: float | None = None
    """Bytes a block keeps under selective checkpointing: its input and the outputs of its matmuls and
    attention (the ops ``fsdp_runtime.checkpointing`` saves); None: not traced (taken as ``block_saved``)."""


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
    attention_head_dim: int = 0
    """The head dim of the model's fused attention (its query's last dim; 0: no attention)."""

    def get_flops_per_microbatch(self) -> float:
        """Model FLOPs of one microbatch (forward + backward, every unit), as FlopCounterMode counts them."""
        block = self.work["block", "forward"].flops + self.work["block", "backward"].flops
        root = sum(self.work[seg, p].flops for seg in ("head", "tail") for p in ("forward", "backward"))
        return len(self.block_names) * block + root


@functools.lru_cache(maxsize=16)
def get_model_work(profile: ModelSource, dtype: str = "bfloat16") -> ModelWork:
    """Trace the model ``profile`` names (cached per model and dtype)."""
    torch_dtype = getattr(torch, dtype)
    full = profile.build(device="meta")
    block_names = tuple(find_block_names(full))
    traced = _get_traced_source(profile)
    work, selective, head_dim = _trace_work(traced, torch_dtype)
    activations = _trace_activations(traced, torch_dtype)
    return ModelWork(
        name=profile.name,
        tokens=profile.batch_size * profile.seq_len,
        dtype=dtype,
        block_names=block_names,
        param_shapes=_get_param_shapes(full, block_names),
        root_head_fraction=_get_root_head_fraction(full, block_names),
        work=work,
        activations=dataclasses.replace(activations, block_selective=activations.block_input + selective),
        attention_head_dim=head_dim,
    )


def _get_traced_source(profile: ModelSource) -> ModelSource:
    """The model with one block where its source can be resized (a profile, an HF config), else itself."""
    from profiles.hf import HFModel

    if isinstance(profile, ModelProfile):
        return profile.with_overrides(num_layers=1)
    if isinstance(profile, HFModel) and hasattr(profile.get_config(), "num_hidden_layers"):
        one_block = profile.with_overrides(num_hidden_layers=1)
        try:
            if len(find_block_names(one_block.build(device="meta"))) == 1:
                return one_block
        except Exception:  # a config whose other fields depend on the depth (per-layer lists): trace it whole
            pass
    return profile


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


def _build_fake(profile: ModelSource, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """The model in ``dtype`` and one microbatch, under the caller's ``FakeTensorMode``."""
    if isinstance(profile, ModelProfile):  # our Llama builds under the fake mode in the dtype directly: no cast
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device("cpu"):
                model: torch.nn.Module = Llama(profile.shape)
        finally:
            torch.set_default_dtype(previous)
    else:  # built on meta, outside the fake mode, and cast there (a fake parameter cannot be cast), then given fake CPU storage
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            model = profile.build(device="meta").to(dtype)
        model.to_empty(device="cpu")
    hook = getattr(model, BATCH_HOOK, None)
    if callable(hook):
        return model, hook(
            generator=torch.Generator().manual_seed(0), batch_size=profile.batch_size, seq_len=profile.seq_len
        )
    return model, torch.randint(0, profile.vocab_size, (profile.batch_size, profile.seq_len + 1))


class _WorkCounter(TorchDispatchMode):
    """Sums :class:`PassWork` per ``(segment, pass)``, the segment told by torch's ModTracker."""

    def __init__(self, tracker, block_fqns: tuple[str, ...]) -> None:
        super().__init__()
        self.tracker = tracker
        self.block_prefixes = tuple(f"{fqn}." for fqn in block_fqns)
        self.block_fqns = set(block_fqns)
        self.seen_block = {"forward": False, "backward": False}
        self.sums: dict[tuple[str, str], list[float]] = {
            (s, p): [0.0, 0.0, 0.0] for s in SEGMENTS for p in ("forward", "backward")
        }
        self.head_dim = 0
        self.selective = 0.0
        """Bytes of the outputs of blocks' matmuls and attention in forward (what selective checkpointing keeps)."""

    def _get_key(self) -> tuple[str, str]:
        phase = "backward" if self.tracker.is_bw else "forward"
        if any(p in self.block_fqns or p.startswith(self.block_prefixes) for p in self.tracker.parents):
            self.seen_block[phase] = True
            return "block", phase
        after_block = self.seen_block[phase]
        if phase == "forward":
            return ("tail" if after_block else "head"), phase
        return ("head" if after_block else "tail"), phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        key = self._get_key()
        sums = self.sums[key]
        name = func._overloadpacket.__name__
        if key == ("block", "forward") and name in _SELECTIVE_SAVED:
            self.selective += sum(
                t.numel() * t.element_size() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
            )
        if name in _ATTENTION_FORWARD:
            q, k, v = args[:3]
            self.head_dim = int(q.shape[-1])
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


def _trace_work(profile: ModelSource, dtype: torch.dtype) -> tuple[dict[tuple[str, str], PassWork], float, int]:
    """Work per segment and pass (the block segment: the mean over the traced blocks), a block's
    bytes of matmul and attention outputs in forward, and the attention's head dim."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mod_tracker import ModTracker

    with FakeTensorMode(allow_non_fake_inputs=True):
        model, batch = _build_fake(profile, dtype)
        blocks = find_block_names(model)
        tracker = ModTracker()
        with tracker, _WorkCounter(tracker, tuple(f"{type(model).__name__}.{b}" for b in blocks)) as counter:
            compute_loss(model, batch).backward()
    work = {
        key: PassWork(*(v / len(blocks) for v in values) if key[0] == "block" else values)
        for key, values in counter.sums.items()
    }
    return work, counter.selective / len(blocks), counter.head_dim


def _trace_activations(profile: ModelSource, dtype: torch.dtype) -> ActivationProfile:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    with FakeTensorMode(allow_non_fake_inputs=True):
        model, batch = _build_fake(profile, dtype)
        blocks = find_block_names(model)
        block = model.get_submodule(blocks[0])
        inputs: list[int] = []
        handle = block.register_forward_pre_hook(
            lambda _, args: inputs.append(args[0].numel() * args[0].element_size()) if not inputs else None
        )
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            compute_loss(model, batch).backward()
        handle.remove()
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
        block_input=float(inputs[0]),
        block_forward_peak=live(_ModState.PEAK_FW),
        block_backward_peak=live(_ModState.PEAK_BW),
        tail_peak=global_peak - (len(blocks) - 1) * saved,  # as if one block had been traced
    )


class _ByteCounter(TorchDispatchMode):
    """Bytes every op reads (its tensor arguments) and writes (arguments it mutates, new outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        values = [*args, *(kwargs.get(a.name) for a in schema.arguments[len(args) :])]
        for arg, value in zip(schema.arguments, values):
            size = sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
            self.bytes += size * (2 if arg.alias_info is not None and arg.alias_info.is_write else 1)
        if not any(r.alias_info is not None for r in schema.returns):
            self.bytes += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


@functools.lru_cache(maxsize=1)
def get_optimizer_bytes_per_element() -> float:
    """Bytes torch's AdamW (``foreach``, the default on CUDA) reads and writes per float32
    parameter element in one step, counted op by op on torch's own implementation (a step on a
    1M-element parameter after a first step that creates the state): 84 on torch 2.13
    (``_foreach_mul_``, ``_foreach_lerp_``, ``_foreach_mul_``, ``_foreach_addcmul_``,
    ``_foreach_sqrt``, ``_foreach_div_``, ``_foreach_add_``, ``_foreach_addcdiv_``)."""
    numel = 1 << 20
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.ones(numel)
    optimizer = torch.optim.AdamW([param], foreach=True)
    optimizer.step()
    with _ByteCounter() as counter:
        optimizer.step()
    return counter.bytes / numel
