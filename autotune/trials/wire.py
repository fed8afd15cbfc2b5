"""What the rank pools send through a store: signed JSON, never a pickle.

[Note: signed messages]
A store is a socket anyone who reaches its port can write to, so every value the project's pools
put there for a peer to act on (a job, a result, a worker's ticket and placement, a failure
report) is a :func:`seal`-ed message: JSON of

    {"v": 1, "key": <the store key it was set under>, "nonce": <32 random hex digits>,
     "body": <the value, encoded>, "mac": <HMAC-SHA256 of the rest, hex>}

keyed by a secret the driver makes per search (:func:`new_secret`) and hands to its ranks: the
one-host pool in its ranks' private spec file, the search across nodes in the environment or a
file the launcher passes (:func:`load_secret`; docs/workers.md). :func:`open_sealed` refuses, in
one :class:`WireError` line naming the sender, a value that is not such a message, whose MAC does
not match (tampered, or signed with another secret), that was sealed for another key (moved) or
whose nonce this process has already seen (replayed). Keys are never reused under one secret
(each names its world and job number), so a captured message cannot be set again where it would
be read. Heartbeat and job-count counters are bare integers (``store.add``): forging one can keep a
rank looking alive until its job's time limit, abort a world, or wake the driver early (which
then finds no signed result and waits on), never run code or forge a result.

The body's encoding is JSON with a few tagged objects for what JSON lacks: tuples, bytes (base64),
dicts with keys other than strings, sets, paths, and torch tensors (dtype, shape and their raw
bytes; torch is imported only where a tensor is met). Anything else is a ``TypeError`` naming its
type: a rank program returns data.

A job names its target as ``module:function``; :func:`check_target` accepts the project's own
targets (:data:`PROJECT_TARGETS`) and the modules or targets the rank's own environment allows
(``AUTOTUNE_ALLOW_TARGETS``: set by whoever starts the rank, never by the store), and refuses
any other in one line: a valid signature is needed to name a target, an allowed one to run it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path, PurePath
from typing import Any

from fsdp_runtime.errors import AutotuneError

__all__ = [
    "ALLOW_TARGETS_ENV",
    "PROJECT_TARGETS",
    "SECRET_ENV",
    "WireError",
    "check_target",
    "decode",
    "encode",
    "load_secret",
    "new_secret",
    "open_sealed",
    "seal",
]

VERSION = 1
SECRET_ENV = "AUTOTUNE_POOL_SECRET"
"""The search's secret, hex, where the launcher passes it in the environment ([Note: signed messages])."""
ALLOW_TARGETS_ENV = "AUTOTUNE_ALLOW_TARGETS"
"""Comma-separated modules (``pkg.mod``) or targets (``pkg.mod:fn``) a rank may run besides the project's."""
PROJECT_TARGETS = frozenset(
    {
        "autotune.trials.program:run_trial_rank",
        "autotune.trials.numerics:memorise_ranks",
        "autotune.trials.numerics:switch_ranks",
        "autotune.search.consolidation:consolidation_timing",
        "autotune.trials.worker:check_rank",
    }
)
"""Every rank program of the project's own that a pool runs."""
_SECRET_BYTES = 32
_seen: set[str] = set()


class WireError(AutotuneError):
    """A message refused: not signed, tampered, moved, replayed, or naming a target not allowed."""


def new_secret() -> bytes:
    """A fresh secret for one search (or one start of the one-host pool)."""
    return secrets.token_bytes(_SECRET_BYTES)


def load_secret(path: str | Path | None = None) -> bytes:
    """The search's secret from ``path`` (a file holding it in hex) or else ``$AUTOTUNE_POOL_SECRET``;
    a one-line :class:`WireError` where neither holds one of at least 16 bytes."""
    where = f"the file {path}" if path is not None else f"${SECRET_ENV}"
    try:
        text = Path(path).read_text().strip() if path is not None else os.environ.get(SECRET_ENV, "").strip()
    except OSError as e:
        raise WireError(f"cannot read the pool's secret from {where}: {e.strerror}") from None
    if not text:
        raise WireError(
            f"no secret for the pool's messages in {where}: give the workers the search's secret "
            f"(${SECRET_ENV}, or --secret-file; docs/workers.md)"
        )
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise WireError(f"the pool's secret in {where} is not hex") from None
    if len(secret) < 16:
        raise WireError(f"the pool's secret in {where} is {len(secret)} bytes: at least 16 are needed")
    return secret


