"""Trials measured against the best so far ([Note: measured against the best]): which reference a
trial gets, its ratio chained to the defaults, drift detected and anchored, kept across a resume.

The ranks are stood in for: ``run_trial`` returns figures chosen per trial (a stand-in clock)."""

from __future__ import annotations

import socket
import subprocess
import sys
from types import SimpleNamespace

import optuna
import pytest
from _search_fixtures import FAST

from autotune.search import SearchSettings, SearchSpace, SilentReporter
from autotune.search.reference import ANCHORS_ATTR, DRIFT_LIMIT
from autotune.trials.metrics import TrialMetrics, TrialResult
from autotune.trials.paired import summarize_pairs

SPACE = SearchSpace(block_names=("layers.0", "layers.1"), world_size=2, num_microbatches=1)
DEFAULTS = SPACE.get_default_params()
PARAMS = {
    "a": {**DEFAULTS, "forward_prefetch": "depth1"},
    "b": {**DEFAULTS, "unshard_async": "on"},
    "c": {**DEFAULTS, "reshard_after_forward": "false"},
}


class StandIn:
    """``run_trial`` for the tests: per trial dir name, the candidate's and the reference's step ms."""

    def __init__(self, steps: dict[str, tuple[float, float]]) -> None:
        self.steps, self.specs = steps, []

    def __call__(self, spec, *, pool=None) -> TrialResult:
        self.specs.append(spec)
        candidate_ms, reference_ms = self.steps[spec.out_dir.name]
        pairs = 4
        jitter = [1.0, 1.01, 0.99, 1.0]
        cand = [candidate_ms * j for j in jitter]
        ref = [reference_ms] * pairs
        metrics = TrialMetrics(
            status="ok",
            model="tiny",
            world_size=2,
            backend="gloo",
            step_ms=candidate_ms,
            step_ms_per_step=cand,
            reference_step_ms_per_step=ref,
            paired=summarize_pairs(cand, ref),
            process_peak_bytes=1,
            stopped="settled",
        )
        return TrialResult(status="ok", out_dir=spec.out_dir, metrics=metrics, wall_s=1.0)


def _ctx(tmp_path, study, reference="best"):
    from autotune.search.context import SearchContext

    return SearchContext(
        study=study,
        space=SPACE,
        settings=SearchSettings(out_dir=tmp_path, reference=reference, **FAST),
        plan=SimpleNamespace(trial_model="tiny"),
        reporter=SilentReporter(),
    )


def _run(ctx, key: str | None):
    from autotune.search.loop import get_rows, pick_best, run_one

    if key is None:  # the defaults trial, as run_search enqueues it
        ctx.study.enqueue_trial(DEFAULTS, user_attrs={"is_default": True})
    else:
        ctx.study.enqueue_trial(PARAMS[key])
    return run_one(ctx, pick_best(get_rows(ctx.study)))


def test_trials_pair_with_the_best_and_chain_their_ratio(tmp_path, monkeypatch):
    from autotune.search import context

    stand_in = StandIn(
        {
            "trial_0000": (100.0, 100.0),  # the defaults with themselves
            "trial_0001": (50.0, 100.0),  # a: 0.5x the defaults, the new best
            "trial_0002": (40.0, 50.0),  # b against a (whose step is still 50 ms): 0.8x a, 0.4x the defaults
            "trial_0003": (45.0, 40.0),  # c against b: slower than the best
        }
    )
    monkeypatch.setattr(context, "run_trial", stand_in)
    ctx = _ctx(tmp_path, optuna.create_study())
    rows = [_run(ctx, key) for key in (None, "a", "b", "c")]
    references = [spec.reference for spec in stand_in.specs]
    assert references == [SPACE.build_config(p) for p in (DEFAULTS, DEFAULTS, PARAMS["a"], PARAMS["b"])]
    assert [r.reference_trial for r in rows] == [None, None, 1, 2]
    assert rows[1].ratio == pytest.approx(0.5) and rows[1].ratio_to_reference is None
    assert rows[2].ratio_to_reference == pytest.approx(0.8) and rows[2].ratio == pytest.approx(0.4)
    assert rows[2].reference_ratio == pytest.approx(0.5) and rows[2].reference_drift == pytest.approx(0.0)
    assert rows[3].ratio == pytest.approx(45 / 40 * 0.4)
    # Every trial ran with the search's stopping rule, deciding against the best so far (the
    # defaults' measured noise first); the defaults against themselves decide on precision alone.
    rules = [spec.stopping for spec in stand_in.specs]
    assert rules[0]["faster_below"] is None and rules[0]["prune_above"] is None
    assert rules[1]["faster_below"] == pytest.approx(rows[0].ratio)
    assert [r["faster_below"] for r in rules[2:]] == pytest.approx([1.0, 1.0])  # the best is the reference
    assert all(r["prune_above"] == pytest.approx(ctx.settings.prune_ratio * r["faster_below"]) for r in rules[1:])
    # A trial profiles only when it beats the best; the defaults trial (the presearch reads it) always.
    assert [spec.profile_below for spec in stand_in.specs][0] is None
    assert [spec.profile_below for spec in stand_in.specs][1:] == pytest.approx([rows[0].ratio, 1.0, 1.0])
    assert ANCHORS_ATTR not in ctx.study.user_attrs


