"""Failure classification of rank runs (pure: no ranks launched)."""

from __future__ import annotations

import signal

from autotune.trials import EXIT_USER_ERROR, classify_failure


def test_the_first_rank_to_fail_is_the_cause():
    tails = ["RuntimeError: Connection closed by peer", "RuntimeError: injected"]
    status, reason = classify_failure([1, 1], tails, timed_out=False, timeout_s=60, exit_order=[1, 0])
    assert (status, reason) == ("crash", "rank 1 exited with 1: RuntimeError: injected")


def test_ranks_the_parent_killed_are_not_out_of_memory():
    # Rank 0 hung in a collective and was killed by the launcher (None); rank 1 crashed.
    status, reason = classify_failure([None, 1], ["", "ValueError: boom"], timed_out=False, timeout_s=60, exit_order=[1])
    assert status == "crash" and reason.endswith("ValueError: boom")


def test_a_sigkill_nobody_sent_is_out_of_memory():
    status, reason = classify_failure([-signal.SIGKILL, None], ["", ""], timed_out=False, timeout_s=60, exit_order=[0])
    assert status == "oom" and reason.startswith("rank 0")


def test_user_errors_win_and_timeouts_say_so():
    status, reason = classify_failure([None, EXIT_USER_ERROR], ["", "ConfigError: mesh: bad"], timed_out=False, timeout_s=60, exit_order=[1])
    assert (status, reason) == ("invalid_config", "rank 1: ConfigError: mesh: bad")
    assert classify_failure([None, None], ["", ""], timed_out=True, timeout_s=7, exit_order=[])[0] == "timeout"
