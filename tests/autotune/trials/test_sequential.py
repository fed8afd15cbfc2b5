"""The sequential stopping rule ([Note: sequential measurement]): pure decisions on ratios, and the
real ``run_pairs`` stopping on a stand-in clock (a one-rank gloo group; exact times, no sleeping)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from autotune.trials.paired import Side, StepTiming, run_pairs
from autotune.trials.spec import TrialSpec, TrialSpecError
from fsdp_runtime.tuning.sequential import StoppingRule, confirms, decide, get_interval

SEARCH_RULE = StoppingRule(max_blocks=3, precision=0.05, faster_below=1.0, prune_above=1.0)
"""The search's rule with its defaults: at most 6 pairs."""


def test_the_interval_is_a_t_interval_of_the_mean_log_ratio():
    interval = get_interval([0.5, 2.0])  # logs -0.693 and +0.693: mean 0, sd 0.980
    assert interval.center == pytest.approx(1.0)
    assert math.log(interval.high) == pytest.approx(6.314 * 0.98026 / math.sqrt(2), rel=1e-3)
    assert interval.low == pytest.approx(1 / interval.high)
    assert get_interval([0.9]) is None


def test_a_clear_winner_stops_after_one_block():
    assert decide(SEARCH_RULE, [0.50, 0.52]) == "faster"


def test_a_tie_keeps_measuring_until_the_most_pairs():
    tie = [1.10, 0.91, 1.08, 0.93, 1.09, 0.92]  # +-9% around 1.0
    assert [decide(SEARCH_RULE, tie[:n]) for n in (2, 4)] == [None, None]
    assert decide(SEARCH_RULE, tie) == "max_blocks"


def test_a_slower_config_is_pruned_from_its_second_block_only():
    slow = [1.50, 1.60, 1.55, 1.58]
    assert decide(SEARCH_RULE, slow[:2]) is None  # one block cannot prune: a burst could fill it
    assert decide(SEARCH_RULE, slow) == "slower"
    # Without a prune threshold (the presearch's calibration trials) it settles instead, or runs on.
    assert decide(StoppingRule(max_blocks=3, prune_above=None, faster_below=1.0), slow) == "settled"


def test_one_burst_on_a_block_s_candidate_steps_does_not_prune():
    # Both candidate steps of the first block slowed 1.5x by load; the config is as fast as the best.
    burst = [1.5 * 1.01, 1.5 * 0.99, 1.00, 0.98]
    assert decide(SEARCH_RULE, burst) is None


def test_a_tight_tie_settles_without_running_every_pair():
    assert decide(SEARCH_RULE, [1.00, 1.01, 0.99, 1.00]) == "settled"


def test_a_spec_with_a_bad_rule_is_refused(tmp_path):
    from fsdp_runtime import default_config

    config = default_config(["layers.0"])
    with pytest.raises(TrialSpecError, match="stopping rule needs max_blocks"):
        TrialSpec(model="tiny", config=config, world_size=2, out_dir=tmp_path, stopping={"max_blocks": 0})
    with pytest.raises(TrialSpecError, match="stopping rule .*unexpected keyword"):
        TrialSpec(model="tiny", config=config, world_size=2, out_dir=tmp_path, stopping={"max_blocks": 2, "x": 1})


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Clock:
    """Stand-in step times: each training's ``ms`` times the next factor of its ``noise`` cycle."""

    def __init__(self) -> None:
        self.steps = 0

    def timed_step(self, training, step, device, emulator=None) -> StepTiming:
        noise = training["noise"][training["i"] % len(training["noise"])]
        training["i"] += 1
        self.steps += 1
        return StepTiming(ms=training["ms"] * noise, loss=0.0, cpu_ms=0.0, page_faults=0)


def _run(candidate_ms: float, noise: list[float], rule: StoppingRule, num_pairs: int = 6):
    clock = _Clock()
    sides = {
        "candidate": Side(training={"ms": candidate_ms, "noise": noise, "i": 0}),
        "reference": Side(training={"ms": 60.0, "noise": [1.0], "i": 0}),
    }
    stopped = run_pairs(
        sides,
        num_pairs=num_pairs,
        device=torch.device("cpu"),
        timed_step=clock.timed_step,
        prune_if_ratio_above=None,
        stopping=rule,
    )
    return stopped, sides, clock