def test_by_default_every_trial_pairs_with_the_defaults_and_must_beat_the_best(tmp_path, monkeypatch):
    """``--reference defaults``: no chain; the rule's thresholds and the profiled window follow the best's ratio."""
    from autotune.search import context

    stand_in = StandIn(
        {
            "trial_0000": (100.0, 100.0),
            "trial_0001": (50.0, 100.0),
            "trial_0002": (40.0, 100.0),
            "trial_0003": (45.0, 100.0),
        }
    )
    monkeypatch.setattr(context, "run_trial", stand_in)
    ctx = _ctx(tmp_path, optuna.create_study(), reference="defaults")
    rows = [_run(ctx, key) for key in (None, "a", "b", "c")]
    assert all(spec.reference == ctx.default_config for spec in stand_in.specs)
    assert [r.reference_trial for r in rows] == [None] * 4 and rows[3].ratio_to_reference is None
    assert [r.ratio for r in rows[1:]] == pytest.approx([0.5, 0.4, 0.45])
    beat = [spec.stopping["faster_below"] for spec in stand_in.specs[1:]]
    assert beat == pytest.approx([rows[0].ratio, 0.5, 0.4])  # the best so far, each time
    assert [spec.profile_below for spec in stand_in.specs[1:]] == pytest.approx(beat)
    assert [spec.stopping["prune_above"] for spec in stand_in.specs[1:]] == pytest.approx(
        [ctx.settings.prune_ratio * b for b in beat]
    )
    # A trial unlikely to end below the best stops before its last block ([Note: futility]); the
    # defaults trial measures the noise to its end.
    assert [spec.stopping["futile_above"] for spec in stand_in.specs[1:]] == pytest.approx(beat)
    assert stand_in.specs[0].stopping["futile_above"] is None
    # Without a profile at the end, a trial that beats the best takes its profiled window.
    assert all(spec.profile for spec in stand_in.specs)
    assert rows[2].reference_drift == pytest.approx(0.0)  # the defaults' steps, against the defaults trial's


def test_with_the_emitted_config_profiled_at_the_end_only_the_defaults_trial_profiles(tmp_path, monkeypatch):
    """[Note: the emitted config's trace]: the recipe round profiles the config to emit, so the
    search's other trials skip their profiled windows; the defaults trial still takes one."""
    from autotune.search import context

    stand_in = StandIn({"trial_0000": (100.0, 100.0), "trial_0001": (50.0, 100.0), "trial_0002": (40.0, 100.0)})
    monkeypatch.setattr(context, "run_trial", stand_in)
    ctx = _ctx(tmp_path, optuna.create_study(), reference="defaults")
    ctx.profile_at_end = True
    for key in (None, "a", "b"):
        _run(ctx, key)
    assert [spec.profile for spec in stand_in.specs] == [True, False, False]


