"""A Hugging Face model from its config alone: ``--model path/config.json`` or a local model dir.

Built with ``transformers.AutoModelForCausalLM.from_config`` (random weights, never a
download: only local files are read) in float32, with ``use_cache = False`` (training keeps
no KV cache). Unit names are the model's own module paths (``model.layers.0`` for Llama,
``transformer.h.0`` for GPT-2). Its batch and loss follow the causal-LM default of
[Note: model factory protocol] (:mod:`profiles.factory`), the output's ``.logits``.

Scale proxy: the widths an HF config names in the usual fields (``hidden_size``,
``intermediate_size`` / ``n_inner`` / ``ffn_dim``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``vocab_size``; GPT-2's ``n_embd``/``n_head`` through
its ``attribute_map``) can be overridden like a profile's (:meth:`HFModel.with_overrides`),
so ``autotune.search.proxy`` shrinks them by one factor and keeps every block. Needs the
``hf`` extra: ``pip install 'fsdp-autotune[hf]'``.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from profiles.factory import (
    DEFAULT_SEQ_LEN,
    FactsModel,
    ModelFacts,
    ModelSourceError,
    inspect_model,
)

if TYPE_CHECKING:
    from torch import nn

_FFN_FIELDS = ("intermediate_size", "n_inner", "ffn_dim")


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelSourceError("a Hugging Face config needs transformers: pip install 'fsdp-autotune[hf]'") from None
    transformers.logging.set_verbosity_error()  # config sanity notes would print once per rank and build
    return transformers


def find_config_file(value: str) -> Path:
    """The ``config.json`` a path names (the file itself, or a model dir holding one), absolute."""
    path = Path(value).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelSourceError(
            f"no Hugging Face config at {value!r} ({path} does not exist); pass a config.json or a local model directory (nothing is downloaded)"
        )
    return path.resolve()


@dataclass(kw_only=True, frozen=True, slots=True)
class HFModel(FactsModel):
    """A causal LM built from a local Hugging Face config, optionally with some fields overridden."""

    config_path: str
    """Absolute path of the ``config.json``."""
    config_overrides: tuple[tuple[str, Any], ...] = ()
    """Config fields set over the file's (a scale proxy's widths)."""

    def get_config(self) -> Any:
        """A fresh ``PretrainedConfig`` with the overrides applied and the KV cache off."""
        return _read_config(self.config_path, self.config_overrides)

    def build(self, *, device: str = "cpu", seed: int = 0) -> nn.Module:
        import torch

        transformers = _import_transformers()
        config = self.get_config()
        torch.manual_seed(seed)
        try:
            with torch.device(device):
                return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise ModelSourceError(
                f"{self.config_path}: AutoModelForCausalLM cannot build this config ({type(e).__name__}: {first})"
            ) from None

    @property
    def facts(self) -> ModelFacts:
        return _inspect_hf(self.config_path, self.config_overrides)

    def get_widths(self) -> dict[str, Any]:
        """``dim``, ``ffn_hidden_dim``, ``num_heads``, ``num_kv_heads``, ``vocab_size``,
        ``tie_embeddings``, ``num_layers``, read from the config; one line if one is missing."""
        config = self.get_config()
        missing = [
            k
            for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
            if not isinstance(getattr(config, k, None), int)
        ]
        if missing:
            raise ModelSourceError(
                f"{self.config_path}: no {', '.join(missing)} in this {type(config).__name__}, so no scale proxy can be made; search it where it fits"
            )
        dim, heads = config.hidden_size, config.num_attention_heads
        ffn = next((getattr(config, k) for k in _FFN_FIELDS if isinstance(getattr(config, k, None), int)), 4 * dim)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        tie = bool(getattr(config, "tie_word_embeddings", False))
        return {
            "dim": dim,
            "ffn_hidden_dim": ffn,
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "vocab_size": config.vocab_size,
            "tie_embeddings": tie,
            "num_layers": config.num_hidden_layers,
        }

    def get_width_overrides(
        self, *, dim: int, ffn_hidden_dim: int, vocab_size: int, num_heads: int, num_kv_heads: int
    ) -> dict[str, int]:
        """The config fields that give this model these widths (for :meth:`with_overrides`)."""
        config = self.get_config()
        overrides = {"hidden_size": dim}
        ffn_field = next((k for k in _FFN_FIELDS if isinstance(getattr(config, k, None), int)), None)
        if ffn_field is not None:
            overrides[ffn_field] = ffn_hidden_dim
        overrides |= {"vocab_size": vocab_size, "num_attention_heads": num_heads}
        if getattr(config, "num_key_value_heads", None) is not None:
            overrides["num_key_value_heads"] = num_kv_heads
        if getattr(config, "head_dim", None) is not None:
            overrides["head_dim"] = dim // num_heads
        return overrides

    def with_overrides(self, **changes: Any) -> HFModel:
        shape = {k: changes.pop(k) for k in ("seq_len", "batch_size") if k in changes}
        config = self.get_config()
        unknown = sorted(k for k in changes if not hasattr(config, k))
        if unknown:
            raise ModelSourceError(
                f"{self.config_path}: {type(config).__name__} has no field {unknown[0]!r} to override"
            )
        merged = dict(self.config_overrides) | changes
        return replace(self, config_overrides=tuple(merged.items()), **shape)


@functools.lru_cache(maxsize=64)
def _load_config(config_path: str) -> Any:
    transformers = _import_transformers()
    try:
        return transformers.AutoConfig.from_pretrained(config_path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ModelSourceError(
            f"{config_path}: not a Hugging Face config transformers can read ({type(e).__name__}: {first})"
        ) from None


def _read_config(config_path: str, overrides: tuple[tuple[str, Any], ...]) -> Any:
    config = copy.deepcopy(_load_config(config_path))
    for key, value in overrides:
        setattr(config, key, value)
    config.use_cache = False
    return config


@functools.lru_cache(maxsize=64)
def _inspect_hf(config_path: str, overrides: tuple[tuple[str, Any], ...]) -> ModelFacts:
    model = HFModel(name=config_path, config_path=config_path, source=config_path, config_overrides=overrides).build(
        device="meta"
    )
    return inspect_model(model, f"Hugging Face config {config_path}")


def get_default_seq_len(config_path: str) -> int:
    """``DEFAULT_SEQ_LEN``, at most the config's maximum positions."""
    config = _load_config(config_path)
    limit = next(
        (
            getattr(config, k)
            for k in ("max_position_embeddings", "n_positions", "n_ctx")
            if isinstance(getattr(config, k, None), int)
        ),
        None,
    )
    return min(DEFAULT_SEQ_LEN, limit) if limit else DEFAULT_SEQ_LEN
