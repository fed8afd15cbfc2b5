"""``autotune compare``: configs run alone, as a training job runs them, to check a search's claim.

A search measures every config paired with a reference on the same ranks; a user runs the
emitted config alone, in their own job. This stage runs each config of a list alone, on fresh
ranks with its own model build, in rounds whose order rotates and reverses ([Note: compare
rounds] in :mod:`~autotune.compare.stats`), and gives each config's median step, its peak memory
and its speedup over the first config with an interval over the rounds ([Note: compare
interval]). Modules in data-flow order: :mod:`~autotune.compare.settings` (settings, errors,
progress) -> :mod:`~autotune.compare.configs` (CONFIG arguments read or built and checked) ->
:mod:`~autotune.compare.stats` (the order of runs, the intervals) -> :mod:`~autotune.compare.run`
-> :mod:`~autotune.compare.record` (``compare.json``) -> :mod:`~autotune.compare.tables`. Uses
trials, the search's space (its defaults) and the report's tables, upstream; nothing upstream
imports it.
"""

from autotune.compare.configs import ComparedConfig, build_word_config, load_compare_configs
from autotune.compare.record import CompareRecord, ConfigFigures
from autotune.compare.run import run_compare
from autotune.compare.settings import (
    WORDS,
    CompareError,
    CompareReporter,
    CompareRunError,
    CompareSettings,
    SilentCompareReporter,
)
from autotune.compare.stats import INTERVAL_METHOD, SpeedupInterval, get_round_order, get_speedup_interval
from autotune.compare.tables import get_compare_lines, get_compare_table

__all__ = [
    "INTERVAL_METHOD",
    "WORDS",
    "CompareError",
    "CompareRecord",
    "CompareReporter",
    "CompareRunError",
    "CompareSettings",
    "ComparedConfig",
    "ConfigFigures",
    "SilentCompareReporter",
    "SpeedupInterval",
    "build_word_config",
    "get_compare_lines",
    "get_compare_table",
    "get_round_order",
    "get_speedup_interval",
    "load_compare_configs",
    "run_compare",
]
