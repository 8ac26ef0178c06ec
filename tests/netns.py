"""Separate hosts on one machine: network namespaces joined by veth pairs to a bridge.

``hosts(n)`` makes a switch namespace holding a bridge, and n host namespaces, each with
one veth into the switch and its own address (10.77.X.1 ... 10.77.X.n/24, X picked per
use, never one this process has in use, so concurrent uses do not meet). A command run
with ``on_host`` also gets its own host name and a private ``/dev/shm`` (``unshare --uts
--mount``), so plexus sees another machine: links between hosts take sockets, never
shared memory. Everything is removed on
exit, also when the test fails; traffic stays inside the namespaces the test made.

Needs root and iproute2; ``skip_reason()`` says why not where they are missing.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterator, Sequence

import warm_cli

__all__ = ["Host", "hosts", "on_host", "start_helper", "start_train", "kill_host", "link_down", "kill_all", "pids",
           "skip_reason"]


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
    link: str  # its interface onto the bridge


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")


# Subnets (10.77.X) of this process's hosts that exist now. A module fixture's hosts outlive
# the tests that make their own meanwhile, and the subnet names the namespaces too: a second
# use of a live one failed with "File exists" (1 in 249 per use, by chance).
_in_use: set[int] = set()


@contextlib.contextmanager
def hosts(count: int, rate: str | None = None) -> Iterator[list[Host]]:
    """``count`` hosts on one bridge; ``rate`` (tbf, e.g. ``100mbit``) shapes every host's
    link out of its namespace."""
    net = random.choice([n for n in range(1, 250) if n not in _in_use])
    _in_use.add(net)
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
            inside, outside = f"{tag}h{i}", f"{tag}s{i}"  # unique per process: veths start in the root namespace
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
            found.append(Host(ns, f"host{i}", address, inside))
        yield found
    finally:
        for ns in reversed(made):
            # Processes left inside would keep nothing alive: the test kills its own first.
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        _in_use.discard(net)


def on_host(host: Host, argv: Sequence[str], env: dict[str, str], **popen) -> subprocess.Popen:
    """Start ``argv`` on ``host``: its network namespace, its host name, its own /dev/shm."""
    script = (f"hostname {host.name} && mount -t tmpfs -o size=256m tmpfs /dev/shm && "
              f"exec \"$@\"")
    return subprocess.Popen(["ip", "netns", "exec", host.namespace, "unshare", "--uts", "--mount",
                             "--propagation", "private", "sh", "-c", script, "sh", *argv],
                            env=env, start_new_session=True, **popen)


def start_helper(host: Host, path: str) -> subprocess.Popen:
    """A warm helper on ``host`` (``warm_cli.py --listen``) at the Unix socket ``path``: the
    processes ``start_train(..., helpers=...)`` starts there are forked from it, torch
    imported once per host instead of once per process (6 s of CPU each here)."""
    sock, argv, env = warm_cli.listener(path)
    with sock:
        return on_host(host, argv, env, pass_fds=[sock.fileno()], stdin=subprocess.DEVNULL)


def start_train(found: list[Host], per_node: list[int], flags: list[str], out, port: int, agent: bool = True,
                helpers: Sequence[str] | None = None) -> list:
    """``plexus train FLAGS`` with node i's per_node[i] processes on host i: under a torchrun
    agent per host, or (``agent=False``) as bare processes with the environment torchrun
    gives them, so that a test sees each process's own exit status; with ``helpers`` (the
    socket of each host's ``start_helper``) those are forked from the host's helper
    (``warm_cli.Command``, a Popen of their own)."""
    # TMPDIR: torchrun's agent leaves a torchelastic_* folder there (its logs), in the test's own.
    env = {**os.environ, "PLEXUS_TOKEN": "many-hosts", "MPLCONFIGDIR": "/tmp/plexus-mpl",
           "TMPDIR": os.path.dirname(str(out))}
    master = found[0].address
    train = ["-m", "plexus.cli", "train", *flags, "--host", master, "--quiet", "--json", "--out", str(out)]
    procs = []
    for node, (host, nproc) in enumerate(zip(found, per_node)):
        if agent:
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(per_node)),
                    "--node-rank", str(node), "--nproc-per-node", str(nproc), "--master-addr", master,
                    "--master-port", str(port), *train]
            procs.append(on_host(host, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            continue
        first = sum(per_node[:node])
        for local in range(nproc):
            ranks = {"RANK": str(first + local), "WORLD_SIZE": str(sum(per_node)), "LOCAL_RANK": str(local),
                     "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(node), "MASTER_ADDR": master,
                     "MASTER_PORT": str(port)}
            if helpers is not None:
                procs.append(warm_cli.Command(helpers[node], train[2:], {**env, **ranks}))
                continue
            procs.append(on_host(host, [sys.executable, *train], {**env, **ranks}, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True))
    return procs


def pids(host: Host) -> list[int]:
    """The processes left in ``host``'s namespace."""
    out = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def kill_host(host: Host) -> None:
    """SIGKILL every process on ``host``: the machine is gone."""
    for pid in pids(host):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def link_down(host: Host) -> None:
    """Take ``host``'s only link down: it is cut off, its processes still run."""
    _ip("-n", host.namespace, "link", "set", host.link, "down")


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
