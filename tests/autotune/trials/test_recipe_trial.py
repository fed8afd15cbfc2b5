"""``autotune trial --config torchtitan``: torchtitan's recipe built for the model, run on its own."""

from __future__ import annotations

import sys

import pytest

from autotune.trials import TrialSpec
from fsdp_runtime import MixedPrecisionConfig

pytestmark = pytest.mark.torch_matrix


def test_trial_config_torchtitan_builds_the_recipe_for_the_model(tmp_path, monkeypatch):
    import cli

    spec_path = tmp_path / "spec.json"
    argv = ["autotune", "trial", "--model", "tiny", "--config", "torchtitan", "--out", str(tmp_path / "t")]
    monkeypatch.setattr(sys, "argv", [*argv, "--write-spec", str(spec_path)])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert not e.value.code
    config = TrialSpec.read(spec_path).config
    assert [(u.name, u.reshard_after_forward) for u in config.units] == [
        ("tok_embeddings", True),
        *((f"layers.{i}", True) for i in range(4)),
        ("norm+output", False),
        ("root", None),
    ]
    # the device's precision, as for FSDP2's defaults (this box: CPU, fp32; on CUDA bf16/fp32, torchtitan's own)
    assert config.mixed_precision == MixedPrecisionConfig(param_dtype="float32", reduce_dtype="float32")
