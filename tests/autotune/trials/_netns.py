"""Two "hosts" on one machine: a network namespace each, with its own address on a bridge, its own
hostname and a mount namespace with a tmpfs over the driver's directory (its own ``TMPDIR`` in
it), so that its processes reach the driver by a real address, not loopback, and see neither the
driver's files nor each other's. Needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root); :func:`probe` says why not where they are missing.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = "10.231.{}"


@dataclass
class Host:
    namespace: str
    address: str
    interface: str
    hostname: str

    def wrap(self, command: list[str], hide: str) -> list[str]:
        """``command`` run on this host: in its network namespace, with its hostname (in an ``/etc/hosts``
        of its own) and a tmpfs over ``hide`` (the driver's directory: this host cannot see it),
        which holds this host's own ``TMPDIR``."""
        hosts = f"127.0.0.1 localhost\n{self.address} {self.hostname}\n"  # torchrun resolves its own hostname
        own = shlex.quote(hide)
        inner = f"mount -t tmpfs tmpfs {own} && mkdir -p {own}/tmp && printf {shlex.quote(hosts)} > {own}/hosts && "
        inner += f"mount --bind {own}/hosts /etc/hosts && hostname {self.hostname} && "
        inner += f"TMPDIR={own}/tmp exec {shlex.join(command)}"
        return ["ip", "netns", "exec", self.namespace, "unshare", "--mount", "--uts", "sh", "-c", inner]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30)


def probe() -> str | None:
    """None where this process may make network and mount namespaces; else why not, in one line."""
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH"
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_NET_ADMIN"
    name = f"atp{os.getpid() % 100000}"
    made = _run("ip", "netns", "add", name)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    try:
        tried = _run(
            "ip", "netns", "exec", name, "unshare", "--mount", "--uts", "sh", "-c", "mount -t tmpfs tmpfs /tmp"
        )
        if tried.returncode != 0:
            return f"cannot make a mount namespace with a tmpfs: {tried.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", name)
    return None


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[str, list[Host]]]:
    """A bridge with this process's address on it and two namespaces on it; yields (the driver's
    address, the two hosts), and removes them all."""
    tag = os.getpid() % 10000
    bridge, octet = f"atbr{tag}", 10 + tag % 200
    driver = SUBNET.format(f"{octet}.1")
    hosts = [Host(f"atns{tag}-{i}", SUBNET.format(f"{octet}.{i + 2}"), f"atv{tag}n{i}", f"node{i}") for i in range(2)]
    steps = [("ip", "link", "add", bridge, "type", "bridge"), ("ip", "addr", "add", f"{driver}/24", "dev", bridge)]
    steps.append(("ip", "link", "set", bridge, "up"))
    for i, host in enumerate(hosts):
        outer = f"atv{tag}h{i}"
        steps += [
            ("ip", "netns", "add", host.namespace),
            ("ip", "link", "add", outer, "type", "veth", "peer", "name", host.interface),
            ("ip", "link", "set", host.interface, "netns", host.namespace),
            ("ip", "link", "set", outer, "master", bridge),
            ("ip", "link", "set", outer, "up"),
            ("ip", "netns", "exec", host.namespace, "ip", "addr", "add", f"{host.address}/24", "dev", host.interface),
            ("ip", "netns", "exec", host.namespace, "ip", "link", "set", host.interface, "up"),
            ("ip", "netns", "exec", host.namespace, "ip", "link", "set", "lo", "up"),
        ]
    try:
        for step in steps:
            done = _run(*step)
            if done.returncode != 0:
                raise RuntimeError(f"{shlex.join(step)}: {done.stderr.strip()}")
        yield driver, hosts
    finally:
        for host in hosts:
            _run("ip", "netns", "del", host.namespace)  # its veth end goes with it, and the pair with that
        _run("ip", "link", "del", bridge)
