"""Signed messages instead of pickles ([Note: signed messages] in autotune/trials/wire.py) and the
pools' stores on the interface they are meant for ([Note: store binding] in autotune/trials/stores.py).

The codec and the MAC on their own; then the one-host pool under attack from a client of its
store: an unsigned, tampered or replayed job is refused by the ranks in one line and not run, a
forged result is refused by the parent, a target off the allowlist is refused; the store takes
no connection on an address other than loopback; the node pool passes over a forged ticket."""

from __future__ import annotations

import json
import math
import os
import pickle
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed import PrefixStore, TCPStore

from autotune.trials import NodePool
from autotune.trials.loopback import get_free_port
from autotune.trials.nodes import get_pool_secret
from autotune.trials.stores import listen_store
from autotune.trials.wire import (
    ALLOW_TARGETS_ENV,
    SECRET_ENV,
    WireError,
    check_target,
    decode,
    encode,
    load_secret,
    new_secret,
    open_sealed,
    seal,
)

KEY = "gen/3/job/7"


def test_every_kind_of_value_a_rank_program_returns_comes_back_equal():
    value = {
        "losses": [1.5, float("inf"), None],
        "pair": (1, "a"),
        "by_rank": {0: {"ms": 2.0}, 1: {"ms": 3.0}},
        "names": {"a", "b"},
        "raw": b"\x00\xff",
        "__wire__": "not a tag",
    }
    back = decode(json.loads(json.dumps(encode(value))))
    assert back == value
    assert math.isnan(decode(json.loads(json.dumps(encode(float("nan"))))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_tensors_come_back_bitwise_with_their_dtype_and_shape(dtype):
    tensor = (torch.randn(3, 4) * 100).to(dtype)
    back = decode(json.loads(json.dumps(encode({"t": tensor, "empty": torch.zeros(0, 2, dtype=dtype)}))))
    assert back["t"].dtype == dtype and torch.equal(back["t"], tensor)
    assert back["empty"].shape == (0, 2) and back["empty"].dtype == dtype


def test_an_object_that_is_not_data_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="cannot send a builtins.object through the pool"):
        encode({"x": object()})


def test_a_sealed_message_opens_once_under_its_key_and_secret():
    secret = new_secret()
    assert open_sealed(secret, KEY, seal(secret, KEY, {"target": "m:f"}), sender="the driver") == {"target": "m:f"}


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda s: pickle.dumps({"target": "os:system"}), "not a signed message"),
        (lambda s: json.dumps({"target": "os:system"}).encode(), "not a signed message (no MAC)"),
        (lambda s: seal(new_secret(), KEY, 1), "bad signature"),
        (lambda s: seal(s, KEY, 1).replace(b'"body": 1', b'"body": 2'), "bad signature"),
        (lambda s: seal(s, "gen/2/job/7", 1), "signed for 'gen/2/job/7' (moved)"),
    ],
    ids=["pickle", "unsigned", "other-secret", "tampered", "moved"],
)
def test_a_message_not_signed_for_its_key_is_refused_in_one_line_naming_the_sender(make, why):
    secret = new_secret()
    with pytest.raises(WireError) as refused:
        open_sealed(secret, KEY, make(secret), sender="rank 1 on node-7")
    line = str(refused.value)
    assert line.startswith(f"refused the value of {KEY!r} from rank 1 on node-7: ") and why in line
    assert "\n" not in line


def test_a_replayed_message_is_refused():
    secret = new_secret()
    message = seal(secret, KEY, 1)
    open_sealed(secret, KEY, message, sender="the driver")
    with pytest.raises(WireError, match="replayed"):
        open_sealed(secret, KEY, message, sender="the driver")


def test_only_the_project_s_targets_and_those_the_rank_s_environment_allows_run(monkeypatch):
    check_target("autotune.trials.program:run_trial_rank")
    monkeypatch.setenv(ALLOW_TARGETS_ENV, "my_pkg.train, other:fn")
    check_target("my_pkg.train:step")
    check_target("other:fn")
    for target in ("os:system", "other:fn2", "autotune.trials.launch:kill_tree"):
        with pytest.raises(WireError, match=rf"refused the job's target '{target}': not one of the project's"):
            check_target(target)


def test_the_secret_is_read_from_the_environment_or_a_file_or_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(WireError, match=r"no secret for the pool's messages in \$AUTOTUNE_POOL_SECRET"):
        load_secret()
    (tmp_path / "short").write_text("abcd")
    with pytest.raises(WireError, match="is 2 bytes: at least 16 are needed"):
        load_secret(tmp_path / "short")
    with pytest.raises(WireError, match="cannot read the pool's secret from the file"):
        load_secret(tmp_path / "missing")
    made = get_pool_secret(tmp_path / "out", say=lambda line: None)  # none given: made, written 0600
    path = tmp_path / "out" / "pool-secret"
    assert load_secret(path) == made and (path.stat().st_mode & 0o777) == 0o600
    assert get_pool_secret(tmp_path / "out") == made  # a resumed search's workers keep theirs
    monkeypatch.setenv(SECRET_ENV, made.hex())
    assert load_secret() == made


