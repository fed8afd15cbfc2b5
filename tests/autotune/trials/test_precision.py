"""Precision resolution ([Note: precision defaults]), the CUDA checks made before anything is
written, and the overlap-deciding environment recorded in env.json. No ranks start here: CUDA is
a monkeypatched device count and device memory."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from autotune.trials import (
    MachineError,
    PrecisionError,
    TrialSpec,
    apply_precision_options,
    check_cuda_devices,
    check_fits_gpu,
    get_min_gpu_bytes,
    get_overlap_env,
    get_overlap_warning,
    resolve_precision,
    resolve_profile,
)
from autotune.trials.trialdir import write_trial_dir
from fsdp_runtime import MixedPrecisionConfig, default_config, save_config

pytestmark = pytest.mark.torch_matrix

BF16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
FP32 = MixedPrecisionConfig(param_dtype="float32", reduce_dtype="float32")
GIB = 2**30


def test_the_default_precision_is_the_device_s():
    assert resolve_precision("cuda") == BF16  # torchtitan's: bf16 params, fp32 reduction
    assert resolve_precision("cpu") == FP32  # this CPU's bf16 matmuls are slow
    assert resolve_precision("cpu", param_dtype="bfloat16") == BF16
    assert resolve_precision("cuda", param_dtype="float32") == FP32
    assert resolve_precision("cuda", reduce_dtype="bfloat16") == MixedPrecisionConfig(
        param_dtype="bfloat16", reduce_dtype="bfloat16"
    )


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype"])
def test_an_unknown_dtype_is_refused_naming_the_option(field):
    with pytest.raises(PrecisionError, match=r"unknown dtype 'fp8' \(use float32, bfloat16, float16\)") as e:
        resolve_precision("cpu", **{field: "fp8"})
    assert e.value.field == field


def test_a_config_s_own_precision_is_kept_unless_an_option_is_given():
    plain = default_config(["layers.0"])
    # No [mixed_precision] of its own: the device default, or the options.
    assert apply_precision_options(plain, "cuda") == (_with_mp(plain, BF16), [])
    assert apply_precision_options(plain, "cpu")[0].mixed_precision == FP32
    # Its own: kept as it is on any device...
    own = _with_mp(plain, MixedPrecisionConfig(param_dtype="float16", reduce_dtype="float32"))
    assert apply_precision_options(own, "cuda") == (own, [])
    assert apply_precision_options(own, "cpu", param_dtype="float16") == (own, [])  # same value: nothing to say
    # ...unless an option names a field: the option wins for that field, said in one line.
    changed, notes = apply_precision_options(own, "cpu", param_dtype="bfloat16")
    assert changed.mixed_precision == MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
    assert notes == ["--param-dtype bfloat16 overrides the config's [mixed_precision] param_dtype = float16"]
    with pytest.raises(PrecisionError) as e:
        apply_precision_options(own, "cpu", reduce_dtype="int8")
    assert e.value.field == "reduce_dtype"


def _with_mp(config, mp):
    import dataclasses

    return dataclasses.replace(config, mixed_precision=mp)


def test_trial_config_option_wins_over_the_config_s_and_says_so(tmp_path, capsys, monkeypatch):
    """``autotune trial --config`` (``--write-spec``: no ranks start) keeps the config's own
    [mixed_precision] unless an option is given; then the option wins, in one line."""

    config = tmp_path / "cfg.toml"
    save_config(_with_mp(default_config(["layers.0", "layers.1"]), BF16), config)

    def spec_of(*options: str) -> tuple[TrialSpec, str]:
        spec_path = tmp_path / "spec.json"
        args = ["trial", "--model", "tiny", "--config", str(config), "--out", str(tmp_path / "t"), *options]
        _run_cli(monkeypatch, [*args, "--write-spec", str(spec_path)])
        return TrialSpec.read(spec_path), capsys.readouterr().err

    spec, err = spec_of()
    assert spec.config.mixed_precision == BF16 and "overrides" not in err
    spec, err = spec_of("--param-dtype", "float32")
    assert spec.config.mixed_precision == FP32
    assert (
        err.count("\n") == 1
        and "--param-dtype float32 overrides the config's [mixed_precision] param_dtype = bfloat16" in err
    )
    # Without --config, FSDP2's defaults in the device's precision (this box: CPU, gloo).
    spec_path = tmp_path / "defaults.json"
    _run_cli(monkeypatch, ["trial", "--model", "tiny", "--out", str(tmp_path / "t"), "--write-spec", str(spec_path)])
    assert TrialSpec.read(spec_path).config.mixed_precision == FP32


def _run_cli(monkeypatch, args: list[str]) -> int:
    """``cli.main()`` in this process (its error mapping included); returns the exit code."""
    import cli

    monkeypatch.setattr(sys, "argv", ["autotune", *args])
    with pytest.raises(SystemExit) as e:
        cli.main()
    return e.value.code or 0


@pytest.mark.parametrize("command", ["search", "trial", "plan"])
def test_a_bad_dtype_option_is_one_line_exit_2_and_nothing_written(command, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    args = [command, "--model", "tiny", "--out", str(out), "--reduce-dtype", "fp8"]
    assert _run_cli(monkeypatch, args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--reduce-dtype: unknown dtype 'fp8'" in err, err
    assert not out.exists()


# --------------------------------------------------------------------------- CUDA, up front


def test_more_ranks_than_visible_gpus_are_refused(fake_cuda):
    check_cuda_devices(1, "cuda")
    check_cuda_devices(4, "cpu")  # gloo ranks need no GPU
    with pytest.raises(MachineError, match=r"2 ranks need 2 CUDA devices on this node, 1 visible .*--nproc 1") as e:
        check_cuda_devices(2, "cuda")
    assert e.value.field == "world_size"


def test_the_fit_bound_counts_sharded_state_and_one_gathered_unit():
    # 16 B/param sharded (fp32 param, grad, 2 AdamW states), one unit gathered in bf16 with fp32 reduction.
    assert get_min_gpu_bytes(1000, 100, 4, BF16) == 16 * 1000 // 4 + 100 * (2 + 4)
    assert get_min_gpu_bytes(1000, 100, 4, FP32) == 16 * 1000 // 4 + 100 * (4 + 4)


def test_a_model_no_gpu_holds_even_fully_sharded_is_refused(fake_cuda):
    llama8b = resolve_profile("llama8b")  # 8.03B params: 16 B each over 2 ranks is 59.8 GiB, + one block gathered
    check_fits_gpu(llama8b, 2, BF16, device_type="cuda", total_memory=80 * GIB)
    check_fits_gpu(llama8b, 2, BF16, device_type="cpu", total_memory=GIB)  # CPU: the search's proxy decides
    with pytest.raises(MachineError) as e:
        check_fits_gpu(llama8b, 2, BF16, device_type="cuda", total_memory=40 * GIB)
    assert e.value.field == "model"
    assert "needs at least 61.0 GiB per GPU fully sharded over 2 ranks (bfloat16 params, float32 reduce, AdamW)" in str(
        e.value
    )
    assert "over this GPU's 40.0 GiB" in str(e.value) and "autotune plan --model llama8b" in str(e.value)
    fake_cuda.total_memory = 40 * GIB  # read from torch.cuda.get_device_properties when not given
    with pytest.raises(MachineError):
        check_fits_gpu(llama8b, 2, BF16, device_type="cuda")


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["search", "--model", "tiny", "--nproc", "2"], "--nproc: 2 ranks need 2 CUDA devices"),
        (
            ["search", "--model", "llama8b", "--nproc", "1", "--no-proxy"],
            "--model: llama8b (8.03B params) needs at least",
        ),
        (["trial", "--model", "tiny", "--nproc", "2", "--backend", "nccl"], "--nproc: 2 ranks need 2 CUDA devices"),
        (["trial", "--model", "llama8b", "--nproc", "1", "--backend", "nccl"], "--model: llama8b"),
    ],
)
def test_cuda_refusals_are_one_line_exit_2_before_anything_is_written(
    args, flag, fake_cuda, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "out"
    assert _run_cli(monkeypatch, [*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err, err
    assert not out.exists()


def test_a_model_no_config_of_fits_one_gpu_is_searched_as_a_proxy_said_in_one_line(
    fake_cuda, tmp_path, monkeypatch, capsys
):
    """llama8b on one 80 GiB GPU: even its leanest config is over it, so the dry run plans a scale proxy
    (with ``--no-proxy`` it is refused, above)."""
    assert _run_cli(monkeypatch, ["search", "--model", "llama8b", "--dry-run", "--out", str(tmp_path / "o")]) == 0
    model = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("model: "))
    assert model.startswith("model: llama8b as the scale proxy llama8b@dim=") and "GiB per GPU on 1 ranks" in model


def test_a_torchrun_spec_is_checked_for_fit_not_for_this_node_s_gpus(fake_cuda, tmp_path, monkeypatch):
    """``--write-spec``: ``--nproc`` is the world over every node, so this node's GPU count is not checked."""
    spec = tmp_path / "spec.json"
    args = ["trial", "--model", "tiny", "--nproc", "16", "--backend", "nccl", "--out", str(tmp_path / "t")]
    assert _run_cli(monkeypatch, [*args, "--write-spec", str(spec)]) == 0
    assert TrialSpec.read(spec).config.mixed_precision == BF16  # NCCL ranks run on CUDA: its default


