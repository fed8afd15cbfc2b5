"""Makes ``tests/`` importable (``_harness``) in the test process and, through ``sys.path``, in the
ranks; the rank pool shared by every test that may reuse ranks."""

import sys
from pathlib import Path

import pytest

from autotune.trials import RankPool

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


@pytest.fixture(scope="session")
def pool2():
    """One 2-rank gloo pool for every test that may reuse ranks (start-up paid once)."""
    with RankPool(2) as pool:
        yield pool


@pytest.fixture
def one_rank_group():
    """A one-rank gloo default group for the test (in-process; destroyed after it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
