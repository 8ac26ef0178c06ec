"""Separate hosts on one machine: network namespaces joined by veth pairs to a bridge.

``hosts(n)`` makes a switch namespace holding a bridge, and n host namespaces, each with
one veth into the switch and its own address (10.77.X.1 ... 10.77.X.n/24, X picked per
use so concurrent uses do not meet). A command run with ``on_host`` also gets its own
host name and a private ``/dev/shm`` (``unshare --uts --mount``), so plexus sees another
machine: links between hosts take sockets, never shared memory. Everything is removed on
exit, also when the test fails; traffic stays inside the namespaces the test made.

Needs root and iproute2; ``skip_reason()`` says why not where they are missing.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
from dataclasses import dataclass
from typing import Iterator, Sequence

__all__ = ["Host", "hosts", "on_host", "skip_reason"]


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


@dataclass(frozen=True)
class Host:
    namespace: str
    name: str
    address: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def hosts(count: int, rate: str | None = None) -> Iterator[list[Host]]:
    """``count`` hosts on one bridge; ``rate`` (tbf, e.g. ``100mbit``) shapes every host's
    link out of its namespace."""
    net = random.randrange(1, 250)
    tag = f"plx{os.getpid() % 10000}{net}"
    switch = f"{tag}-sw"
    made: list[str] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        found = []
        for i in range(1, count + 1):
            ns = f"{tag}-h{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            inside, outside = f"h{i}x{net}", f"s{i}x{net}"
            _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "netns", switch)
            _ip("-n", switch, "link", "set", outside, "master", "br0")
            _ip("-n", switch, "link", "set", outside, "up")
            address = f"10.77.{net}.{i}"
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if rate:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inside, "root", "tbf",
                                "rate", rate, "burst", "64kb", "latency", "50ms"], check=True, capture_output=True)
            found.append(Host(ns, f"host{i}", address))
        yield found
    finally:
        for ns in reversed(made):
            # Processes left inside would keep nothing alive: the test kills its own first.
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def on_host(host: Host, argv: Sequence[str], env: dict[str, str], **popen) -> subprocess.Popen:
    """Start ``argv`` on ``host``: its network namespace, its host name, its own /dev/shm."""
    script = (f"hostname {host.name} && mount -t tmpfs -o size=256m tmpfs /dev/shm && "
              f"exec \"$@\"")
    return subprocess.Popen(["ip", "netns", "exec", host.namespace, "unshare", "--uts", "--mount",
                             "--propagation", "private", "sh", "-c", script, "sh", *argv],
                            env=env, start_new_session=True, **popen)
