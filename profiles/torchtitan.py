"""torchtitan's own models: ``--model torchtitan:llama3/debugmodel`` (``torchtitan:FAMILY/FLAVOR``).

[Note: torchtitan models]
The model is torchtitan's: its registry (0.2.2's here; 0.3.0's below) names the flavor's arguments and its model class
(``get_train_spec()`` in ``torchtitan/models/<family>/__init__.py``: ``model_cls`` and
``model_args``, a dict of flavors), built as its trainer builds it (``model_cls(args)`` with
``max_seq_len`` set to the training sequence length, as ``update_from_config`` does, then
``init_weights()``), and trained on its own loss (``torchtitan.components.loss.cross_entropy_loss``,
a sum over tokens, divided here by the microbatch's token count as its trainer divides by the
global count of valid tokens) on its output: the logits of ``model(tokens)``.

Which torchtitan: 0.2.2 trains here, 0.3.0 on a GPU (:func:`check_version` refuses any other in
one line). 0.2.2 (``pip install 'fsdp-autotune[torchtitan]'``): its llama3 and qwen3 default to
SDPA attention, which trains on CPU. 0.3.0: its language models take only flex, flex_flash or
varlen attention ("sdpa is no longer supported"), and FlexAttention has no backward on CPU
(``NotImplementedError``), so a CPU trial or search of a 0.3.0 model is refused in one line
(:meth:`TorchtitanModel.check_device_type`; it builds on the meta device everywhere, for its units).
Its registry is another API: ``model_registry(flavor)`` in the family's ``__init__`` returns a
``ModelSpec`` whose ``model`` is the model's config (its default attention, flex), built with
``config.build()`` after the RoPE caches' ``max_seq_len`` is set to the training sequence length
(what its trainer's ``update_from_config`` does) and initialised with ``init_weights()``; the flavors
are the keys of ``<family>_configs``. Its trainer passes ``positions`` and ``attention_masks =
model.get_attention_masks(positions)`` to every forward of a flex or varlen model
(``post_dataloading_process``); the loss hook does the same (:func:`get_forward_kwargs`; one
document per row: positions ``0..seq_len-1``), so a GPU trial trains as its trainer does. Its
trainer builds them per batch because a batch's documents change; here they are always one per
row, so positions and masks depend on the batch's shape and device only: the hook builds them
once per shape and device and keeps them with the model (:class:`ForwardKwargsCache`), in its
first step, a warm-up step (trials take 2 by default): a timed step times the model, not
``create_block_mask``.

Only what the models need is imported. 0.2.2: importing ``torchtitan`` itself (its ``__init__``
registers float8 converters, which import the MoE Triton kernels: no ``triton`` in a CPU
torch) or ``torchtitan.models.<family>`` (its ``__init__`` imports the trainer's data loaders:
``datasets``) would pull the trainer; so those three packages are entered without running
their ``__init__`` (bare package modules over torchtitan's own directories), and two modules
the model files import for names they do not use in a dense model are stood in for:
``torchtitan.protocols.train_spec`` (the model files take ``ModelProtocol`` and ``BaseModelArgs``
from it, which it imports from ``torchtitan.protocols.model``; it also imports the metrics,
validator and data loader: ``tensorboard``, ``datasets``) by a module holding those two, and ``torchtitan.models.moe.kernels``
(Triton; expert-parallel token permutation, never called by a dense decoder) by a module whose
function raises. The registry is read from the family's ``__init__`` source: the dict literal named by
``get_train_spec``'s ``model_args`` is evaluated over the names of the family's model modules,
and ``model_cls`` is looked up there (the ``__init__`` itself cannot run without the trainer).
0.3.0: the registry is code in the family's ``__init__``, which imports only torchtitan's model,
parallelism and optimizer modules (no data loaders, metrics or trainer), so that package is imported
as it is; the one module on its way that needs more than torch, ``tyro`` and ``spmd_types`` is
``torchtitan.distributed.minimal_async_ep`` (Triton kernels of expert-parallel dispatch, imported by
the MoE token dispatcher, never called by a dense decoder), stood in for where ``triton`` is
absent by a module whose functions raise. A process that already imported torchtitan whole keeps
its modules as they are. Needs beyond torch: ``tyro`` (``torchtitan.config``), and for 0.3.0 ``spmd_types``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from profiles.factory import FactoryModel, ModelFacts, ModelSourceError, call_factory, inspect_model

if TYPE_CHECKING:
    import torch
    from torch import nn

PREFIX = "torchtitan:"
FAMILIES = ("llama3", "qwen3")
"""The dense decoders of torchtitan's registry read here (0.2.2 and 0.3.0)."""
INSTALL = "pip install 'fsdp-autotune[torchtitan]'"
RELEASES = {(0, 2): "0.2.2", (0, 3): "0.3.0"}
"""The torchtitan releases whose registry this module reads, by (major, minor): the one it was read from."""
CPU_TRAINS = (0, 2)
"""The release whose models train on CPU ([Note: torchtitan models])."""


