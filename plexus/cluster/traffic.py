"""Byte and message counters: one row of the job's traffic matrix per process."""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["Traffic", "PeerCount"]


@dataclass
class PeerCount:
    bytes_sent: int = 0
    bytes_recv: int = 0
    msgs_sent: int = 0
    msgs_recv: int = 0


@dataclass
class Traffic:
    """Counts every send and receive of this process, per peer name (``worker 3``).

    Thread-safe: communication threads and the training thread both count.
    """

    peers: dict[str, PeerCount] = field(default_factory=lambda: defaultdict(PeerCount))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def sent(self, peer: str, nbytes: int, messages: int = 1) -> None:
        with self._lock:
            row = self.peers[peer]
            row.bytes_sent += nbytes
            row.msgs_sent += messages

    def received(self, peer: str, nbytes: int, messages: int = 1) -> None:
        with self._lock:
            row = self.peers[peer]
            row.bytes_recv += nbytes
            row.msgs_recv += messages

    @property
    def bytes_sent(self) -> int:
        with self._lock:
            return sum(r.bytes_sent for r in self.peers.values())

    @property
    def bytes_recv(self) -> int:
        with self._lock:
            return sum(r.bytes_recv for r in self.peers.values())

    @property
    def msgs_sent(self) -> int:
        with self._lock:
            return sum(r.msgs_sent for r in self.peers.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Plain data for JSON: {peer: {bytes_sent, bytes_recv, msgs_sent, msgs_recv}}."""
        with self._lock:
            return {peer: vars(row).copy() for peer, row in sorted(self.peers.items())}

    def reset(self) -> None:
        with self._lock:
            self.peers.clear()