def test_run_pairs_stops_a_clear_winner_after_one_block(one_rank_group):
    stopped, sides, clock = _run(30.0, [1.0, 1.02, 0.99], SEARCH_RULE)
    assert stopped == "faster" and len(sides["candidate"].step_ms) == 2 and len(sides["reference"].step_ms) == 2
    assert clock.steps == 6  # two pairs, each with a settle step where the ranks switched


def test_run_pairs_measures_a_tie_to_the_end(one_rank_group):
    # The candidate's settle and measured steps share the noise cycle: pair ratios swing +-8% around 1.
    stopped, sides, _ = _run(60.0, [1.0, 1.08, 0.92, 1.0, 0.92, 1.08], SEARCH_RULE)
    assert stopped == "max_blocks" and len(sides["candidate"].step_ms) == 6


def test_without_a_rule_every_pair_runs(one_rank_group):
    clock = _Clock()
    sides = {
        "candidate": Side(training={"ms": 30.0, "noise": [1.0], "i": 0}),
        "reference": Side(training={"ms": 60.0, "noise": [1.0], "i": 0}),
    }
    assert (
        run_pairs(
            sides, num_pairs=4, device=torch.device("cpu"), timed_step=clock.timed_step, prune_if_ratio_above=None
        )
        is None
    )
    assert len(sides["candidate"].step_ms) == 4


def test_the_defaults_paired_with_themselves_decide_on_their_own_noise(one_rank_group):
    """One model in alternate steps: its ratios are its steps split by pair order, not a list
    divided by itself (all 1.0: a zero-width interval would settle after one block)."""
    clock = _Clock()
    side = Side(training={"ms": 60.0, "noise": [1.0, 1.08, 0.92, 1.0, 0.92, 1.08], "i": 0})
    precision_only = StoppingRule(max_blocks=3, precision=0.05)
    stopped = run_pairs(
        {"candidate": side, "reference": side},
        num_pairs=6,
        device=torch.device("cpu"),
        timed_step=clock.timed_step,
        prune_if_ratio_above=None,
        settle=False,
        stopping=precision_only,
    )
    assert stopped == "max_blocks" and len(side.step_ms) == 12


def test_a_clearly_slower_first_block_is_not_called_settled_before_it_can_be_pruned():
    """A candidate many times slower with a tight first block (a sleeping rank's steps vary little)
    goes on to its second block and is pruned there, not recorded as settled after one block."""
    from fsdp_runtime.tuning.sequential import StoppingRule, decide

    rule = StoppingRule(prune_above=1.1, max_blocks=4)
    assert rule.min_blocks_to_prune == 2
    assert decide(rule, [18.35, 18.38]) is None
    assert decide(rule, [18.35, 18.38, 18.36, 18.37]) == "slower"


# [Note: pooled noise]: the box's spread pooled from earlier trials.
POOLED_RULE = StoppingRule(max_blocks=2, precision=0.05, faster_below=1.0, prune_above=1.0, noise_sd=0.05, noise_df=24)
"""The search's rule once it has measured paired trials whose pairs spread 5%."""


def test_a_pooled_interval_is_a_pooled_variance_t_interval():
    from fsdp_runtime.tuning.sequential import t_95

    interval = get_interval([1.0, 1.0], noise_sd=0.05, noise_df=24)  # own spread 0: only the pool's
    assert math.log(interval.high) == pytest.approx(t_95(25) * math.sqrt(24 * 0.05**2 / 25 / 2), rel=1e-9)
    assert get_interval([0.9], noise_sd=0.05, noise_df=24) is not None  # one pair is enough with a pool
    # Two pairs alone: t(0.95, 1) = 6.3 on their own spread, 3x wider than with the pool.
    own, pooled = get_interval([0.95, 1.05]), get_interval([0.95, 1.05], noise_sd=0.05, noise_df=24)
    assert own.half_width > 2.5 * pooled.half_width


