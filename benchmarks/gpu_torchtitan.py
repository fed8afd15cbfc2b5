"""Searches torchtitan 0.3.0's llama3 on one GPU; prints the emitted config's speedup over both baselines.

    PYTHONPATH=. python benchmarks/gpu_torchtitan.py --dry-run      # anywhere: everything up to the first CUDA call
    PYTHONPATH=. python benchmarks/gpu_torchtitan.py --out DIR      # on a GPU box: a few minutes on one H100/H200

torchtitan 0.3.0 comes from ``--torchtitan DIR`` (default ``.venv/torchtitan-0.3.0``, where ``./dev``
installs it with ``--no-deps``; put first on ``sys.path`` and on ``PYTHONPATH``, so the trial ranks
import it too), else from the installed torchtitan, which must then be 0.3.0 (0.2.2's models are
the ones that train on CPU: [Note: torchtitan models]). Beside torch (a CUDA build, with triton):
optuna, traceinsight, tyro and spmd_types (the last two in DIR or installed); the wheels a GPU box
lacks: ``benchmarks/gpu_suite.py``.

1. *the model*: ``torchtitan:llama3/FLAVOR`` of 0.3.0's registry, built as its trainer builds it
   (flex attention, the masks passed by the loss hook, built once per batch shape); the largest
   flavor of ``FLAVORS`` whose one model fits ``--fill`` of one GPU fully sharded
   (:func:`autotune.trials.get_min_gpu_bytes`, bf16 params; the rest is for activations). One
   model, because a trial holds one per GPU: the reference's knobs switched in place on the
   candidate's model, or, where the two differ in structure (torchtitan's recipe has a unit more
   than the defaults), the two models built in turn ([Note: models built in turn] in
   ``autotune/trials/in_turn.py``). 1B on an H100 (3B's 50 GiB is over 60% of 80 GiB), 3B on an
   H200; ``--flavor`` picks one. It trains at ``--seq-len`` x ``--batch-size`` per rank (4096 x 1:
   a model TOML naming the registry's flavor, ``model.toml`` under ``--out``), not the bare
   name's 128 x 4, whose steps a GPU runs in milliseconds.
2. *a search* of ``--trials`` trials (the defaults first) in bf16 params / fp32 reduce, 2
   microbatches, with the final round against FSDP2's defaults and against torchtitan's recipe.
3. *the answer*: the emitted config's speedup over FSDP2's defaults and over torchtitan's recipe
   (median and interquartile range of the final round's blocks), which config was emitted, and
   ``results.json`` under ``--out``.

``--dry-run`` makes no CUDA call: it checks the imports, builds 0.3.0's model on the meta device
(its units and torchtitan's recipe for it, both resolved against the model), the search's
settings, plan and space, the trial specs of the defaults and of the recipe's pair (checked as
a trial checks them), and prints the answer's lines from an empty record, so the script is known
to run before a GPU minute is spent on it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.search import SearchSettings  # noqa: E402
from fsdp_runtime import MixedPrecisionConfig, RuntimeConfig  # noqa: E402

BF16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
FAMILY = "llama3"
FLAVORS = ("debugmodel", "1B", "3B", "8B")
"""The llama3 flavors of 0.3.0's registry that one GPU may hold, smallest first."""
TORCHTITAN = "0.3.0"
DEFAULT_DIR = ROOT / ".venv" / f"torchtitan-{TORCHTITAN}"
NEEDED = {"optuna": "optuna", "hta": "traceinsight", "tyro": "tyro", "spmd_types": "spmd_types==0.2.3"}
"""Modules the GPU run imports beyond torch and torchtitan, and the wheel that brings each."""


def use_torchtitan(path: Path | None) -> str:
    """Put ``path`` (torchtitan 0.3.0, installed with ``--target``) first on ``sys.path`` and
    ``PYTHONPATH`` (the ranks'); the torchtitan version this process then imports, or exit."""
    if path is not None and (path / "torchtitan").is_dir():
        sys.path.insert(0, str(path))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(path), str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
    from profiles.torchtitan import get_installed_version

    version = get_installed_version()
    if version != TORCHTITAN:
        raise SystemExit(
            f"torchtitan {version or 'is not installed'}: this script runs {TORCHTITAN}; "
            f"pip install --no-deps --target {DEFAULT_DIR} torchtitan=={TORCHTITAN} spmd_types==0.2.3 (./dev does)"
        )
    return version


def check_imports() -> list[str]:
    """The wheels to carry to the GPU box: one line each for a module this Python lacks."""
    return [
        f"missing {module}: carry the {wheel} wheel"
        for module, wheel in NEEDED.items()
        if not importlib.util.find_spec(module)
    ]


