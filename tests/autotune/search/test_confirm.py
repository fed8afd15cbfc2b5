"""The final round's decision rules (autotune/search/confirm.py): when it is contested, and
how a second window's pairs are pooled. Pure functions: no ranks."""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
from _search_fixtures import complete_row

from autotune.search.confirm import get_contested, pool_windows
from autotune.trials import PairNoise
from autotune.trials.paired import summarize_pairs


def _finalist(trial: int, ratios: list[float]) -> dict:
    # summarize_pairs takes step times; a reference of 1.0 ms per pair makes the ratios exact.
    return {"trial": trial, "status": "ok", **summarize_pairs(ratios, [1.0] * len(ratios))}


def test_a_clear_tight_winner_is_not_contested():
    measured = [_finalist(3, [0.80, 0.81, 0.82, 0.80, 0.81, 0.82]), _finalist(5, [0.90, 0.91, 0.92, 0.90, 0.91, 0.92])]
    assert get_contested(measured, max_spread=0.10) == []


def test_a_noisy_leader_is_contested_alone_when_no_runner_up_is_close():
    # The final round this rule came from: the leader's pairs spread from 0.56 to 1.11.
    leader = _finalist(11, [0.556, 0.676, 0.831, 0.673, 1.111, 0.730])
    far = _finalist(10, [0.95, 0.96, 0.95, 0.96, 0.95, 0.96])
    assert leader["ratio_spread"] > 0.10
    assert get_contested([far, leader], max_spread=0.10) == [11]


def test_a_runner_up_inside_the_leader_s_interquartile_range_is_contested_with_it():
    leader = _finalist(11, [0.556, 0.676, 0.831, 0.673, 1.111, 0.730])
    close = _finalist(10, [0.700, 1.000, 0.760, 0.780, 0.790, 0.800])  # median 0.785 <= the leader's q75 (0.806)
    assert close["ratio"] <= leader["ratio_q75"]
    assert get_contested([leader, close], max_spread=0.10) == [11, 10]
    # A tight leader with a runner-up inside its (narrow) range is contested too.
    tight = _finalist(1, [0.800, 0.810, 0.820, 0.830])
    assert get_contested([tight, _finalist(2, [0.81, 0.815, 0.82, 0.825])], max_spread=0.10) == [1, 2]


def test_a_settled_leader_is_not_contested_by_a_close_runner_up():
    """A leader whose interval settled within the precision: a runner-up inside its range is as fast
    as a second window could tell ([Note: sequential measurement]); not settled, it is contested."""
    tight = _finalist(1, [0.800, 0.810, 0.820, 0.830])
    close = _finalist(2, [0.81, 0.815, 0.82, 0.825])
    assert get_contested([tight | {"stopped": "settled"}, close], max_spread=0.10) == []
    assert get_contested([tight | {"stopped": "max_blocks"}, close], max_spread=0.10) == [1, 2]


def test_with_the_box_s_noise_a_quiet_leader_takes_a_window_only_where_it_could_change_the_choice():
    """[Note: pooled noise]: a runner-up inside the leader's range is measured again with the leader
    only where it could be faster than the leader by more than the precision and a second window
    each could show that much; a tie it cannot is left, and the leader is not measured again alone."""
    leader = _finalist(1, [0.70, 0.80, 0.75, 0.85, 0.72, 0.82])  # median of blocks 0.776, quartiles 0.763-0.784
    near = _finalist(2, [0.76, 0.79, 0.78, 0.79, 0.78, 0.77])  # 0.7% slower: inside the quartiles
    assert near["ratio"] <= leader["ratio_q75"]
    assert get_contested([leader, near], max_spread=0.10) == [1, 2]  # without the noise: both again
    # Pairs spreading 8%: the runner-up may be 5% faster (a chance over 10%), and two windows each resolve 5%.
    assert get_contested([leader, near], max_spread=0.10, noise_sd=0.08) == [1, 2]
    # This box's 11%: two windows each resolve only 5.8%; no window, not even the leader's alone.
    assert get_contested([leader, near], max_spread=0.10, noise_sd=0.11) == []
    # A quiet box (pairs spreading 0.5%): 0.7% slower cannot be 5% faster: a tie at the precision.
    assert get_contested([leader, near], max_spread=0.10, noise_sd=0.005) == []
    assert get_contested([leader, near], max_spread=0.10, noise_sd=0.005, precision=0.001) == []
    # A noisy leader is contested with every close runner-up whatever the noise (bursts).
    noisy = _finalist(11, [0.556, 0.676, 0.831, 0.673, 1.111, 0.730])
    close = _finalist(10, [0.700, 1.000, 0.760, 0.780, 0.790, 0.800])
    assert get_contested([noisy, close], max_spread=0.10, noise_sd=0.11) == [11, 10]


