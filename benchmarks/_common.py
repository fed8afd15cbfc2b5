"""What several benchmarks share; imported by bare name (``from _common import ...``) after the
benchmark has put the repository on ``sys.path``."""

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
