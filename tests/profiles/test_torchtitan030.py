"""torchtitan 0.3.0's registry ([Note: torchtitan models]): read and built on the meta device, its
attention masks passed by the loss hook, and its models refused for CPU training in one line.

0.3.0 is not the venv's torchtitan (0.2.2, which trains here): the checks run in a subprocess with
0.3.0 first on ``PYTHONPATH`` (``tests/_torchtitan030.py``; skipped without it, failed under
``AUTOTUNE_REQUIRE_ALL=1``). One subprocess for the module (``checked``): each check's code runs
in turn there and its result is kept apart, the registry's first (what it imports is checked
before anything else ran), the CLI's as the console script runs it (``cli.main()``). A process per
check spent most of its time importing torch, torchtitan and the CLI again.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from _torchtitan030 import run_with_030

pytestmark = pytest.mark.torch_matrix

MODEL = "torchtitan:llama3/debugmodel"

CHECKS = {
    "registry": """
        import json, sys
        import torch, torch._dynamo  # what torch's compiler imports (triton, where installed) is not torchtitan's doing
        torch_imported = set(sys.modules)
        from fsdp_runtime import get_torchtitan_units
        from profiles import load_model_source
        from profiles.torchtitan import get_installed_version

        result = {"version": get_installed_version()}
        for ref in ("torchtitan:llama3/debugmodel", "torchtitan:qwen3/debugmodel"):
            source = load_model_source(ref)
            model = source.build(device="meta")
            result[ref] = {
                "cls": [type(model).__module__, type(model).__name__],
                "blocks": source.block_names,
                "vocab": source.vocab_size,
                "params": source.get_num_params(),
                "rope": sorted({l.attention.rope.max_seq_len for l in model.config.layers}),
                "attention": type(model.config.layers[0].attention.inner_attention).__qualname__,
                "units": [[u.name, u.reshard_after_forward] for u in get_torchtitan_units(model)],
            }
        result["seq_len"] = source.seq_len
        result["imported"] = sorted(
            m for m in ("datasets", "tensorboard", "wandb", "triton", "torchdata", "torchtitan.trainer")
            if m in sys.modules and m not in torch_imported
        )
        print(json.dumps(result))
        """,
    "refused": """
        import json
        from profiles import ModelSourceError, load_model_source

        errors = []
        for ref in ("torchtitan:llama3/huge", "torchtitan:qwen3/debugmodel_moe"):
            try:
                load_model_source(ref).build(device="meta")
            except ModelSourceError as e:
                errors.append(str(e))
        print(json.dumps(errors))
        """,
    "cpu_build": """
        import json
        from profiles import ModelSourceError, load_model_source
        source = load_model_source("torchtitan:llama3/debugmodel")
        source.check_device_type("cuda")  # trains there
        try:
            source.build(device="cpu")
            print(json.dumps("built"))
        except ModelSourceError as e:
            print(json.dumps(str(e)))
        """,
    "loss_hook": """
        import json, math, torch
        from profiles import load_model_source

        source = load_model_source("torchtitan:llama3/debugmodel")
        model = source.build(device="meta")  # on CPU it refuses to train; its forward runs without grad
        model.to_empty(device="cpu")
        batch = torch.randint(0, 2048, (2, source.seq_len + 1), generator=torch.Generator().manual_seed(0))
        built, passed = [], []  # the masks the model built, and those each forward was given
        get_masks = model.get_attention_masks
        model.get_attention_masks = lambda **kw: built.append(get_masks(**kw)) or built[-1]
        model.register_forward_pre_hook(lambda m, a, kw: passed.append(kw.get("attention_masks")), with_kwargs=True)
        with torch.no_grad():
            model.init_weights()
            losses = [model.compute_autotune_loss(batch).item() for _ in range(3)]  # three steps
            model.compute_autotune_loss(batch[:1])  # another batch shape
            try:
                model(batch[:, :-1])
                maskless = "ran"
            except AssertionError as e:
                maskless = str(e)
        print(json.dumps({
            "loss": losses[0],
            "same_loss": len(set(losses)) == 1,
            "built": len(built),
            "passed_built": [next(i for i, b in enumerate(built) if b is p) for p in passed[:4]],
            "mask_type": type(built[0]).__name__,
            "maskless": maskless,
        }))
        """,
}

# Runs each step in turn, a check (its last line of output is its JSON result; an exception is its
# result instead) or ``autotune ARGS`` (its exit code and stderr), and prints every result as JSON.
DRIVER = """
import contextlib, io, json, sys, traceback