def test_could_be_faster_needs_a_chance_of_a_difference_beyond_the_precision_and_its_resolution():
    from autotune.search.confirm import Z_90, could_be_faster

    leader = {"ratio": 0.80, "num_pairs": 6}
    zone, spread = math.log(1.05), 0.08 * math.sqrt(2 / 6)
    edge = 0.80 * math.exp(Z_90 * spread - zone)  # the gap at which the chance is 10%
    assert could_be_faster(leader, {"ratio": edge * 0.999, "num_pairs": 6}, 0.08, 0.05)
    assert not could_be_faster(leader, {"ratio": edge * 1.001, "num_pairs": 6}, 0.08, 0.05)
    # More pairs resolve more: at 11% six pairs each do not resolve 5%, twelve each do.
    assert not could_be_faster(leader, {"ratio": 0.80, "num_pairs": 6}, 0.11, 0.05)
    assert could_be_faster(leader | {"num_pairs": 12}, {"ratio": 0.80, "num_pairs": 12}, 0.11, 0.05)


def test_failed_finalists_are_ignored():
    assert get_contested([{"trial": 4, "status": "timeout"}], max_spread=0.10) == []


def test_pooling_ranks_on_every_block_of_both_windows():
    first, second = (
        _finalist(11, [0.556, 0.676, 0.831, 0.673, 1.111, 0.730]),
        _finalist(11, [0.80, 0.81, 0.82, 0.81, 0.80, 0.82]),
    )
    pooled = pool_windows(first, second)
    blocks = first["block_ratios"] + second["block_ratios"]
    # a reference of 1.0 ms per pair: a block's ratio is the mean of its two pairs
    assert blocks == pytest.approx([0.616, 0.752, 0.9205, 0.805, 0.815, 0.81])
    assert pooled["pair_ratios"] == first["pair_ratios"] + second["pair_ratios"] and pooled["num_pairs"] == 12
    assert pooled["block_ratios"] == blocks and pooled["num_blocks"] == 6 and pooled["windows"] == 2
    assert pooled["ratio"] == pytest.approx(statistics.median(blocks))
    q25, _, q75 = statistics.quantiles(blocks, n=4, method="inclusive")
    assert (pooled["ratio_q25"], pooled["ratio_q75"]) == pytest.approx((q25, q75))
    assert pooled["ratio_spread"] == pytest.approx((q75 - q25) / pooled["ratio"])
    assert (pooled["ratio_min"], pooled["ratio_max"]) == pytest.approx((0.616, 0.9205))
    # each window starts with the reference: pairs 0, 2, 4 of both windows are one order
    assert pooled["order_ratios"]["reference_first"] == pytest.approx(
        statistics.median([0.556, 0.831, 1.111, 0.80, 0.82, 0.80])
    )
    assert pooled["first_window_ratio"] == first["ratio"] and pooled["trial"] == 11
    # a window whose pairs started with the candidate (its model switched in place, metrics v10):
    # its odd pairs are the reference-first ones
    flipped = pool_windows(first, second | {"first": "candidate"})
    assert flipped["order_ratios"]["reference_first"] == pytest.approx(
        statistics.median([0.556, 0.831, 1.111, 0.81, 0.81, 0.82])
    )
    assert flipped["order_ratios"]["candidate_first"] == pytest.approx(
        statistics.median([0.676, 0.673, 0.730, 0.80, 0.82, 0.80])
    )


