"""Shared-memory transport of a ``Link`` between two processes on one machine.

Why. Over gloo's sockets a message crosses the kernel twice and pays the TCP stack and
gloo's I/O thread on loopback. On this 2-core machine a 4 MB ping-pong moves about 0.9 GB/s
that way and 2.1 GB/s through shared memory, and a one-byte round trip takes about 290 us
over gloo against 75 us over a pipe (measured; ``plexus bench ps`` has the end result).

How. Each direction of a link has a ring buffer in a ``/dev/shm`` file (``Region``) that
the sender writes and the receiver reads, and a FIFO that carries one fixed-size *token*
per message: (magic, sequence number, tag, offset, bytes, region generation). Receives
are matched to tokens per tag in the order they were posted, as gloo matches messages; a
receive's data is copied out of the ring when a thread waiting on the link reads its
token (one waiting thread reads the FIFO at a time and hands tokens to the others; see
``shm_channel.py``). The FIFO also gives the failures: its end-of-file when the peer's process is gone
(``PeerLost``), and a ``poll`` timeout when it is silent (``CommTimeout``). A receive may
also *borrow* its message (``post(view=True)``): it gets a view of the ring and frees the
space with ``Pending.release``, which saves a parameter server one copy per push.

Ring (``Outbox``). Messages sit contiguously, ``ALIGN``-aligned; the receiver writes the
sequence number below which every message has been copied out, and the sender reuses
space only behind it (waiting up to its timeout while the receiver lags by more than the
ring; a peer process that disappeared is reported at once). An empty ring starts again at
offset 0, so request-reply traffic touches only as much memory as its largest message.
A message larger than the ring moves the sender to a new region (the next *generation*)
of at least twice its size; pages are reserved with ``posix_fallocate``, so a full
``/dev/shm`` gives the fallback, never a SIGBUS. A message no region can hold travels
inline over the link's gloo pair, on a tag of its own, after its token.

Safety (ARCHITECTURE.md, contract 5). A peer names its files by a random suffix only; a
file must be ours (same owner), of the right type and size, and a region must carry the
nonce the peer sent over gloo. Tokens are checked against the ring and the posted buffer:
a message longer than the receive posted for it raises ``ProtocolError``, where over
gloo's sockets it terminates the receiving process. Files are unlinked as soon as both
sides have opened them, so nothing is left in ``/dev/shm`` when a process dies.
"""
from __future__ import annotations

import collections
import ctypes
import os
import re
import secrets
import socket
import stat
import struct
import threading
import time
from typing import Callable, NamedTuple

import torch

from plexus.errors import CommTimeout, PeerLost, ProtocolError

__all__ = ["Outbox", "Inbox", "Region", "Token", "INLINE", "TOKEN_BYTES", "host_id", "new_base", "open_fifo",
           "make_fifo", "peer_alive", "shm_dir", "unlink_quietly"]

# Bytes before the ring: int64 slots [consumed sequence, nonce, capacity].
_CTRL = 64
ALIGN = 64
_MAGIC = 0x504C5853_5348  # "PLXSSH"
_TOKEN = struct.Struct("<7q")  # magic, then a Token's fields
TOKEN_BYTES = _TOKEN.size
# Token offset of a message that travels inline over gloo.
INLINE = -1
FIRST_CAPACITY = 1 << 20
MAX_CAPACITY = 1 << 30
_MAX_GENERATIONS = 64  # regions double from 1 MiB: far more than MAX_CAPACITY needs
_NAME = re.compile(r"^plexus-[0-9a-f]{24}-(fifo|[0-9]+)$")


def shm_dir() -> str:
    return os.environ.get("PLEXUS_SHM_DIR", "/dev/shm")


def new_base() -> str:
    return os.path.join(shm_dir(), f"plexus-{secrets.token_hex(12)}")