def parse_torchtitan_ref(ref: str) -> tuple[str, str]:
    """``(family, flavor)`` of ``torchtitan:FAMILY/FLAVOR``; one line when it is not one."""
    family, _, flavor = ref.removeprefix(PREFIX).partition("/")
    if family not in FAMILIES or not flavor:
        raise ModelSourceError(
            f"{ref!r}: write torchtitan:FAMILY/FLAVOR with FAMILY one of {', '.join(FAMILIES)} (e.g. torchtitan:llama3/debugmodel)"
        )
    return family, flavor


def _root() -> Path:
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"torchtitan is not installed: {INSTALL}")
    return Path(next(iter(spec.submodule_search_locations)))


def _imported_whole() -> bool:
    return getattr(sys.modules.get("torchtitan"), "__file__", None) is not None


def _enter_packages(family: str) -> Path:
    """0.2.2's packages on the way to ``family``'s model modules, without their ``__init__``."""
    root = _root()
    if _imported_whole():  # imported whole by this process
        importlib.import_module(f"torchtitan.models.{family}")
        return root
    for name in ("torchtitan", "torchtitan.models", f"torchtitan.models.{family}"):
        if name not in sys.modules:
            path = str(root.joinpath(*name.split(".")[1:]))
            module = types.ModuleType(name)
            module.__path__ = [path]
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            module.__spec__.submodule_search_locations = [path]
            sys.modules[name] = module
    if "torchtitan.protocols.train_spec" not in sys.modules:
        protocols = importlib.import_module("torchtitan.protocols.model")
        _stand_in(
            "torchtitan.protocols.train_spec",
            ModelProtocol=protocols.ModelProtocol,
            BaseModelArgs=protocols.BaseModelArgs,
        )
    if "torchtitan.models.moe.kernels" not in sys.modules and importlib.util.find_spec("triton") is None:
        _stand_in("torchtitan.models.moe.kernels", generate_permute_indices=_no_triton)
    return root


def _stand_in(name: str, **names: Any) -> None:
    module = types.ModuleType(name, f"fsdp-autotune's stand-in ([Note: torchtitan models] in {__name__})")
    module.__dict__.update(names)
    sys.modules[name] = module


def _no_triton(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("expert-parallel token permutation needs triton (fsdp-autotune builds dense decoders)")


def get_installed_version() -> str | None:
    """The installed torchtitan's version (its package metadata, first on ``sys.path``), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchtitan")
    except PackageNotFoundError:
        return None


def check_version(installed: str | None) -> tuple[int, int]:
    """The release (major, minor) of ``installed`` whose registry this module reads (:data:`RELEASES`),
    or one line where it reads none."""
    if installed is None:
        raise ModelSourceError(f"torchtitan is not installed: {INSTALL}")
    release = tuple(int(p) for p in installed.split(".")[:2] if p.isdecimal())
    if release not in RELEASES:
        raise ModelSourceError(
            f"torchtitan {installed} is installed; this fsdp-autotune reads the registries of torchtitan "
            f"{' and '.join(RELEASES.values())} (0.2.2 trains on CPU, 0.3.0 on a GPU): {INSTALL}"
        )
    return release  # type: ignore[return-value]


@functools.cache
def get_release() -> tuple[int, int]:
    """The installed torchtitan's release (major, minor), checked by :func:`check_version`."""
    return check_version(get_installed_version())


@functools.cache
def load_registry(family: str) -> tuple[type, dict[str, Any]]:
    """``(model class, {flavor: model args})`` of torchtitan 0.2.2's registry for ``family`` ([Note: torchtitan models])."""
    try:
        root = _enter_packages(family)
        args = importlib.import_module(f"torchtitan.models.{family}.model.args")
        model = importlib.import_module(f"torchtitan.models.{family}.model.model")
    except ImportError as e:
        raise ModelSourceError(f"torchtitan's {family} model cannot be imported ({e}): {INSTALL}") from None
    source = (root / "models" / family / "__init__.py").read_text(encoding="utf-8")
    namespace = {**vars(sys.modules.get("torchtitan.models.moe", types.ModuleType("_"))), **vars(args), **vars(model)}
    cls_name, args_name = _find_train_spec(ast.parse(source), family)
    flavors = next(
        (
            node.value
            for node in ast.parse(source).body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == args_name for t in node.targets)
        ),
        None,
    )
    if flavors is None or cls_name not in namespace:
        raise ModelSourceError(f"torchtitan's {family} registry is not the one this fsdp-autotune reads (0.2.2)")
    return namespace[cls_name], eval(compile(ast.Expression(flavors), str(root), "eval"), namespace)


