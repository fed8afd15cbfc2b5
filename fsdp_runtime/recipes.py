"""Named reference configs: the FSDP2 recipes users already run, built for any decoder.

[Note: the torchtitan recipe]
torchtitan shards a decoder with ``apply_fsdp_to_decoder`` (torchtitan 0.3.0,
``torchtitan/distributed/fsdp.py``; 0.2.2 has the same rules in
``torchtitan/models/llama3/infra/parallelize.py:apply_fsdp``), which departs from FSDP2's
defaults (``fully_shard`` on each block and the root with default arguments,
:func:`fsdp_runtime.default_config`). Without pipeline parallelism and with its default
``reshard_after_forward_policy = "default"``:

- the token embeddings are a unit of their own, resharded after forward;
- the final norm and the output head are one unit (``fully_shard([norm, output])``) that is
  *not* resharded after forward ("do not reshard_after_forward the last layers by default
  since FSDP would prefetch them immediately", its comment: the head's backward runs first);
- with tied embeddings (``enable_weight_tying``, 0.3.0) the embeddings, the norm and the head
  are one unit, not resharded after forward (one parameter cannot be sharded by two units);
- each transformer block is a unit, resharded after forward (not with PP, which we do not build);
- the root is sharded last with default arguments;
- prefetch is FSDP2's implicit one (explicit lists only with expert parallelism), all-gathers
  are FSDP2's synchronous default, and every microbatch reduce-scatters: its training loop
  (``Trainer.train_step``) never turns gradient sync off under gradient accumulation;
- mixed precision: bf16 parameters, fp32 reduction (``TrainingConfig.mixed_precision_param``
  and ``_reduce``).

:func:`get_torchtitan_config` reads the same parts from any decoder's structure
(:func:`fsdp_runtime.blocks.split_edge_modules`: the ``nn.Embedding`` modules outside the
blocks, and the other modules outside them that hold parameters: the final norm and the
head), so an HF Llama (``model.embed_tokens``; ``model.norm`` + ``lm_head``) gets the
recipe torchtitan would give its own Llama. What it leaves to the caller, on purpose:

- *precision*: the recipe is built on a ``base`` config (a search's defaults: its mesh,
  microbatches, precision, synchronous all-gathers), so both baselines of a search run in the
  search's one precision ([Note: precision defaults]); on CUDA that default is torchtitan's
  bf16/fp32, on CPU fp32 (this CPU's bf16 matmuls are slow). A speedup over the recipe is then
  a speedup of the FSDP2 knobs, not of a dtype;
- ``disable_fsdp_gradient_division`` (torchtitan divides the loss by the global token count
  instead of letting FSDP2 divide the gradients by the world size): the same gradients up
  to rounding and no change in time, so not a knob here.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from fsdp_runtime.blocks import find_block_names, split_edge_modules
from fsdp_runtime.config import ROOT_UNIT, RuntimeConfig, UnitConfig

RECIPES = ("torchtitan",)
"""The names ``autotune trial --config`` takes in place of a file."""


def _edge_unit(modules: list[str], *, reshard_after_forward: bool | None) -> UnitConfig:
    if len(modules) == 1:
        return UnitConfig(name=modules[0], reshard_after_forward=reshard_after_forward)
    return UnitConfig(name="+".join(modules), modules=modules, reshard_after_forward=reshard_after_forward)


def get_torchtitan_units(model: nn.Module) -> list[UnitConfig]:
    """torchtitan's units for ``model`` ([Note: the torchtitan recipe]), in its order:
    embeddings, blocks, final norm + head, root."""
    blocks = find_block_names(model)
    embeddings, head, tied = split_edge_modules(model, blocks)
    block_units = [UnitConfig(name=b, reshard_after_forward=True) for b in blocks]
    root = UnitConfig(name=ROOT_UNIT)
    nested = any(b.startswith(a + ".") for a in embeddings + head for b in embeddings + head)
    if nested:  # a module holding another: only the root can hold both
        return [*block_units, root]
    if tied:
        return [*block_units, _edge_unit(embeddings + head, reshard_after_forward=False), root]
    edges = [_edge_unit(embeddings, reshard_after_forward=True)] if embeddings else []
    tail = [_edge_unit(head, reshard_after_forward=False)] if head else []
    return [*edges, *block_units, *tail, root]


def get_torchtitan_config(model: nn.Module, base: RuntimeConfig | None = None) -> RuntimeConfig:
    """``base`` (default: a config at FSDP2's defaults) with torchtitan's units for ``model``
    and every other knob at FSDP2's default: implicit prefetch, sync every microbatch,
    resharded after backward ([Note: the torchtitan recipe]). Each block keeps ``base``'s
    activation checkpointing (torchtitan checkpoints per block too: a search whose baseline
    checkpoints every block measures the recipe with the same checkpointing)."""
    base = base if base is not None else RuntimeConfig()
    checkpointing = {u.name: u.activation_checkpointing for u in base.units}
    units = [
        dataclasses.replace(u, activation_checkpointing=checkpointing[u.name])
        if checkpointing.get(u.name, "none") != "none"
        else u
        for u in get_torchtitan_units(model)
    ]
    return dataclasses.replace(base, units=units, unlisted_blocks="error")
