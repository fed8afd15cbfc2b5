"""What ``--model`` names, loaded as one kind of object whatever its source.

[Note: model sources]
``--model`` (``autotune search``, ``trial``, ``validate``) takes, checked in this order:

1. a model TOML naming a factory or an HF config, with its training shape::

       name = "my-llama"                  # optional; default: the file's stem
       hf_config = "llama3/config.json"   # or: factory = "package.module:function"
       seq_len = 512                      # optional, per rank and microbatch
       batch_size = 2                     # optional

   (a relative ``hf_config`` is relative to the TOML file);
2. a Hugging Face config: a path ending in ``.json`` or a local model directory
   (:class:`profiles.hf.HFModel`);
3. a model of torchtitan's registry, ``torchtitan:FAMILY/FLAVOR`` (``torchtitan:llama3/debugmodel``;
   :class:`profiles.torchtitan.TorchtitanModel`, [Note: torchtitan models]; the ``torchtitan`` extra);
   else a model factory ``package.module:function`` (:class:`profiles.factory.FactoryModel`,
   protocol in [Note: model factory protocol]);
4. a Llama profile: a built-in name or a TOML with a ``[shape]`` table
   (:func:`profiles.load_model_profile`).

Every kind answers the same questions: ``name``, ``source`` (the string trial ranks load
it from), ``seq_len``, ``batch_size``, ``vocab_size``, ``block_names`` and ``unit_names``
(the model's own module paths, from a meta-device build), ``get_num_params()``,
``build(device=, seed=)`` (identical weights on every rank for one seed) and
``with_overrides(**changes)`` (a scale proxy's widths, or the training shape).
``{"name": source, **overrides}`` names a resized one (what trials of a proxy receive).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_runtime.errors import ConfigError
from profiles.factory import DEFAULT_BATCH_SIZE, DEFAULT_SEQ_LEN, FactoryModel, ModelSourceError
from profiles.hf import HFModel, find_config_file, get_default_seq_len
from profiles.profile import ModelProfile, list_model_profiles, load_model_profile, read_profile_toml
from profiles.torchtitan import PREFIX as TORCHTITAN_PREFIX
from profiles.torchtitan import TorchtitanModel, parse_torchtitan_ref

if TYPE_CHECKING:
    from fsdp_runtime import RuntimeConfig

ModelSource = ModelProfile | FactoryModel | HFModel
"""Any model ``--model`` can name (see [Note: model sources])."""

_WRAPPER_FIELDS = ("name", "description", "factory", "hf_config", "seq_len", "batch_size")


def load_model_source(model: str | dict[str, Any]) -> ModelSource:
    """The model ``model`` names (see [Note: model sources]); a dict is ``{"name": ..., **overrides}``."""
    if isinstance(model, dict):
        overrides = dict(model)
        return load_model_source(overrides.pop("name")).with_overrides(**overrides)
    if not isinstance(model, str) or not model:
        raise ModelSourceError(f"expected a model name, path or package.module:function, got {model!r}")
    path = Path(model).expanduser()
    if path.suffix == ".toml" and path.is_file():
        data = read_profile_toml(path, "model")
        if "factory" in data or "hf_config" in data:
            return _load_wrapper(path, data)
        return load_model_profile(model)
    if path.suffix == ".json" or path.is_dir():
        config_path = find_config_file(model)
        name = config_path.parent.name or config_path.stem
        return HFModel(
            name=name,
            config_path=str(config_path),
            source=str(config_path),
            seq_len=get_default_seq_len(str(config_path)),
        )
    if model.startswith(TORCHTITAN_PREFIX):
        parse_torchtitan_ref(model)
        return TorchtitanModel(name=model, ref=model, source=model)
    if ":" in model and not path.exists():
        return FactoryModel(name=model, ref=model, source=model)
    try:
        return load_model_profile(model)
    except ConfigError as e:
        if e.path or path.exists():
            raise
        raise ModelSourceError(
            f"unknown model {model!r}: use a profile ({', '.join(list_model_profiles())}), a model TOML, "
            "package.module:function (a factory), or a Hugging Face config.json / local model dir"
        ) from None


def _load_wrapper(path: Path, data: dict[str, Any]) -> ModelSource:
    source = str(path.resolve())

    def fail(key: str, problem: str) -> ConfigError:
        return ConfigError(key, problem, source=str(path))

    for key in data:
        if key not in _WRAPPER_FIELDS:
            raise fail(
                key, f"unknown field (a model TOML naming a factory or an HF config knows {', '.join(_WRAPPER_FIELDS)})"
            )
    if "factory" in data and "hf_config" in data:
        raise fail("factory", "a model TOML names a factory or an hf_config, not both")
    for key in ("name", "description", "factory", "hf_config"):
        if key in data and not isinstance(data[key], str):
            raise fail(key, f"expected a string, got {data[key]!r}")
    for key in ("seq_len", "batch_size"):
        if key in data and (not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] < 1):
            raise fail(key, f"must be a positive integer, got {data[key]!r}")
    common = {"name": data.get("name", path.stem), "source": source, "description": data.get("description", "")}
    if data.get("factory", "").startswith(TORCHTITAN_PREFIX):  # a registry model at a training shape of its own
        parse_torchtitan_ref(data["factory"])
        shape = {k: data[k] for k in ("seq_len", "batch_size") if k in data}
        return TorchtitanModel(ref=data["factory"], **common, **shape)
    if "factory" in data:
        shape = {
            "seq_len": data.get("seq_len", DEFAULT_SEQ_LEN),
            "batch_size": data.get("batch_size", DEFAULT_BATCH_SIZE),
        }
        return FactoryModel(ref=data["factory"], **common, **shape)
    config_path = find_config_file(str(path.parent / Path(data["hf_config"]).expanduser()))
    shape = {
        "seq_len": data.get("seq_len", get_default_seq_len(str(config_path))),
        "batch_size": data.get("batch_size", DEFAULT_BATCH_SIZE),
    }
    return HFModel(config_path=str(config_path), **common, **shape)


def resolve_config_for_model(
    config: RuntimeConfig, model: str, *, source: str | None = None
) -> tuple[RuntimeConfig, list[str]]:
    """``config``'s units resolved against the model ``model`` names, built on the meta device
    (nothing allocated), as ``apply_fsdp`` would resolve them ([Note: unit names]); returns
    the resolved config and what the resolution said (e.g. names mapped by position).
    Errors name the config field (``units[2].name``) and the file (``source``)."""
    import warnings

    from fsdp_runtime import resolve_units

    module = load_model_source(model).build(device="meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            resolved = resolve_units(module, config)
        except ConfigError as e:
            raise ConfigError(e.path, e.problem, fix=e.fix, source=source) from None
    return resolved, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
