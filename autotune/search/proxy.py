"""Decide whether trials can run the real model here, or a scale proxy of it.

[Note: scale proxy]
``autotune search --model llama8b`` on a CPU machine with tens of GiB cannot run llama8b
(8.03B params need ~128 GB for fp32 params, grads and AdamW state alone). The search
then runs a proxy with the *same depth and unit structure* -- the same number of blocks,
so every per-unit knob maps one-to-one onto llama8b's units -- and every width (model
dim, FFN dim, vocabulary, heads) shrunk by one common factor, which keeps the ratio of
the root unit (embeddings + head) to a block and the GQA ratio. The sequence is
shortened only if the width alone does not fit the per-step time budget. The emitted
config says so in its provenance; its measured times are the proxy's, never the
model's. Relative effects (which knobs overlap better) transfer only approximately: the
compute/communication ratio of a block changes with width, which is why link emulation
(``--cluster``) exists.

The same holds for a Hugging Face config (``--model path/config.json``): its width fields
(``hidden_size``, ``intermediate_size``, heads, ``vocab_size``) shrink by one factor, its
``num_hidden_layers`` and so its unit names (``model.layers.N``) stay. A model factory
(``package.module:function``) is opaque: it is measured as it is where it fits (parameter
count from a meta-device build; activations, unknown, are not counted), and refused with
one line where it does not (:class:`~profiles.factory.ModelSourceError`).

This module's estimates are a CPU box's (fp32 activations, a materialised attention matrix, a
step budget). On a GPU a proxy is the last resort and the simulator decides it ([Note: the
search plan] in :mod:`autotune.search.search_plan`): only a model whose leanest config cannot fit
the GPU is shrunk, by the same :func:`shrink_widths`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profiles import ModelProfile
from profiles.factory import FactoryModel, ModelSourceError
from profiles.hf import HFModel
from profiles.sources import ModelSource

BYTES_PER_PARAM_TRAINING = 16  # fp32 param + grad + AdamW exp_avg + exp_avg_sq
MIN_DIM = 64


@dataclass(kw_only=True, frozen=True)
class ModelPlan:
    """What trials will run: the profile itself or a proxy, and why."""

    requested: ModelSource
    run: ModelSource
    is_proxy: bool
    reason: str
    estimated_memory_per_rank: int
    estimated_step_s: float
    overrides: dict[str, int] = field(default_factory=dict)
    """Profile overrides that turn ``requested`` into ``run`` (passed to trials)."""
    shape_overrides: dict[str, int] = field(default_factory=dict)
    """``--seq-len`` / ``--batch-size``: already in ``requested``, passed to trials with the model's name."""

    @property
    def proxy_name(self) -> str | None:
        if not self.is_proxy:
            return None
        return f"{self.requested.name}@" + ",".join(f"{k}={v}" for k, v in self.overrides.items())

    @property
    def trial_model(self) -> str | dict:
        """The ``model`` argument for trials (a name, or a name plus overrides)."""
        name = self.requested.source or self.requested.name
        overrides = {**self.shape_overrides, **(self.overrides if self.is_proxy else {})}
        return {"name": name, **overrides} if overrides else name


def get_widths(profile: ModelSource) -> dict[str, Any] | None:
    """The widths a proxy shrinks (``dim``, ``ffn_hidden_dim``, heads, vocabulary), or None (a factory)."""
    if isinstance(profile, ModelProfile):
        s = profile.shape
        return {
            "dim": s.dim,
            "ffn_hidden_dim": s.ffn_hidden_dim,
            "num_heads": s.num_heads,
            "num_kv_heads": s.num_kv_heads,
            "vocab_size": s.vocab_size,
            "tie_embeddings": s.tie_embeddings,
            "num_layers": s.num_layers,
        }
    if isinstance(profile, HFModel):
        return profile.get_widths()
    return None


