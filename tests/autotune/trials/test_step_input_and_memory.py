"""What a timed step leaves out (the data path) and what a trial's peak counts (its own
steps only): on CUDA through a stand-in allocator counter, on CPU the kernel's reset high-water mark."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from autotune.trials import build_training, program, rank_memory, training
from fsdp_runtime import config_to_dict, default_config
from profiles import load_model_profile

pytestmark = pytest.mark.torch_matrix


def test_a_timed_step_makes_its_input_before_the_timing_and_trains_the_same(one_rank_group, monkeypatch):
    config = config_to_dict(default_config(load_model_profile("tiny").unit_names, num_microbatches=2))
    plain = build_training(0, 1, model="tiny", config=config)
    expected = [plain.step(s) for s in range(2)]

    timed = build_training(0, 1, model="tiny", config=config)
    made: list[int] = []
    original = training.make_microbatch
    monkeypatch.setattr(training, "make_microbatch", lambda *a, **k: made.append(k["step"]) or original(*a, **k))
    inside: list[list[int]] = []
    step = timed.step
    timed.step = lambda s: inside.append(list(made)) or step(s)  # what had been made when the timed step began
    losses = [program.timed_step(timed, s, torch.device("cpu")).loss for s in range(2)]
    assert losses == expected  # bitwise: the same batches, made earlier
    assert inside == [[0, 0], [0, 0, 1, 1]] and made == [0, 0, 1, 1]  # none made inside a step


class _FakeCudaCounter:
    """A stand-in for the CUDA caching allocator's counters: allocated bytes and their peak."""

    def __init__(self) -> None:
        self.allocated = self.peak = 0
        self.emptied = 0

    def allocate(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: setattr(self, "emptied", self.emptied + 1))
        monkeypatch.setattr(
            torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.allocated)
        )
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak + 2**20)


def test_each_trial_s_cuda_peak_is_its_own(monkeypatch):
    counter = _FakeCudaCounter()
    counter.install(monkeypatch)
    cuda = torch.device("cuda", 0)
    counter.allocate(10 * 2**30)  # an earlier trial of the pool's rank peaked at 10 GiB
    counter.free(10 * 2**30)
    rank_memory.reset_device_memory(cuda)
    assert counter.emptied == 1
    counter.allocate(3 * 2**30)  # this trial: 3 GiB
    assert rank_memory.get_peak_bytes(cuda, rss=None) == 3 * 2**30
    memory = rank_memory.get_memory(cuda, None, candidate_peak=2 * 2**30)
    assert memory == {
        "source": "cuda_max_allocated",
        "peak_bytes": 2 * 2**30,
        "baseline_bytes": 0,
        "trial_peak_bytes": 3 * 2**30,
        "reserved_peak_bytes": 3 * 2**30 + 2**20,
    }
    rank_memory.reset_device_memory(torch.device("cpu"))  # nothing to reset on CPU
    assert counter.emptied == 1


def _touch(num_bytes: int) -> torch.Tensor:
    return torch.ones(num_bytes // 4)  # every page written


def test_a_cpu_trial_s_peak_rss_is_the_kernel_s_high_water_mark_reset_at_its_start(monkeypatch):
    """No sampling thread (it took the GIL from the training thread 200 times a second): the
    kernel's peak, reset when the trial starts, so an earlier trial's larger peak is not this one's,
    and a spike of any length counts. Where the reset is refused, the sampling thread does it."""
    mib = 2**20
    earlier = _touch(400 * mib)  # an earlier trial of the pool's rank peaked higher
    del earlier
    with rank_memory.RssSampler() as rss:
        if not rss.kernel_peak:
            pytest.skip("/proc/self/clear_refs cannot be written here")
        assert not any(t.name == "autotune-rss" for t in threading.enumerate())
        assert rss.peak_bytes < rss.baseline_bytes + 200 * mib
        spike = _touch(256 * mib)
        del spike
        assert rss.peak_bytes >= rss.baseline_bytes + 250 * mib > rss.read()
    monkeypatch.setattr(rank_memory, "reset_high_water_mark", lambda: False)
    with rank_memory.RssSampler() as sampled:
        assert not sampled.kernel_peak and any(t.name == "autotune-rss" for t in threading.enumerate())
        held = _touch(256 * mib)
        time.sleep(0.05)  # ten sampling intervals
        del held
    assert sampled.peak_bytes >= sampled.baseline_bytes + 250 * mib