def test_a_failed_second_window_keeps_the_first_window_s_figures():
    first = _finalist(7, [0.9, 0.8, 0.85])
    pooled = pool_windows(first, {"trial": 7, "status": "timeout", "reason": "hung"})
    assert pooled["pair_ratios"] == first["pair_ratios"] and pooled["ratio"] == first["ratio"]
    assert pooled["second_window_status"] == "timeout" and pooled["windows"] == 2


def _window(trial: int, ratios: list[float], faster: bool) -> dict:
    """A verdict window's figures ([Note: emitted on an interval]): ``ratios`` pair by pair, an
    interval from their extremes, and whether its rule called the config faster."""
    return _finalist(trial, ratios) | {"ratio_low": min(ratios), "ratio_high": max(ratios), "faster": faster}


def _final_round_ctx() -> SimpleNamespace:
    """What the final round reads of a search: 3 finalists, 2 pairs each, a 100-byte memory budget;
    a finalist's config is named by its param ``k``."""
    settings = SimpleNamespace(
        num_finalists=3, num_confirm_pairs=2, max_ratio_spread=0.5, memory_budget_bytes=100, precision=0.05
    )
    return SimpleNamespace(
        settings=settings,
        reporter=SimpleNamespace(on_phase=lambda message: None),
        default_config="defaults",
        space=SimpleNamespace(build_config=lambda params: f"config {params['k']}"),
        noise=PairNoise(),
    )


def test_a_finalist_over_the_memory_budget_in_the_final_round_is_not_emitted(monkeypatch):
    """Peaks vary between measurements: the emitted config must fit the budget when re-measured too."""
    from autotune.search import confirm

    rows = [
        complete_row(0, 100.0, ratio=1.0, is_default=True),
        complete_row(1, 70.0, ratio=0.70, params={"k": 1}),
        complete_row(2, 80.0, ratio=0.80, params={"k": 2}),
    ]
    peaks = {1: 110, 2: 90}  # trial 1 fit in the search but not now; trial 2 fits
    final_ratios = {1: [0.70, 0.71, 0.72, 0.70], 2: [0.80, 0.81, 0.82, 0.80]}

    def measure(ctx, row, *, window=0, leader=None):
        memory = {
            "process_peak_bytes": peaks[row.number],
            "over_budget": peaks[row.number] > ctx.settings.memory_budget_bytes,
        }
        return _finalist(row.number, final_ratios[row.number]) | memory

    monkeypatch.setattr(confirm, "_measure_finalist", measure)
    monkeypatch.setattr(confirm, "_measure_verdict", lambda ctx, row, config: _window(row.number, [0.8] * 4, True))
    ctx = _final_round_ctx()
    config, record = confirm.run_final_round(ctx, rows)
    assert config == "config 2" and record["winner"] == 2 and record["emitted"] == "best"
    assert [f["over_budget"] for f in record["finalists"]] == [True, False]
    # No finalist fits when re-measured: the search's pick is kept, and the record says why.
    peaks[2] = 120
    config, record = confirm.run_final_round(ctx, rows)
    assert config == "config 1" and record["emitted"] == "search" and record["winner"] is None
    assert record["memory"] == "every finalist was over the memory budget in the final round"