def estimate_memory_per_rank(profile: ModelSource, world_size: int) -> int:
    """Bytes per rank: sharded training state, unsharded grads under no-sync accumulation,
    two unsharded blocks in flight, and fp32 activations kept for backward (not for a factory)."""
    params = profile.get_num_params()
    w = get_widths(profile)
    if w is None:
        block = params // max(1, len(profile.block_names))
        return BYTES_PER_PARAM_TRAINING * params // world_size + 4 * params // world_size + 2 * 4 * block
    block = (params - w["vocab_size"] * w["dim"] * (1 if w["tie_embeddings"] else 2)) // max(1, w["num_layers"])
    tokens = profile.batch_size * profile.seq_len
    per_layer_act = (
        tokens * (14 * w["dim"] + 4 * w["ffn_hidden_dim"]) * 4
        + profile.batch_size * w["num_heads"] * profile.seq_len**2 * 4
    )
    logits = tokens * w["vocab_size"] * 4 * 3
    return (
        BYTES_PER_PARAM_TRAINING * params // world_size
        + 4 * params // world_size
        + 2 * 4 * block
        + w["num_layers"] * per_layer_act
        + logits
    )


def estimate_step_seconds(profile: ModelSource, flops_per_second: float) -> float:
    """Forward + backward time of one microbatch per rank from 6 * params * tokens + attention."""
    tokens = profile.batch_size * profile.seq_len
    w = get_widths(profile)
    if w is None:
        return 6 * profile.get_num_params() * tokens / flops_per_second
    # The embedding lookup costs no matmul FLOPs; the output head does.
    dense = 6 * (profile.get_num_params() - w["vocab_size"] * w["dim"] * (0 if w["tie_embeddings"] else 1)) * tokens
    attention = 12 * w["num_layers"] * profile.batch_size * profile.seq_len**2 * w["dim"]
    return (dense + attention) / flops_per_second


# Nominal sustained fp32 matmul throughput of one x86/ARM server core. A fixed figure, not a
# probe: the same command on the same machine must always pick the same proxy (a resumed
# study reuses its stored plan anyway), and a probe on a busy box varied 2x.
CPU_FLOPS_PER_CORE = 25e9


