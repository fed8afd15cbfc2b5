"""A model from the user's own code: ``--model package.module:function`` (see [Note: model sources]
in :mod:`profiles.sources`), and what every non-profile source shares (its error, inspection).

[Note: model factory protocol]
- ``function()`` takes no arguments and returns a ``torch.nn.Module``. It is called after
  ``torch.manual_seed(seed)`` inside ``with torch.device(device):``: every rank calls it
  with the same seed and must get the same weights (FSDP2 shards each rank's own copy), so
  it must draw from torch's global generator and not pick a device itself. Unit names,
  parameter count and whether the model fits come from a call on the ``meta`` device
  (nothing is allocated), so it must also build there.
- Batch (default: a causal LM taking token ids): a microbatch is ``(batch_size, seq_len + 1)``
  int64 ids drawn uniformly from ``[0, vocab_size)``; ``vocab_size`` is the model's
  ``config.vocab_size``, else its ``vocab_size`` attribute, else its input embedding's size
  (``get_input_embeddings()``), the first that exists.
- Loss (default): ``out = model(ids[:, :-1])``; ``out.loss`` if the output has one that is
  not None, else the fp32 cross-entropy of the logits (``out`` itself if it is a tensor,
  else ``out.logits``) against ``ids[:, 1:]``, averaged over tokens.
- Any other model gives itself two methods, used instead of both defaults:
  ``make_autotune_batch(generator, batch_size, seq_len)`` returns a tensor, or a tuple, list
  or dict of tensors, drawn from ``generator`` (a CPU ``torch.Generator``; trials move the
  batch to the device), and ``compute_autotune_loss(batch)`` returns the scalar loss; it must
  call ``self(...)`` so that FSDP2's hooks run.
- Training shape: ``seq_len`` 128 and ``batch_size`` 4 per rank unless a model TOML says
  otherwise (:mod:`profiles.sources`).
- A factory's widths are opaque: there is no scale proxy of it. A factory model that does
  not fit the machine is refused with one line (``autotune.search.proxy``).
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fsdp_runtime import ROOT_UNIT, find_block_names
from fsdp_runtime.errors import AutotuneError, ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

DEFAULT_SEQ_LEN = 128
DEFAULT_BATCH_SIZE = 4
BATCH_HOOK = "make_autotune_batch"
LOSS_HOOK = "compute_autotune_loss"
_FACTORY_REF = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


class ModelSourceError(AutotuneError):
    """``--model`` names a model that cannot be loaded, built or searched (``field = "model"``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, field="model")


@dataclass(frozen=True)
class ModelFacts:
    """What a meta-device build of a model tells: its units, size and batch protocol."""

    block_names: tuple[str, ...]
    num_params: int
    vocab_size: int | None
    has_hooks: bool


def get_vocab_size(model: nn.Module) -> int | None:
    """The vocabulary size of a causal LM, as [Note: model factory protocol] looks for it."""
    config = getattr(model, "config", None)
    for value in (getattr(config, "vocab_size", None), getattr(model, "vocab_size", None)):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embedding = get_embeddings() if callable(get_embeddings) else None
    return getattr(embedding, "num_embeddings", None)


def inspect_model(model: nn.Module, label: str) -> ModelFacts:
    """Units, parameter count and batch protocol of ``model`` (built on meta), or one line on what is missing."""
    try:
        blocks = find_block_names(model)
    except ConfigError as e:
        raise ModelSourceError(
            f"{label}: {e.problem}; the search's units are a model's repeated blocks: build them as one ModuleList"
        ) from None
    has_hooks = callable(getattr(model, BATCH_HOOK, None)) and callable(getattr(model, LOSS_HOOK, None))
    vocab_size = get_vocab_size(model)
    if vocab_size is None and not has_hooks:
        raise ModelSourceError(
            f"{label} builds {type(model).__name__}, whose vocabulary size is unknown (no config.vocab_size, vocab_size or get_input_embeddings()): "
            f"give it a vocab_size attribute, or the methods {BATCH_HOOK} and {LOSS_HOOK}"
        )
    return ModelFacts(
        block_names=tuple(blocks),
        num_params=sum(p.numel() for p in model.parameters()),
        vocab_size=vocab_size,
        has_hooks=has_hooks,
    )


