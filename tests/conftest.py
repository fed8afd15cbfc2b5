"""Makes ``tests/`` importable (``_harness``) in the test process and, through ``sys.path``, in the ranks."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
