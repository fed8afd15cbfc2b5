"""Rank programs of tests/fsdp_runtime/test_real_job_guards.py: the README's loops run as written
on a tiny Llama (too few microbatches per step, the right count, HSDP), a model built on the meta
device, and models sharded by hand for ``adopt_fsdp`` (FSDP+TP, HSDP)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

README = Path(__file__).resolve().parents[1] / "README.md"


def get_readme_block(marker: str) -> str:
    """The README's code block under ``<!-- marker -->``."""
    match = re.search(rf"<!-- {marker} -->\s*```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert match, f"README.md has no <!-- {marker} --> code block"
    return match.group(1)


def _microbatches(rank: int, count: int, *, profile: str = "tiny") -> list[torch.Tensor]:
    from autotune.trials.training import make_microbatch, resolve_profile

    source = resolve_profile(profile)
    return [make_microbatch(source, seed=0, step=0, microbatch=m, dp_rank=rank)[:, :-1] for m in range(count)]


def _run_plain_loop(config_path: str, microbatches: list[torch.Tensor], *, count: int | None = None) -> dict[str, Any]:
    """The README's plain loop, as written (``count``: ``GradAccumulator(applied, num_microbatches=count)``),
    on a fresh tiny Llama: the error it raised, the world-size warnings it gave (message, file,
    line) and, per parameter, whether the step changed it and this rank's shard's sum after it."""
    from fsdp_runtime import apply_fsdp  # noqa: F401  (the block imports it too)
    from fsdp_runtime.accumulation import AccumulationError
    from fsdp_runtime.apply import WorldSizeWarning
    from profiles import build_model, load_model_profile

    model = build_model(load_model_profile("tiny"), seed=0)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    code = get_readme_block("plain loop example").replace('"runs/search/best.toml"', repr(config_path))
    if count is not None:
        code = code.replace("GradAccumulator(applied)", f"GradAccumulator(applied, num_microbatches={count})")
    scope: dict[str, Any] = {
        "torch": torch,
        "model": model,
        "microbatches": microbatches,
        "loss_fn": lambda logits: logits.float().logsumexp(-1).mean(),
    }
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            exec(compile(code, "README.md", "exec"), scope)
        except AccumulationError as e:
            error = str(e)
    params = dict(model.named_parameters())
    return {
        "error": error,
        "warnings": [
            (str(w.message), w.filename, w.lineno) for w in caught if issubclass(w.category, WorldSizeWarning)
        ],
        "changed": {n: not torch.equal(p.full_tensor(), initial[n]) for n, p in params.items()},
        "shard_sums": {n: float(p.to_local().double().sum()) for n, p in params.items()},
    }


def run_plain_loops(rank: int, world_size: int, *, config_path: str) -> dict[str, Any]:
    """The README's plain loop under a 2-microbatch config: one microbatch per step (the error),
    the config's count, and one microbatch with the accumulator told so."""
    return {
        "one": _run_plain_loop(config_path, _microbatches(rank, 1)),
        "two": _run_plain_loop(config_path, _microbatches(rank, 2)),
        "one_told": _run_plain_loop(config_path, _microbatches(rank, 1), count=1),
    }


def train_meta_built(rank: int, world_size: int, *, model: str, config: dict[str, Any], num_steps: int) -> dict:
    """This rank's losses of a CPU build (``build_training``) and of the same Llama built on the
    meta device, applied with ``apply_fsdp`` alone (no mesh, no device type), given memory with
    ``to_empty`` and initialised; the meta build's mesh device and its parameters' devices."""
    from autotune.trials.training import LEARNING_RATE, Training, build_training, resolve_profile
    from fsdp_runtime import GradAccumulator, apply_fsdp, config_from_dict

    full = build_training(rank, world_size, model=model, config=config, sharded=False)
    full_losses = [full.step(s) for s in range(num_steps)]
    del full
    source = resolve_profile(model)
    torch.manual_seed(0)
    module = source.build(device="meta", seed=0)
    applied = apply_fsdp(module, config_from_dict(config))
    module.to_empty(device="cpu")
    module.init_weights(0)
    training = Training(
        profile=source,
        applied=applied,
        optimizer=torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE),
        accumulator=GradAccumulator(applied),
        seed=0,
        dp_rank=rank,
    )
    return {
        "full": full_losses,
        "meta": [training.step(s) for s in range(num_steps)],
        "mesh_device": applied.mesh.device_type,
        "devices": sorted({p.device.type for p in module.parameters()}),
    }


