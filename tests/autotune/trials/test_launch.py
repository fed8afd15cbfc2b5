"""Failure classification of rank runs (pure: no ranks launched)."""

from __future__ import annotations

import signal

from autotune.trials import EXIT_USER_ERROR, classify_failure


def test_the_first_rank_to_fail_is_the_cause():
    tails = ["RuntimeError: Connection closed by peer", "RuntimeError: injected"]
    status, reason = classify_failure([1, 1], tails, timed_out=False, timeout_s=60, exit_order=[1, 0])
    assert (status, reason) == ("crash", "rank 1 exited with 1: RuntimeError: injected")


def test_a_peer_that_only_lost_its_connection_is_not_the_cause_even_when_it_exited_first():
    """A dying pipeline stage can take longer to exit than its peers take to see the reset."""
    reset = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer."
    tails = [reset, reset, "RuntimeError: stage 1 died", ""]
    status, reason = classify_failure([1, 1, 1, None], tails, timed_out=False, timeout_s=60, exit_order=[0, 1, 2])
    assert (status, reason) == ("crash", "rank 2 exited with 1: RuntimeError: stage 1 died")
    # only broken connections: the first to fail is still named
    status, reason = classify_failure([1, 1], [reset, reset], timed_out=False, timeout_s=60, exit_order=[1, 0])
    assert reason.startswith("rank 1 exited with 1:")


def test_ranks_the_parent_killed_are_not_out_of_memory():
    # Rank 0 hung in a collective and was killed by the launcher (None); rank 1 crashed.
    status, reason = classify_failure(
        [None, 1], ["", "ValueError: boom"], timed_out=False, timeout_s=60, exit_order=[1]
    )
    assert status == "crash" and reason.endswith("ValueError: boom")


def test_a_sigkill_is_out_of_memory_only_when_the_kernel_says_so():
    killed = dict(timed_out=False, timeout_s=60, exit_order=[0])
    status, reason = classify_failure([-signal.SIGKILL, None], ["", ""], oom_kills=0, **killed)
    assert (status, reason) == (
        "crash",
        "rank 0 was killed by SIGKILL from outside the trial (the kernel reported no OOM kill)",
    )
    status, reason = classify_failure([-signal.SIGKILL, None], ["", ""], oom_kills=1, **killed)
    assert status == "oom" and reason.startswith("rank 0 was killed by the kernel's OOM killer")
    status, reason = classify_failure([-signal.SIGKILL, None], ["", ""], oom_kills=None, **killed)
    assert (status, reason) == ("crash", "rank 0 was killed by SIGKILL from outside the trial")
    status, reason = classify_failure([-signal.SIGTERM, None], ["", ""], oom_kills=3, **killed)
    assert (status, reason) == ("crash", "rank 0 was killed by SIGTERM from outside the trial")


def test_a_rank_that_reports_running_out_of_memory_is_oom():
    tail = (
        "Traceback ...\nRuntimeError: DefaultCPUAllocator: not enough memory: you tried to allocate 8589934592 bytes."
    )
    status, reason = classify_failure([1, None], [tail, ""], timed_out=False, timeout_s=60, exit_order=[0], oom_kills=0)
    assert status == "oom" and reason.startswith("rank 0 ran out of memory: RuntimeError: DefaultCPUAllocator")


def test_a_cuda_oom_says_what_the_rank_held_and_asked_for():
    """torch's CUDA out-of-memory message (torch 2.11's wording) read into figures a search records."""
    from autotune.trials.launch import parse_oom

    tail = (
        "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
        "capacity of 79.19 GiB of which 1.05 GiB is free. Including non-PyTorch memory, this process has 78.13 GiB "
        "memory in use. Of the allocated memory 75.20 GiB is allocated by PyTorch, and 1.30 GiB is reserved by "
        "PyTorch but unallocated."
    )
    status, reason = classify_failure([1, None], [tail, ""], timed_out=False, timeout_s=60, exit_order=[0], oom_kills=0)
    assert status == "oom" and reason.startswith("rank 0 ran out of memory at ")
    assert parse_oom(reason) == (int(78.13 * 2**30), 2 * 2**30)
    assert parse_oom("rank 0 ran out of memory: RuntimeError: DefaultCPUAllocator") is None


def test_user_errors_win_and_timeouts_say_so():
    status, reason = classify_failure(
        [None, EXIT_USER_ERROR], ["", "ConfigError: mesh: bad"], timed_out=False, timeout_s=60, exit_order=[1]
    )
    assert (status, reason) == ("invalid_config", "rank 1: ConfigError: mesh: bad")
    assert classify_failure([None, None], ["", ""], timed_out=True, timeout_s=7, exit_order=[])[0] == "timeout"