def host_id() -> int:
    """This machine, as an int63: its host name and the kernel's boot id. A quick filter;
    whether two processes share ``/dev/shm`` is settled by opening the peer's files."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    digest = 0xCBF29CE484222325
    for byte in f"{socket.gethostname()}|{boot}".encode():
        digest = ((digest ^ byte) * 0x100000001B3) & ((1 << 63) - 1)
    return digest


def peer_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _align(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def _copy_in(region: "Region", offset: int, tensor: torch.Tensor, nbytes: int) -> None:
    """``tensor``'s bytes into the ring at ``offset``: memmove for host memory (a torch copy
    costs tens of microseconds of dispatch, a small message's whole budget), torch's copy
    from a device."""
    if tensor.is_cpu and tensor.is_contiguous():
        ctypes.memmove(region.ptr + offset, tensor.data_ptr(), nbytes)
    else:
        region.data[offset:offset + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))


def _copy_out(region: "Region", offset: int, into: torch.Tensor, nbytes: int) -> None:
    if into.is_cpu and into.is_contiguous():
        ctypes.memmove(into.data_ptr(), region.ptr + offset, nbytes)
    else:
        into.view(-1).view(torch.uint8)[:nbytes].copy_(region.data[offset:offset + nbytes])


def _checked(path: str, peer: str, kind: Callable[[int], bool]) -> os.stat_result:
    """The peer's file ``path``, checked to be one of plexus's files of this user."""
    if os.path.dirname(path) != shm_dir() or not _NAME.match(os.path.basename(path)):
        raise ProtocolError(f"{peer} named a shared-memory file outside plexus's ({path!r})", peer=peer)
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        raise ProtocolError(f"{peer}'s shared-memory file {path} cannot be opened: {exc.strerror}",
                            peer=peer) from None
    if not kind(info.st_mode) or info.st_uid != os.getuid():
        raise ProtocolError(f"{peer}'s shared-memory file {path} is not a plexus file of this user", peer=peer)
    return info


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def make_fifo(base: str) -> int:
    """Make this side's incoming FIFO ``<base>-fifo`` and open it for reading (non-blocking)."""
    path = f"{base}-fifo"
    os.mkfifo(path, 0o600)
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK)


def open_fifo(base: str, peer: str) -> int:
    """Open the peer's incoming FIFO for writing (it holds the reading end open already)."""
    path = f"{base}-fifo"
    _checked(path, peer, stat.S_ISFIFO)
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ProtocolError(f"{peer}'s FIFO {path} cannot be opened: {exc.strerror}", peer=peer) from None


class Region:
    """One mapped ``/dev/shm`` file: a control block and ``capacity`` bytes of ring."""

    def __init__(self, path: str, capacity: int) -> None:
        self.path, self.capacity = path, capacity
        self.bytes = torch.from_file(path, shared=True, size=_CTRL + capacity, dtype=torch.uint8)
        # A memoryview of int64s: every message reads and writes these, and right after a
        # stage's matrix products (caches cold) a torch index costs about 10 us, numpy's 5.
        self.ctrl = memoryview(self.bytes[:_CTRL].numpy()).cast("q")
        self.data = self.bytes[_CTRL:]
        self.ptr = self.data.data_ptr()

    @classmethod
    def create(cls, base: str, generation: int, capacity: int, nonce: int) -> "Region":
        """A new region file ``<base>-<generation>`` with its pages reserved (OSError if
        ``/dev/shm`` cannot hold it)."""
        path = f"{base}-{generation}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, _CTRL + capacity)
        except OSError:
            os.close(fd)
            unlink_quietly(path)
            raise
        os.close(fd)
        region = cls(path, capacity)
        region.ctrl[1], region.ctrl[2] = nonce, capacity
        return region

    @classmethod
    def open(cls, base: str, generation: int, nonce: int, peer: str) -> "Region":
        """Map the peer's region ``generation``, checked to be the file the peer made."""
        path = f"{base}-{generation}"
        info = _checked(path, peer, stat.S_ISREG)
        if info.st_size <= _CTRL:
            raise ProtocolError(f"{peer}'s shared-memory region {path} is too small", peer=peer)
        region = cls(path, info.st_size - _CTRL)
        if int(region.ctrl[1]) != nonce or int(region.ctrl[2]) != region.capacity:
            raise ProtocolError(f"{peer}'s shared-memory region {path} does not carry the nonce it announced",
                                peer=peer)
        return region

    def unlink(self) -> None:
        unlink_quietly(self.path)


