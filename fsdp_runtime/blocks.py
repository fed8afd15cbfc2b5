"""Which modules of a model are the units of a config: block discovery and unit resolution.

[Note: unit names]
A unit is named by its module path in the model it is applied to (``layers.3`` in our
Llama, ``model.layers.3`` in a Hugging Face Llama, ``transformer.h.3`` in GPT-2), or
``root`` for the model itself. :func:`resolve_units` checks a config against a model,
loudly:

- *Unknown unit*: a unit whose name is no module of the model is an error naming
  ``units[i].name``, except in the one case below. A unit with a ``modules`` list (several
  blocks in one unit, schema 2) is checked module by module (``units[i].modules[j]``); its
  name is a label, and a label that is another module of the model is refused as ambiguous.
- *Same depth, other names* (a config searched on our Llama profile, ``layers.N``, applied
  to an HF Llama, ``model.layers.N``): when *no* block unit of the config names a module of
  the model, the config's block units are exactly ``P.0 .. P.{n-1}`` for one prefix ``P``,
  and the model has exactly ``n`` blocks (:func:`find_block_names`), block ``P.i`` means
  the model's ``i``-th block. Names are rewritten by position everywhere (units, module
  lists and prefetch lists) and a ``UserWarning`` says so. Any other mismatch (another depth, a mix
  of known and unknown names, units that are not blocks) stays an error.
- *Fewer blocks than the model*: a block that is in no unit (neither a unit itself, nor
  inside or around one) would be sharded with the root, silently another wrapping. That
  is an error naming ``units`` unless the config says ``unlisted_blocks = "root"``.
- *Parameters outside every unit*: ``apply_fsdp(model.model, config)`` shards only
  ``model.model``; the parent's other parameters (``lm_head``) are in no unit, their
  gradients are never synchronised and the ranks drift apart. :func:`find_parameters_outside`
  finds the modules that hold the given model as a child (through the garbage
  collector's view of live modules: a module has no parent pointer) and returns their
  trainable parameters that are not the model's; ``apply_fsdp`` refuses them, naming the
  root unit.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings

from torch import nn

from fsdp_runtime.config import ROOT_UNIT, RuntimeConfig, UnitConfig
from fsdp_runtime.errors import ConfigError
from fsdp_runtime.validation import validate_config

# Where the repeated blocks of common decoder implementations live.
BLOCK_CONTAINERS = (
    "layers",
    "model.layers",
    "transformer.h",
    "model.decoder.layers",
    "transformer.layers",
    "h",
    "blocks",
)


def find_block_names(model: nn.Module) -> list[str]:
    """FQNs of the transformer blocks of a decoder (ours, HF, torchtitan, GPT-2, or the
    largest ModuleList whose children share one class)."""
    modules = dict(model.named_modules())
    for path in BLOCK_CONTAINERS:
        container = modules.get(path)
        if isinstance(container, (nn.ModuleList, nn.ModuleDict)) and len(container) > 0:
            return [f"{path}.{name}" for name, _ in container.named_children()]
    best: tuple[int, str] | None = None
    for path, module in modules.items():
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(c) for c in module}) == 1:
            if best is None or len(module) > best[0]:
                best = (len(module), path)
    if best is None:
        raise ConfigError(
            "units",
            f"no repeated blocks found in {type(model).__name__} (looked for {', '.join(BLOCK_CONTAINERS)} and any ModuleList of 2+ modules of one class)",
            fix="list the units explicitly in the config's [[units]] tables",
        )
    path = best[1]
    return [f"{path}.{name}" for name, _ in modules[path].named_children()]


def find_edge_modules(model: nn.Module) -> tuple[list[str], list[str]]:
    """``(embeddings, head)``: the modules outside the blocks that hold parameters, which
    torchtitan shards as units of their own instead of with the root. ``embeddings``: the
    ``nn.Embedding`` modules; ``head``: the others (final norm, output projection), one unit
    together. Both empty when either is missing, when the two share a parameter (tied
    embeddings: one parameter cannot be sharded by two units) or a candidate holds another."""
    embeddings, head, shared = split_edge_modules(model, _try_blocks(model))
    candidates = embeddings + head
    nested = any(b.startswith(a + ".") for a in candidates for b in candidates)
    return ([], []) if shared or nested or not embeddings or not head else (embeddings, head)


def split_edge_modules(model: nn.Module, blocks: list[str]) -> tuple[list[str], list[str], bool]:
    """``(embeddings, others, tied)``: the modules outside ``blocks`` that hold trainable
    parameters of their own, ``nn.Embedding`` or not, and whether the two share a parameter."""
    embeddings, head = [], []
    for path, module in model.named_modules():
        if not path or any(path == b or path.startswith(b + ".") for b in blocks):
            continue
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            (embeddings if isinstance(module, nn.Embedding) else head).append(path)
    modules = dict(model.named_modules())
    shared = {id(p) for n in embeddings for p in modules[n].parameters()} & {
        id(p) for n in head for p in modules[n].parameters()
    }
    return embeddings, head, bool(shared)


def _summarize(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 2 else f"{names[0]}..{names[-1]}"


def get_unit_modules(config: RuntimeConfig) -> list[str]:
    """Module paths of the config's units other than the root, in unit order."""
    return [m for u in config.units if u.name != ROOT_UNIT for m in u.get_modules()]