def test_pooled_windows_keep_the_higher_peak_and_any_overrun():
    first = _finalist(7, [0.9, 0.8, 0.85]) | {"process_peak_bytes": 90, "over_budget": False}
    second = _finalist(7, [0.9, 0.8, 0.85]) | {"process_peak_bytes": 120, "over_budget": True}
    pooled = pool_windows(first, second)
    assert pooled["process_peak_bytes"] == 120 and pooled["over_budget"] is True
    assert "over_budget" not in pool_windows(_finalist(7, [0.9]), _finalist(7, [0.8]))


def test_defaults_over_the_memory_budget_are_never_the_fallback(monkeypatch):
    """Checkpointing makes every config that fits slower than the defaults; when the defaults do not
    fit, the fastest finalist that fits is emitted, not the defaults."""
    from autotune.search import confirm

    rows = [
        complete_row(0, 100.0, ratio=1.0, is_default=True, feasible=False),
        complete_row(1, 115.0, ratio=1.15, params={"k": 1}),
        complete_row(2, 120.0, ratio=1.20, params={"k": 2}),
    ]
    final_ratios = {1: [1.16, 1.17, 1.18, 1.16], 2: [1.08, 1.09, 1.10, 1.08]}
    monkeypatch.setattr(
        confirm,
        "_measure_finalist",
        lambda ctx, row, *, window=0, leader=None: _finalist(row.number, final_ratios[row.number]),
    )
    # the window does not call a config slower than the defaults faster: it is emitted all the same
    monkeypatch.setattr(confirm, "_measure_verdict", lambda ctx, row, config: _window(row.number, [1.1] * 4, False))
    ctx = _final_round_ctx()
    config, record = confirm.run_final_round(ctx, rows)
    assert config == "config 2" and record["winner"] == 2 and record["defaults_over_budget"] is True
    # Defaults that fit stay the fallback when no finalist beats them.
    rows[0].feasible = True
    config, record = confirm.run_final_round(ctx, rows)
    assert config == "defaults" and record["emitted"] == "defaults"


def _rows_and_round(monkeypatch, final_ratios: dict[int, list[float]], window: dict):
    """Two finalists measured with ``final_ratios``; the chosen one's verdict window ``window``."""
    from autotune.search import confirm

    rows = [
        complete_row(0, 100.0, ratio=1.0, is_default=True),
        complete_row(1, 95.0, ratio=0.95, params={"k": 1}),
        complete_row(2, 97.0, ratio=0.97, params={"k": 2}),
    ]
    monkeypatch.setattr(
        confirm,
        "_measure_finalist",
        lambda ctx, row, *, window=0, leader=None: _finalist(row.number, final_ratios[row.number]),
    )
    windows = []
    monkeypatch.setattr(confirm, "_measure_verdict", lambda ctx, row, config: windows.append(row.number) or window)
    ctx = _final_round_ctx()
    ctx.settings.memory_budget_bytes = None
    return (*confirm.run_final_round(ctx, rows), windows)


def test_a_tie_within_noise_is_not_emitted_over_the_defaults(monkeypatch):
    """[Note: emitted on an interval]: the fastest finalist at 0.96 in the round that chose it, then a
    window of its own whose interval reaches 1: the defaults are emitted, and the one line says why."""
    window = _window(1, [0.97, 1.02, 0.99, 1.01], faster=False)
    config, record, windows = _rows_and_round(monkeypatch, {1: [0.95, 0.96, 0.97, 0.96], 2: [0.98] * 4}, window)
    assert windows == [1] and config == "defaults"
    assert (record["emitted"], record["winner"], record["chosen"]) == ("defaults", None, 1)
    assert record["verdict"].startswith(
        "the defaults are emitted: trial 1 (the fastest finalist) was not shown faster than them at 90%"
    )
    # the speedup said is the window's, not the choosing round's (1 / 0.96)
    assert record["speedup_from"] == "verdict" and record["speedup_median"] == pytest.approx(1 / window["ratio"])
    assert record["selection_speedup"] == pytest.approx(1 / record["finalists"][0]["ratio"])
    assert record["speedup_low"] == pytest.approx(1 / 1.02) and record["speedup_high"] == pytest.approx(1 / 0.97)
    assert record["interval_covers"] == "the noise of this window's pairs, not a run alone"  # search.json says it