def _find_train_spec(tree: ast.Module, family: str) -> tuple[str, str]:
    """The names ``get_train_spec`` passes as ``model_cls`` and ``model_args``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "TrainSpec":
            keywords = {k.arg: getattr(k.value, "id", None) for k in node.keywords}
            if keywords.get("model_cls") and keywords.get("model_args"):
                return keywords["model_cls"], keywords["model_args"]
    raise ModelSourceError(f"torchtitan's {family} registry has no TrainSpec(model_cls=..., model_args=...) (0.2.2)")


MINIMAL_ASYNC_EP = "torchtitan.distributed.minimal_async_ep"
_MINIMAL_ASYNC_EP_NAMES = ("combine_op", "dispatch_op", "init_buffer", "MinimalAsyncEPDispatchMetadata")


TORCH_FOR_030 = "2.12"
"""The oldest torch torchtitan 0.3.0 imports with: its ``torchtitan.distributed`` imports
``torch.distributed.fsdp.DataParallelMeshDims``, first released in torch 2.12.0 (read from the
2.11.0 and 2.12.0 wheels)."""


def check_torch_for_030() -> None:
    """Refuse, in one line naming the torch it needs, torchtitan 0.3.0 on a torch it cannot import
    with (the GPU machines' 2.11 among them), before any of it is imported."""
    import torch
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        raise ModelSourceError(
            f"torchtitan 0.3.0 needs torch >= {TORCH_FOR_030} (torch.distributed.fsdp.DataParallelMeshDims); "
            f"torch {torch.__version__} has none: use torchtitan 0.2.2 with it, or a newer torch"
        )


@functools.cache
def load_model_registry(family: str) -> types.ModuleType:
    """torchtitan 0.3.0's ``torchtitan.models.<family>``: its ``model_registry(flavor)`` and
    ``<family>_configs`` ([Note: torchtitan models]), imported without Triton."""
    _root()
    check_torch_for_030()
    # 0.3.0's own __init__ imports nothing of it: a process that imported torchtitan whole has it already
    if MINIMAL_ASYNC_EP not in sys.modules and importlib.util.find_spec("triton") is None:
        _stand_in(MINIMAL_ASYNC_EP, **dict.fromkeys(_MINIMAL_ASYNC_EP_NAMES, _no_triton))
    try:
        registry = importlib.import_module(f"torchtitan.models.{family}")
    except ImportError as e:
        raise ModelSourceError(f"torchtitan's {family} registry cannot be imported ({e}): {INSTALL}") from None
    if not callable(getattr(registry, "model_registry", None)) or not isinstance(
        getattr(registry, f"{family}_configs", None), dict
    ):
        raise ModelSourceError(f"torchtitan's {family} registry is not the one this fsdp-autotune reads (0.3.0)")
    return registry


def get_forward_kwargs(model: nn.Module, inputs: torch.Tensor) -> dict[str, Any]:
    """What torchtitan 0.3.0's trainer passes to a flex or varlen model beside the tokens: ``positions``
    (one document per row) and ``attention_masks`` built from them ([Note: torchtitan models])."""
    import torch

    positions = torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape[0], -1)
    return {"positions": positions, "attention_masks": model.get_attention_masks(positions=positions)}


class ForwardKwargsCache:
    """:func:`get_forward_kwargs` once per inputs' shape and device: one document per row makes them
    depend on nothing else ([Note: torchtitan models]). Kept with the model (the loss hook holds it),
    so a model built in turn builds its own and frees them with itself."""

    def __init__(self) -> None:
        self.built: dict[tuple[tuple[int, ...], str], dict[str, Any]] = {}

    def get(self, model: nn.Module, inputs: torch.Tensor) -> dict[str, Any]:
        key = (tuple(inputs.shape), str(inputs.device))
        if key not in self.built:
            self.built[key] = get_forward_kwargs(model, inputs)
        return self.built[key]


def torchtitan_loss(
    model: nn.Module,
    batch: torch.Tensor,
    *,
    attention_masks: bool = False,
    masks: ForwardKwargsCache | None = None,
) -> torch.Tensor:
    """torchtitan's loss on its model's output, per token; ``attention_masks``: the model takes them
    (0.3.0: :func:`get_forward_kwargs`, from ``masks`` when given) ([Note: torchtitan models])."""
    from torchtitan.components.loss import cross_entropy_loss

    inputs, labels = batch[:, :-1], batch[:, 1:]
    kwargs = {}
    if attention_masks:
        kwargs = masks.get(model, inputs) if masks is not None else get_forward_kwargs(model, inputs)
    return cross_entropy_loss(model(inputs, **kwargs), labels) / labels.numel()


