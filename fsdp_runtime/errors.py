"""The project's one exception base.

Every error a user can cause (a bad config, a bad trace file, a bad CLI option)
derives from :class:`AutotuneError` and carries a one-line message that says what
was wrong, where, and what to do. The CLI prints that line and exits non-zero.
"""

from __future__ import annotations


class AutotuneError(Exception):
    """Base of every user-facing error in fsdp-autotune."""

    exit_code: int = 2


class ConfigError(AutotuneError, ValueError):
    """A runtime config is invalid; the message names the field path and the fix."""

    def __init__(self, path: str, problem: str, *, fix: str | None = None, source: str | None = None):
        self.path = path
        self.problem = problem
        self.fix = fix
        self.source = source
        where = f"{source}: " if source else ""
        msg = f"{where}{path}: {problem}" if path else f"{where}{problem}"
        if fix:
            msg += f" ({fix})"
        super().__init__(msg)
