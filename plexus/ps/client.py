"""A worker's side of the parameter servers: one Link per server, all of them at once.

Every operation addresses every shard (a push with an empty slice still carries the
worker's clock, which the consistency gates of every shard need). For each shard the
client posts the header, the payloads and the receives of the reply together, and only
then waits, so the S transfers overlap (Li et al. 2014: a worker talks to the server
group, each server handling its key range).

``versions[s]`` is the version of shard s held locally (from the last pull); a push
carries the version its gradient was computed on, from which the server measures its
staleness. ``acks[s]`` counts the pushes shard s acknowledged.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from plexus.cluster.group import Link, Work
from plexus.cluster.traffic import Traffic
from plexus.config import NetSpec
from plexus.errors import ConfigError, PeerLost, ProtocolError
from plexus.ps.heartbeat import Heartbeat, Watch
from plexus.ps.protocol import HEADER_LEN, Header, Op, Status, check_reply, decode, dtype_code, encode
from plexus.ps.replication import owner_of
from plexus.ps.server import KEYS, VNODES
from plexus.ps.sharding import HashRing, RangeSharding

__all__ = ["PSClient", "Reply", "Heartbeat"]

logger = logging.getLogger(__name__)


class _Moved(PeerLost):
    """A server answered that the shard moved (drained away): send the request again to
    its new owner."""


@dataclass
class _Request:
    header: Header
    payloads: list[torch.Tensor] = field(default_factory=list)
    into: list[torch.Tensor] = field(default_factory=list)   # receive buffers of the reply's payloads


@dataclass(frozen=True)
class Reply:
    """What every shard answered to one call."""

    headers: list[Header]

    def staleness(self) -> float | None:
        """Mean staleness of the push this answered, over the shards that know it."""
        known = [h.staleness - 1 for h in self.headers if h.staleness > 0]
        return sum(known) / len(known) if known else None


class PSClient:
    """Worker ``rank``'s connection to ``servers`` servers holding a model of ``numel``
    dense elements (and a sparse table of ``rows`` x ``width``).

    In a tree (``tree.py``) the client may be an aggregator (``name``), and its parent
    may be an aggregator (``parent``) rather than the servers: then one link carries the
    messages of every shard, in shard order, and the parent answers them in that order.
    ``sender`` is the client's index among its parent's children (its rank by default).

    Shards that move. A server that drains answers MOVED; with ``replicated``
    (``--replication``) a server's link that breaks means it died. Either way the client
    waits for the shard's new server (``replication.owner_of``), links to it and sends the
    request again; a push it already holds is acknowledged, not applied twice."""

    def __init__(self, store: dist.Store, rank: int, servers: int, *, numel: int, dtype: torch.dtype,
                 rows: int = 0, width: int = 0, traffic: Traffic, timeout: float, net: NetSpec | None = None, transport: str = "auto",
                 sender: int | None = None, name: str | None = None, parent: str | None = None,
                 replicated: bool = False) -> None:
        self.store, self.rank, self.servers = store, rank, servers
        # A flat client follows its shards when they move (a drain) or, with replicas
        # (``replicated``), when their server dies; a tree's talk to their parent only.
        self.failover = parent is None
        self.replicated = replicated
        self.hosts = list(range(servers))     # the server process serving each shard
        self.me = name or f"worker {rank}"
        self.sender = rank if sender is None else sender
        self.parent = parent
        self.numel, self.dtype, self.rows, self.width = numel, dtype, rows, width
        self.traffic, self.timeout, self.net, self.transport = traffic, timeout, net, transport
        self.sharding = RangeSharding(numel, servers)
        self.ring = HashRing(servers, VNODES) if rows else None
        self.links: list[Link] = []
        self.versions = [0] * servers
        self.acks = [0] * servers
        self.bases = [0] * servers
        self._rx = [torch.empty(HEADER_LEN, dtype=torch.int64) for _ in range(servers)]
        self._owned: list[torch.Tensor] | None = None

    # --- layout -----------------------------------------------------------------------

    def owned(self, server: int) -> torch.Tensor:
        """The sorted sparse keys ``server`` owns."""
        if self._owned is None:
            self._owned = [self.ring.keys_of(s, self.rows) if self.ring else torch.empty(0, dtype=torch.int64)
                           for s in range(self.servers)]
        return self._owned[server]

    def split_keys(self, keys: torch.Tensor) -> list[torch.Tensor]:
        """``keys`` (sorted, unique) by owning server, each part still sorted."""
        if self.ring is None or not len(keys):
            return [keys[:0] for _ in range(self.servers)]
        owners = self.ring.owners(keys)
        return [keys[owners == s] for s in range(self.servers)]

    def _header(self, op: Op, server: int, clock: int = 0, version: int = 0, keys: int = 0) -> Header:
        start, stop = self.sharding.range(server)
        return Header(op=op, sender=self.sender, shard=server, clock=clock, version=version, offset=start,
                      count=stop - start, keys=keys, width=self.width if keys else 0, dtype=dtype_code(self.dtype),
                      total=self.numel, rows=self.rows)

    # --- connection -----------------------------------------------------------------------

    def connect(self) -> None:
        """Open the links (each waits up to ``timeout`` for its server, or for the parent)."""
        if self.parent is not None:
            link = Link(self.store, self.me, self.parent, traffic=self.traffic, timeout=self.timeout, net=self.net,
                        transport=self.transport)
            self.links = [link] * self.servers
            return
        for s in range(self.servers):
            self.links.append(Link(self.store, self.me, f"server {s}", traffic=self.traffic, timeout=self.timeout,
                                   net=self.net, transport=self.transport))

    def close(self) -> None:
        for link in {id(link): link for link in self.links}.values():
            link.close()
        self.links = []

    def _exchange(self, requests: list[_Request]) -> Reply:
        """Send every request and receive every reply, all shards at once."""
        if not self.failover:
            posted = [self._post(s, req) for s, req in enumerate(requests)]
            return Reply([self._complete(s, req, works) for s, (req, works) in enumerate(zip(requests, posted))])
        # Under replication a broken link is a dead server: the other shards' exchanges
        # finish first, then the broken ones go again to the shard's new server.
        posted: list[tuple[list[Work], Work, list[Work]] | PeerLost] = []
        for s, req in enumerate(requests):
            try:
                posted.append(self._post(s, req))
            except PeerLost as exc:
                posted.append(exc)
        headers: list[Header | None] = [None] * self.servers
        for s, (req, works) in enumerate(zip(requests, posted)):
            try:
                if isinstance(works, PeerLost):
                    raise works
                headers[s] = self._complete(s, req, works)
            except PeerLost as exc:
                if not (self.replicated or isinstance(exc, _Moved)):
                    raise  # no replica can take a dead server's shard over
                headers[s] = self._again(s, req, exc)
        return Reply(headers)

    def _post(self, s: int, req: _Request) -> tuple[list[Work], Work, list[Work]]:
        """Post shard ``s``'s request and the receives of its reply."""
        link = self.links[s]
        head = link.irecv(self._rx[s], link.peer_index)
        body = [link.irecv(buf, link.peer_index) for buf in req.into]
        sends = [link.isend(encode(req.header), link.peer_index)]
        sends += [link.isend(p, link.peer_index) for p in req.payloads]
        return sends, head, body

    def _complete(self, s: int, req: _Request, works: tuple[list[Work], Work, list[Work]]) -> Header:
        sends, head, body = works
        for work in sends:
            work.wait()
        head.wait()
        who = f"server {self.hosts[s]}"
        header = decode(self._rx[s], who)
        check_reply(header, req.header, who)
        if header.status != Status.OK:
            self._refused(s, header)
        for work in body:
            work.wait()
        return header

    def _again(self, s: int, req: _Request, lost: PeerLost) -> Header:
        """Shard ``s``'s server died during ``req``: send it to the server that took the
        shard over (PeerLost if none did within ``timeout``), as often as servers die."""
        while True:
            dead = self.hosts[s]
            deadline = time.monotonic() + self.timeout
            while (host := owner_of(self.store, s)) == dead:
                if time.monotonic() > deadline:
                    raise PeerLost(f"{self.me}: server {dead} died and no replica took shard {s} over within "
                                   f"{self.timeout:g} s ({lost})", peer=f"server {dead}") from None
                time.sleep(0.01)
            logger.warning("%s: shard %d moved from server %d to server %d; sending %s again", self.me, s, dead,
                           host, Op(req.header.op).name)
            self.links[s].close()
            self.hosts[s] = host
            try:
                self.links[s] = Link(self.store, self.me, f"server {host}", traffic=self.traffic,
                                     timeout=self.timeout, net=self.net, transport=self.transport, tag=f"shard {s}")
                return self._complete(s, req, self._post(s, req))
            except PeerLost as exc:
                lost = exc

    def _refused(self, server: int, header: Header) -> None:
        if header.status == Status.MOVED:
            raise _Moved(f"{self.me}: shard {server} moved away from server {self.hosts[server]}",
                         peer=f"server {self.hosts[server]}")
        if header.status == Status.LOST:
            raise PeerLost(f"{self.me}: server {server} declared this worker lost (silent for longer than "
                           f"--peer-timeout, or its link broke); a lost worker does not come back",
                           peer=f"server {server}")
        if header.status == Status.REFUSED:
            raise ConfigError(f"{self.me}: server {server} refused this worker: the job has finished, or its "
                              f"consistency (bsp) admits no worker after the start")
        raise ProtocolError(f"{self.me}: server {server} rejected a message as malformed (see its log)",
                            peer=f"server {server}")

    def _dense_slice(self, flat: torch.Tensor, server: int) -> torch.Tensor:
        start, stop = self.sharding.range(server)
        return flat[start:stop]

    # --- operations ---------------------------------------------------------------------

    def init(self, flat: torch.Tensor, table: torch.Tensor | None = None, clock: int = 0) -> Reply:
        """Offer our initial values (the first worker's are kept) and receive the current
        ones into ``flat`` and ``table``: a worker that joins late starts from the current model.
        ``clock``: the next push's clock, for a tree node that re-attached to a new parent."""
        requests, rows_in = [], []
        for s in range(self.servers):
            keys = self.owned(s) if table is not None else torch.empty(0, dtype=torch.int64)
            req = _Request(self._header(Op.INIT, s, clock=clock, keys=len(keys)))
            part = self._dense_slice(flat, s)
            if part.numel():
                req.payloads.append(part.clone())
                req.into.append(part)
            if len(keys):
                rows = table.index_select(0, keys)
                req.payloads += [keys, rows.reshape(-1)]
                req.into.append(torch.empty_like(rows).reshape(-1))
            rows_in.append((keys, req.into[-1] if len(keys) else None))
            requests.append(req)
        reply = self._exchange(requests)
        for s, header in enumerate(reply.headers):
            self.versions[s], self.bases[s] = header.version, header.clock
            keys, rows = rows_in[s]
            if rows is not None:
                table.index_copy_(0, keys, rows.view(len(keys), self.width))
        return reply

    def _push_request(self, op: Op, grad: torch.Tensor, server: int, clock: int, versions: list[int],
                      members: list[torch.Tensor] | None) -> _Request:
        """A push of ``grad``'s slice; a tree push also lists its ``members[server]``."""
        part = self._dense_slice(grad, server)
        header = self._header(op, server, clock, versions[server])
        if members is not None:
            header = replace(header, members=len(members[server]))
        req = _Request(header, [part] if part.numel() else [])
        if members is not None:
            req.payloads.append(members[server].reshape(-1))
        return req

    def push_pull(self, grad: torch.Tensor, flat: torch.Tensor, clock: int, versions: list[int],
                  members: list[torch.Tensor] | None = None) -> Reply:
        """Downpour's fused step: push ``grad``, receive the weights that answer it into ``flat``.
        ``members[s]``: for an aggregator, the (worker, clock, version) rows of the gradients
        ``grad`` sums, per shard."""
        requests = []
        for s in range(self.servers):
            req = self._push_request(Op.PUSH_PULL, grad, s, clock, versions, members)
            part = self._dense_slice(flat, s)
            if part.numel():
                req.into.append(part)
            requests.append(req)
        reply = self._exchange(requests)
        for s, header in enumerate(reply.headers):
            self.versions[s] = header.version
            self.acks[s] += 1
        return reply

    def push(self, grad: torch.Tensor, clock: int, versions: list[int],
             members: list[torch.Tensor] | None = None) -> Reply:
        requests = [self._push_request(Op.PUSH, grad, s, clock, versions, members) for s in range(self.servers)]
        reply = self._exchange(requests)
        for s in range(self.servers):
            self.acks[s] += 1
        return reply

    def pull(self, flat: torch.Tensor, clock: int) -> Reply:
        self._follow()
        requests = []
        for s in range(self.servers):
            part = self._dense_slice(flat, s)
            requests.append(_Request(self._header(Op.PULL, s, clock), into=[part] if part.numel() else []))
        reply = self._exchange(requests)
        for s, header in enumerate(reply.headers):
            self.versions[s] = header.version
        return reply

    def sparse_pull(self, flat: torch.Tensor, table: torch.Tensor, keys: torch.Tensor, clock: int) -> Reply:
        """Receive the dense weights into ``flat`` and the rows ``keys`` (sorted, unique) into ``table``."""
        parts = self.split_keys(keys)
        requests = []
        for s in range(self.servers):
            req = _Request(self._header(Op.SPARSE_PULL, s, clock, keys=len(parts[s])))
            dense = self._dense_slice(flat, s)
            if dense.numel():
                req.into.append(dense)
            if len(parts[s]):
                req.payloads.append(parts[s])
                req.into.append(torch.empty(len(parts[s]) * self.width, dtype=self.dtype))
            requests.append(req)
        reply = self._exchange(requests)
        for s, (req, header) in enumerate(zip(requests, reply.headers)):
            self.versions[s] = header.version
            if len(parts[s]):
                table.index_copy_(0, parts[s], req.into[-1].view(len(parts[s]), self.width))
        return reply

    def sparse_push(self, grad: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, clock: int,
                    versions: list[int]) -> Reply:
        """Push the dense gradient and the gradients ``rows`` [len(keys), width] of rows ``keys``."""
        owners = self.ring.owners(keys) if self.ring is not None and len(keys) else None
        requests = []
        for s in range(self.servers):
            mine = owners == s if owners is not None else None
            part_keys = keys[mine] if mine is not None else keys[:0]
            req = _Request(self._header(Op.SPARSE_PUSH, s, clock, versions[s], keys=len(part_keys)))
            dense = self._dense_slice(grad, s)
            if dense.numel():
                req.payloads.append(dense)
            if len(part_keys):
                req.payloads += [part_keys, rows[mine].reshape(-1)]
            requests.append(req)
        reply = self._exchange(requests)
        for s in range(self.servers):
            self.acks[s] += 1
        return reply

    def wait_drained(self, peer_timeout: float) -> int:
        """After BYE: wait until every server has drained (no live worker, nothing pending),
        for as long as the servers keep beating; returns the worker that evaluates the final
        model (server 0's choice, -1 for none)."""
        keys = [KEYS.drained(s) for s in range(self.servers)]
        # The servers have beaten since the start, so silence counts from now on; our own
        # stalls (a store that answers late stops us too) are not held against them.
        watch, start = Watch(self.me, peer_timeout, peer_timeout, 0.1), time.monotonic()
        pause = 0.005
        while not self.store.check(keys):
            now = time.monotonic()
            watch.tick(now)
            hosts = {owner_of(self.store, s) if self.failover else s for s in range(self.servers)}
            for s in sorted(hosts):
                why = watch.judge(f"server {s}", self.store.add(KEYS.heartbeat("server", s), 0), now, start)
                if why is not None:
                    raise PeerLost(f"{self.me}: server {s} stopped beating while the job drained: {why}",
                                   peer=f"server {s}")
            time.sleep(pause)
            pause = min(0.1, pause * 2)
        return int(json.loads(self.store.get(KEYS.drained(0)).decode())["evaluator"])

    def _follow(self) -> None:
        """Link to the current server of every shard that moved (a drain) since we last
        talked to it: a worker that finished meets the shard's new server only here."""
        if not self.failover:
            return
        for s in range(self.servers):
            host = owner_of(self.store, s)
            if host != self.hosts[s]:
                self.links[s].close()
                self.hosts[s] = host
                self.links[s] = Link(self.store, self.me, f"server {host}", traffic=self.traffic,
                                     timeout=self.timeout, net=self.net, transport=self.transport, tag=f"shard {s}")

    def signal(self, op: Op, clock: int = 0) -> Reply:
        """A payload-free message to every shard: CLOCK, BYE or SHUTDOWN."""
        self._follow()
        return self._exchange([_Request(Header(op=op, sender=self.sender, shard=s, clock=clock,
                                               dtype=dtype_code(self.dtype), total=self.numel, rows=self.rows))
                               for s in range(self.servers)])