def _other_address() -> str | None:
    """An address of this host that is not loopback, or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: it picks the outgoing interface
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_a_store_listens_on_the_address_it_is_given_only():
    store = listen_store("127.0.0.1", 0)
    client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"
    other = _other_address()
    if other is None:
        pytest.skip("this host has no address but loopback to try a connection on")
    with pytest.raises(ConnectionRefusedError), socket.create_connection((other, store.port), timeout=5):
        pass


def _attacker(pool) -> PrefixStore:
    """A client of the pool's store, as anyone on this host could open: its port is the only secret it needs."""
    port = pool._store.port
    return PrefixStore("pool/", TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)))


@pytest.mark.multirank
@pytest.mark.parametrize("forge", ["pickle", "tampered", "replayed"])
def test_a_forged_job_on_the_one_host_pool_s_store_is_refused_and_never_run(pool2, tmp_path, forge):
    assert pool2.run("_trial_programs:get_rank_pid", timeout_s=90).ok  # the ranks up, waiting for job n
    n, marker = pool2._next_job, tmp_path / "ran"
    job = {"target": "_trial_programs:touch", "kwargs": {"path": str(marker)}}
    if forge == "pickle":
        data = pickle.dumps(job)
    elif forge == "tampered":  # a real job's message, its target swapped
        data = seal(pool2._secret, f"pool/job/{n}", {"target": "_trial_programs:get_rank_pid", "kwargs": {}})
        data = data.replace(b"get_rank_pid", b"touch")
    else:  # a real job's message, captured while it ran, set again as the next job
        attacker, captured = _attacker(pool2), []
        threading.Timer(1.0, lambda: captured.append(attacker.get(f"job/{n}"))).start()
        assert pool2.run("_trial_programs:sleep_then_pid", {"seconds": 2}, timeout_s=60).ok and captured
        n, data = n + 1, captured[0]
    _attacker(pool2).set(f"job/{n}", data)
    deadline = time.monotonic() + 30
    while any(p.poll() is None for p in pool2._procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    run = pool2.run("_trial_programs:get_rank_pid", timeout_s=30)  # the dead ranks' reason
    why = {"pickle": "not a signed message", "tampered": "bad signature", "replayed": f"signed for 'pool/job/{n - 1}'"}
    assert run.status == "crash" and "WireError: rank " in run.reason and why[forge] in run.reason, run.reason
    assert not marker.exists()
    assert pool2.run("_trial_programs:get_rank_pid", timeout_s=90).ok  # fresh ranks, a fresh secret


@pytest.mark.multirank
def test_a_forged_result_is_refused_by_the_pool_and_the_job_fails_with_that_line(pool2):
    assert pool2.run("_trial_programs:get_rank_pid", timeout_s=90).ok
    n, attacker = pool2._next_job, _attacker(pool2)

    def forge() -> None:
        time.sleep(1.0)
        for rank in range(2):
            attacker.set(f"result/{n}/{rank}", json.dumps({"pid": 1}))

    threading.Thread(target=forge, daemon=True).start()
    run = pool2.run("_trial_programs:sleep_then_pid", {"seconds": 20}, timeout_s=60)
    assert run.status == "crash", run.reason
    assert run.reason.startswith(f"refused the value of 'pool/result/{n}/0' from rank 0 of this host's pool: ")


@pytest.mark.multirank
def test_a_target_off_the_allowlist_is_refused_on_every_rank(pool2):
    run = pool2.run("os:getcwd", timeout_s=60)
    assert run.status == "crash" and "refused the job's target 'os:getcwd'" in run.reason, run.reason


def test_a_forged_ticket_on_the_node_pool_s_store_is_passed_over_with_its_line():
    port = get_free_port()
    lines: list[str] = []
    pool = NodePool(2, address=f"127.0.0.1:{port}", secret=new_secret(), join_timeout_s=2, say=lines.append)
    worker = PrefixStore("nodepool/", TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)))
    ticket = worker.add("tickets", 1)
    worker.set(f"ticket/{ticket}", pickle.dumps({"rank": 0, "world_size": 2}))
    with pytest.raises(Exception, match="no world of 2 ranks formed"):
        pool.run("_trial_programs:get_rank_pid", timeout_s=5)
    assert any(
        line.startswith("refused the value of 'nodepool/ticket/1' from the worker that took ticket 1") for line in lines
    )
    assert os.environ.get(ALLOW_TARGETS_ENV)  # the tests' own programs allowed (tests/conftest.py)
