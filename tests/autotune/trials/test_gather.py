"""What a rank on another host sends the driver ([Note: node-local files] in autotune/trials/gather.py)."""

from __future__ import annotations

import socket
import tempfile

from autotune.trials.gather import get_node_dir, pack_trace, receive_files


def test_a_trace_is_sent_and_removed_from_its_node_and_written_into_the_trial_dir(tmp_path, monkeypatch):
    (tmp_path / "node").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))

    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR read again
    node = get_node_dir({"out_dir": "/driver/only/trial_0003"})
    assert node.is_dir() and node.name == "trial_0003" and str(node).startswith(str(tmp_path / "node"))
    trace = node / "trace_rank1.json.gz"
    trace.write_bytes(b"gz" * 10)
    results = [{"rank": 1, "trace": trace.name, "sent_trace": pack_trace(trace)}]
    assert not trace.exists()  # sent: nothing left on the node
    out = tmp_path / "trial"
    out.mkdir()
    assert receive_files(results, out) == []
    assert (out / "trace_rank1.json.gz").read_bytes() == b"gz" * 10
    assert results == [{"rank": 1, "trace": "trace_rank1.json.gz"}]


def test_a_trace_over_the_cap_stays_on_its_node_and_the_trial_names_where(tmp_path):
    trace = tmp_path / "trace_rank0.json.gz"
    trace.write_bytes(b"x" * 100)
    results = [{"rank": 0, "trace": trace.name, "sent_trace": pack_trace(trace, cap_bytes=99)}]
    out = tmp_path / "trial"
    out.mkdir()
    kept = receive_files(results, out)
    assert kept == [{"rank": 0, "host": socket.gethostname(), "path": str(trace), "bytes": 100}]
    assert trace.exists() and results[0]["trace"] is None and not list(out.iterdir())


def test_a_sent_name_never_writes_outside_the_trial_dir(tmp_path):
    out = tmp_path / "trial"
    out.mkdir()
    results = [{"rank": 0, "trace": "x", "sent_trace": {"name": "../../evil.sh", "data": b"rm -rf"}}]
    receive_files(results, out)
    assert not (tmp_path / "evil.sh").exists() and not list(out.iterdir()) and results[0]["trace"] is None