def pick_flavor(*, gpu_bytes: int, fill: float, nproc: int) -> tuple[str, int]:
    """The largest of :data:`FLAVORS` whose model (one per GPU: a trial holds no second one) fits
    ``fill`` of one GPU fully sharded; and its bytes."""
    from autotune.trials import get_min_gpu_bytes
    from profiles import load_model_source

    best = None
    for flavor in FLAVORS:
        source = load_model_source(f"torchtitan:{FAMILY}/{flavor}")
        model = source.build(device="meta")
        num_params = source.get_num_params()
        blocks = [sum(p.numel() for p in model.get_submodule(b).parameters()) for b in source.block_names]
        largest = max(*blocks, num_params - sum(blocks))  # a block, or what the root holds
        need = get_min_gpu_bytes(num_params, largest, nproc, BF16)
        if need > fill * gpu_bytes:
            break
        best = (flavor, need)
    if best is None:
        raise SystemExit(f"torchtitan's {FAMILY}/{FLAVORS[0]} does not fit {fill:.0%} of {gpu_bytes / 2**30:.0f} GiB")
    return best


def write_model_file(flavor: str, args: argparse.Namespace, out: Path) -> Path:
    """The model TOML the search reads: the registry's flavor at ``--seq-len`` x ``--batch-size`` per rank."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.toml"
    path.write_text(
        f'name = "torchtitan-{FAMILY}-{flavor}"\nfactory = "torchtitan:{FAMILY}/{flavor}"\n'
        f"seq_len = {args.seq_len}\nbatch_size = {args.batch_size}\n"
    )
    return path.resolve()


def search_settings(flavor: str, args: argparse.Namespace, out: Path) -> SearchSettings:
    return SearchSettings(
        model=str(write_model_file(flavor, args, out)),
        world_size=args.nproc,
        num_trials=args.trials,
        num_microbatches=2,
        out_dir=out / "search",
        param_dtype="bfloat16",
        reduce_dtype="float32",
        num_confirm_pairs=args.confirm_pairs,
    )


def plan_search(settings: SearchSettings, gpu_bytes: int) -> tuple[list[str], RuntimeConfig, RuntimeConfig]:
    """What the search will run, checked as ``run_search`` checks it before its first CUDA call; the
    defaults and torchtitan's recipe, both resolved against the model built on meta."""
    from autotune.search import get_planned_target
    from autotune.search.run import make_space, prepare_search
    from fsdp_runtime import get_torchtitan_config, resolve_units

    target = get_planned_target("h200-node", settings.world_size, memory_bytes=gpu_bytes)
    plan = prepare_search(settings, target=target)  # as run_search plans and checks it, for a GPU of gpu_bytes
    source, mp = plan.source, plan.precision
    space = make_space(settings, plan)
    defaults = space.build_config(space.get_default_params())
    model = source.build(device="meta")
    recipe = get_torchtitan_config(model, defaults)
    for config in (defaults, recipe):
        resolve_units(model, config)  # each unit's modules are the model's
    lines = [
        f"search: {settings.num_trials} trials of {source.name} on {settings.world_size} GPU(s), {mp.param_dtype}/{mp.reduce_dtype}",
        f"model: {type(model).__name__}, {source.get_num_params() / 1e9:.3f}B params, blocks {source.block_names[0]}..{source.block_names[-1]}",
        f"space: {len(space.get_default_params())} knobs; defaults: {len(defaults.units)} units",
        f"recipe: {len(recipe.units)} units; beside the blocks: "
        + ", ".join(f"{u.name} (reshard after forward: {u.reshard_after_forward})" for u in recipe.units[-2:]),
        *space.notes,
    ]
    return lines, defaults, recipe


def trial_specs(settings: SearchSettings, defaults: RuntimeConfig, recipe: RuntimeConfig) -> dict[str, Any]:
    """The search's first trial (the defaults) and the final round's pair against the recipe, checked."""
    from autotune.trials import TrialSpec, check_trial_spec

    common = {"model": settings.model, "world_size": settings.world_size, "backend": "nccl", "timeout_s": 600}
    specs = {
        "defaults": TrialSpec(config=defaults, out_dir=settings.out_dir / "defaults", **common),
        "vs_recipe": TrialSpec(
            config=defaults, reference=recipe, profile=False, out_dir=settings.out_dir / "vs_recipe", **common
        ),
    }
    for spec in specs.values():
        check_trial_spec(spec)
    return specs


def format_speedups(confirmation: dict[str, Any] | None, recipe: dict[str, Any] | None) -> list[str]:
    """The answer: the emitted config's speedup over each baseline, with its spread, and what was emitted."""

    def speedup(figures: dict[str, Any] | None) -> str:
        if not figures or figures.get("speedup_median") is None:
            return f"not measured ({(figures or {}).get('reason') or 'no final round'})"
        spread = ""
        if figures.get("speedup_q25") is not None:
            spread = f" (interquartile {figures['speedup_q25']:.3f}-{figures['speedup_q75']:.3f}x)"
        return f"{figures['speedup_median']:.3f}x{spread}"

    if (recipe or {}).get("emitted") == "recipe":
        emitted = "torchtitan's recipe (the search's config did not beat it)"
    elif (confirmation or {}).get("emitted") == "defaults":
        emitted = "FSDP2's defaults (no config beat them)"
    else:
        emitted = "the search's config"
    return [
        f"speedup over FSDP2's defaults: {speedup(confirmation)}",
        f"speedup over torchtitan's recipe: {speedup(recipe)}",
        f"emitted: {emitted}",
    ]