def test_trials_after_the_first_decide_with_the_box_s_noise_pooled_from_them(tmp_path, monkeypatch):
    """[Note: pooled noise]: once two paired trials have run (3 degrees of freedom each), the next
    trial's rule carries their pairs' spread; before, it decides on its own pairs."""
    import math
    import statistics

    from autotune.search import context

    stand_in = StandIn({f"trial_{i:04d}": (100.0 - 10 * i, 100.0) for i in range(4)})
    monkeypatch.setattr(context, "run_trial", stand_in)
    ctx = _ctx(tmp_path, optuna.create_study(), reference="defaults")
    for key in (None, "a", "b", "c"):
        _run(ctx, key)
    rules = [spec.stopping for spec in stand_in.specs]
    assert [r["noise_sd"] for r in rules[:2]] == [None, None] and [r["noise_df"] for r in rules[:2]] == [0, 0]
    # The stand-in's pairs: the candidate jittered [1.0, 1.01, 0.99, 1.0] against a steady reference.
    logs = [math.log(j) for j in (1.0, 1.01, 0.99, 1.0)]
    spread = math.sqrt(sum((x - statistics.fmean(logs)) ** 2 for x in logs) / 3)
    assert rules[2]["noise_df"] == 6 and rules[2]["noise_sd"] == pytest.approx(spread)
    assert rules[3]["noise_df"] == 9


def test_drift_of_the_reference_is_detected_and_anchored(tmp_path, monkeypatch):
    from autotune.search import context

    slowed = 50.0 * (1 + 2 * DRIFT_LIMIT)  # the box got slower: a's steps take twice the drift limit longer
    stand_in = StandIn(
        {
            "trial_0000": (100.0, 100.0),
            "trial_0001": (50.0, 100.0),
            "trial_0002": (0.9 * slowed, slowed),  # b against a, under the new load
            "anchor_0002": (60.0, 100.0),  # a against the defaults now: 0.6x (was 0.5x)
        }
    )
    monkeypatch.setattr(context, "run_trial", stand_in)
    ctx = _ctx(tmp_path, optuna.create_study())
    rows = [_run(ctx, key) for key in (None, "a", "b")]
    anchor_spec = stand_in.specs[3]
    assert anchor_spec.out_dir.name == "anchor_0002" and anchor_spec.reference == ctx.default_config
    assert anchor_spec.config == SPACE.build_config(PARAMS["a"]) and not anchor_spec.profile
    assert rows[2].reference_drift == pytest.approx(2 * DRIFT_LIMIT)
    # b is chained through the anchor's ratio, measured under the same load as b itself.
    assert rows[2].reference_ratio == pytest.approx(0.6) and rows[2].ratio == pytest.approx(0.9 * 0.6)
    anchors = ctx.study.user_attrs[ANCHORS_ATTR]
    assert anchors["1"]["ratio"] == pytest.approx(0.6) and anchors["1"]["previous_ratio"] == pytest.approx(0.5)
    assert anchors["1"]["at_trial"] == 2 and anchors["1"]["dir"] == "anchors/anchor_0002"


def test_a_resumed_study_keeps_its_measurements_and_anchors(tmp_path, monkeypatch):
    """Stopped while trial 3 ran: the finished trials, their chain and the anchor stay; the
    interrupted trial measured nothing and does not use the budget."""
    from autotune.search import context
    from autotune.search.loop import count_measured, get_rows, pick_best
    from autotune.search.reference import choose_reference
    from autotune.search.study import close_interrupted

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    steps = {"trial_0000": (100.0, 100.0), "trial_0001": (50.0, 100.0), "trial_0002": (40.0, 50.0)}
    monkeypatch.setattr(context, "run_trial", StandIn(steps))
    ctx = _ctx(tmp_path, optuna.create_study(study_name="s", storage=storage))
    before = [_run(ctx, key) for key in (None, "a", "b")]
    ctx.study.set_user_attr(ANCHORS_ATTR, {"2": {"ratio": 0.45, "step_ms": 42.0}})
    running = ctx.study.ask()  # the trial the search was measuring when its worker died
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    running.set_user_attr("worker", f"{socket.gethostname()}:{dead.pid}")

    resumed = _ctx(tmp_path, optuna.load_study(study_name="s", storage=storage))
    close_interrupted(resumed.study)
    rows = get_rows(resumed.study)
    assert [(r.number, r.state, r.ratio) for r in rows[:3]] == [(r.number, r.state, r.ratio) for r in before]
    assert (rows[3].state, rows[3].status) == ("FAIL", "interrupted") and count_measured(rows) == 3
    reference = choose_reference(resumed, rows, pick_best(rows))
    assert (reference.trial, reference.ratio, reference.step_ms) == (2, 0.45, 42.0)
