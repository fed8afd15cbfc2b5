"""Errors a user can cause by pointing the analysis at a bad file."""

from __future__ import annotations

from pathlib import Path

from fsdp_runtime.errors import AutotuneError


class TraceError(AutotuneError):
    """A trace file is missing, truncated, empty or not a torch.profiler chrome trace."""

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")
