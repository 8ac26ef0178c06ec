"""Deterministic emulation of slow machines and planned deaths (ARCHITECTURE.md section 6).

``--slow worker:K=F`` stretches worker K's compute by sleeping (F - 1) times each measured
compute interval, which frees the CPU for the others on a small machine. ``--kill
worker:K@step=N`` ends process K abruptly (SIGKILL, no clean-up) when it reaches step N;
``--kill ROLE:K@time=S`` ends any process S seconds after training started.
Network delays (``--net``) are applied per send in ``group.py``; over shared memory through
this process's one emulated interface (``INTERFACE``).
"""
from __future__ import annotations

import bisect
import logging
import os
import signal
import threading
from typing import Callable
import time
from contextlib import contextmanager
from typing import Iterator

from plexus.config import ClusterConfig, NetSpec

__all__ = ["Emulator", "Interface", "INTERFACE"]

logger = logging.getLogger(__name__)


class Emulator:
    """The slow-down and planned death that apply to one process (``role`` ``rank``)."""

    def __init__(self, cluster: ClusterConfig, role: str, rank: int) -> None:
        self.name = f"{role} {rank}"
        self.factor = 1.0
        for spec in cluster.slow:
            if spec.role == role and spec.rank == rank:
                self.factor = spec.factor
        mine = [k for k in cluster.kill if k.role == role and k.rank == rank]
        self.kill_step = min((k.step for k in mine if k.step is not None), default=None)
        self.kill_seconds = min((k.seconds for k in mine if k.seconds is not None), default=None)
        self.slept = 0.0
        # Called just before a planned kill (the runner records the time of death).
        self.before_kill: Callable[[], None] | None = None

    def stretch(self, compute_seconds: float) -> None:
        """Sleep so that a compute interval of ``compute_seconds`` lasts ``factor`` times as long."""
        if self.factor > 1.0 and compute_seconds > 0:
            extra = (self.factor - 1.0) * compute_seconds
            time.sleep(extra)
            self.slept += extra

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Time the enclosed computation and stretch it by the slow factor."""
        start = time.perf_counter()
        yield
        self.stretch(time.perf_counter() - start)

    def at_step(self, step: int) -> None:
        """Die abruptly if this is the planned step."""
        if self.kill_step is not None and step >= self.kill_step:
            self._die(f"at step {step}")

    def arm_timer(self, started: Callable[[], float]) -> None:
        """Die ``--kill ROLE:K@time=S`` seconds after training starts: ``started()`` blocks
        until it knows when (a wall-clock time), on a daemon thread."""
        if self.kill_seconds is None:
            return

        def fire() -> None:
            time.sleep(max(0.0, started() + self.kill_seconds - time.time()))
            self._die(f"{self.kill_seconds:g} s after training started")

        threading.Thread(target=fire, name="plexus-kill", daemon=True).start()

    def _die(self, when: str) -> None:
        logger.warning("%s: killed on purpose %s (--kill)", self.name, when)
        if self.before_kill is not None:
            self.before_kill()
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


class Interface:
    """This process's one network interface under ``--net``, for the messages it sends and
    receives over shared memory.

    Sending: a message leaves once the interface has sent the ones before it, takes bytes /
    bandwidth on the wire, and arrives latency after that. The sender waits only while the
    interface still carries an earlier message (a send buffer of one message), not for its
    own to arrive, so a pipeline stage computes while its activations travel. Sends of all
    threads and links share the interface, as they share a machine's network card: a
    server's replies to many workers leave one after another.

    Receiving: the bytes of a message reach this interface from latency after it left on,
    at the link's bandwidth, and the interface takes in one message at a time, as a
    card's receiving side does (full duplex: sending and receiving do not wait for each
    other). So the gradients of P - 1 workers that reach a master or a server together
    arrive one after another (incast), and the receiver gets each when its last byte is in
    (``shm_channel``)."""

    # How long the receiving side remembers when it was busy (ns): a message read later
    # than this after its first byte came in is not fitted between older ones.
    _MEMORY = 1_000_000_000

    def __init__(self) -> None:
        self._free = 0  # time.monotonic_ns() at which the last message is off the wire
        self._lock = threading.Lock()
        self._busy: list[tuple[int, int]] = []  # the receiving side's [start, end) ns, in order

    def send(self, net: NetSpec, nbytes: int) -> int:
        """Wait for the interface to take a message of ``nbytes`` bytes; returns when it
        arrives (``time.monotonic_ns()``, the same clock in every process of a machine)."""
        wire = round(net.wire(nbytes) * 1e9)
        with self._lock:
            now = time.monotonic_ns()
            start = max(now, self._free)
            self._free = start + wire
        if start > now:
            time.sleep((start - now) / 1e9)
        return start + wire + round(net.latency * 1e9)

    def receive(self, net: NetSpec, nbytes: int, due: int) -> int:
        """When a message of ``nbytes`` bytes that the sender's interface said arrives at
        ``due`` (``send``) is in, once this interface has taken in the ones it overlaps:
        its bytes take the earliest free span of the receiving side from ``due`` - wire
        (their first byte) on. Messages are fitted in the order they are read, which is
        the order they were sent on each link."""
        wire = round(net.wire(nbytes) * 1e9)
        if wire == 0:
            return due
        start = due - wire
        with self._lock:
            busy = self._busy
            del busy[:bisect.bisect_right(busy, time.monotonic_ns() - self._MEMORY, key=_end)]
            # Spans are disjoint and in order, so their ends are too: skip those that end
            # before this message's first byte, then take the first gap it fits in.
            at = bisect.bisect_right(busy, start, key=_end)
            while at < len(busy) and start + wire > busy[at][0]:
                start, at = max(start, busy[at][1]), at + 1
            busy.insert(at, (start, start + wire))
        return start + wire


def _end(span: tuple[int, int]) -> int:
    return span[1]


INTERFACE = Interface()