class Token(NamedTuple):
    seq: int
    tag: int
    offset: int      # in the ring of region ``generation``; INLINE: the bytes follow over gloo
    nbytes: int
    generation: int
    due: int = 0     # under --net: when it arrives (time.monotonic_ns(); emulation.Interface)

    def encode(self) -> bytes:
        return _TOKEN.pack(_MAGIC, *self)

    @staticmethod
    def decode(raw: bytes, me: str, peer: str) -> "Token":
        magic, *values = _TOKEN.unpack(raw)
        if magic != _MAGIC:
            raise ProtocolError(f"{me}: {peer} sent a message that is not a shared-memory token", peer=peer)
        return Token(*values)


class Outbox:
    """The sending side of one direction: places messages in the ring of the newest
    region. The receiver's consumed count lives in region 0, which is kept for life.

    ``eager``: a send never waits for the receiver to take earlier messages, as a gloo send
    never does; when the ring has no room it moves to a region at least twice as large and
    twice the size of everything not yet taken (at most ten moves from 1 MiB to the 1 GiB
    cap, past which it waits after all). Algorithms written for gloo need it: in an
    all-reduce over a group two members may each send the other several messages before
    either receives. Otherwise a send waits for room, which bounds what a slow receiver
    costs in memory."""

    def __init__(self, base: str, nonce: int, me: str, peer: str, eager: bool = False) -> None:
        self.base, self.nonce, self.me, self.peer, self.eager = base, nonce, me, peer, eager
        self.peer_pid: int | None = None  # known once the peer said hello
        self.regions = [Region.create(base, 0, FIRST_CAPACITY, nonce)]
        self.seq = 0
        # (seq, generation, start, end) of every message not yet consumed, in order.
        self.pending: collections.deque[tuple[int, int, int, int]] = collections.deque()
        self.lock = threading.Lock()

    @property
    def region(self) -> Region:
        return self.regions[-1]

    def _release(self) -> None:
        consumed = self.regions[0].ctrl[0]
        while self.pending and self.pending[0][0] < consumed:
            self.pending.popleft()

    def _fit(self, need: int) -> int | None:
        """Where ``need`` bytes go in the ring once what the receiver has copied out is
        freed, or None while there is no room."""
        self._release()
        generation, capacity = len(self.regions) - 1, self.region.capacity
        live = [(start, end) for _, g, start, end in self.pending if g == generation]
        if not live:
            return 0
        head, tail = live[0][0], live[-1][1]
        if tail > head:  # live bytes are [head, tail): room after the tail, or before the head
            if tail + need <= capacity:
                return tail
            return 0 if need <= head else None
        return tail if tail + need <= head else None  # wrapped: room is [tail, head)

    def _wait(self, done: Callable[[], bool], nbytes: int, timeout: float) -> None:
        deadline, pause = time.monotonic() + timeout, 2e-5
        while not done():
            if self.peer_pid is not None and not peer_alive(self.peer_pid):
                raise PeerLost(f"{self.me}: send of {nbytes} bytes: lost {self.peer} (its process is gone)",
                               peer=self.peer)
            if time.monotonic() > deadline:
                raise CommTimeout(f"{self.me}: send of {nbytes} bytes: {self.peer} did not take the earlier "
                                  f"messages within {timeout:g} s", peer=self.peer)
            time.sleep(pause)
            pause = min(1e-3, pause * 2)

    def _grow(self, need: int) -> bool:
        """Move to a region of at least twice ``need`` bytes; False when none can be had
        (too large, or ``/dev/shm`` is full): the message then goes inline."""
        capacity = self.region.capacity
        while capacity < 2 * need:
            capacity *= 2
        if capacity > MAX_CAPACITY:
            return False
        try:
            self.regions.append(Region.create(self.base, len(self.regions), capacity, self.nonce))
        except OSError:
            return False
        return True

    def put(self, tensor: torch.Tensor, tag: int, timeout: float, due: int = 0) -> Token:
        """Copy ``tensor`` into the ring (caller holds ``lock``); returns its token, which
        says the message arrives at ``due`` (``time.monotonic_ns()``; 0: at once)."""
        nbytes = tensor.numel() * tensor.element_size()
        need = _align(nbytes)
        if need > self.region.capacity and not self._grow(need):
            offset = INLINE
        else:
            offset = self._fit(need)
            if offset is None and self.eager:
                live = sum(end - start for _, _, start, end in self.pending)
                if self._grow(max(live + need, self.region.capacity)):  # at least doubles
                    offset = 0  # the new region holds nothing yet
            if offset is None:  # the receiver is behind by more than the ring: wait for room
                slot: list[int | None] = [None]

                def placed() -> bool:
                    slot[0] = self._fit(need)
                    return slot[0] is not None

                self._wait(placed, nbytes, timeout)
                offset = slot[0]
            if nbytes:
                _copy_in(self.region, offset, tensor, nbytes)
            self.pending.append((self.seq, len(self.regions) - 1, offset, offset + need))
        token = Token(self.seq, tag, offset, nbytes, len(self.regions) - 1, due)
        self.seq += 1
        return token

    def close(self) -> None:
        for region in self.regions:
            region.unlink()  # the peer unlinks what it opened; these are the ones it never did


