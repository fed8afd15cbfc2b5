"""The configs a comparison runs: CONFIG arguments read or built, and checked before anything is written.

A file is read as ``autotune trial --config`` reads one (``fsdp_runtime.load_config``; its own
``[mixed_precision]`` kept unless ``--param-dtype``/``--reduce-dtype`` is given). The words are
built for the model as a search builds its baselines: ``defaults`` is the search's defaults trial
(:meth:`autotune.search.SearchSpace.get_default_params`: FSDP2's defaults, one unit per block and
the root, ``unshard_async`` off on CPU; on a GPU where they do not fit, with the least checkpointing
on every block that does, as the search's baseline: :func:`autotune.search.search_plan.get_baseline`), ``torchtitan`` torchtitan's recipe on those defaults
(``fsdp_runtime.get_torchtitan_config``, as the search's recipe round builds it). Both carry the
files' microbatches and the first file's precision, so they differ from the files only in knobs.

Every config is checked before the first run: its units against the model (a meta-device
build), its mesh against the world size, its pipeline stages, the cluster, and (on CUDA) the
GPUs; a failure is one line naming the config, and nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autotune.compare.settings import WORDS, CompareError, CompareReporter, CompareSettings
from autotune.search import SearchSpace
from autotune.trials import (
    apply_precision_options,
    check_trial_machine,
    check_trial_spec,
    get_default_backend,
    get_device_type,
    resolve_precision,
    resolve_profile,
)
from fsdp_runtime import (
    MixedPrecisionConfig,
    RuntimeConfig,
    get_torchtitan_config,
    get_unsupported_knobs,
    load_config,
    validate_for_world,
)
from fsdp_runtime.errors import AutotuneError
from profiles import load_cluster_profile, resolve_config_for_model


@dataclass(frozen=True)
class ComparedConfig:
    """One config under comparison: what the user typed, and the runtime config its runs run."""

    label: str
    """The CONFIG argument as typed (a path, or one of :data:`~autotune.compare.settings.WORDS`)."""
    source: str
    """``file``, ``defaults`` or ``torchtitan``."""
    config: RuntimeConfig


def load_compare_configs(settings: CompareSettings, reporter: CompareReporter) -> list[ComparedConfig]:
    """Every CONFIG argument as a runtime config, in order, each checked ([module docstring])."""
    device_type = get_device_type(settings.backend or get_default_backend())
    resolve_profile(settings.model)  # an unknown model is named before any config
    if settings.cluster is not None:
        try:
            load_cluster_profile(settings.cluster)
        except AutotuneError as e:
            raise CompareError(str(e), field=e.field or "cluster") from None
    files = {arg: _load_file(arg, settings, device_type) for arg in settings.configs if arg not in WORDS}
    num_microbatches = _get_microbatches(settings, files)
    if files:
        precision = next(iter(files.values())).mixed_precision
    else:
        precision = resolve_precision(device_type, param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype)
    configs = []
    for arg in settings.configs:
        if arg in files:
            configs.append(ComparedConfig(label=arg, source="file", config=files[arg]))
        else:
            word = build_word_config(arg, settings, num_microbatches=num_microbatches, mixed_precision=precision)
            configs.append(ComparedConfig(label=arg, source=arg, config=word))
    for item in configs:
        for note in check_compared_config(item, settings):
            reporter.on_note(note)
    return configs


def build_word_config(
    word: str, settings: CompareSettings, *, num_microbatches: int, mixed_precision: MixedPrecisionConfig
) -> RuntimeConfig:
    """``defaults`` or ``torchtitan`` for the settings' model and world ([module docstring]): the
    search's baseline on this machine, with its checkpointing where FSDP2's defaults do not fit the GPU."""
    model = resolve_profile(settings.model)
    device_type = get_device_type(settings.backend or get_default_backend())
    baseline = get_compare_baseline(settings, model, device_type, mixed_precision, num_microbatches)
    space = SearchSpace(
        block_names=tuple(model.block_names),
        world_size=settings.world_size,
        num_microbatches=num_microbatches,
        device_type=device_type,
        mixed_precision=mixed_precision,
        unsupported_knobs=tuple(get_unsupported_knobs().items()),
        checkpointing=baseline != "none",
        baseline_checkpointing=baseline,
    )
    defaults = space.build_config(space.get_default_params())
    if word == "defaults":
        return defaults
    if word == "torchtitan":
        return get_torchtitan_config(model.build(device="meta"), defaults)
    raise CompareError(f"{word}: not a config word (use {' or '.join(WORDS)}, or a file)", field="configs")


def get_compare_baseline(
    settings: CompareSettings,
    model: object,
    device_type: str,
    mixed_precision: MixedPrecisionConfig,
    num_microbatches: int,
) -> str:
    """The checkpointing a search on this machine would give its baseline ([Note: the search plan] in
    :mod:`autotune.search.search_plan`): none on CPU; on CUDA the least that fits this GPU."""
    if device_type != "cuda":
        return "none"
    from autotune.search import get_baseline, get_this_gpu_target

    target = get_this_gpu_target(settings.world_size, cluster=None)
    return get_baseline(model, target, mixed_precision, num_microbatches=num_microbatches).checkpointing


def check_compared_config(item: ComparedConfig, settings: CompareSettings) -> list[str]:
    """Refuse, in one line naming the config, what the model, the world or the machine cannot run;
    return notes (a file's units mapped by position, a file tuned for another model or world)."""
    notes = []
    if item.source == "file":
        _, notes = resolve_config_for_model(item.config, settings.model, source=item.label)
        notes = [f"{item.label}: {note}" for note in notes] + _get_provenance_notes(item, settings)
    validate_for_world(item.config, settings.world_size, source=item.label)
    spec = settings.trial_spec(item.config, settings.out_dir / "check")
    try:
        check_trial_spec(spec)
        check_trial_machine(spec)
    except AutotuneError as e:
        if str(e).startswith(f"{item.label}:"):
            raise
        raise CompareError(f"{item.label}: {e}", field=e.field) from None
    return notes


def _load_file(arg: str, settings: CompareSettings, device_type: str) -> RuntimeConfig:
    if not Path(arg).exists():
        raise CompareError(
            f"{arg}: no such config file (a CONFIG is a .toml or .json file, or one of the words {', '.join(WORDS)})",
            field="configs",
        )
    config, _ = apply_precision_options(
        load_config(Path(arg)), device_type, param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype
    )
    return config


def _get_microbatches(settings: CompareSettings, files: dict[str, RuntimeConfig]) -> int:
    """The microbatches every config runs: a step of each must do the same work to be compared."""
    counts = [(label, cfg.num_microbatches) for label, cfg in files.items()]
    if settings.num_microbatches is not None:
        counts.insert(0, ("--microbatches", settings.num_microbatches))
    for label, count in counts[1:]:
        if count != counts[0][1]:
            raise CompareError(
                f"{label} runs {count} microbatches a step and {counts[0][0]} {counts[0][1]}: their steps do "
                f"different work; compare configs of one microbatch count",
                field="num_microbatches",
            )
    return counts[0][1] if counts else 1


def _get_provenance_notes(item: ComparedConfig, settings: CompareSettings) -> list[str]:
    provenance = item.config.provenance
    notes = []
    if provenance.model is not None and provenance.model != settings.model:
        notes.append(f"{item.label}: tuned for {provenance.model} (its provenance), run here on {settings.model}")
    if provenance.world_size is not None and provenance.world_size != settings.world_size:
        notes.append(
            f"{item.label}: tuned on {provenance.world_size} ranks (its provenance), run here on {settings.world_size}"
        )
    return notes
