"""fsdp_runtime: apply a tuned FSDP2 runtime config to a model. Depends on torch only.

from fsdp_runtime import load_config, apply_fsdp, GradAccumulator
applied = apply_fsdp(model, load_config("best.toml"))

The in-job tuner (:class:`InJobTuner`) is here too, and in :mod:`fsdp_runtime.tuning`.
"""

from fsdp_runtime._toml import dumps as dumps_toml
from fsdp_runtime.accumulation import AccumulationError, GradAccumulator
from fsdp_runtime.adopt import adopt_fsdp
from fsdp_runtime.apply import AppliedFsdp, WorldSizeWarning, apply_fsdp, build_mesh, find_block_names, resolve_units
from fsdp_runtime.blocks import find_edge_modules
from fsdp_runtime.checkpointing import SAVED_OP_NAMES
from fsdp_runtime.config import (
    CHECKPOINTING_KINDS,
    CONSOLIDATION_METHODS,
    PIPELINE_SCHEDULES,
    ROOT_UNIT,
    SCHEMA_VERSION,
    CheckpointConfig,
    MeshConfig,
    MixedPrecisionConfig,
    PipelineConfig,
    Provenance,
    RuntimeConfig,
    UnitConfig,
    default_config,
)
from fsdp_runtime.consolidate import (
    CheckpointError,
    consolidate_state,
    load_consolidated_checkpoint,
    save_consolidated_checkpoint,
)
from fsdp_runtime.errors import AutotuneError, ConfigError
from fsdp_runtime.files import atomic_path, write_atomic, write_json_atomic
from fsdp_runtime.knob_checks import check_device_supports, check_torch_supports
from fsdp_runtime.knobs import (
    KNOBS,
    Knob,
    SearchChoice,
    get_added_knobs,
    get_knob,
    get_method_knobs,
    get_sim_values,
    get_unsupported_knobs,
)
from fsdp_runtime.pipeline import AppliedPipeline, StageSplit, apply_pipeline, split_stages
from fsdp_runtime.recipes import RECIPES, get_torchtitan_config, get_torchtitan_units
from fsdp_runtime.serialize import (
    config_from_dict,
    config_to_dict,
    dumps_config,
    load_config,
    loads_config,
    save_config,
)
from fsdp_runtime.switch import CONFIG_KNOBS_IN_PLACE, UNIT_KNOBS_IN_PLACE, get_structural_differences, switch_config
from fsdp_runtime.tuning import InJobTuner, PeerStepError, TunerError
from fsdp_runtime.validation import validate_config, validate_for_world

__all__ = [
    "RECIPES",
    "get_torchtitan_config",
    "get_torchtitan_units",
    "CONFIG_KNOBS_IN_PLACE",
    "UNIT_KNOBS_IN_PLACE",
    "get_structural_differences",
    "switch_config",
    "CHECKPOINTING_KINDS",
    "CONSOLIDATION_METHODS",
    "ROOT_UNIT",
    "SAVED_OP_NAMES",
    "SCHEMA_VERSION",
    "StageSplit",
    "AppliedFsdp",
    "AppliedPipeline",
    "AccumulationError",
    "AutotuneError",
    "CheckpointConfig",
    "CheckpointError",
    "ConfigError",
    "GradAccumulator",
    "InJobTuner",
    "TunerError",
    "PeerStepError",
    "WorldSizeWarning",
    "MeshConfig",
    "MixedPrecisionConfig",
    "PIPELINE_SCHEDULES",
    "PipelineConfig",
    "Provenance",
    "RuntimeConfig",
    "UnitConfig",
    "adopt_fsdp",
    "apply_fsdp",
    "build_mesh",
    "apply_pipeline",
    "atomic_path",
    "config_from_dict",
    "config_to_dict",
    "consolidate_state",
    "default_config",
    "dumps_config",
    "dumps_toml",
    "find_block_names",
    "find_edge_modules",
    "get_unsupported_knobs",
    "check_device_supports",
    "check_torch_supports",
    "KNOBS",
    "Knob",
    "SearchChoice",
    "get_added_knobs",
    "get_knob",
    "get_method_knobs",
    "get_sim_values",
    "load_config",
    "load_consolidated_checkpoint",
    "loads_config",
    "resolve_units",
    "save_config",
    "save_consolidated_checkpoint",
    "split_stages",
    "validate_config",
    "validate_for_world",
    "write_atomic",
    "write_json_atomic",
]
