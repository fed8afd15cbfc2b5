"""How the report's tables write a number (one place, so every table writes it alike)."""

from __future__ import annotations

from typing import Any


def fmt(value: Any, kind: str = "ms") -> str:
    """``ms``: 12.34; ``pct``: 56.7%; ``x``: 1.234x; ``mb``: bytes as MB; ``over``: a ratio as
    +15% (1.15) or -6% (0.94); None: ``-``."""
    if value is None:
        return "-"
    match kind:
        case "over":
            return f"{100 * (value - 1):+.0f}%"
        case "ms":
            return f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}"
        case "pct":
            return f"{100 * value:.1f}%"
        case "x":
            return f"{value:.3f}x"
        case "mb":
            return f"{value / 2**20:.1f} MB"
        case _:
            return str(value)