def test_with_the_box_s_noise_a_clearly_slower_first_block_is_pruned_on_one_confirming_pair():
    from fsdp_runtime.tuning.sequential import confirms_slower

    slow = [1.12, 1.15]  # 13% slower than the best, on a box whose pairs spread 5%
    assert decide(SEARCH_RULE, slow) is None and decide(POOLED_RULE, slow) is None  # a burst could fill a block
    assert confirms_slower(POOLED_RULE, [*slow, 1.11])  # the third pair: above the best by more than 5%
    assert not confirms_slower(SEARCH_RULE, [*slow, 1.11])  # without the pool: the second block decides
    assert not confirms_slower(POOLED_RULE, [*slow, 1.03])  # within one spread of the best: not confirmed
    assert not confirms_slower(POOLED_RULE, [1.02, 0.98, 1.30])  # the first block did not look slower
    assert not confirms_slower(POOLED_RULE, [1.12, 1.15, 1.11, 1.14, 1.13])  # from block 2 on, blocks prune
    # Faster and settled are called after one block on the pool's spread.
    assert decide(POOLED_RULE, [0.84, 0.90]) == "faster"
    assert decide(SEARCH_RULE, [0.84, 0.90]) is None
    assert decide(dataclasses.replace(POOLED_RULE, noise_sd=0.02), [1.00, 1.01]) == "settled"


def test_a_burst_on_the_first_block_is_not_confirmed_by_the_third_pair():
    from fsdp_runtime.tuning.sequential import confirms_slower

    burst = [1.5 * 1.01, 1.5 * 0.99, 1.00]  # a tie with the best, both first-block candidate steps 1.5x
    assert not confirms_slower(POOLED_RULE, burst)


def test_run_pairs_prunes_on_the_confirming_pair(one_rank_group):
    """The real ``run_pairs`` on a stand-in clock: a candidate 30% slower stops after 3 pairs with
    the box's noise pooled, after 4 (its second block) without."""
    noise = [1.0, 1.02, 0.99]
    stopped, sides, _ = _run(78.0, noise, dataclasses.replace(POOLED_RULE, max_blocks=3))
    assert stopped == "slower" and len(sides["candidate"].step_ms) == 3
    stopped, sides, _ = _run(78.0, noise, SEARCH_RULE)
    assert stopped == "slower" and len(sides["candidate"].step_ms) == 4


def test_a_trial_noisier_than_the_box_is_judged_on_its_own_pairs():
    # A burst on the first block (1.5x) then a tie: the pool alone would call it slower after two
    # blocks; its own four pairs spread 20%, wider than the box's 5%, so its own interval decides.
    burst = [1.5 * 1.01, 1.5 * 0.99, 1.00, 0.98]
    assert decide(POOLED_RULE, burst) == "max_blocks"
    pool_only = get_interval(burst, noise_sd=0.05, noise_df=24)
    assert pool_only.low > 1.0  # what the guard prevents


def test_the_pair_noise_pools_each_trial_about_its_own_mean_over_a_window():
    from fsdp_runtime.tuning.sequential import MIN_NOISE_DF, NOISE_WINDOW, PairNoise

    noise = PairNoise()
    noise.observe([0.7, 0.7 * math.exp(0.1)])  # 1 df, deviations +-0.05 about its own mean
    assert noise.get() is None  # under MIN_NOISE_DF
    for _ in range(MIN_NOISE_DF):
        noise.observe([1.3, 1.3 * math.exp(0.1)])  # another config, same spread: the level does not count
    sd, df = noise.get()
    assert df == MIN_NOISE_DF + 1 and sd == pytest.approx(math.sqrt(0.05**2 * 2), rel=1e-9)
    noise.observe([1.0])  # a single pair teaches nothing
    assert noise.get()[1] == MIN_NOISE_DF + 1
    for _ in range(NOISE_WINDOW):
        noise.observe([1.0, math.exp(0.4)])  # the box got noisier: the window forgets the quiet trials
    assert noise.get() == (pytest.approx(math.sqrt(0.2**2 * 2)), NOISE_WINDOW)


# [Note: futility]: a trial unlikely to end below the best stops before its last block.
FUTILE_RULE = dataclasses.replace(POOLED_RULE, noise_sd=0.09, futile_above=1.0)
"""The search's rule on a box whose pairs spread 9%: ties run both blocks, a trial 6% above stops."""