results = {}
for name, kind, payload in json.loads(sys.argv[1]):
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if kind == "check":
                exec(compile(payload, f"<check {name}>", "exec"), {"__name__": "__main__"})
            else:
                import cli

                sys.argv = ["autotune", *payload]
                try:
                    cli.main()
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        results[name] = {"error": traceback.format_exc() + out.getvalue()[-2000:] + err.getvalue()[-2000:]}
        continue
    if kind == "check":
        results[name] = {"result": json.loads(out.getvalue().strip().splitlines()[-1])}
    else:
        results[name] = {"result": {"code": code, "stderr": err.getvalue()}}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def cli_out(tmp_path_factory):
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def checked(cli_out) -> dict:
    """Every check's result, from one subprocess with torchtitan 0.3.0 (the hard limit covers all)."""
    checks = [[name, "check", textwrap.dedent(CHECKS[name])] for name in ("registry", "refused", "cpu_build")]
    commands = [[f"cli {c}", "cli", [c, "--model", MODEL, "--out", str(cli_out / c)]] for c in ("search", "trial")]
    # The registry's check first (nothing else imported yet), the heaviest last.
    steps = [*checks, *commands, ["loss_hook", "check", textwrap.dedent(CHECKS["loss_hook"])]]
    done = run_with_030(["-c", DRIVER, json.dumps(steps)], timeout_s=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _result(checked: dict, name: str):
    entry = checked[name]
    assert "error" not in entry, entry.get("error")
    return entry["result"]


def test_0_3_0_s_registry_builds_its_models_on_meta_and_their_units_come_from_the_model(checked):
    out = _result(checked, "registry")
    assert out["version"] == "0.3.0"
    llama = out["torchtitan:llama3/debugmodel"]
    assert llama["cls"] == ["torchtitan.models.llama3.model", "Llama3Model"]
    assert llama["blocks"] == [f"layers.{i}" for i in range(6)] and llama["vocab"] == 2048
    assert llama["params"] == 6_163_712  # 0.2.2's debugmodel: the same widths
    assert llama["rope"] == [out["seq_len"]]  # the RoPE cache at the training length, as its trainer sets it
    assert llama["attention"] == "FlexAttention.Config"  # the registry's default
    # Units come from the model (0.3.0 names its head lm_head): torchtitan's recipe for it.
    assert llama["units"] == [
        ["tok_embeddings", True],
        *([f"layers.{i}", True] for i in range(6)),
        ["norm+lm_head", False],
        ["root", None],
    ]
    qwen = out["torchtitan:qwen3/debugmodel"]
    assert qwen["cls"] == ["torchtitan.models.qwen3.model", "Qwen3Model"] and len(qwen["blocks"]) == 8
    assert qwen["units"][-2:] == [["tok_embeddings+norm+lm_head", False], ["root", None]]  # its tied head
    assert out["imported"] == []  # no trainer, data loaders, metrics or Triton


def test_0_3_0_s_registry_refuses_what_it_does_not_build_in_one_line(checked):
    out = _result(checked, "refused")
    assert out[0].startswith(
        "'torchtitan:llama3/huge': torchtitan's llama3 registry has no flavor 'huge' (debugmodel, "
    )
    assert out[1] == "'torchtitan:qwen3/debugmodel_moe': only the dense decoders of the registry are built here"


def test_the_loss_hook_passes_0_3_0_s_attention_masks(checked):
    """0.3.0's flex model runs forward on CPU (no backward): with the hook's positions and masks it
    gives the loss; without masks it cannot run at all."""
    out = _result(checked, "loss_hook")
    assert 0 < out["loss"] < 20, out  # about ln(2048) = 7.6 at initialisation
    assert out["maskless"].startswith("attention_masks must be instance of BlockMask")


def test_the_loss_hook_builds_0_3_0_s_masks_once_per_batch_shape(checked):
    """One document per row: the masks depend on the batch's shape alone, so three steps of one
    shape build them once (in the first, a warm-up step: not in a timed step) and pass the same
    BlockMask to every forward; another shape builds its own."""
    out = _result(checked, "loss_hook")
    assert (out["mask_type"], out["built"], out["same_loss"]) == ("BlockMask", 2, True), out
    assert out["passed_built"] == [0, 0, 0, 1]


def test_training_0_3_0_s_models_on_cpu_is_refused_in_one_line(checked, cli_out):
    message = (
        "'torchtitan:llama3/debugmodel': torchtitan 0.3.0's models train only with flex or varlen attention, "
        "and FlexAttention has no backward on CPU: train it on a GPU, or install torchtitan 0.2.2 (SDPA) to "
        "train on CPU: pip install 'fsdp-autotune[torchtitan]'"
    )
    for command in ("search", "trial"):
        done = _result(checked, f"cli {command}")
        assert (done["code"], done["stderr"].splitlines()) == (2, [f"error: --model: {message}"]), done["stderr"]
        assert not (cli_out / command).exists()  # refused before anything is written
    assert _result(checked, "cpu_build") == message


def test_0_3_0_on_a_torch_it_cannot_import_is_refused_in_one_line():
    """0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims`` (torch 2.12 on): on the GPU
    machines' torch 2.11 the model source and the GPU benchmark refuse it in one line naming the
    torch it needs, before anything is built. Where torch has the name, the test takes it away."""
    from _torchtitan030 import run_with_030

    without = "import torch.distributed.fsdp as f; f.__dict__.pop('DataParallelMeshDims', None); "
    build = (
        "from profiles import load_model_source; load_model_source('torchtitan:llama3/debugmodel').build(device='meta')"
    )
    done = run_with_030(["-c", without + build], torch_can=False, timeout_s=120)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("profiles.factory.ModelSourceError: torchtitan 0.3.0 needs torch >= 2.12"), done.stderr[
        -2000:
    ]
    script = (
        without + "import runpy, sys; sys.argv = ['gpu_torchtitan.py', '--dry-run']; "
        "runpy.run_path('benchmarks/gpu_torchtitan.py', run_name='__main__')"
    )
    done = run_with_030(["-c", script], torch_can=False, timeout_s=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("gpu_torchtitan.py: torchtitan 0.3.0 needs torch >= 2.12"), done.stderr
