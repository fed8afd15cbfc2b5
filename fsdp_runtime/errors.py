"""The project's one exception base.

Every error a user can cause (a bad config, a bad trace file, a bad CLI option)
derives from :class:`AutotuneError` and carries a one-line message that says what
was wrong, where, and what to do. The CLI prints that line and exits non-zero.
"""

from __future__ import annotations


class AutotuneError(Exception):
    """Base of every user-facing error in fsdp-autotune.

    ``field`` names the setting at fault in the library's own terms (``world_size``);
    a front end maps it to its own name for it (the CLI's ``--nproc``).
    """

    exit_code: int = 2

    def __init__(self, message: str = "", *, field: str | None = None):
        super().__init__(message)
        self.field = field


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
        super().__init__(msg, field=path or None)