def test_a_trial_unlikely_to_end_below_the_best_stops_after_its_first_block():
    from fsdp_runtime.tuning.sequential import is_unlikely, t_90

    # The final mean's predictive spread after 2 of 4 pairs: sd * sqrt(2 / 8) = sd / 2; a t(0.90) of them.
    sd, df = 0.09, 25
    edge = math.exp(t_90(df) * sd / 2)
    assert 1.055 < edge < 1.062
    above, below = edge * 1.005, edge * 0.995
    assert decide(FUTILE_RULE, [above, above]) == "unlikely"
    assert decide(FUTILE_RULE, [below, below]) is None  # a chance over 10%: the second block decides
    assert decide(dataclasses.replace(FUTILE_RULE, futile_above=None), [above, above]) is None
    assert decide(dataclasses.replace(FUTILE_RULE, noise_sd=None, noise_df=0), [above, above]) is None  # no pool
    assert not is_unlikely(FUTILE_RULE, [above] * 4)  # after the last block there is nothing to save
    assert decide(FUTILE_RULE, [above] * 4) == "max_blocks"
    # Against a best of 0.8, the same trial relative to it.
    best = dataclasses.replace(FUTILE_RULE, futile_above=0.8, prune_above=0.8, faster_below=0.8)
    assert decide(best, [0.8 * above] * 2) == "unlikely"


def test_futility_keeps_the_burst_guard():
    # A first block wholly above the best (a 1.5x burst on a tie) waits for the next block or a
    # confirming pair, as without futility, instead of stopping the trial with a burst in its ratio.
    burst = [1.5 * 1.01, 1.5 * 0.99]
    assert decide(FUTILE_RULE, burst) is None


def test_futility_stops_more_ties_early_the_further_above_the_best():
    """Monte Carlo on the rule itself (pairs drawn at the box's 9%): ties run on most of the time,
    configs 10% slower stop early far more often, and a config 10% faster is almost never lost."""
    import random

    rng = random.Random(0)

    def share_unlikely(true: float) -> float:
        hits = 0
        for _ in range(4000):
            pairs = [true * math.exp(rng.gauss(0.0, 0.09)) for _ in range(2)]
            hits += decide(FUTILE_RULE, pairs) == "unlikely"
        return hits / 4000

    tie, slower, faster = share_unlikely(1.0), share_unlikely(1.1), share_unlikely(0.9)
    assert 0.05 < tie < 0.20 and slower > 2 * tie and faster < 0.02


# [Note: burst windows]: one burst of load over two adjacent steps of the schedule that runs.
BOX_RULE = dataclasses.replace(POOLED_RULE, noise_sd=0.09, futile_above=1.0)
"""The search's rule, 4 pairs at most, on a box whose pairs spread 9%."""


class _BurstClock:
    """Every step 60 ms times its side's ``scale``, the steps at ``burst`` (their place in the trial) 1.5x."""

    def __init__(self, burst: set[int]) -> None:
        self.burst, self.steps = burst, 0

    def timed_step(self, training, step, device, emulator=None) -> StepTiming:
        ms = 60.0 * training["scale"] * (1.5 if self.steps in self.burst else 1.0)
        self.steps += 1
        return StepTiming(ms=ms, loss=0.0, cpu_ms=0.0, page_faults=0)


def _run_burst(first: str, burst: set[int], scale: float = 1.0, rule: StoppingRule = BOX_RULE):
    sides = {"candidate": Side(training={"scale": scale}), "reference": Side(training={"scale": 1.0})}
    clock = _BurstClock(burst)
    stopped = run_pairs(
        sides,
        num_pairs=4,
        device=torch.device("cpu"),
        timed_step=clock.timed_step,
        prune_if_ratio_above=None,
        stopping=rule,
        first=first,
        last=first,
    )
    return stopped, len(sides["candidate"].step_ms)


