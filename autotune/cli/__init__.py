"""The parts of the ``autotune`` command line that ``cli.py`` assembles: :mod:`~autotune.cli.options`
(every option's flags and help, and the library setting each one sets) and
:mod:`~autotune.cli.render` (what the commands print: rich consoles, tables, progress, summaries).
``cli.py`` holds the commands themselves: parse into the library's settings, call, render, map
errors to exit codes."""

from autotune.cli import options
from autotune.cli.render import (
    PIPED_WIDTH,
    CompareProgress,
    PlanProgress,
    SearchProgress,
    console,
    err_console,
    make_console,
    print_compare,
    print_device_profile,
    print_error,
    print_plan,
    print_search_summary,
    print_tables,
    print_trial_summary,
)

__all__ = [
    "PIPED_WIDTH",
    "CompareProgress",
    "PlanProgress",
    "SearchProgress",
    "console",
    "err_console",
    "make_console",
    "options",
    "print_compare",
    "print_device_profile",
    "print_error",
    "print_plan",
    "print_search_summary",
    "print_tables",
    "print_trial_summary",
]