@dataclass(kw_only=True, frozen=True, slots=True)
class TorchtitanModel(FactoryModel):
    """A model of torchtitan's registry (``ref``: ``torchtitan:FAMILY/FLAVOR``); as opaque as a
    factory to the scale proxy ([Note: model factory protocol]): searched at its registry size."""

    def build(self, *, device: str = "cpu", seed: int = 0) -> nn.Module:
        import torch

        if torch.device(device).type != "meta":
            self.check_device_type(torch.device(device).type)
        model = call_factory(functools.partial(_build, self.ref, self.seq_len), self.ref, device=device, seed=seed)
        # the loss hook trials call; 0.3.0's models take attention masks, built once per batch shape
        masked = get_release() >= (0, 3)
        model.compute_autotune_loss = functools.partial(
            torchtitan_loss, model, attention_masks=masked, masks=ForwardKwargsCache() if masked else None
        )
        return model

    def check_device_type(self, device_type: str) -> None:
        """One line where the installed torchtitan's models cannot train on ``device_type`` (0.3.0 on CPU)."""
        release = get_release()
        if device_type == "cpu" and release != CPU_TRAINS:
            raise ModelSourceError(
                f"{self.ref!r}: torchtitan {RELEASES[release]}'s models train only with flex or varlen attention, and "
                f"FlexAttention has no backward on CPU: train it on a GPU, or install torchtitan "
                f"{RELEASES[CPU_TRAINS]} (SDPA) to train on CPU: {INSTALL}"
            )

    @property
    def facts(self) -> ModelFacts:
        return _inspect(self.ref, self.seq_len)

    def with_overrides(self, **changes: Any) -> TorchtitanModel:
        widths = sorted(set(changes) - {"seq_len", "batch_size"})
        if widths:
            raise ModelSourceError(
                f"{self.ref!r} cannot be resized ({', '.join(widths)}): its widths are the registry's"
            )
        return replace(self, **changes)


def _build(ref: str, seq_len: int) -> nn.Module:
    family, flavor = parse_torchtitan_ref(ref)
    model = (
        _build_v3(ref, family, flavor, seq_len) if get_release() >= (0, 3) else _build_v2(ref, family, flavor, seq_len)
    )
    if next(iter(model.parameters())).device.type != "meta":
        import torch

        with torch.no_grad():
            model.init_weights()  # its trainer's initialisation, after the constructor
    return model


def _no_flavor(ref: str, family: str, flavor: str, flavors: Any) -> ModelSourceError:
    return ModelSourceError(f"{ref!r}: torchtitan's {family} registry has no flavor {flavor!r} ({', '.join(flavors)})")


def _build_v2(ref: str, family: str, flavor: str, seq_len: int) -> nn.Module:
    cls, flavors = load_registry(family)
    if flavor not in flavors:
        raise _no_flavor(ref, family, flavor, flavors)
    args = replace(flavors[flavor], max_seq_len=seq_len)  # what its trainer's update_from_config sets
    if getattr(args, "moe_enabled", False) or getattr(args, "attn_type", "sdpa") != "sdpa":
        raise ModelSourceError(f"{ref!r}: only the dense SDPA decoders of the registry train here")
    return cls(args)


def _build_v3(ref: str, family: str, flavor: str, seq_len: int) -> nn.Module:
    registry = load_model_registry(family)
    if flavor not in getattr(registry, f"{family}_configs"):
        raise _no_flavor(ref, family, flavor, getattr(registry, f"{family}_configs"))
    config = registry.model_registry(flavor).model  # its default attention: flex
    if any(getattr(layer, "moe", None) is not None for layer in config.layers):
        raise ModelSourceError(f"{ref!r}: only the dense decoders of the registry are built here")
    if seq_len > config.max_seq_len:
        raise ModelSourceError(f"{ref!r}: seq_len {seq_len} is over the flavor's {config.max_seq_len}")
    for layer in config.layers:  # what its trainer's update_from_config sets
        layer.attention.rope = replace(layer.attention.rope, max_seq_len=seq_len)
    return config.build()


@functools.lru_cache(maxsize=16)
def _inspect(ref: str, seq_len: int) -> ModelFacts:
    return inspect_model(call_factory(functools.partial(_build, ref, seq_len), ref, device="meta", seed=0), ref)
