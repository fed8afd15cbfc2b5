"""``autotune search --dry-run``: what a search would run and, across nodes, the world it would run on; no trial.

A user of a cluster runs it first, on one node or on all of them, or with ``--plan-for CLUSTER`` from a
login node without GPUs: the search plan (the model as itself or its proxy, the baseline, the rounds and
their cost: [Note: the search plan] in :mod:`autotune.search.search_plan`), the space (the
meshes named by node), and with ``--workers`` the world formed exactly as the search forms it
(``[Note: node pool]`` in :mod:`autotune.trials.nodes`): every rank's host, node and device, and
one all-reduce over the whole world timed, so that a node that cannot reach the others is found
before a trial is spent. Nothing is written but ``--out`` itself (checked writable, as a search
checks it): no study, no trial dir.
"""

from __future__ import annotations

import statistics
from typing import Any

from autotune.search.loop import open_pool
from autotune.search.run import get_node_notes, make_space, prepare_search
from autotune.search.settings import SearchError, SearchSettings

__all__ = ["dry_run_search"]


def dry_run_search(settings: SearchSettings) -> list[str]:
    """The lines a dry run prints ([module doc]); :class:`SearchError` where the world's check fails."""
    plan = prepare_search(settings)
    space = make_space(settings, plan)
    lines = [
        *plan.describe(),
        f"search: {settings.num_trials} trials on {settings.world_size} ranks",
        f"space: {len(space.get_default_params())} knobs; meshes: {', '.join(space.get_mesh_choices())}",
        *space.notes,
        *space.device_notes,
        *get_node_notes(settings, space),
    ]
    if settings.workers is not None:
        with open_pool(settings) as pool:
            run = pool.run("autotune.trials.worker:check_rank", timeout_s=120)
        if not run.ok:
            raise SearchError(f"the world formed, but its check failed: {run.reason}", field="workers")
        lines += describe_checked_world(run.results)
    return [*lines, "dry run: no trial ran"]


def describe_checked_world(ranks: list[dict[str, Any]]) -> list[str]:
    """Per node its host, ranks and devices; the world's all-reduce time (the slowest rank's)."""
    nodes: dict[int, list[dict[str, Any]]] = {}
    for rank in ranks:
        nodes.setdefault(rank["node"], []).append(rank)
    lines = [f"world: {len(ranks)} ranks on {len(nodes)} node(s)"]
    for node, members in sorted(nodes.items()):
        devices = sorted({m["device"] for m in members})
        ids = ", ".join(str(m["rank"]) for m in members)
        lines.append(f"  node {node} ({members[0]['host']}): ranks {ids} on {', '.join(devices)}")
    slowest = max(r["all_reduce_ms"] for r in ranks)
    spread = statistics.median(r["all_reduce_ms"] for r in ranks)
    lines.append(f"all-reduce of 8 MiB over every rank: {slowest:.1f} ms (median rank {spread:.1f} ms)")
    return lines
