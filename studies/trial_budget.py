"""Prints how many trials a workload's search needs, from searches already recorded (no trial runs).

    .venv/bin/python studies/trial_budget.py runs/search_time/*/quiet [--budgets 8,10,12,16]

Reads the run dirs of finished searches of one workload (``results.json``, ``search.json``; e.g.
``benchmarks/search_time.py``'s), runs nothing, and prints:

1. per search, each trial's stop reason in order (``F``: clearly faster than the best so far,
   ``m``: its most pairs, ``u``: unlikely to beat the best, ``s``: pruned as slower, ``=``: settled;
   ``[Note: sequential measurement]``) and the emitted trial: where the clear new bests come;
2. an additive model of the log step ratio to the defaults (one-hot knob values, ridge), fitted
   over every trial's and finalist's ratio of all the searches: its residual spread is what the
   measurement's noise leaves, and its prediction stands in for a config's true ratio;
3. per budget (``--budgets``) and number of finalists: the modelled ratio of the config the search
   would have emitted, had it stopped after that many trials. Each search's own trials, in their
   order, are cut at the budget; its finalists are those the search's final round takes; the final
   round is drawn around each finalist's modelled ratio at ``--final-sd`` (a six-pair window at the
   box's pair spread) and the lowest is taken, ``--draws`` times per search.

A budget whose modelled ratio is within the model's own error of the largest budget's is as good
here; the model sees no interaction between knobs, so it is a lead, not a proof: the measured
searches (``benchmarks/search_time.py --trials``) decide. Every search read must be of the same workload.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.search.confirm import get_finalists  # noqa: E402
from autotune.search.results import TrialRow  # noqa: E402

STOP_CODES = {"faster": "F", "max_blocks": "m", "unlikely": "u", "slower": "s", "settled": "="}


def load_search(run_dir: Path) -> tuple[list[dict], dict]:
    """The search's trial rows and its ``search.json``."""
    rows = json.loads((run_dir / "results.json").read_text())["trials"]
    return rows, json.loads((run_dir / "search.json").read_text())


def stop_codes(rows: list[dict]) -> str:
    return "".join(STOP_CODES.get(r.get("stopped"), "?") for r in rows)


class AdditiveModel:
    """Log ratio = intercept + one effect per (knob, value), fitted by ridge regression."""

    def __init__(self, samples: list[tuple[dict, float]], ridge: float = 2.0) -> None:
        values = sorted({(k, json.dumps(v)) for params, _ in samples for k, v in params.items()})
        self.index = {kv: i for i, kv in enumerate(values)}
        x = np.array([self.features(params) for params, _ in samples])
        y = np.array([math.log(ratio) for _, ratio in samples])
        self.beta = np.linalg.solve(x.T @ x + ridge * np.eye(x.shape[1]), x.T @ y)
        self.residual_sd = float((y - x @ self.beta).std())

    def features(self, params: dict) -> np.ndarray:
        row = np.zeros(len(self.index) + 1)
        row[-1] = 1.0
        for k, v in params.items():
            i = self.index.get((k, json.dumps(v)))
            if i is not None:
                row[i] = 1.0
        return row

    def ratio(self, params: dict) -> float:
        return math.exp(float(self.features(params) @ self.beta))


def get_samples(searches: list[tuple[list[dict], dict]]) -> list[tuple[dict, float]]:
    """Every measured ratio to the defaults: each trial's and each finalist's in the final round."""
    samples = []
    for rows, search in searches:
        by_number = {r["number"]: r for r in rows}
        samples += [(r["params"], r["ratio"]) for r in rows if r.get("ratio") and r["state"] in ("COMPLETE", "PRUNED")]
        for f in (search.get("confirmation") or {}).get("finalists", []):
            if f.get("ratio") and f["trial"] in by_number:
                samples.append((by_number[f["trial"]]["params"], f["ratio"]))
    return samples


def emitted_ratio(
    model: AdditiveModel, rows: list[dict], budget: int, finalists: int, final_sd: float, rng: np.random.Generator
) -> float:
    """The modelled ratio of what a search cut at ``budget`` trials emits, one final round drawn;
    the finalists are the ones the search's own final round would take (:func:`get_finalists`)."""
    done = [TrialRow.from_dict(r, source="results.json") for r in rows if r["number"] < budget]
    top = get_finalists(done, finalists)
    if not top:
        return 1.0
    true = np.array([model.ratio(r.params) for r in top])
    drawn = true * np.exp(rng.normal(0.0, final_sd, len(true)))
    return float(true[int(drawn.argmin())])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--budgets", default="8,10,12,16")
    parser.add_argument("--finalists", default="1,2,3")
    parser.add_argument("--final-sd", type=float, default=0.045, help="log spread of a finalist's final-round ratio")
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    searches = [load_search(d) for d in args.run_dirs if (d / "search.json").exists()]
    if not searches:
        raise SystemExit(f"no finished search (search.json) under {', '.join(map(str, args.run_dirs))}")
    workloads = {json.dumps(search.get("model"), sort_keys=True) for _, search in searches}
    if len(workloads) > 1:
        raise SystemExit(f"the searches are of {len(workloads)} different models; give one workload's run dirs")
    for d, (rows, search) in zip(args.run_dirs, searches):
        print(f"{str(d):40s} {stop_codes(rows):20s} emitted trial {(search.get('confirmation') or {}).get('winner')}")
    samples = get_samples(searches)
    model = AdditiveModel(samples)
    print(f"\nadditive model: {len(samples)} ratios, residual spread {model.residual_sd:.1%}")
    rng = np.random.default_rng(args.seed)
    for budget in (int(b) for b in args.budgets.split(",")):
        cells = []
        for finalists in (int(f) for f in args.finalists.split(",")):
            draws = [
                emitted_ratio(model, rows, budget, finalists, args.final_sd, rng)
                for rows, _ in searches
                for _ in range(args.draws)
            ]
            cells.append(f"{finalists} finalists {statistics.fmean(draws):.4f}")
        print(f"{budget:3d} trials: modelled ratio emitted, " + ", ".join(cells))


if __name__ == "__main__":
    main()