def test_a_config_the_window_calls_faster_is_emitted_with_the_window_s_speedup(monkeypatch):
    window = _window(1, [0.90, 0.92, 0.91, 0.93], faster=True)
    config, record, _ = _rows_and_round(monkeypatch, {1: [0.85, 0.86, 0.85, 0.86], 2: [0.98] * 4}, window)
    assert config == "config 1" and (record["emitted"], record["winner"]) == ("best", 1) and "verdict" not in record
    assert record["speedup_median"] == pytest.approx(1 / window["ratio"])
    assert record["speedup_median"] < record["selection_speedup"]
    assert record["speedups"] == pytest.approx([1 / r for r in window["block_ratios"]])
    # nothing faster than the defaults in the choosing round: no window, the defaults, and why
    config, record, windows = _rows_and_round(monkeypatch, {1: [1.02] * 4, 2: [1.05] * 4}, window)
    assert windows == [] and config == "defaults" and record["chosen"] is None
    assert record["verdict"] == "no finalist was faster than the defaults in the final round: they are emitted"


def test_the_verdict_window_runs_its_pairs_and_calls_faster_on_their_interval(tmp_path):
    """[Note: emitted on an interval]: the chosen config's own trial against the defaults, at most
    2 x --confirm-pairs pairs, stopped early only as clearly slower or settled, never as faster
    (its figure is the one reported); ``faster``: the interval of its pairs, the rule's, below 1."""
    from autotune.search.context import SearchContext
    from autotune.search.verdict import measure_verdict
    from autotune.trials import get_rule_interval
    from autotune.trials.metrics import TrialMetrics

    noise = PairNoise()
    for _ in range(4):
        noise.observe([1.0, 1.0, 1.1, 1.1])
    ctx = SimpleNamespace(
        settings=SimpleNamespace(num_measured=4, precision=0.05, prune_ratio=1.2, num_confirm_pairs=3), noise=noise
    )
    ctx.get_stopping_rule = lambda **kw: SearchContext.get_stopping_rule(ctx, **kw)
    specs = []
    ctx.trial_spec = lambda config, out_dir, **kw: specs.append(kw) or SimpleNamespace(**kw)

    def ran(ratios: list[float], stopped: str):
        metrics = TrialMetrics(status="ok", model="tiny", world_size=2, backend="gloo", stopped=stopped)
        metrics.paired = summarize_pairs(ratios, [1.0] * len(ratios))
        return lambda spec: SimpleNamespace(status="ok", reason="", step_ms=1.0, metrics=metrics)

    ctx.run = ran([0.96, 1.01, 0.97, 1.00, 0.98, 0.99], "max_blocks")
    tie = measure_verdict(ctx, "config", tmp_path)
    rule = specs[-1]["stopping"]
    # never stopped as faster (its figure is the one reported), pruned as clearly slower than the defaults
    assert (rule.faster_below, rule.prune_above, rule.futile_above, rule.max_blocks) == (None, 1.0, None, 3)
    assert specs[-1]["num_pairs"] == 6 and specs[-1]["reference"] is None and not specs[-1]["profile"]
    interval = get_rule_interval(rule, tie["pair_ratios"])
    assert (tie["ratio_low"], tie["ratio_high"]) == (interval.low, interval.high) and interval.high > 1.0
    assert not tie["faster"] and tie["ratio"] < 1.0  # a median below 1 is not a call
    ctx.run = ran([0.80, 0.82, 0.81, 0.80], "settled")
    assert measure_verdict(ctx, "config", tmp_path)["faster"]
    # every pair run and their interval below 1, the pairs a burst can reach left out in turn still below 1: faster
    ctx.run = ran([0.90, 0.84, 0.93, 0.88, 0.86, 0.91], "max_blocks")
    steady = measure_verdict(ctx, "config", tmp_path)
    assert steady["ratio_high"] < 1.0 and steady["faster"]
    # spread pairs, every one run, their interval below 1: faster, though no early call was made
    ctx.run = ran([0.93, 0.73, 1.0, 0.99, 0.75, 0.70], "max_blocks")
    spread = measure_verdict(ctx, "config", tmp_path)
    assert spread["ratio_high"] < 1.0 and spread["faster"]
    # one block, settled far below 1: never a call (one burst over its two reference steps can make it)
    assert rule.min_blocks == 2
    ctx.run = ran([0.80, 0.81], "settled")
    one_block = measure_verdict(ctx, "config", tmp_path)
    assert one_block["ratio_high"] < 1.0 and not one_block["faster"]
    # --confirm-pairs 1: still two blocks, the fewest in which the rule can call a config faster
    ctx.settings.num_confirm_pairs = 1
    measure_verdict(ctx, "config", tmp_path)
    assert specs[-1]["num_pairs"] == 4 and specs[-1]["stopping"].max_blocks == 2


