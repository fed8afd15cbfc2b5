"""Model and cluster profiles: the dataclasses and their TOML loaders (see :mod:`profiles`)."""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_runtime import ROOT_UNIT, find_block_names
from fsdp_runtime.errors import ConfigError
from profiles.llama import Llama, LlamaShape

_HERE = Path(__file__).parent
COLLECTIVE_MODELS = ("flat", "ring")


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelProfile:
    """A model architecture plus the per-rank training shape used by trials."""

    name: str
    description: str
    shape: LlamaShape
    seq_len: int
    """Tokens per sequence in a trial."""
    batch_size: int
    """Sequences per rank per microbatch in a trial."""
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def block_names(self) -> list[str]:
        """FQNs of the transformer blocks, discovered on the model itself (built on the meta
        device) by :func:`fsdp_runtime.find_block_names`: the one rule for unit names."""
        return list(_discover_block_names(self.shape))

    @property
    def unit_names(self) -> list[str]:
        """The default FSDP units: one per block, then the root."""
        return [*self.block_names, ROOT_UNIT]

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    def get_num_params(self) -> int:
        return self.shape.get_num_params()

    def build(self, *, device: str = "cpu", seed: int = 0) -> Llama:
        """The model on ``device`` (``meta``: nothing allocated); the same for every model source
        (:mod:`profiles.sources`)."""
        return build_model(self, device=device, seed=seed)

    def with_overrides(self, **changes: Any) -> ModelProfile:
        shape_changes = {
            k: changes.pop(k) for k in list(changes) if k in {f.name for f in dataclasses.fields(LlamaShape)}
        }
        shape = dataclasses.replace(self.shape, **shape_changes) if shape_changes else self.shape
        return dataclasses.replace(self, shape=shape, **changes)


@dataclass(kw_only=True, frozen=True, slots=True)
class LinkClass:
    """A link's cost model: time = latency + bytes / bandwidth (0 bandwidth: not emulated)."""

    latency_us: float = 0.0
    bandwidth_gbps: float = 0.0
    efficiency: float = 1.0
    """Fraction of ``bandwidth_gbps`` a large NCCL collective reaches as bus bandwidth
    (nccl-tests' busbw); used by the simulator's ring model, not by link emulation."""

    def __post_init__(self) -> None:
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency!r}")

    @property
    def emulated(self) -> bool:
        return self.bandwidth_gbps > 0 or self.latency_us > 0

    def get_seconds(self, num_bytes: int) -> float:
        transfer = num_bytes / (self.bandwidth_gbps * 1e9) if self.bandwidth_gbps > 0 else 0.0
        return self.latency_us * 1e-6 + transfer


@dataclass(kw_only=True, frozen=True, slots=True)
class AcceleratorSpec:
    """One accelerator as the step simulator sees it (datasheets and microbenchmarks, not
    end-to-end training throughput)."""

    name: str
    peak_tflops: dict[str, float]
    """Dense peak per dtype name (``bfloat16``, ``float32``, ...)."""
    gemm_efficiency: float
    """Best measured large-matmul throughput / peak (MAMF)."""
    attention_efficiency: float
    """Fused attention forward throughput / peak at head dim ``attention_head_dim``, counting the
    causal half of the FLOPs."""
    hbm_gbps: float
    """HBM bandwidth, GB/s."""
    hbm_efficiency: float = 0.9
    """Fraction of ``hbm_gbps`` that elementwise kernels reach."""
    reserved_gib: float = 0.0
    """Device memory that tensors cannot use (CUDA context, NCCL buffers, workspaces)."""
    attention_backward_efficiency: float | None = None
    """Fused attention backward throughput / peak at ``attention_head_dim`` (its FLOPs 2.5x the
    forward's, causal half); None: the forward's."""
    attention_head_dim: int = 128
    """The head dim the attention efficiencies were measured at."""
    special_function_tflops: float | None = None
    """Exponentials per second (the SFUs), in T/s: attention spends one per score element besides
    its 4 x head_dim (forward) or 10 x head_dim (backward) matmul FLOPs, so a smaller head dim
    runs at a lower efficiency ([Note: attention and head dim] in ``autotune.sim.hardware``);
    None: the efficiencies hold at every head dim."""
    host_floor_us: dict[str, float] = field(default_factory=dict)
    """Device idle per call the host leaves while it launches eager kernels: ``block_forward``,
    ``block_backward`` (per block and microbatch), ``microbatch``, ``step``; missing keys: 0."""

    def __post_init__(self) -> None:
        for name in ("gemm_efficiency", "attention_efficiency", "hbm_efficiency", "attention_backward_efficiency"):
            if getattr(self, name) is not None and not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.hbm_gbps <= 0 or not self.peak_tflops or min(self.peak_tflops.values()) <= 0:
            raise ValueError("hbm_gbps and every peak_tflops value must be positive")