def run_torchtitan_readme_on_meta(rank: int, world_size: int, *, model: str, config_path: str, num_steps: int = 2):
    """The README's torchtitan block as written, on a CPU-built torchtitan model and on one built
    on the meta device (then ``to_empty``, torchtitan's ``init_weights`` and the CPU build's initial
    values loaded, as a trainer loads its seed checkpoint): this rank's losses of each."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from fsdp_runtime import load_config
    from profiles.sources import load_model_source

    source = load_model_source(model)
    num_microbatches = load_config(config_path).num_microbatches
    code = get_readme_block("torchtitan example").replace('"runs/search/best.toml"', repr(config_path))
    cpu_built = source.build(seed=0)
    initial = {k: v.detach().clone() for k, v in cpu_built.state_dict().items()}
    losses = {}
    for name, module in (("cpu", cpu_built), ("meta", source.build(device="meta"))):
        scope: dict[str, Any] = {"model": module}
        exec(compile(code, "README.md", "exec"), scope)
        if name == "meta":
            module.to_empty(device="cpu")
            with torch.no_grad():
                module.init_weights(buffer_device=torch.device("cpu"))
                for key, value in module.state_dict().items():
                    if isinstance(value, DTensor):
                        shard = distribute_tensor(initial[key], value.device_mesh, value.placements, src_data_rank=None)
                        value.to_local().copy_(shard.to_local())
                    else:
                        value.copy_(initial[key])
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        losses[name] = [
            scope["train_step"](
                [(b[:, :-1], b[:, 1:]) for b in _torchtitan_batches(source, rank, s, num_microbatches)], optimizer
            )
            for s in range(num_steps)
        ]
    return losses


def _torchtitan_batches(source: Any, rank: int, step: int, count: int) -> list[torch.Tensor]:
    from autotune.trials.training import make_microbatch

    return [make_microbatch(source, seed=0, step=step, microbatch=m, dp_rank=rank) for m in range(count)]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(8, 16, bias=False)
        self.w2 = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def adopt_tp_and_hsdp(rank: int, world_size: int, *, provenance_world_size: int) -> dict[str, Any]:
    """On a 2 x 2 world: ``adopt_fsdp`` of a model with tensor parallelism on ``tp`` and FSDP on
    ``dp`` (the error), and of one sharded HSDP (the mesh read, the world-size warnings given)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fsdp_runtime import ConfigError, Provenance, adopt_fsdp, default_config
    from fsdp_runtime.apply import WorldSizeWarning

    config = default_config(["layers.0", "layers.1"], provenance=Provenance(world_size=provenance_world_size))
    torch.manual_seed(0)
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_model = _Stack()
    for block in tp_model.layers:
        parallelize_module(block, tp_mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(block, mesh=tp_mesh["dp"])
    fully_shard(tp_model, mesh=tp_mesh["dp"])
    refused, described = None, None
    try:
        described = adopt_fsdp(tp_model, config).config.mesh
    except ConfigError as e:
        refused = str(e)
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp_model = _Stack()
    for block in hsdp_model.layers:
        fully_shard(block, mesh=hsdp_mesh)
    fully_shard(hsdp_model, mesh=hsdp_mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = adopt_fsdp(hsdp_model, config).config.mesh
    return {
        "tp_refused": refused,
        "tp_described": None if described is None else (described.kind, described.replicate, described.shard),
        "hsdp": (mesh.kind, mesh.replicate, mesh.shard),
        "warnings": [
            (str(w.message), Path(w.filename).name) for w in caught if issubclass(w.category, WorldSizeWarning)
        ],
    }


def run_hsdp_guards(rank: int, world_size: int, *, config_path: str) -> dict[str, Any]:
    """The 4-rank launch: the README's plain loop under an HSDP ``replica_last`` config (one
    microbatch per step, then the config's count), and ``adopt_tp_and_hsdp``."""
    from fsdp_runtime import load_config

    measured = load_config(config_path).provenance.world_size
    return {
        "one": _run_plain_loop(config_path, _microbatches(rank, 1)),
        "two": _run_plain_loop(config_path, _microbatches(rank, 2)),
        "adopt": adopt_tp_and_hsdp(rank, world_size, provenance_world_size=measured),
    }