def get_position_map(config: RuntimeConfig, blocks: list[str]) -> dict[str, str] | None:
    """``{config block name: model block name}`` when the config's block units hold the
    modules ``P.0 .. P.{n-1}`` and the model has ``n`` blocks (see [Note: unit names]); else None."""
    names = get_unit_modules(config)
    if not names or len(names) != len(blocks):
        return None
    split = [n.rpartition(".") for n in names]
    indices = [index for _, _, index in split]
    if len({prefix for prefix, _, _ in split}) != 1 or not split[0][0] or not all(i.isdecimal() for i in indices):
        return None
    if sorted(int(i) for i in indices) != list(range(len(names))):
        return None
    return {name: blocks[int(index)] for name, index in zip(names, indices)}


def _rename(config: RuntimeConfig, mapping: dict[str, str]) -> RuntimeConfig:
    def rename_list(names: list[str] | None) -> list[str] | None:
        return None if names is None else [mapping.get(n, n) for n in names]

    units = [
        dataclasses.replace(
            u,
            name=mapping.get(u.name, u.name),
            modules=rename_list(u.modules),
            forward_prefetch=rename_list(u.forward_prefetch),
            backward_prefetch=rename_list(u.backward_prefetch),
        )
        for u in config.units
    ]
    return dataclasses.replace(config, units=units)


def _try_blocks(model: nn.Module) -> list[str]:
    try:
        return find_block_names(model)
    except ConfigError:
        return []


def _check_names(model: nn.Module, config: RuntimeConfig, modules: dict[str, nn.Module]) -> RuntimeConfig:
    """Every unit names a module; a same-depth config with other names is mapped by position."""
    block_units = get_unit_modules(config)
    if block_units and not any(n in modules for n in block_units):
        blocks = _try_blocks(model)
        mapping = get_position_map(config, blocks)
        if mapping is not None:
            warnings.warn(
                f"config units {_summarize(list(mapping))} are not modules of {type(model).__name__}: "
                f"resolved by position onto its {len(blocks)} blocks {_summarize(blocks)}",
                UserWarning,
                stacklevel=4,
            )
            return _rename(config, mapping)
    for i, unit in enumerate(config.units):
        if unit.name == ROOT_UNIT:
            continue
        if unit.modules is not None and unit.name in modules and unit.name not in unit.modules:
            raise ConfigError(
                f"units[{i}].name",
                f"{unit.name!r} is a module of {type(model).__name__} but not one of this unit's modules",
                fix="name the unit after what it holds (e.g. 'layers.0-1')",
            )
        for j, module in enumerate(unit.get_modules()):
            if module not in modules:
                path = f"units[{i}].modules[{j}]" if unit.modules is not None else f"units[{i}].name"
                raise ConfigError(
                    path,
                    f"module {module!r} not found in {type(model).__name__}",
                    fix=f"{_hint(model, block_units)}; the model itself is {ROOT_UNIT!r}",
                )
    return config