def test_a_runner_up_unlikely_to_beat_the_leader_stops_early():
    """A runner-up is pruned when clearly slower than the leader so far and stops as ``unlikely``
    when it will hardly end below it ([Note: futility]); the leader itself is measured to its
    last block or its settled ratio."""
    from autotune.search import confirm
    from autotune.search.context import SearchContext

    class Measured(Exception):
        pass

    def run(spec):
        raise Measured(spec)

    noise = PairNoise()
    for _ in range(4):
        noise.observe([1.0, 1.0, 1.1, 1.1])
    ctx = SimpleNamespace(
        settings=SimpleNamespace(num_measured=4, precision=0.05, prune_ratio=1.0, num_confirm_pairs=3),
        noise=noise,
        space=SimpleNamespace(build_config=lambda params: "config"),
        write_dir=Path("/nonexistent"),
        run=run,
    )
    ctx.get_stopping_rule = lambda **kw: SearchContext.get_stopping_rule(ctx, **kw)
    ctx.trial_spec = lambda config, out_dir, **kw: SimpleNamespace(**kw)
    rules = {}
    for leader in (None, 0.8):
        figures = None if leader is None else {"ratio": leader, "pair_ratios": [leader] * 6}
        with pytest.raises(Measured) as measured:
            confirm._measure_finalist(ctx, complete_row(3, 80.0, ratio=0.8), leader=figures)
        rules[leader] = measured.value.args[0].stopping
    assert rules[None].prune_above is None and rules[None].futile_above is None
    assert rules[0.8].prune_above == 0.8 and rules[0.8].futile_above == 0.8 and rules[0.8].faster_below is None


def test_a_finalist_pruned_against_a_leader_its_second_window_moved_is_measured_again_and_ranked(monkeypatch):
    """The leader's first window at 0.70 prunes trial 2 at 0.76; the contested leader's second window
    pools it to 0.81, above 0.76: trial 2 is measured again against the new leader, pooled, and
    ranked first, where before it stayed pruned and trial 1 was chosen at 0.81."""
    from autotune.search import confirm

    rows = [
        complete_row(0, 100.0, ratio=1.0, is_default=True),
        complete_row(1, 70.0, ratio=0.70, params={"k": 1}),
        complete_row(2, 76.0, ratio=0.76, params={"k": 2}),
    ]
    windows = {
        (1, 0): [0.70, 0.62, 0.80, 0.69],
        (1, 1): [0.92, 0.95, 0.90, 0.93],  # the leader measured again: its pooled median moves up
        (2, 0): [0.76, 0.77, 0.75, 0.76],
        (2, 1): [0.75, 0.77, 0.76, 0.76],
    }
    leaders = []

    def measure(ctx, row, *, window=0, leader=None):
        leaders.append((row.number, window, leader["ratio"] if leader else None))
        figures = _finalist(row.number, windows[row.number, window])
        pruned = row.number == 2 and window == 0  # pruned against the first window's leader
        return figures | {"status": "pruned" if pruned else "ok"}

    monkeypatch.setattr(confirm, "_measure_finalist", measure)
    ctx = _final_round_ctx()
    monkeypatch.setattr(confirm, "get_contested", lambda *args: [1])
    measured, contested = confirm._measure_finalists(ctx, rows[1:])
    by_trial = {m["trial"]: m for m in measured}
    leader = by_trial[1]["ratio"]
    assert contested == [1] and leader > 0.76
    assert (2, 1, leader) in leaders  # measured again against the moved leader
    assert by_trial[2]["status"] == "ok" and by_trial[2]["reranked"] and by_trial[2]["num_pairs"] == 8
    assert min((m for m in measured if m["status"] == "ok"), key=lambda m: m["ratio"])["trial"] == 2