class Inbox:
    """The receiving side of one direction: copies messages out and frees their space."""

    def __init__(self, base: str, nonce: int, me: str, peer: str) -> None:
        self.base, self.nonce, self.me, self.peer = base, nonce, me, peer
        self.regions = [Region.open(base, 0, nonce, peer)]
        self.next = 0
        self.done: set[int] = set()

    def check(self, token: Token, into: torch.Tensor) -> None:
        """Raise ProtocolError unless ``token`` fits the ring and the buffer ``into``."""
        capacity = into.numel() * into.element_size()
        if token.nbytes < 0 or token.nbytes > capacity:
            raise ProtocolError(f"{self.me}: {self.peer} sent {token.nbytes} bytes where {capacity} were posted",
                                peer=self.peer)
        if token.seq < self.next or token.seq in self.done or not 0 <= token.generation < _MAX_GENERATIONS:
            raise ProtocolError(f"{self.me}: {self.peer} sent a token out of sequence ({token.seq}, "
                                f"region {token.generation})", peer=self.peer)
        # Tokens of different tags may be taken out of order, so regions may be skipped over.
        while len(self.regions) <= token.generation:
            region = Region.open(self.base, len(self.regions), self.nonce, self.peer)
            region.unlink()
            self.regions.append(region)
        ring = self.regions[token.generation].capacity
        if token.offset != INLINE and not 0 <= token.offset <= ring - token.nbytes:
            raise ProtocolError(f"{self.me}: {self.peer} sent a token outside its ring "
                                f"({token.offset}+{token.nbytes})", peer=self.peer)

    def take(self, token: Token, into: torch.Tensor) -> None:
        """Copy the message of ``token`` into ``into`` and free its space (and that of every
        earlier message already taken)."""
        if token.nbytes and token.offset != INLINE:
            _copy_out(self.regions[token.generation], token.offset, into, token.nbytes)
        self.consumed(token.seq)

    def consumed(self, seq: int) -> None:
        self.done.add(seq)
        while self.next in self.done:
            self.done.discard(self.next)
            self.next += 1
        self.regions[0].ctrl[0] = self.next
