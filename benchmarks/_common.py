"""Helpers several scripts share: ``run_rank0`` (one function on fresh ranks).

A benchmark imports it by bare name (``from _common import ...``: a script's own folder comes first on
``sys.path``); a study or tool puts the repository root on ``sys.path`` and imports
``benchmarks._common``."""

from __future__ import annotations

import sys
from typing import Any

from autotune.trials import run_ranks


def run_rank0(target: str, *, world_size: int, kwargs: dict[str, Any], timeout_s: float = 3600) -> Any:
    """What ``target`` (``"module:function"``) returned on rank 0 of ``world_size`` fresh ranks; exits
    with one line when the ranks failed."""
    run = run_ranks(target, world_size=world_size, kwargs=kwargs, timeout_s=timeout_s)
    if not run.ok:
        sys.exit(f"benchmark failed: {run.status}: {run.reason}")
    return run.results[0]