# --------------------------------------------------------------------------- overlap environment


def test_cuda_device_max_connections_1_is_named_with_its_fix_on_cuda_only():
    line = get_overlap_warning({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "cuda")
    assert line.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 is set: it serialises FSDP2's reduce-scatter behind compute")
    assert "unset it" in line and "\n" not in line
    assert get_overlap_warning({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "cpu") is None
    assert get_overlap_warning({"CUDA_DEVICE_MAX_CONNECTIONS": "32"}, "cuda") is None
    assert get_overlap_warning({}, "cuda") is None


def test_env_json_records_the_variables_that_decide_overlap(tmp_path, monkeypatch):
    from autotune.trials.program import _get_rank_env

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "8")
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    overlap = get_overlap_env()
    assert overlap["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and overlap["NCCL_MAX_NCHANNELS"] == "8"
    assert overlap["NCCL_ALGO"] is None
    # A rank reports what it saw; env.json records the ranks' values (here a trial whose ranks never reported).
    assert _get_rank_env(torch.device("cpu"))["overlap_env"] == overlap
    spec = TrialSpec(model="tiny", config=default_config(["layers.0"]), world_size=2, out_dir=tmp_path / "t")
    write_trial_dir(spec, status="crash", reason="x", rank_results=[], wall_s=0.0)
    env = json.loads((tmp_path / "t" / "env.json").read_text())
    assert env["schema_version"] == 3 and env["overlap_env"] == overlap
    ranks = [{"env": {"overlap_env": {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}}, "memory": {"source": "rss"}}]
    assert _get_env_of(spec, ranks)["overlap_env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}


def _get_env_of(spec, rank_results):
    from autotune.trials.trialdir import _get_env

    return _get_env(spec, rank_results)