def gpu_run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    from autotune.search import run_search

    args.nproc = args.nproc or torch.cuda.device_count()
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    flavor, need = (
        (args.flavor, None) if args.flavor else pick_flavor(gpu_bytes=gpu_bytes, fill=args.fill, nproc=args.nproc)
    )
    settings = search_settings(flavor, args, out)
    lines, _, _ = plan_search(settings, gpu_bytes)
    print("\n".join(lines), flush=True)
    started = time.monotonic()
    summary = run_search(settings)
    answer = format_speedups(summary.confirmation, summary.record.recipe)
    print("\n".join(answer), flush=True)
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "torchtitan": TORCHTITAN,
        "nproc": args.nproc,
        "model": settings.model,
        "model_gib": None if need is None else need / 2**30,
        "search_s": time.monotonic() - started,
        "best": {"trial": summary.best.number, "ratio": summary.best.ratio} if summary.best else None,
        "best_config": str(summary.best_config_path) if summary.best_config_path else None,
        "confirmation": summary.confirmation,
        "recipe": summary.record.recipe,
        "answer": answer,
    }


def dry_run(args: argparse.Namespace, out: Path) -> None:
    for line in check_imports():
        print(line)
    args.nproc = args.nproc or 1
    gpu_bytes = int(args.gpu_gib * 2**30)
    flavor, need = (
        (args.flavor, 0) if args.flavor else pick_flavor(gpu_bytes=gpu_bytes, fill=args.fill, nproc=args.nproc)
    )
    print(
        f"flavor: {FAMILY}/{flavor} (one model {need / 2**30:.1f} GiB of {args.gpu_gib:.0f} GiB, fill {args.fill:.0%}),"
        f" seq_len {args.seq_len} x batch {args.batch_size} per rank"
    )
    settings = search_settings(flavor, args, out)
    # The device queries before the first trial (the GPU's memory, the number of GPUs): stood in for.
    stand_in = types.SimpleNamespace(total_memory=gpu_bytes, name=f"dry run: {args.gpu_gib:.0f} GiB")
    with (
        mock.patch("torch.cuda.get_device_properties", lambda device=0: stand_in),
        mock.patch("torch.cuda.device_count", lambda: args.nproc),
    ):
        lines, defaults, recipe = plan_search(settings, gpu_bytes)
    print("\n".join(lines))
    for name, spec in trial_specs(settings, defaults, recipe).items():
        reference = "" if spec.reference is None else f" vs {len(spec.reference.units)} units"
        print(f"trial {name}: {Path(spec.model).name}, {len(spec.config.units)} units{reference}, {spec.backend}")
    print("\n".join(format_speedups(None, None)))
    print("dry run: no trial ran")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="no CUDA call: the model, plan and trial specs")
    parser.add_argument("--out", type=Path, default=None, help="trial dirs and results.json (default: a temp dir)")
    parser.add_argument("--torchtitan", type=Path, default=DEFAULT_DIR, help="a directory holding torchtitan 0.3.0")
    parser.add_argument("--nproc", type=int, default=None, help="GPUs (default: every GPU; 1 in a dry run)")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--confirm-pairs", type=int, default=3, help="the final round's pairs (x2 against the recipe)")
    parser.add_argument("--flavor", choices=FLAVORS, default=None, help="default: the largest that fits --fill")
    parser.add_argument(
        "--fill", type=float, default=0.6, help="one model's sharded training state, as a share of one GPU"
    )
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (torchtitan's configs: 8192)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank and microbatch")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="dry run: one GPU's memory (an H100's by default)")
    args = parser.parse_args()
    print(f"torchtitan {use_torchtitan(args.torchtitan)}")
    run_030_script("gpu_torchtitan", args, dry_run, gpu_run)


def run_030_script(name: str, args: argparse.Namespace, dry: Any, gpu: Any) -> None:
    """A torchtitan 0.3.0 script's run: this torch checked, ``--out`` made, then ``dry(args, out)``
    (``--dry-run``) or ``gpu(args, out)``, whose results go to ``results.json``."""
    from profiles.factory import ModelSourceError
    from profiles.torchtitan import check_torch_for_030

    try:  # before a minute is spent: 0.3.0 does not import with every torch (the GPU machines' 2.11)
        check_torch_for_030()
    except ModelSourceError as e:
        sys.exit(f"{name}.py: {e}")
    out = args.out or Path(tempfile.mkdtemp(prefix=f"{name}_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        dry(args, out)
        return
    results = gpu(args, out)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"written: {out / 'results.json'}")


if __name__ == "__main__":
    main()
