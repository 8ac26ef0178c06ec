"""Both directions of a shared-memory link (``shm.py``): posting receives, matching the
FIFO's tokens to them, and the waits.

Receives are matched to tokens per tag in the order they were posted, as gloo matches
messages. A token that comes before its receive is posted is kept (its bytes stay in the
ring) and handed to the next receive posted for its tag. Only one thread at a time reads
the FIFO; a thread whose token another thread read finds its receive done when it wakes.
"""
from __future__ import annotations

import collections
import datetime as dt
import os
import select
import threading
import time
from typing import Callable

import torch

from plexus.cluster.emulation import INTERFACE
from plexus.cluster.shm import INLINE, TOKEN_BYTES, Inbox, Outbox, Token
from plexus.config import NetSpec
from plexus.errors import CommError, CommTimeout, PeerLost, ProtocolError

__all__ = ["Channel", "Pending", "set_spin"]

# Seconds a receive polls its FIFO before it sleeps in poll() (``set_spin``; --spin), and
# the one thread of the process that may poll at a time (the others sleep at once).
_spin = 0.0
_spinner = threading.Lock()


def set_spin(seconds: float) -> None:
    """How long each receive over shared memory in this process polls its FIFO, yielding
    the core between reads, before it sleeps in ``poll()``: 0 sleeps at once. A token that
    comes while it polls is read without the wake-up from ``poll()`` (tens to hundreds of
    microseconds once the core has idled, with the caches gone cold meanwhile), on the
    path of every pipeline hand-off; the price is the core it polls on
    (``train.runner.spin_seconds`` decides for --spin). One thread of the process polls at
    a time, and a receive that finds another polling sleeps at once: a server's threads,
    one per worker, would otherwise take turns at the GIL with the one applying gradients."""
    global _spin
    _spin = seconds


class _Receive:
    """One posted receive: where its bytes go (or, for a view, the largest buffer it may
    stand for), and how it ended."""

    def __init__(self, into: torch.Tensor, tag: int, what: str, view: bool) -> None:
        self.into, self.tag, self.what, self.view = into, tag, what, view
        self.done = False
        self.error: CommError | None = None
        self.data: torch.Tensor | None = None   # a view's bytes in the ring, typed like ``into``
        self.seq: int | None = None             # a view's message, freed by ``release``
        self.due = 0                            # when the message arrives under --net (monotonic ns)


class Pending:
    """Handle of a shared-memory receive; ``wait`` reads tokens until this one arrived."""

    def __init__(self, channel: "Channel", receive: _Receive) -> None:
        self._channel, self._receive = channel, receive

    def wait(self, timeout: dt.timedelta) -> None:
        self._channel.wait(self._receive, timeout.total_seconds())

    def is_completed(self) -> bool:
        receive = self._receive
        return receive.done and (receive.error is not None or time.monotonic_ns() >= receive.due)

    def data(self) -> torch.Tensor:
        """A completed view receive's message (its bytes in the ring until ``release``)."""
        return self._receive.data

    def release(self) -> None:
        """Free the ring space of a view receive; its ``data`` must not be read after."""
        self._channel.release(self._receive)