def shrink_widths(profile: ModelSource, factor: int, seq_len: int) -> tuple[ModelSource, dict[str, int]]:
    w = get_widths(profile)
    assert w is not None
    dim = max(MIN_DIM, w["dim"] // factor)
    gqa = w["num_heads"] // w["num_kv_heads"]
    heads = max(gqa, min(w["num_heads"], dim // 32))
    heads -= heads % gqa
    while dim % heads:
        heads -= gqa
    widths = {
        "dim": dim,
        "ffn_hidden_dim": max(8, round(w["ffn_hidden_dim"] * dim / w["dim"] / 8) * 8),
        "vocab_size": max(256, w["vocab_size"] * dim // w["dim"]),
        "num_heads": heads,
        "num_kv_heads": heads // gqa,
    }
    if isinstance(profile, HFModel):
        widths = profile.get_width_overrides(**widths)
    overrides = {
        **widths,
        "seq_len": seq_len,
        "batch_size": 1 if factor > 1 or seq_len < profile.seq_len else profile.batch_size,
    }
    return profile.with_overrides(**overrides), overrides


def refuse_opaque(profile: FactoryModel, why: list[str]) -> ModelSourceError:
    return ModelSourceError(
        f"the model of factory {profile.ref!r} ({profile.get_num_params() / 1e6:.1f}M params) does not fit this machine ({'; '.join(why)}), "
        "and a factory's widths cannot be shrunk into a scale proxy: search a narrower model of the same depth from another factory, "
        "use more ranks (--nproc), or pass the model's Hugging Face config.json, which can be scaled"
    )


def plan_model(
    profile: ModelSource,
    *,
    world_size: int,
    memory_per_rank: int,
    flops_per_rank: float,
    step_budget_s: float,
    memory_bound: bool = False,
    force_proxy: bool | None = None,
) -> ModelPlan:
    """The real model if it fits memory and the per-step time budget, else the largest proxy that does;
    ``force_proxy`` (``--proxy`` / ``--no-proxy``): a proxy, or the model as it is, whatever the estimates.

    ``memory_bound`` (the search has a memory budget): a proxy's peak memory is not the model's, so
    a model that fits memory runs as it is however slow; one that does not still gets a proxy, which
    the caller must refuse (:func:`autotune.search.study.check_budget`)."""
    mem = estimate_memory_per_rank(profile, world_size)
    step = estimate_step_seconds(profile, flops_per_rank)
    if force_proxy is False:
        estimate = (
            f"estimated ~{mem / 2**30:.1f} GiB per rank of {memory_per_rank / 2**30:.1f}, ~{step:.2f} s a microbatch"
        )
        return as_itself(profile, f"--no-proxy ({estimate})", mem, step)
    if force_proxy is None and mem <= memory_per_rank and step <= step_budget_s:
        return as_itself(profile, "fits", mem, step)
    if force_proxy is None and mem <= memory_per_rank and memory_bound:
        reason = f"~{step:.1f} s per microbatch step, over the {step_budget_s:.1f} s budget, run as it is: a memory budget needs the model's own peaks"
        return as_itself(profile, reason, mem, step)
    why = ["--proxy"] if force_proxy else []
    if mem > memory_per_rank and not force_proxy:
        why.append(f"needs ~{mem / 2**30:.1f} GiB per rank, {memory_per_rank / 2**30:.1f} GiB available")
    if step > step_budget_s and not force_proxy:
        why.append(f"~{step:.1f} s per microbatch step, budget {step_budget_s:.1f} s")
    if isinstance(profile, FactoryModel):
        if mem > memory_per_rank or force_proxy:
            raise refuse_opaque(profile, why)
        # Slower than the budget but in memory: a factory cannot be shrunk, so its trials are just slow.
        return as_itself(profile, "; ".join(why) + " (a factory runs as it is)", mem, step)
    return _find_proxy(
        profile,
        world_size=world_size,
        memory_per_rank=memory_per_rank,
        flops_per_rank=flops_per_rank,
        step_budget_s=step_budget_s,
        reason="; ".join(why),
    )


def as_itself(profile: ModelSource, reason: str, memory: float, step_s: float) -> ModelPlan:
    """The plan that runs ``profile`` itself, and why."""
    return ModelPlan(
        requested=profile,
        run=profile,
        is_proxy=False,
        reason=reason,
        estimated_memory_per_rank=int(memory),
        estimated_step_s=step_s,
    )


def _find_proxy(
    profile: ModelSource,
    *,
    world_size: int,
    memory_per_rank: int,
    flops_per_rank: float,
    step_budget_s: float,
    reason: str,
) -> ModelPlan:
    """The largest scale proxy of ``profile`` (widths halved, then shorter sequences) that fits both budgets, or the smallest."""
    seq_choices = [s for s in (profile.seq_len, 512, 256, 128, 64) if s <= profile.seq_len]
    factor = 2
    while True:
        for seq in seq_choices:
            candidate, overrides = shrink_widths(profile, factor, seq)
            cmem = estimate_memory_per_rank(candidate, world_size)
            cstep = estimate_step_seconds(candidate, flops_per_rank)
            smallest = get_widths(candidate)["dim"] == MIN_DIM and seq == seq_choices[-1]
            if (cmem <= memory_per_rank and cstep <= step_budget_s) or smallest:
                return ModelPlan(
                    requested=profile,
                    run=candidate,
                    is_proxy=True,
                    reason=reason,
                    estimated_memory_per_rank=cmem,
                    estimated_step_s=cstep,
                    overrides=overrides,
                )
        factor *= 2


def get_model_argument(source: ModelSource) -> str:
    """How ``--model`` names ``source`` on a command line: a built-in profile by its name, anything else by its path."""
    import profiles

    path = source.source or source.name
    return source.name if Path(path).parent == Path(profiles.__file__).parent / "models" else path


def get_plan_hint(plan: Any, *, num_nodes: int = 1, cluster: str = "h100-node") -> str | None:
    """For a search on a scale proxy: the ``autotune plan`` command that answers for the real model on a GPU cluster."""
    if not getattr(plan, "is_proxy", False):
        return None
    return (
        f"hint: these trials measure a proxy; for {plan.requested.name} itself on a GPU cluster, simulate it: "
        f"autotune plan --model {get_model_argument(plan.requested)} --cluster {cluster} --nodes {num_nodes}"
    )


def get_available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_for_this_machine(
    profile: ModelSource,
    *,
    world_size: int,
    step_budget_s: float,
    memory_bound: bool = False,
    force_proxy: bool | None = None,
) -> ModelPlan:
    """Plan against this CPU box (a share of host memory, fp32, a step budget). A GPU is priced by the
    simulator instead ([Note: the search plan] in :mod:`autotune.search.search_plan`)."""
    memory = int(get_available_memory_bytes() * 0.6) // world_size
    flops = CPU_FLOPS_PER_CORE * max(1, (os.cpu_count() or 1) // world_size)
    return plan_model(
        profile,
        world_size=world_size,
        memory_per_rank=memory,
        flops_per_rank=flops,
        step_budget_s=step_budget_s,
        memory_bound=memory_bound,
        force_proxy=force_proxy,
    )
