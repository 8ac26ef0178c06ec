"""Read-only access to the parameter servers: the weight path of Rudra-adv* (Gupta, Zhang and
Wang, "Model accuracy and runtime tradeoff in distributed deep learning", ICDM 2016).

In Rudra-adv* a learner pushes its gradients up the aggregation tree, as in Rudra-adv, but
fetches the weights asynchronously and straight from the parameter server: a weight no
longer waits at every level of the tree on its way down, so the learner computes on
weights only as old as one transfer from the root. The root's *push* fan-in stays at the
tree's fanout, since only its children push; the learners' fetches are reads, which the
server answers from the current version without touching the consistency gate.

A reader is a named process (``worker 3``) with one extra link per server, tagged
``weights`` so that it never collides with the link a worker at the top of the tree pushes
on. It speaks a subset of the protocol (``protocol.py``): PULL, whose header carries in
``version`` the shard version the reader already holds, and SHUTDOWN. A PULL is answered
as soon as the shard is newer than that version, or after ``READ_WAIT`` seconds, or at
once when the job has drained: a long poll, so a reader that keeps one pull outstanding
receives every new version once, right after it is applied, and never spins on the
version it has. A reader is outside the membership and the gate: it cannot push, its
loss costs nothing but its own link, and the server does not wait for it to finish.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from plexus.cluster.group import Link
from plexus.errors import CommError, ProtocolError
from plexus.ps.client import PSClient, Reply, _Request
from plexus.ps.protocol import HEADER_BYTES, SENTINEL, Header, Op, Status, check_request, decode, encode, \
    header_buffer

if TYPE_CHECKING:
    from plexus.ps.server import ParameterServer

__all__ = ["READ_TAG", "READ_WAIT", "ShardReaders", "WeightReader"]

logger = logging.getLogger(__name__)

READ_TAG = "weights"
# Longest wait of a pull for a version newer than the reader's: short enough that a reader
# that stops (or a server that drains) is never held up by a pull in flight.
READ_WAIT = 0.5


class ShardReaders:
    """The read-only links of one server (``server``), one thread each; ``reads`` counts the
    pulls answered per reader, for the summary."""

    def __init__(self, server: ParameterServer, names: list[str]) -> None:
        self.server, self.names = server, list(names)
        self.reads = {name: 0 for name in self.names}
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._serve, args=(name,), name=f"{server.me} -> {name} (reads)",
                                         daemon=True) for name in self.names]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self, deadline: float) -> None:
        """Stop waiting for readers and join their threads until ``deadline`` (monotonic).
        A thread still in a receive from a hung reader is left behind, as the server leaves
        those of its workers (safe at exit, measured); one opening its link gives up at once."""
        self.stopping.set()
        with self.server.cond:
            self.server.cond.notify_all()
        for thread in self.threads:
            if thread.is_alive():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _serve(self, name: str) -> None:
        s = self.server
        try:
            link = Link(s.store.clone(), s.me, name, traffic=s.traffic, timeout=s.timeout, net=s.cfg.cluster.net,
                        tag=READ_TAG, transport=s.cfg.cluster.transport,
                        cancelled=lambda: self.stopping.is_set() or s.drained)
        except CommError as exc:  # a learner lost before it reached us: nothing to serve
            logger.info("%s: no read link to %s (%s)", s.me, name, exc)
            return
        buffer = header_buffer()
        try:
            while True:
                buffer.fill_(SENTINEL)
                link.recv_from_peer(buffer, timeout=s.idle_limit, counted=HEADER_BYTES)
                h = decode(buffer, name)
                if h.op == Op.SHUTDOWN:
                    self._answer(link, h, None)
                    return
                if h.op != Op.PULL:
                    raise ProtocolError(f"{name} sent {h.describe()} on its read link, which serves PULL only",
                                        peer=name)
                if s.spec is None:
                    raise ProtocolError(f"{name} pulled before the model's layout was known", peer=name)
                check_request(h, s.spec, int(name.split()[1]), name)
                self._answer(link, h, self._newer_than(h.version))
        except ProtocolError as exc:
            with s.cond:
                s.protocol_errors += 1
            logger.error("%s: protocol error from %s on its read link: %s; closing it", s.me, name, exc)
            try:
                link.send_to_peer(encode(Header(op=Op.REPLY, sender=s.index, shard=s.index, status=Status.ERROR)),
                                  timeout=min(5.0, s.timeout))
            except CommError:
                pass
        except CommError as exc:  # the learner left or died: only its reads end
            logger.info("%s: read link to %s closed (%s)", s.me, name, exc)
        finally:
            link.close()

    def _newer_than(self, version: int) -> tuple[torch.Tensor, int]:
        """The shard's values once its version exceeds ``version`` (or after READ_WAIT, or at
        once when drained or stopping), copied under the lock so that they are one version."""
        s = self.server
        with s.cond:
            s.cond.wait_for(lambda: s.version > version or s.drained or self.stopping.is_set(), timeout=READ_WAIT)
            return s.params.clone(), s.version

    def _answer(self, link: Link, h: Header, weights: tuple[torch.Tensor, int] | None) -> None:
        s = self.server
        values, version = weights if weights is not None else (None, s.version)
        count = values.numel() if values is not None else 0
        reply = Header(op=Op.REPLY, sender=s.index, shard=s.index, version=version, offset=h.offset, count=count,
                       dtype=h.dtype)
        works = [link.isend(encode(reply), link.peer_index)]
        if count:
            works.append(link.isend(values, link.peer_index))
        for work in works:
            work.wait()
        if values is not None:
            with s.cond:
                self.reads[link.peer] += 1


class WeightReader(PSClient):
    """A learner's read-only client of every server (see the module docstring): ``read``
    brings the weights newer than those it holds, straight from the shards."""

    def connect(self) -> None:
        """One read link per server, in server order (``close`` closes those already open
        if a later one fails)."""
        for s in range(self.servers):
            self.links.append(Link(self.store, self.me, f"server {s}", traffic=self.traffic, timeout=self.timeout,
                                   net=self.net, tag=READ_TAG, transport=self.transport))

    def read(self, flat: torch.Tensor, held: list[int]) -> Reply:
        """Pull every shard into ``flat``; shard s answers once its version exceeds ``held[s]``
        (or after READ_WAIT). ``versions`` then holds the versions received."""
        requests = []
        for s in range(self.servers):
            part = self._dense_slice(flat, s)
            requests.append(_Request(self._header(Op.PULL, s, version=held[s]), into=[part] if part.numel() else []))
        reply = self._exchange(requests)
        for s, header in enumerate(reply.headers):
            self.versions[s] = header.version
        return reply
