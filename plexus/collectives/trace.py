"""Measuring an algorithm's steps: record its messages, then find the longest chain.

``TracedEndpoint`` wraps a group and logs, on each rank, every send (to whom, with which
tag, and how many receives this rank had completed before it) and every completed
receive. ``steps(logs)`` then matches the k-th send from a to b on a tag with the k-th
receive b posted from a on that tag (the backend delivers each (pair, tag) stream in
order) and computes the longest chain of messages: a send comes after every receive its
rank completed before posting it, and after the previous send of its stream (same peer
and tag: a stream's messages go one after another, streams do not wait for each other). For the non-pipelined algorithms this is the number of
sequential communication steps of the textbooks (ring 2(P-1), rhd 2 log2 P); for dbtree
it counts the pipeline's steps, 2H + C - 1.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["TracedEndpoint", "steps"]


class _TracedRecv:
    def __init__(self, work: Any, log: "TracedEndpoint", key: tuple[int, int, int]) -> None:
        self._work = work
        self._log = log
        self._key = key
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        self._work.wait(timeout)
        if not self._done:
            self._done = True
            self._log.recvs.append(self._key)

    def is_completed(self) -> bool:
        return self._work.is_completed()


class TracedEndpoint:
    """``group`` with every point-to-point message recorded (it shares the group's lane,
    scratch buffers and counters)."""

    def __init__(self, group: Any) -> None:
        self.parent = group
        self.rank, self.size, self.names = group.rank, group.size, group.names
        self.me, self.traffic, self.timeout = group.me, group.traffic, group.timeout
        self.sends: list[tuple[int, int, int, int]] = []   # (peer, tag, seq, receives done before)
        self.recvs: list[tuple[int, int, int]] = []        # (peer, tag, seq) in completion order
        self._sent: dict[tuple[int, int], int] = {}
        self._posted: dict[tuple[int, int], int] = {}

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        seq = self._sent.get((peer, tag), 0)
        self._sent[peer, tag] = seq + 1
        self.sends.append((peer, tag, seq, len(self.recvs)))
        return self.parent.isend(tensor, peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        seq = self._posted.get((peer, tag), 0)
        self._posted[peer, tag] = seq + 1
        return _TracedRecv(self.parent.irecv(tensor, peer, tag), self, (peer, tag, seq))

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0, timeout: float | None = None) -> None:
        self.isend(tensor, peer, tag).wait(timeout)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0, timeout: float | None = None) -> None:
        self.irecv(tensor, peer, tag).wait(timeout)

    def all_reduce_backend(self, tensor: torch.Tensor, *args: Any, **kwargs: Any):
        """The backend's collective: its messages are invisible here (no steps measured)."""
        self.opaque = True
        return self.parent.all_reduce_backend(tensor, *args, **kwargs)

    def log(self) -> dict:
        """This rank's record, as JSON data for ``steps``."""
        return {"sends": [list(s) for s in self.sends], "recvs": [list(r) for r in self.recvs],
                "opaque": getattr(self, "opaque", False)}

    def clear(self) -> None:
        self.sends.clear()
        self.recvs.clear()
        self._sent.clear()
        self._posted.clear()


def steps(logs: list[dict], ignore_tags: Iterable[int] = ()) -> int | None:
    """The longest chain of messages in the logs of all ranks (index = rank), leaving out
    messages with ``ignore_tags``; None when a rank used the backend's own collectives."""
    if any(log.get("opaque") for log in logs):
        return None
    ignore = set(ignore_tags)
    # (sender, receiver, tag, seq) -> index of that send in the sender's log
    where: dict[tuple[int, int, int, int], int] = {}
    for src, log in enumerate(logs):
        for i, (dst, tag, seq, _) in enumerate(log["sends"]):
            if tag not in ignore:
                where[src, dst, tag, seq] = i
    depth: dict[tuple[int, int], int] = {}  # (rank, send index) -> chain length ending with it

    def resolve(rank: int, index: int) -> int:
        # Iterative depth-first evaluation (chains can be longer than Python's recursion limit).
        stack = [(rank, index)]
        while stack:
            r, i = stack[-1]
            if (r, i) in depth:
                stack.pop()
                continue
            deps = _dependencies(logs, where, ignore, r, i)
            missing = [d for d in deps if d not in depth]
            if missing:
                stack.extend(missing)
                continue
            depth[r, i] = 1 + max((depth[d] for d in deps), default=0)
            stack.pop()
        return depth[rank, index]

    best = 0
    for rank, log in enumerate(logs):
        for i, (_, tag, _, _) in enumerate(log["sends"]):
            if tag not in ignore:
                best = max(best, resolve(rank, i))
    return best


def _dependencies(logs: list[dict], where: dict, ignore: set[int], rank: int, index: int) -> list[tuple[int, int]]:
    """The sends a send depends on: those whose receives its rank completed before posting
    it, and the previous send of its stream."""
    peer, tag, seq, done = logs[rank]["sends"][index]
    deps = []
    for src, rtag, rseq in logs[rank]["recvs"][:done]:
        if rtag not in ignore:
            deps.append((src, where[src, rank, rtag, rseq]))
    if seq:  # the previous message of the same stream
        deps.append((rank, where[rank, peer, tag, seq - 1]))
    return deps