def compute_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The training loss of [Note: model factory protocol]: ``model.compute_autotune_loss(batch)``,
    or the causal-LM default: the output's ``.loss``, else fp32 cross-entropy of its logits (the
    output, or ``.logits``) against the next token. Trials train with it and the simulator traces it."""
    import torch
    import torch.nn.functional as F

    hook = getattr(model, LOSS_HOOK, None)
    if callable(hook):
        return hook(batch)
    out = model(batch[:, :-1])
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ModelSourceError(
            f"{type(model).__name__}(token ids) returned {type(out).__name__}: expected logits, or an object with .logits or .loss (see [Note: model factory protocol])"
        )
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def load_factory(ref: str) -> Callable[[], Any]:
    """The function ``ref`` (``package.module:function``) names; the current directory is importable, as for ``python -m``."""
    if not _FACTORY_REF.match(ref):
        raise ModelSourceError(f"{ref!r} is not a model factory reference: write package.module:function")
    module_name, _, attr = ref.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # trial ranks inherit sys.path through PYTHONPATH
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ModelSourceError(
            f"model factory {ref!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); it must be importable from the current directory or PYTHONPATH"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelSourceError(f"model factory {ref!r}: module {module_name!r} has no function {attr!r}")
    return factory


def call_factory(factory: Callable[[], Any], ref: str, *, device: str, seed: int) -> nn.Module:
    """``factory()`` under ``torch.manual_seed(seed)`` and ``torch.device(device)``; one line if it raises or returns no module."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = factory()
    except AutotuneError:
        raise
    except Exception as e:
        raise ModelSourceError(
            f"model factory {ref!r} raised {type(e).__name__}: {e} (building on the {device} device)"
        ) from None
    if not isinstance(model, nn.Module):
        raise ModelSourceError(f"model factory {ref!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


@dataclass(kw_only=True, frozen=True, slots=True)
class FactsModel:
    """What every model source that inspects a built model holds (its name, how ranks rebuild it,
    the training shape) and answers from its :class:`ModelFacts` (a ``facts`` property, defined by
    the source)."""

    name: str
    source: str
    """What trial ranks pass to :func:`profiles.sources.load_model_source` to rebuild it."""
    seq_len: int = DEFAULT_SEQ_LEN
    batch_size: int = DEFAULT_BATCH_SIZE
    description: str = ""

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelSourceError(f"{self.name}: {name} must be a positive integer, got {value!r}")

    @property
    def block_names(self) -> list[str]:
        return list(self.facts.block_names)

    @property
    def unit_names(self) -> list[str]:
        return [*self.block_names, ROOT_UNIT]

    @property
    def vocab_size(self) -> int | None:
        return self.facts.vocab_size

    def get_num_params(self) -> int:
        return self.facts.num_params


@dataclass(kw_only=True, frozen=True, slots=True)
class FactoryModel(FactsModel):
    """A model built by the user's function (see [Note: model factory protocol])."""

    ref: str
    """``package.module:function``."""

    def build(self, *, device: str = "cpu", seed: int = 0) -> nn.Module:
        return call_factory(load_factory(self.ref), self.ref, device=device, seed=seed)

    @property
    def facts(self) -> ModelFacts:
        return _inspect_factory(self.ref)

    def with_overrides(self, **changes: Any) -> FactoryModel:
        widths = sorted(set(changes) - {"seq_len", "batch_size"})
        if widths:
            raise ModelSourceError(
                f"model factory {self.ref!r} cannot be resized ({', '.join(widths)}): its widths are the factory's own"
            )
        return replace(self, **changes)


@functools.lru_cache(maxsize=16)
def _inspect_factory(ref: str) -> ModelFacts:
    return inspect_model(call_factory(load_factory(ref), ref, device="meta", seed=0), f"model factory {ref!r}")