def _mac(secret: bytes, fields: dict[str, Any]) -> str:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def seal(secret: bytes, key: str, value: Any) -> bytes:
    """``value`` as a signed message for the store key ``key`` ([Note: signed messages])."""
    fields = {"v": VERSION, "key": key, "nonce": secrets.token_hex(16), "body": encode(value)}
    return json.dumps(fields | {"mac": _mac(secret, fields)}, allow_nan=True).encode()


def open_sealed(secret: bytes, key: str, data: bytes, *, sender: str) -> Any:
    """The value of a message read from ``key``; a one-line :class:`WireError` naming ``sender``
    (who is meant to have set it: an address, a rank and its host) where it is refused."""

    def refuse(why: str) -> WireError:
        return WireError(f"refused the value of {key!r} from {sender}: {why}")

    try:
        message = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise refuse("not a signed message (not JSON: a pickle, or garbage)") from None
    if not isinstance(message, dict) or set(message) != {"v", "key", "nonce", "body", "mac"}:
        raise refuse("not a signed message (no MAC)")
    if message["v"] != VERSION:
        raise refuse(f"message version {message['v']!r}, this side reads {VERSION}")
    fields = {name: message[name] for name in ("v", "key", "nonce", "body")}
    mac = message["mac"]
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(secret, fields)):
        raise refuse("bad signature (tampered, or signed with another search's secret)")
    if message["key"] != key:
        raise refuse(f"signed for {message['key']!r} (moved)")
    if message["nonce"] in _seen:
        raise refuse("replayed (its nonce was seen before)")
    _seen.add(message["nonce"])
    return decode(message["body"])


def check_target(target: str) -> None:
    """Refuse, in one line, a target that is neither the project's nor allowed by this rank's environment."""
    if target in PROJECT_TARGETS:
        return
    module = target.partition(":")[0]
    allowed = {entry.strip() for entry in os.environ.get(ALLOW_TARGETS_ENV, "").split(",") if entry.strip()}
    if target in allowed or module in allowed:
        return
    raise WireError(
        f"refused the job's target {target!r}: not one of the project's rank programs, and its module is not "
        f"in ${ALLOW_TARGETS_ENV} of this rank"
    )


# -- the body's encoding ---------------------------------------------------------------

_TAG = "__wire__"


def encode(value: Any) -> Any:
    """``value`` as JSON data, tagged where JSON has no type of its own ([Note: signed messages])."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: encode(v) for k, v in value.items()}
        return {_TAG: "dict", "items": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [encode(v) for v in value]}
    if isinstance(value, set | frozenset):
        return {_TAG: "set", "items": [encode(v) for v in value]}
    if isinstance(value, bytes | bytearray):
        return {_TAG: "bytes", "b64": base64.b64encode(value).decode()}
    if isinstance(value, PurePath):
        return {_TAG: "path", "path": str(value)}
    if type(value).__module__ == "torch" and type(value).__name__ in ("Tensor", "Parameter"):
        return _encode_tensor(value)
    if hasattr(value, "item") and type(value).__module__ == "numpy":  # a numpy scalar
        return value.item()
    raise TypeError(f"cannot send a {type(value).__module__}.{type(value).__qualname__} through the pool: return data")


def decode(data: Any) -> Any:
    """The value :func:`encode` encoded."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    tag = data.get(_TAG)
    if tag is None:
        return {k: decode(v) for k, v in data.items()}
    if tag == "dict":
        return {_hashable(decode(k)): decode(v) for k, v in data["items"]}
    if tag == "tuple":
        return tuple(decode(v) for v in data["items"])
    if tag == "set":
        return {_hashable(decode(v)) for v in data["items"]}
    if tag == "bytes":
        return base64.b64decode(data["b64"])
    if tag == "path":
        return Path(data["path"])
    if tag == "tensor":
        return _decode_tensor(data)
    raise ValueError(f"unknown tag {tag!r} in a pool message")


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _encode_tensor(tensor: Any) -> dict[str, Any]:
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return {_TAG: "tensor", "dtype": dtype, "shape": list(tensor.shape), "b64": base64.b64encode(raw).decode()}


def _decode_tensor(data: dict[str, Any]) -> Any:
    import torch

    dtype = getattr(torch, data["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {data['dtype']!r} in a pool message")
    raw = bytearray(base64.b64decode(data["b64"]))
    if not raw:
        return torch.empty(data["shape"], dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(data["shape"]).clone()