@dataclass(kw_only=True, frozen=True, slots=True)
class ClusterProfile:
    name: str
    description: str
    backend: str
    device: str
    ranks_per_node: int
    memory_per_rank_gib: float
    links: dict[str, LinkClass] = field(default_factory=dict)
    source: str = ""
    collective_model: str = "flat"
    """How the simulator prices a collective: ``flat`` = latency + full buffer / bandwidth
    (what link emulation holds a collective to), ``ring`` = latency + buffer x (n-1)/n /
    bus bandwidth (NCCL's ring algorithm)."""
    accelerator: AcceleratorSpec | None = None
    """The device's compute and memory figures; needed by ``autotune plan``."""

    def __post_init__(self) -> None:
        if self.collective_model not in COLLECTIVE_MODELS:
            raise ValueError(
                f"collective_model must be one of {', '.join(COLLECTIVE_MODELS)}, got {self.collective_model!r}"
            )
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive integer, got {self.ranks_per_node!r}")


def read_profile_toml(path: Path, kind: str) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError("", f"cannot read {kind} profile: {e.strerror}", source=str(path)) from None
    except UnicodeDecodeError as e:
        raise ConfigError("", f"not UTF-8 text (byte {e.start}: {e.reason})", source=str(path)) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("", f"not valid TOML: {e}", source=str(path)) from None


def _resolve(name_or_path: str, folder: str, kind: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml" and candidate.exists():
        return candidate
    builtin = _HERE / folder / f"{name_or_path}.toml"
    if builtin.exists():
        return builtin
    known = ", ".join(sorted(p.stem for p in (_HERE / folder).glob("*.toml")))
    raise ConfigError(
        "", f"unknown {kind} profile {name_or_path!r}", fix=f"use one of: {known}, or a path to a .toml file"
    )


def _build(cls: type, data: dict[str, Any], path: str, source: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(
                f"{path}{key}", "unknown field", fix=f"known fields: {', '.join(sorted(names))}", source=source
            )
    try:
        return cls(**data)
    except (TypeError, ValueError) as e:
        raise ConfigError(path.rstrip(".") or "<top>", str(e), source=source) from None


def load_model_profile(name_or_path: str) -> ModelProfile:
    """A built-in profile by name (``tiny``, ``small``, ``llama1b``, ``llama8b``, ``llama70b``) or a TOML path."""
    path = _resolve(name_or_path, "models", "model")
    data = read_profile_toml(path, "model")
    shape = _build(LlamaShape, data.pop("shape", {}), "shape.", str(path))
    data.setdefault("description", "")
    return _build(ModelProfile, {**data, "shape": shape, "source": str(path)}, "", str(path))


def load_cluster_profile(name_or_path: str) -> ClusterProfile:
    path = _resolve(name_or_path, "clusters", "cluster")
    data = read_profile_toml(path, "cluster")
    links = {k: _build(LinkClass, v, f"links.{k}.", str(path)) for k, v in data.pop("links", {}).items()}
    if "accelerator" in data:
        data["accelerator"] = _build(AcceleratorSpec, data["accelerator"], "accelerator.", str(path))
    data.setdefault("description", "")
    return _build(ClusterProfile, {**data, "links": links, "source": str(path)}, "", str(path))


def list_model_profiles() -> list[str]:
    return sorted(p.stem for p in (_HERE / "models").glob("*.toml"))


def list_cluster_profiles() -> list[str]:
    return sorted(p.stem for p in (_HERE / "clusters").glob("*.toml"))


@functools.lru_cache(maxsize=32)
def _discover_block_names(shape: LlamaShape) -> tuple[str, ...]:
    import torch

    with torch.device("meta"):
        return tuple(find_block_names(Llama(shape)))


def build_model(profile: ModelProfile, *, device: str = "cpu", seed: int = 0) -> Llama:
    """Build the profile's model; on ``meta`` nothing is allocated (use for counting/planning)."""
    import torch

    with torch.device(device):
        model = Llama(profile.shape)
    if device != "meta":
        model.init_weights(seed)
    return model
