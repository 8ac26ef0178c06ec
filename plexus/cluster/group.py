"""Point-to-point communication between processes: ``Group`` (a fixed set of members) and
``Link`` (two members, made lazily).

Both wrap one backend process group built directly over a ``PrefixStore`` of the job's
store, so no global ``init_process_group`` state exists and a dead peer breaks only the
groups it belongs to. Every send and receive is counted in the process's ``Traffic``,
every wait has a timeout, and errors name the peer: ``CommTimeout`` when it did not
answer, ``PeerLost`` when its connection broke.

``--net`` emulation shows slow networks on one machine without root: over shared memory a
message leaves through the process's emulated card (``emulation.Interface``), arrives
latency + bytes / bandwidth later and comes in through the receiver's card, one message at
a time; over gloo's sockets the sending thread waits that long.
"""
from __future__ import annotations

import datetime as dt
import logging
import os
import secrets
import threading
import time
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from plexus.cluster.traffic import Traffic
from plexus.cluster.emulation import INTERFACE
from plexus.config import TRANSPORTS, NetSpec
from plexus.cluster.shm import Inbox, Outbox, host_id, make_fifo, new_base, open_fifo, peer_alive, unlink_quietly
from plexus.cluster.shm_channel import Channel
from plexus.errors import CommError, CommTimeout, ConfigError, PeerLost, ProtocolError

__all__ = ["Endpoint", "Group", "Link", "Work", "group_pair", "link_pair", "make_process_group", "translate_error"]
# A shared-memory link's region name travels in this many bytes of its hello.
_NAME_BYTES = 32
# Tag offset of the bytes of a message too large for any shared-memory region.
_INLINE_TAG = 1 << 24

logger = logging.getLogger(__name__)

_LOST_MARKERS = ("closed", "reset", "broken pipe", "sigpipe", "connection refused", "eof", "aborted")