def _hint(model: nn.Module, block_units: list[str]) -> str:
    blocks = _try_blocks(model)
    hint = f"blocks in this model: {_summarize(blocks)}" if blocks else "this model has no repeated blocks"
    if blocks and len(block_units) != len(blocks):
        hint += (
            f"; the config has {len(block_units)} block units for {len(blocks)} blocks, so none is matched by position"
        )
    return hint


def _check_coverage(model: nn.Module, config: RuntimeConfig) -> None:
    """Every block is a unit, inside one or around one, unless ``unlisted_blocks = "root"``."""
    if config.unlisted_blocks == "root":
        return
    units = get_unit_modules(config)
    blocks = _try_blocks(model)

    def covered(block: str) -> bool:
        return any(u == block or u.startswith(block + ".") or block.startswith(u + ".") for u in units)

    unlisted = [b for b in blocks if not covered(b)]
    if unlisted:
        raise ConfigError(
            "units",
            f"cover {len(blocks) - len(unlisted)} of the {len(blocks)} blocks of {type(model).__name__}: {_summarize(unlisted)} would be sharded with the root",
            fix='list every block as a unit, or set unlisted_blocks = "root" to shard the others with the root on purpose',
        )


def resolve_units(model: nn.Module, config: RuntimeConfig) -> RuntimeConfig:
    """The config's units checked against ``model`` (see [Note: unit names]): default units
    filled in (one per block, then ``root``), names mapped by position where that is the
    only reading, every unit a module, every block in a unit, ``root`` last if absent."""
    if not config.units:
        units = [UnitConfig(name=n) for n in find_block_names(model)] + [UnitConfig(name=ROOT_UNIT)]
        config = dataclasses.replace(config, units=units)
        validate_config(config)
    modules = dict(model.named_modules())
    config = _check_names(model, config, modules)
    _check_coverage(model, config)
    if ROOT_UNIT not in config.unit_names:
        config = dataclasses.replace(config, units=[*config.units, UnitConfig(name=ROOT_UNIT)])
    return config


def _get_parents(target: nn.Module) -> list[tuple[nn.Module, str]]:
    """Live modules that hold ``target`` as a direct child, with the child's name."""
    parents = []
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.Module) and obj is not target:  # type(): never an object's own __class__
            for name, child in obj._modules.items():
                if child is target:
                    parents.append((obj, name))
    return parents


def find_parameters_outside(model: nn.Module) -> tuple[str, list[str]]:
    """If ``model`` is a submodule of a live module, that top module's class name and the
    names of its trainable parameters that ``model`` does not hold (see [Note: unit names]);
    else ``("", [])``. Parameters already sharded by FSDP2 (DTensors) do not count."""
    from torch.distributed.tensor import DTensor

    top, path, seen = model, "", {id(model)}
    while True:
        parents = [(p, n) for p, n in _get_parents(top) if id(p) not in seen]
        if not parents:
            break
        top, name = parents[0]
        seen.add(id(top))
        path = f"{name}.{path}" if path else name
    if top is model:
        return "", []
    inside = {id(p) for p in model.parameters()}
    outside = [
        n for n, p in top.named_parameters() if id(p) not in inside and p.requires_grad and not isinstance(p, DTensor)
    ]
    return (f"{type(top).__name__} (it is {path!r} there)", outside) if outside else ("", [])