class Channel:
    """Both directions of one link: ``outbox`` and the FIFO ``wfd`` out, ``inbox`` and the
    FIFO ``rfd`` in. ``inline_send(tensor, tag)`` (returns a work to wait on) and
    ``inline_recv(tensor, tag)`` (blocks) move the bytes of a message too large for any
    region over the link's gloo pair."""

    def __init__(self, me: str, peer: str, outbox: Outbox, inbox: Inbox, rfd: int, wfd: int,
                 inline_send: Callable[[torch.Tensor, int], object],
                 inline_recv: Callable[[torch.Tensor, int], None], net: NetSpec | None = None) -> None:
        self.me, self.peer, self.net = me, peer, net
        self.outbox, self.inbox, self.rfd, self.wfd = outbox, inbox, rfd, wfd
        self._inline_send, self._inline_recv = inline_send, inline_recv
        self._cond = threading.Condition()
        self._posted: dict[int, collections.deque[_Receive]] = collections.defaultdict(collections.deque)
        self._early: dict[int, collections.deque[Token]] = collections.defaultdict(collections.deque)
        self._reading = False
        self._closed = False
        self._broken: str | None = None
        self._partial = b""
        # A pipe of our own wakes the thread reading the FIFO when the link is closed here
        # (closing a descriptor another thread polls does not wake it).
        self._wake_r, self._wake_w = os.pipe()
        self._poll_in, self._poll_out = select.poll(), select.poll()
        self._poll_in.register(rfd, select.POLLIN)
        self._poll_in.register(self._wake_r, select.POLLIN)
        self._poll_out.register(wfd, select.POLLOUT)

    # --- sending ---------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, tag: int, timeout: float, due: int = 0) -> object | None:
        """Put ``tensor`` in the ring and its token in the FIFO; returns the gloo work of an
        inline message (to wait on), else None: the bytes are already in place. ``due``:
        when the receiver may have it (``time.monotonic_ns()``; 0: at once)."""
        with self.outbox.lock:
            token = self.outbox.put(tensor, tag, timeout, due)
            self._write(token.encode(), tensor.numel() * tensor.element_size(), timeout)
            if token.offset == INLINE:
                return self._inline_send(tensor.contiguous(), tag)
        return None

    def _write(self, raw: bytes, nbytes: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.write(self.wfd, raw)  # a token is shorter than PIPE_BUF: written whole or not at all
                return
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"{self.me}: send of {nbytes} bytes: {self.peer} did not answer within "
                                      f"{timeout:g} s", peer=self.peer) from None
                self._poll_out.poll(min(left, 1.0) * 1000)
            except OSError as exc:  # EPIPE: the peer's reading end is gone
                raise PeerLost(f"{self.me}: send of {nbytes} bytes: lost {self.peer} ({exc.strerror})",
                               peer=self.peer) from None

    # --- receiving -------------------------------------------------------------------------

    def post(self, into: torch.Tensor, tag: int, what: str, view: bool = False) -> Pending:
        """Post a receive into ``into``; with ``view``, of a message that stays in the ring
        (at most as long as ``into``) until ``Pending.release``: no copy at all."""
        receive = _Receive(into, tag, what, view)
        with self._cond:
            if self._early[tag]:
                self._deliver(receive, self._early[tag].popleft())
            else:
                self._posted[tag].append(receive)
        return Pending(self, receive)

    def wait(self, receive: _Receive, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not receive.done:
                if self._broken is not None:
                    self._fail(receive, PeerLost(f"{self.me}: {receive.what}: lost {self.peer} ({self._broken})",
                                                 peer=self.peer))
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail(receive, CommTimeout(f"{self.me}: {receive.what}: {self.peer} did not answer within "
                                                    f"{timeout:g} s", peer=self.peer))
                    break
                if self._reading:  # another thread reads the FIFO and will hand us our token
                    self._cond.wait(left)
                    continue
                self._reading = True
                self._cond.release()
                try:
                    raw = self._read(left)
                finally:
                    self._cond.acquire()
                    self._reading = False
                if raw is not None:
                    self._dispatch(raw)
                self._cond.notify_all()
        if receive.error is not None:
            raise receive.error
        early = receive.due - time.monotonic_ns()
        if early > 0:  # under --net: not before it arrives
            time.sleep(early / 1e9)

    def _fail(self, receive: _Receive, error: CommError) -> None:
        """Under the lock: ``receive`` ends with ``error`` (no later token may match it)."""
        try:
            self._posted[receive.tag].remove(receive)
        except ValueError:
            pass
        receive.done, receive.error = True, error

    def _read(self, timeout: float) -> bytes | None:
        """One token from the FIFO, or None if none came within ``timeout`` (without the lock)."""
        if len(self._partial) < TOKEN_BYTES:
            chunk = self._fifo()  # a token already there is read at once: poll() only to wait for one
            if chunk is None and _spin > 0 and _spinner.acquire(blocking=False):
                try:
                    chunk = self._poll_busily(min(_spin, timeout))
                finally:
                    _spinner.release()
            if chunk is None:
                if self._broken is not None:
                    return None
                ready = self._poll_in.poll(timeout * 1000)
                if not ready or any(fd == self._wake_r for fd, _ in ready):
                    return None  # nothing yet, or closed here (``_broken`` says so)
                chunk = self._fifo()
                if chunk is None:
                    return None
            if not chunk:
                self._broken = "its end of the link closed"
                return None
            self._partial += chunk
        if len(self._partial) < TOKEN_BYTES:
            return None
        raw, self._partial = self._partial[:TOKEN_BYTES], self._partial[TOKEN_BYTES:]
        return raw

    def _poll_busily(self, seconds: float) -> bytes | None:
        """What the FIFO holds within ``seconds`` of reading it again and again (``set_spin``),
        giving the core to any other thread that wants it between reads; None when nothing
        came, or the link broke or was closed here (``_broken`` says so)."""
        until = time.monotonic() + seconds
        while self._broken is None and time.monotonic() < until:
            os.sched_yield()
            chunk = self._fifo()
            if chunk is not None:
                return chunk
        return None

    def _fifo(self) -> bytes | None:
        """What the FIFO holds now (b"" once the peer's end is closed), or None when it
        holds nothing or the read failed (``_broken`` then says why)."""
        try:
            return os.read(self.rfd, 64 * TOKEN_BYTES)
        except BlockingIOError:
            return None
        except OSError as exc:
            self._broken = f"its link failed: {exc.strerror}"
            return None

    def _dispatch(self, raw: bytes) -> None:
        """Under the lock: hand a token to the first receive posted for its tag, or keep it."""
        try:
            token = Token.decode(raw, self.me, self.peer)
        except ProtocolError as exc:
            self._broken = str(exc)
            return
        if self._posted[token.tag]:
            self._deliver(self._posted[token.tag].popleft(), token)
        else:
            self._early[token.tag].append(token)

    def _deliver(self, receive: _Receive, token: Token) -> None:
        """Under the lock: copy the message into ``receive``, or lend it the ring's bytes
        (or record why not)."""
        try:
            self.inbox.check(token, receive.into)
            if token.offset == INLINE and token.nbytes:
                self._inline_recv(receive.into.view(-1).view(torch.uint8)[:token.nbytes], token.tag)
            if receive.view:
                size = receive.into.element_size()
                if token.nbytes % size:
                    raise ProtocolError(f"{self.me}: {self.peer} sent {token.nbytes} bytes, not a whole number "
                                        f"of {receive.into.dtype} elements", peer=self.peer)
                if token.offset == INLINE:
                    receive.data = receive.into[:token.nbytes // size]
                else:
                    ring = self.inbox.regions[token.generation].data
                    receive.data = ring[token.offset:token.offset + token.nbytes].view(receive.into.dtype)
                    receive.seq = token.seq  # freed by release
            # Under --net: when it is in, once this process's interface has taken it in.
            receive.due = (INTERFACE.receive(self.net, token.nbytes, token.due)
                           if token.due and self.net is not None else token.due)
            if receive.seq is None:
                self.inbox.take(token, receive.into)
        except CommError as exc:
            self.inbox.consumed(token.seq)
            receive.error, receive.seq = exc, None
        receive.done = True

    def release(self, receive: _Receive) -> None:
        with self._cond:
            if receive.seq is not None:
                self.inbox.consumed(receive.seq)
                receive.seq, receive.data = None, None

    def close(self) -> None:
        """Close both FIFO ends: the peer's waits end with PeerLost, and so do waits here.
        Once: a second call (a link closed by its owner and again on the way out) must not
        write to a descriptor number the process may by then have given to another file."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if self._broken is None:
                self._broken = "the link was closed here"
            os.write(self._wake_w, b"x")
            deadline = time.monotonic() + 5.0
            while self._reading and time.monotonic() < deadline:  # let the reader leave poll()
                self._cond.wait(0.05)
            self._cond.notify_all()
        for fd in (self.rfd, self.wfd, self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.outbox.close()