def translate_error(exc: BaseException, me: str, what: str, peer: str, timeout: float) -> CommError:
    """Map a backend error to CommTimeout or PeerLost, naming who did not answer."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    # gloo appends advice and a source location; keep the fact.
    text = text.split(" This is typically")[0].split("] ", 1)[-1].rstrip(".")
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered:
        return CommTimeout(f"{me}: {what}: {peer} did not answer within {timeout:g} s", peer=peer)
    if any(marker in lowered for marker in _LOST_MARKERS):
        return PeerLost(f"{me}: {what}: lost {peer} ({text})", peer=peer)
    return CommError(f"{me}: {what} with {peer} failed: {text}", peer=peer)


def make_process_group(backend: str, store: dist.Store, rank: int, size: int, timeout: float
                       ) -> dist.ProcessGroup:
    """A backend process group over ``store``: gloo on CPU, NCCL for CUDA tensors."""
    delta = dt.timedelta(seconds=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, delta)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ConfigError("backend nccl is not available in this torch build: pass --backend gloo")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = delta
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ConfigError(f"backend must be gloo or nccl, got {backend!r}")


class Work:
    """Handle of an asynchronous send, receive or collective; ``wait`` applies the timeout."""

    def __init__(self, work: dist.Work | None, endpoint: "Endpoint", what: str, peer: str,
                 on_done: Callable[[], None] | None = None) -> None:
        self._work = work
        self._endpoint = endpoint
        self._what = what
        self._peer = peer
        self._on_done = on_done
        self._done = work is None

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        limit = self._endpoint.timeout if timeout is None else timeout
        try:
            self._work.wait(dt.timedelta(seconds=limit))
        except RuntimeError as exc:
            raise translate_error(exc, self._endpoint.me, self._what, self._peer, limit) from None
        self._done = True
        if self._on_done is not None:
            self._on_done()

    def source_rank(self) -> int:
        """The sender of a completed receive-from-any."""
        return self._work._source_rank()

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Endpoint:
    """This process's side of a backend process group, addressed by member index.

    ``names[i]`` is member i's process name (``worker 2``), used by counters and errors.
    """

    def __init__(self, pg: dist.ProcessGroup, rank: int, names: Sequence[str], traffic: Traffic,
                 timeout: float, net: NetSpec | None = None) -> None:
        self.pg = pg
        self.rank = rank
        self.size = len(names)
        self.names = list(names)
        self.me = self.names[rank]
        self.traffic = traffic
        self.timeout = timeout
        self.net = net if net is not None and (net.bandwidth or net.latency) else None
        # gloo's sends and receives (and this module's shared memory) move host memory: a
        # tensor on a GPU travels through a host copy (``_outgoing``, ``_incoming``).
        self.host_memory = isinstance(pg, dist.ProcessGroupGloo)

    def __deepcopy__(self, memo: dict) -> "Endpoint":
        """A connection is a resource, not a value: a copy of something that holds one (a
        tensor-parallel layer copied by a strategy) shares it."""
        return self

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"{self.me}: peer index {peer} is not another member of a group of {self.size}")

    def _emulate(self, nbytes: int) -> None:
        if self.net is not None:
            time.sleep(self.net.delay(nbytes))

    def _outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a send hands the transport: ``tensor``, or its host copy where the
        transport moves host memory and ``tensor`` is on a GPU."""
        return tensor.cpu() if self.host_memory and not tensor.is_cpu else tensor

    def _incoming(self, tensor: torch.Tensor, then: Callable[[], None] | None = None
                  ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """Where a receive into ``tensor`` lands, and what to do once it has: ``tensor``
        and ``then``, or, where the transport moves host memory and ``tensor`` is on a GPU,
        a host buffer that is copied into ``tensor`` before ``then``."""
        if not self.host_memory or tensor.is_cpu:
            return tensor, then
        host = torch.empty(tensor.shape, dtype=tensor.dtype)

        def land() -> None:
            tensor.copy_(host)
            if then is not None:
                then()

        return host, land

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` (contiguous) to member ``peer``."""
        self._check_peer(peer)
        tensor = self._outgoing(tensor)
        nbytes = _nbytes(tensor)
        self._emulate(nbytes)
        name = self.names[peer]
        try:
            work = self.pg.send([tensor], peer, tag)
        except RuntimeError as exc:
            raise translate_error(exc, self.me, f"send of {nbytes} bytes", name, self.timeout) from None
        self.traffic.sent(name, nbytes)
        return Work(work, self, f"send of {nbytes} bytes", name)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0, counted: int | None = None) -> Work:
        """Start receiving into ``tensor`` (contiguous) from member ``peer``. ``counted``:
        the bytes to count when the buffer is larger than the message it takes (a header
        received into an oversized buffer); the buffer's size by default."""
        self._check_peer(peer)
        nbytes = _nbytes(tensor) if counted is None else counted
        name = self.names[peer]
        tensor, landed = self._incoming(tensor, lambda: self.traffic.received(name, nbytes))
        try:
            work = self.pg.recv([tensor], peer, tag)
        except RuntimeError as exc:
            raise translate_error(exc, self.me, f"receive of {nbytes} bytes", name, self.timeout) from None
        return Work(work, self, f"receive of {nbytes} bytes", name, on_done=landed)

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0, timeout: float | None = None) -> None:
        self.isend(tensor, peer, tag).wait(timeout)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0, timeout: float | None = None,
             counted: int | None = None) -> None:
        self.irecv(tensor, peer, tag, counted).wait(timeout)

    def recv_any(self, tensor: torch.Tensor, tag: int = 0, timeout: float | None = None) -> int:
        """Receive from whichever member sends first; returns its index."""
        nbytes = _nbytes(tensor)
        others = [i for i in range(self.size) if i != self.rank]
        tensor, landed = self._incoming(tensor)
        work = self.pg.recv_anysource([tensor], tag)
        handle = Work(work, self, f"receive of {nbytes} bytes from any member",
                      ", ".join(self.names[i] for i in others), on_done=landed)
        handle.wait(timeout)
        source = handle.source_rank()
        self.traffic.received(self.names[source], nbytes)
        return source

    def barrier(self, timeout: float | None = None) -> None:
        """Block until every member arrives, naming the group on timeout."""
        flag = torch.zeros(1)
        self.all_reduce_backend(flag).wait(timeout)

    def all_reduce_backend(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                           count_bytes: int | None = None) -> Work:
        """The backend's own all-reduce (async). Its traffic is counted as ``count_bytes``
        (the caller knows the algorithm's cost; default: the ring's 2(P-1)/P of the tensor),
        split evenly over the other members, and ``--net`` delays it by the ring's cost."""
        if self.size == 1:
            return Work(None, self, "all-reduce", self.me)
        nbytes = _nbytes(tensor)
        if count_bytes is None:
            count_bytes = 2 * (self.size - 1) * nbytes // self.size
        if self.net is not None:
            # The backend's ring sends 2(P-1) chunks of N/P bytes in sequence.
            steps = 2 * (self.size - 1)
            time.sleep(steps * self.net.delay(nbytes // self.size))
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = dt.timedelta(seconds=self.timeout)
        try:
            work = self.pg.allreduce([tensor], opts)
        except RuntimeError as exc:
            raise translate_error(exc, self.me, "all-reduce", "the group", self.timeout) from None
        others = [n for i, n in enumerate(self.names) if i != self.rank]

        def count() -> None:
            for name in others:
                self.traffic.sent(name, count_bytes // len(others))
                self.traffic.received(name, count_bytes // len(others))

        return Work(work, self, f"all-reduce of {nbytes} bytes", f"one of {', '.join(others)}", on_done=count)

    def broadcast_backend(self, tensor: torch.Tensor, root: int) -> Work:
        """The backend's own broadcast from member ``root`` (async)."""
        if self.size == 1:
            return Work(None, self, "broadcast", self.me)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        opts.timeout = dt.timedelta(seconds=self.timeout)
        nbytes = _nbytes(tensor)
        if self.rank == root:
            for i, name in enumerate(self.names):
                if i != root:
                    self.traffic.sent(name, nbytes)
        else:
            self.traffic.received(self.names[root], nbytes)
        return Work(self.pg.broadcast([tensor], opts), self, f"broadcast of {nbytes} bytes",
                    self.names[root])

    def close(self) -> None:
        """Release the backend group; peers see their links to this process break."""
        shutdown = getattr(self.pg, "shutdown", None) or getattr(self.pg, "abort", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:  # already broken: nothing left to release
                pass


class Group(Endpoint):
    """A fixed set of processes (the job's workers, say) that communicate together.

    Every member must construct it with the same ``name`` and ``names``; construction
    waits up to ``timeout`` seconds for all of them.
    """

    def __init__(self, store: dist.Store, name: str, rank: int, names: Sequence[str], *, traffic: Traffic,
                 timeout: float, backend: str = "gloo", net: NetSpec | None = None) -> None:
        prefix = dist.PrefixStore(f"group/{name}/", store)
        try:
            pg = make_process_group(backend, prefix, rank, len(names), timeout)
        except RuntimeError as exc:
            raise translate_error(exc, names[rank], f"forming group {name}", "a member", timeout) from None
        super().__init__(pg, rank, names, traffic, timeout, net)
        self.name = name
        self.backend = backend
        # The job store it was made over, for control records of code that uses the group.
        self.store = store
        # Members whose point-to-point messages go over a shared-memory Link (``connect``).
        self.links: dict[int, Link] = {}

    def on_one_machine(self) -> bool:
        """Whether every member runs on this machine (``host_id``: its host name and boot
        id). A collective call: every member makes it, and all get the same answer."""
        theirs = self._hosts(set(range(self.size)) - {self.rank}, "asking where the group's members run")
        mine = host_id()
        return all(h == mine for h in theirs.values())

    def _hosts(self, members: Iterable[int], doing: str) -> dict[int, int]:
        """The machine (``host_id``) each of ``members`` runs on, as each says through the
        store; says this member's first. Waits up to the store's timeout for each."""
        hosts = dist.PrefixStore(f"group/{self.name}/hosts/", self.store)
        hosts.set(str(self.rank), str(host_id()))
        theirs = {}
        for p in sorted(members):
            try:
                theirs[p] = int(hosts.get(str(p)).decode())
            except RuntimeError as exc:  # the store's own timeout: that member never came
                raise translate_error(exc, self.me, doing, self.names[p], self.timeout) from None
        return theirs

    def connect(self, peers: Iterable[int], transport: str = "auto") -> list[int]:
        """Carry the point-to-point messages to and from ``peers`` (member indices) over
        shared memory from now on, where they run on this machine; returns the members that
        are. Over gloo's sockets each message wakes the receiver's I/O thread, and on a
        machine with as many busy processes as cores that thread preempts a computing one:
        a two-worker ring all-reduce of 92 KB inside a training step took 1.4 ms over the
        sockets and 0.47 ms over shared memory (docs/results/ddp-throughput.md).

        A collective call: every member calls it at the same point, with no message of the
        group in flight, and the relation must be symmetric (if i names j, j names i). The
        links open pair by pair in one global order, so no two members wait on each other.
        ``transport``: as ``Link``'s; ``socket`` (or a backend other than gloo) connects
        nothing, ``shm`` raises ConfigError for a peer that cannot share memory. Sends over
        these links never wait for the receiver (``Outbox``'s ``eager``), as gloo's do not.
        ``recv_any`` and the backend's collectives keep to gloo's connections: a message
        from a connected peer reaches only a receive posted for that peer."""
        wanted = {int(p) for p in peers} - {self.rank} - set(self.links)
        for p in wanted:
            self._check_peer(p)
        if transport == "socket" or self.backend != "gloo":
            return []
        if transport == "auto" and wanted:
            # Members say which machine they run on, so that no link is set up (a gloo pair
            # each) only to find its peer elsewhere; ``shm`` tries them all, to name the one
            # that cannot.
            theirs, mine = self._hosts(wanted, "connecting the group's links"), host_id()
            wanted = {p for p in wanted if theirs[p] == mine}
        for p in sorted(wanted, key=lambda p: (min(p, self.rank), max(p, self.rank))):
            link = Link(self.store, self.me, self.names[p], traffic=self.traffic, timeout=self.timeout,
                        net=self.net, tag=f"group/{self.name}/", transport=transport, eager=True)
            if link.shm is None:  # another machine: gloo's pair of this group carries it as before
                link.close()
            else:
                self.links[p] = link
        return sorted(self.links)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Work:
        link = self.links.get(peer)
        if link is None:
            return super().isend(tensor, peer, tag)
        return link.isend(tensor, link.peer_index, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0, counted: int | None = None) -> Work:
        link = self.links.get(peer)
        if link is None:
            return super().irecv(tensor, peer, tag, counted)
        return link.irecv(tensor, link.peer_index, tag, counted)

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links = {}
        super().close()


def _meet(store: dist.Store, me: str, peer: str, timeout: float, cancelled: Callable[[], bool]) -> None:
    """Wait in the store for ``peer`` to come and open the link too (each side says it is
    here), giving up as soon as ``cancelled()`` says so: gloo's own set-up cannot be
    interrupted, and a thread left inside it when its process exits aborts the process."""
    deadline, pause = time.monotonic() + timeout, 0.005
    while not store.check([f"here/{peer}"]):
        if cancelled():
            raise PeerLost(f"{me}: opening a link: gave up waiting for {peer}", peer=peer)
        if time.monotonic() > deadline:
            raise CommTimeout(f"{me}: opening a link: {peer} did not answer within {timeout:g} s", peer=peer)
        time.sleep(pause)
        pause = min(0.05, pause * 2)


class Link(Endpoint):
    """A channel between two processes, made when both ask for it.

    Members are ordered by name so that both sides agree on who is 0 and who is 1;
    ``peer`` is always member index ``1 - rank``.

    ``transport``: ``auto`` moves messages through shared memory when both ends are on
    one machine (``shm.py``: rings for the bytes, a FIFO for a small token per message;
    the gloo pair only sets the link up) and over gloo's sockets otherwise; ``socket``
    always uses the sockets; ``shm`` insists on shared memory and raises ConfigError when
    the two ends cannot share it. Either way the calls, their order, timeouts, errors and
    traffic counts are the same.

    ``cancelled``: polled while waiting for the peer to come, to give up early (a peer
    declared lost meanwhile). ``eager``: sends over shared memory never wait for the
    receiver (``Outbox``).
    """

    def __init__(self, store: dist.Store, me: str, peer: str, *, traffic: Traffic, timeout: float,
                 backend: str = "gloo", net: NetSpec | None = None, tag: str = "",
                 transport: str = "auto", cancelled: Callable[[], bool] | None = None, eager: bool = False) -> None:
        if me == peer:
            raise ValueError(f"{me}: a link needs two distinct processes")
        if transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        names = sorted([me, peer])
        prefix = dist.PrefixStore(f"link/{names[0]}|{names[1]}/{tag}", store)
        rank = names.index(me)
        prefix.set(f"here/{me}", "1")
        if cancelled is not None:
            _meet(prefix, me, peer, timeout, cancelled)
        try:
            pg = make_process_group(backend, prefix, rank, 2, timeout)
        except RuntimeError as exc:
            raise translate_error(exc, me, "opening a link", peer, timeout) from None
        super().__init__(pg, rank, names, traffic, timeout, net)
        self.peer_index = 1 - rank
        self.peer = peer
        self.shm: Channel | None = None
        if transport == "shm" and backend != "gloo":
            raise ConfigError(f"--transport shm moves host memory; backend {backend} links use their own transport: "
                              f"pass --transport auto")
        if backend == "gloo" and transport != "socket":
            self._open_shm(required=transport == "shm", eager=eager)

    def _swap(self, mine: torch.Tensor) -> torch.Tensor:
        """Send ``mine`` and receive the peer's tensor of the same shape (set-up traffic,
        not counted, as gloo's own connection set-up is not)."""
        theirs = torch.empty_like(mine)
        try:
            works = [self.pg.recv([theirs], self.peer_index, 0), self.pg.send([mine], self.peer_index, 0)]
            for work in works:
                work.wait(dt.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise translate_error(exc, self.me, "opening a link", self.peer, self.timeout) from None
        return theirs

    def _open_shm(self, required: bool, eager: bool) -> None:
        """Agree with the peer on shared memory: each side makes its outgoing region and its
        incoming FIFO and opens the other's; both use them only if both could (``shm.py``)."""
        base, nonce, why = new_base(), secrets.randbits(62), ""
        outbox = inbox = None
        rfd = wfd = -1
        try:
            outbox = Outbox(base, nonce, self.me, self.peer, eager)
            rfd = make_fifo(base)
        except (OSError, AttributeError) as exc:  # AttributeError: no posix_fallocate on this OS
            why = f"{self.me} cannot make shared-memory files in {os.path.dirname(base)}: {exc}"
        name = os.path.basename(base).encode().ljust(_NAME_BYTES, b"\0")
        hello = torch.cat([torch.tensor([int(not why), host_id(), os.getpid(), nonce]),
                           torch.frombuffer(bytearray(name), dtype=torch.int64)])
        peer_hello = self._swap(hello)
        want, host, pid, peer_nonce = peer_hello[:4].tolist()
        peer_base = os.path.join(os.path.dirname(base),
                                 peer_hello[4:].numpy().tobytes().rstrip(b"\0").decode("ascii", "replace"))
        if not why:
            if not want:
                why = f"{self.peer} could not make shared-memory files"
            elif host != host_id() or not peer_alive(pid):
                why = f"{self.peer} runs on another machine"
            else:
                try:
                    inbox = Inbox(peer_base, peer_nonce, self.me, self.peer)
                    wfd = open_fifo(peer_base, self.peer)
                except ProtocolError as exc:
                    why, inbox = str(exc), None
        agreed = bool(self._swap(torch.tensor([int(inbox is not None and wfd >= 0)]))[0])
        # Both sides have opened these, or neither will.
        if outbox is not None:
            outbox.region.unlink()
        unlink_quietly(f"{base}-fifo")
        if inbox is not None and wfd >= 0 and agreed:
            outbox.peer_pid = pid
            self.shm = Channel(self.me, self.peer, outbox, inbox, rfd, wfd, self._inline_send, self._inline_recv,
                               self.net)
            return
        for fd in (rfd, wfd):
            if fd >= 0:
                os.close(fd)
        if outbox is not None:
            outbox.close()
        if required:
            raise ConfigError(f"{self.me}: --transport shm, but the link to {self.peer} cannot use shared memory "
                              f"({why or 'the peer could not open this side'}): pass --transport auto")

    def _inline_send(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        return self.pg.send([tensor], self.peer_index, tag + _INLINE_TAG)

    def _inline_recv(self, tensor: torch.Tensor, tag: int) -> None:
        try:
            self.pg.recv([tensor], self.peer_index, tag + _INLINE_TAG).wait(dt.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise translate_error(exc, self.me, f"receive of {_nbytes(tensor)} bytes", self.peer,
                                  self.timeout) from None

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Work:
        if self.shm is None:
            return super().isend(tensor, peer, tag)
        self._check_peer(peer)
        tensor = self._outgoing(tensor)
        nbytes = _nbytes(tensor)
        # Under --net the message leaves through this process's emulated interface and the
        # receiver gets it when it arrives; the sender goes on (over sockets it waits).
        due = INTERFACE.send(self.net, nbytes) if self.net is not None else 0
        what = f"send of {nbytes} bytes"
        try:
            inline = self.shm.send(tensor, tag, self.timeout, due)
        except RuntimeError as exc:
            raise translate_error(exc, self.me, what, self.peer, self.timeout) from None
        self.traffic.sent(self.peer, nbytes)
        return Work(inline, self, what, self.peer)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0, counted: int | None = None) -> Work:
        if self.shm is None:
            return super().irecv(tensor, peer, tag, counted)
        self._check_peer(peer)
        nbytes = _nbytes(tensor) if counted is None else counted
        what = f"receive of {nbytes} bytes"
        tensor, landed = self._incoming(tensor, lambda: self.traffic.received(self.peer, nbytes))
        return Work(self.shm.post(tensor, tag, what), self, what, self.peer, on_done=landed)

    def recv_view(self, like: torch.Tensor, tag: int = 0, timeout: float | None = None
                  ) -> tuple[torch.Tensor, Callable[[], None]]:
        """Receive a message of at most ``like``'s size and dtype without copying it where
        possible: over shared memory the result is a view of the ring, valid until the
        returned ``release`` is called (call it soon: the sender reuses the space only
        after); over sockets it is ``like`` itself, received into. Either way the result
        holds exactly the elements that came (over sockets ``like``'s length: check a mark)."""
        if self.shm is None:
            self.recv_from_peer(like, tag, timeout)
            return like, lambda: None
        nbytes = _nbytes(like)
        what = f"receive of {nbytes} bytes"
        pending = self.shm.post(like, tag, what, view=True)
        Work(pending, self, what, self.peer).wait(timeout)
        self.traffic.received(self.peer, nbytes)
        return pending.data(), pending.release

    @property
    def transport(self) -> str:
        """What carries this link's messages: shm or socket."""
        return "socket" if self.shm is None else "shm"

    def send_to_peer(self, tensor: torch.Tensor, tag: int = 0, timeout: float | None = None) -> None:
        self.send(tensor, self.peer_index, tag, timeout)

    def recv_from_peer(self, tensor: torch.Tensor, tag: int = 0, timeout: float | None = None,
                       counted: int | None = None) -> None:
        self.recv(tensor, self.peer_index, tag, timeout, counted)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        super().close()


def _both_ends(make: Callable[[dist.Store, int], Endpoint], timeout: float) -> tuple[Endpoint, Endpoint]:
    """``make(store, i)`` for i = 0 and 1, each in a thread of its own (as two processes would
    open them), over a store of their own."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=dt.timedelta(seconds=timeout), wait_for_workers=False)
    made: dict[int, Endpoint] = {}
    threads = [threading.Thread(target=lambda i=i: made.__setitem__(i, make(store.clone(), i))) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return made[0], made[1]


def link_pair(transport: str = "auto", timeout: float = 10.0, net: NetSpec | None = None) -> tuple[Link, Link]:
    """Two ends of one Link, "a" and "b", both in this process: for tests and for
    benchmarks that time the calls without a second process."""
    names = ("a", "b")
    return _both_ends(lambda store, i: Link(store, names[i], names[1 - i], traffic=Traffic(), timeout=timeout,
                                            transport=transport, net=net), timeout)


def group_pair(transport: str = "auto", timeout: float = 10.0) -> tuple[Group, Group]:
    """Both members of one Group, "worker 0" and "worker 1", in this process, each
    connected to the other with ``transport`` (``Group.connect``): for tests."""
    def make(store: dist.Store, rank: int) -> Group:
        group = Group(store, "pair", rank, ["worker 0", "worker 1"], traffic=Traffic(), timeout=timeout)
        group.connect([1 - rank], transport)
        return group

    return _both_ends(make, timeout)
