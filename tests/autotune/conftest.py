"""Puts ``tests/autotune`` (the ``_*`` helpers) on ``sys.path``, which the launchers pass on to
the ranks, for the tests in its stage folders."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