@pytest.mark.parametrize(
    ("first", "burst", "wrong"),
    [
        # the candidate leads (c0 r_s r0 r1 c_s c1 c2 r_s r2 r3 c_s c3): c1 c2 slow the first
        # block's second pair and the pair that would confirm it; r0 r1 fill the first block
        ("candidate", {5, 6}, "slower"),
        ("candidate", {2, 3}, "faster"),
        # the reference leads (r0 c_s c0 c1 r_s r1 r2 c_s c2 c3 r_s r3): c0 c1 fill the first
        # block; r1 r2 reach its second pair and the next
        ("reference", {2, 3}, "slower"),
        ("reference", {5, 6}, "faster"),
    ],
)
def test_a_burst_over_two_adjacent_steps_neither_prunes_a_tie_nor_makes_it_the_best(
    first, burst, wrong, one_rank_group
):
    """A tie with the best, every step equal but two adjacent ones 1.5x: it runs its four pairs."""
    stopped, pairs = _run_burst(first, burst)
    assert stopped != wrong
    assert (stopped, pairs) == ("max_blocks", 4)


@pytest.mark.parametrize("first", ["candidate", "reference"])
def test_a_clear_winner_and_a_clear_loser_still_stop_early(first, one_rank_group):
    """Twice as fast stops as faster before its last block (the candidate leading: on the third
    pair, its reference steps r0 r1 adjacent; the reference leading: after the first block); a
    config 30% slower is pruned on the confirming third pair either way: even the pairs no one
    window reaches (the first alone, where c1 c2 reach the second and third) lie above the best."""
    assert _run_burst(first, set(), scale=0.5) == ("faster", 3 if first == "candidate" else 2)
    assert _run_burst(first, set(), scale=1.3) == ("slower", 3)


def test_the_guard_leaves_out_the_pairs_one_window_reaches():
    from fsdp_runtime.tuning.pair_schedule import get_burst_windows, get_order_schedule

    kept = get_burst_windows(get_order_schedule("kept", 4))
    own = get_burst_windows(get_order_schedule("own", 4))
    # r0 r1 slowed where the candidate leads: the first block alone says nothing robust
    burst = [1 / 1.5, 1 / 1.5]
    assert decide(BOX_RULE, burst, windows=[]) == "faster"  # without the guard
    assert decide(BOX_RULE, burst, windows=kept) is None
    # one pair's reference step slowed (r1, the reference leading): the other pair must agree
    assert decide(BOX_RULE, [1.0, 1 / 1.5], windows=[]) == "faster"
    assert decide(BOX_RULE, [1.0, 1 / 1.5], windows=own) is None
    assert decide(BOX_RULE, [0.5, 0.5], windows=own) == "faster"
    # c1 c2 slowed where the candidate leads: the third pair does not confirm the first block
    assert confirms_slower_unguarded([1.0, 1.5, 1.5])
    assert confirms(BOX_RULE, [1.0, 1.5, 1.5], kept) is None
    assert confirms(BOX_RULE, [1.3, 1.3, 1.3], own) == "slower"


def confirms_slower_unguarded(ratios: list[float]) -> bool:
    """The confirmation as it was: any third pair above the best by one pooled spread."""
    pool = (BOX_RULE.noise_sd, BOX_RULE.noise_df)
    return (
        get_interval(ratios[:2], *pool).low > 1.0
        and ratios[2] > math.exp(BOX_RULE.noise_sd)
        and get_interval(ratios, *pool).low > 1.0
    )


@pytest.mark.parametrize(
    ("df", "t95", "t90"),
    [(16, 1.7459, 1.3368), (24, 1.7109, 1.3178), (40, 1.6839, 1.3031), (120, 1.6577, 1.2886), (1000, 1.6464, 1.2824)],
)
def test_t_quantiles_above_the_table_are_within_a_tenth_of_a_percent_of_the_published_values(df, t95, t90):
    """Student t's 95th and 90th percentiles (published tables, e.g. NIST/SEMATECH e-Handbook of
    Statistical Methods, 1.3.6.7.2), not the normal quantile the rule once switched to above 15."""
    from fsdp_runtime.tuning.sequential import t_90, t_95

    assert t_95(df) == pytest.approx(t95, rel=1e-3) and t_90(df) == pytest.approx(t90, rel=1e-3)
    assert t_95(df) > 1.6449 and t_90(df) > 1.2816
