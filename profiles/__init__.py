"""Model and cluster profiles: data files plus small loaders.

A model profile is a TOML file in ``profiles/models/`` (or any path given by the user)
with a Llama 3 :class:`~profiles.llama.LlamaShape` and the per-rank training shape
(``seq_len``, ``batch_size``). A cluster profile in ``profiles/clusters/`` names the
backend, device, ranks per node and the link classes used by link emulation; GPU profiles
add an ``[accelerator]`` table and ``collective_model = "ring"`` for the step simulator
(``autotune plan``), each figure with its source in a comment.
"""

from profiles.chunked_init import SHARD_CACHE
from profiles.factory import BATCH_HOOK, LOSS_HOOK, FactoryModel, ModelSourceError, compute_loss
from profiles.hf import HFModel
from profiles.llama import Llama, LlamaShape, get_init_identity
from profiles.profile import (
    COLLECTIVE_MODELS,
    AcceleratorSpec,
    ClusterProfile,
    LinkClass,
    ModelProfile,
    build_model,
    list_cluster_profiles,
    list_model_profiles,
    load_cluster_profile,
    load_model_profile,
)
from profiles.sources import ModelSource, load_model_source, resolve_config_for_model
from profiles.torchtitan import TorchtitanModel

__all__ = [
    "SHARD_CACHE",
    "get_init_identity",
    "BATCH_HOOK",
    "COLLECTIVE_MODELS",
    "LOSS_HOOK",
    "AcceleratorSpec",
    "ClusterProfile",
    "FactoryModel",
    "HFModel",
    "LinkClass",
    "Llama",
    "LlamaShape",
    "ModelProfile",
    "ModelSource",
    "ModelSourceError",
    "TorchtitanModel",
    "build_model",
    "compute_loss",
    "list_cluster_profiles",
    "list_model_profiles",
    "load_cluster_profile",
    "load_model_profile",
    "load_model_source",
    "resolve_config_for_model",
]
