"""The FSDP2 step simulator behind ``autotune plan``.

Modules in data-flow order: :mod:`~autotune.sim.model_work` (the model's FLOPs, bytes and
activation memory per microbatch, traced on fake tensors) -> :mod:`~autotune.sim.hardware`
(a cluster profile's prices: [Note: collective cost model]; :mod:`~autotune.sim.margin`, how far
below its usable memory a predicted peak is safe: [Note: memory margin]) -> :mod:`~autotune.sim.costs`
(per-unit durations and sizes under one mesh) -> :mod:`~autotune.sim.knobs` (a runtime
config indexed by unit) -> :mod:`~autotune.sim.timeline` (streams, links, host, memory
ledger) -> :mod:`~autotune.sim.schedule` ([Note: FSDP2 step schedule]) ->
:mod:`~autotune.sim.predict` (:func:`simulate`; what it predicts: :mod:`~autotune.sim.prediction`) ->
:mod:`~autotune.sim.pipeline` (pipeline stages with FSDP2 inside each: [Note: pipeline schedules];
a config's stages: :mod:`~autotune.sim.pipeline_stages`). On a machine at hand,
:mod:`~autotune.sim.calibrate` fits a :class:`MeasuredProfile` (:mod:`~autotune.sim.measured`)
from trials' traces ([Note: calibration]) that prices the same schedule in place of a GPU
profile's datasheet figures; on a GPU, :mod:`~autotune.sim.gpu_calibrate` fits a
:class:`DeviceProfile` (:mod:`~autotune.sim.device_profile`) from one trial's kernels
(:mod:`~autotune.sim.kernel_costs`), rates that price any model on that GPU. The simulator
itself imports only ``fsdp_runtime``, ``profiles`` and torch; calibration (and
``compare_trial_peak``, the memory margin's check against a GPU trial) reads trial dirs through
``autotune.trials`` and ``autotune.analysis``
(upstream stages). The search stage may import this one, never the reverse.
"""

from autotune.sim.calibrate import calibrate
from autotune.sim.calibration_trial import CalibrationTrial, read_calibration_trial
from autotune.sim.device_profile import DeviceProfile, DeviceProfileError
from autotune.sim.gpu_calibrate import (
    GpuTrial,
    calibrate_device,
    calibrate_trials,
    compare_trial_peak,
    load_kernel_costs,
    read_gpu_trial,
)
from autotune.sim.hardware import Hardware, SimError
from autotune.sim.kernel_costs import KernelCosts, get_kernel_costs
from autotune.sim.knobs import Knobs, resolve_knobs
from autotune.sim.margin import (
    ALLOCATOR_FRAGMENTATION,
    SIMULATOR_MEMORY_ERROR,
    MarginPart,
    MemoryMargin,
    PeakComparison,
)
from autotune.sim.measured import CollectiveFit, MeasuredProfile
from autotune.sim.model_work import ModelWork, get_model_work
from autotune.sim.pipeline import PipelineSimulator
from autotune.sim.pipeline_order import SCHEDULES, get_pipeline_order, time_order
from autotune.sim.pipeline_stages import PipelineSpec, get_pipeline_spec
from autotune.sim.predict import Simulator, simulate
from autotune.sim.prediction import PipelinePrediction, StagePrediction, StepPrediction, UnitPrediction
from autotune.sim.trace_costs import CalibrationError

__all__ = [
    "SCHEDULES",
    "PipelinePrediction",
    "PipelineSimulator",
    "PipelineSpec",
    "StagePrediction",
    "get_pipeline_order",
    "get_pipeline_spec",
    "time_order",
    "ALLOCATOR_FRAGMENTATION",
    "SIMULATOR_MEMORY_ERROR",
    "MarginPart",
    "MemoryMargin",
    "PeakComparison",
    "compare_trial_peak",
    "CalibrationError",
    "CalibrationTrial",
    "CollectiveFit",
    "DeviceProfile",
    "DeviceProfileError",
    "GpuTrial",
    "Hardware",
    "KernelCosts",
    "Knobs",
    "MeasuredProfile",
    "ModelWork",
    "SimError",
    "Simulator",
    "StepPrediction",
    "UnitPrediction",
    "calibrate",
    "calibrate_device",
    "calibrate_trials",
    "get_kernel_costs",
    "load_kernel_costs",
    "get_model_work",
    "read_calibration_trial",
    "read_gpu_trial",
    "resolve_knobs",
    "simulate",
]