def test_a_finalist_is_pruned_on_the_two_sample_interval_not_against_the_leader_s_point_estimate():
    """A finalist whose own interval lies wholly above the leader's mean, yet within what the
    leader's own error allows: pruned against the point estimate, not on the two-sample interval."""
    from fsdp_runtime.tuning import StoppingRule, decide

    ratios = [0.86, 0.87] * 3  # the leader's mean ratio 0.82, from the 2 pairs of its settled first block
    point = StoppingRule(max_blocks=3, prune_above=0.82, min_blocks_to_prune=2, noise_sd=0.05, noise_df=24)
    two_sample = dataclasses.replace(point, limit_pairs=2)
    assert decide(point, ratios) == "slower"
    assert decide(two_sample, ratios) == "settled"  # not pruned: kept, and ranked with its ratio
    assert decide(two_sample, [0.95, 0.96] * 3) == "slower"  # clearly slower still is


def test_a_leader_a_burst_made_look_faster_prunes_no_faster_finalist():
    """Candidate first, one burst over the two adjacent reference steps of pairs 0 and 1 makes
    both pairs look 1.5x faster alike: the leader's first block settles at 0.53 where it is truly
    0.80, and a finalist truly 10% faster (0.72) was pruned against it (``studies/decisions.py``'s
    ``lose`` rows: about 7% of finalists with a burst). Now the leader cannot settle on that block,
    and its figure is the one no single burst can have lowered."""
    from autotune.search.confirm import get_finalist_rule, get_leader_mean
    from fsdp_runtime.tuning import CANDIDATE, StoppingRule, decide, get_burst_windows, get_pair_schedule

    rule = StoppingRule(max_blocks=3, precision=0.05, noise_sd=0.03, noise_df=24)
    burst_block = [0.533, 0.535]
    windows = get_burst_windows(get_pair_schedule(6, first=CANDIDATE))
    assert decide(rule, burst_block, windows) == "settled"  # as the first finalist's window did
    assert decide(get_finalist_rule(rule, None), burst_block, windows) is None  # two blocks first
    leader = {"pair_ratios": [*burst_block, 0.80, 0.79], "first": CANDIDATE, "ratio": 0.66}
    assert get_leader_mean(leader) == pytest.approx(math.sqrt(0.80 * 0.79))  # pairs 0-1 left out
    plain = math.exp(statistics.fmean(math.log(r) for r in leader["pair_ratios"]))
    assert plain < 0.66
    finalist = [0.72, 0.73, 0.71, 0.72]
    against_plain = dataclasses.replace(rule, prune_above=plain, futile_above=plain, limit_pairs=4)
    assert decide(against_plain, finalist, windows) == "slower"  # what the plain mean did: a better config lost
    assert decide(get_finalist_rule(rule, leader), finalist, windows) != "slower"
    assert get_leader_mean({"ratio": 0.9}) == 0.9 and get_leader_mean(None) is None
