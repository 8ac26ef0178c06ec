"""The shared-memory transport of Links (plexus/cluster/shm.py): the ring, its checks, and
Links that use it between two threads and between two processes."""
from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from plexus.cluster import shm
from plexus.cluster.group import Link, link_pair
from plexus.cluster.shm import INLINE, TOKEN_BYTES, Inbox, Outbox, Token
from plexus.cluster import shm_channel
from plexus.cluster.shm_channel import set_spin
from plexus.cluster.spawn import spawn
from plexus.cluster.traffic import Traffic
from plexus.errors import CommTimeout, ConfigError, PeerLost, ProtocolError
from plexus.train.runner import spin_seconds
from test_cluster import wait_until


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """Regions in a private folder, so a test can see what it leaves behind."""
    monkeypatch.setenv("PLEXUS_SHM_DIR", str(tmp_path))
    return tmp_path


def pair(capacity: int = 4096) -> tuple[Outbox, Inbox]:
    base = shm.new_base()
    out = Outbox(base, 7, "a", "b")
    if capacity != out.region.capacity:
        out.region.unlink()
        out.regions[0] = shm.Region.create(base, 0, capacity, 7)
    return out, Inbox(base, 7, "b", "a")


def send(out: Outbox, tensor: torch.Tensor) -> Token:
    with out.lock:
        return out.put(tensor, 0, timeout=0.5)


def recv(inbox: Inbox, token: Token, into: torch.Tensor) -> None:
    inbox.check(token, into)
    inbox.take(token, into)


@pytest.fixture
def spinning():
    """Receives poll their FIFO for up to 30 s (--spin on polls 10 ms) before poll()."""
    set_spin(30.0)
    yield
    set_spin(0.0)


@pytest.fixture(params=[0.0, 30.0], ids=["sleeping", "spinning"])
def either_wait(request):
    """Receives that sleep in poll() at once, then receives that poll their FIFO first."""
    set_spin(request.param)
    yield
    set_spin(0.0)


def test_ring_reuses_space_behind_the_reader_and_wraps(shm_dir):
    out, inbox = pair(capacity=1024)
    msgs = [torch.full((64,), float(i)) for i in range(5)]  # 256 bytes each
    tokens = [send(out, m) for m in msgs[:4]]
    assert [t.offset for t in tokens] == [0, 256, 512, 768]
    got = torch.empty(64)
    recv(inbox, tokens[0], got)
    assert torch.equal(got, msgs[0])
    tokens.append(send(out, msgs[4]))  # wrapped to the freed start
    assert tokens[4].offset == 0
    with pytest.raises(CommTimeout, match="did not take the earlier messages"):
        send(out, torch.zeros(64))  # no room until message 1 is read
    for token, want in zip(tokens[1:], msgs[1:]):
        recv(inbox, token, got)
        assert torch.equal(got, want)
    assert send(out, torch.zeros(128)).offset == 0  # empty again: back to the start


def test_messages_taken_out_of_order_free_space_in_order(shm_dir):
    out, inbox = pair(capacity=512)
    first, second = send(out, torch.zeros(64)), send(out, torch.ones(64))
    got = torch.empty(64)
    recv(inbox, second, got)
    assert int(inbox.regions[0].ctrl[0]) == 0  # the first is still unread: nothing is free
    recv(inbox, first, got)
    assert int(inbox.regions[0].ctrl[0]) == 2


def test_a_larger_message_moves_to_a_larger_region_without_waiting(shm_dir):
    out, inbox = pair(capacity=1024)
    out.region.unlink()  # as the link's handshake does
    small = send(out, torch.ones(10))  # still unread when the large one goes
    big = torch.arange(1000, dtype=torch.float32)  # 4000 bytes
    token = send(out, big)
    assert token.generation == 1 and out.region.capacity == 8192
    got = torch.empty(1000)
    recv(inbox, token, got)
    assert torch.equal(got, big) and len(inbox.regions) == 2
    recv(inbox, small, got[:10])
    assert torch.equal(got[:10], torch.ones(10))
    assert not os.listdir(shm_dir)  # region 1 was unlinked by the reader once it opened it


def test_a_message_no_region_can_hold_goes_inline(shm_dir, monkeypatch):
    monkeypatch.setattr(shm, "MAX_CAPACITY", 2048)
    out, _ = pair(capacity=1024)
    token = send(out, torch.zeros(1000))
    assert token.offset == INLINE and len(out.regions) == 1


@pytest.mark.parametrize("field, value, message", [
    ("nbytes", 10_000, "10000 bytes where 256 were posted"),
    ("offset", 4000, "outside its ring"),
    ("seq", -1, "out of sequence"),
    ("generation", 100, "out of sequence"),
    ("generation", 5, "cannot be opened"),
])
def test_bad_tokens_raise_protocol_errors(shm_dir, field, value, message):
    out, inbox = pair(capacity=4096)
    token = send(out, torch.zeros(64))._replace(**{field: value})
    with pytest.raises(ProtocolError, match=message):
        inbox.check(token, torch.empty(64))


def test_token_round_trip_and_magic():
    token = Token(seq=3, tag=1, offset=INLINE, nbytes=10, generation=2, due=123_456_789)
    assert Token.decode(token.encode(), "a", "b") == token
    with pytest.raises(ProtocolError, match="not a shared-memory token"):
        Token.decode(bytes(TOKEN_BYTES), "a", "b")


def test_a_region_must_carry_the_announced_nonce_and_name(shm_dir):
    base = shm.new_base()
    Outbox(base, 7, "a", "b")
    with pytest.raises(ProtocolError, match="nonce"):
        Inbox(base, 8, "b", "a")
    with pytest.raises(ProtocolError, match="outside plexus"):
        Inbox("/etc/passwd", 7, "b", "a")


def test_a_sender_waiting_on_a_dead_peer_says_so(shm_dir):
    out, _ = pair(capacity=1024)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out.peer_pid = dead.pid
    send(out, torch.zeros(200))
    with pytest.raises(PeerLost, match="its process is gone"):
        send(out, torch.zeros(200))


# --- Links between two threads of this process ----------------------------------------

def _store(timeout: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=dt.timedelta(seconds=timeout), wait_for_workers=False)


@pytest.mark.parametrize("numel", [0, 1, 1000, 2_000_000])
def test_link_over_shared_memory_delivers_every_dtype_and_size(shm_dir, numel):
    a, b = link_pair("shm")
    assert a.transport == b.transport == "shm"
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        sent = torch.arange(numel).to(dtype)
        got = torch.empty(numel, dtype=dtype)
        work = b.irecv(got, b.peer_index)
        a.send_to_peer(sent)
        work.wait()
        assert torch.equal(got, sent)
    assert a.traffic.snapshot()["b"]["bytes_sent"] == b.traffic.snapshot()["a"]["bytes_recv"] == numel * (4 + 8 + 2)
    a.close(), b.close()
    assert not os.listdir(shm_dir)


def test_inline_messages_keep_their_order_with_ring_messages(shm_dir, monkeypatch):
    monkeypatch.setattr(shm, "MAX_CAPACITY", 1 << 16)
    a, b = link_pair("shm")
    sizes = [10, 100_000, 20, 50_000, 5]  # 400 KB and 200 KB exceed the largest region
    gots = [torch.empty(n) for n in sizes]
    works = [b.irecv(got, b.peer_index) for got in gots]
    for n in sizes:
        a.send_to_peer(torch.full((n,), float(n)))
    for work, got, n in zip(works, gots, sizes):
        work.wait()
        assert torch.equal(got, torch.full((n,), float(n)))
    a.close(), b.close()


def test_receives_match_by_tag_in_post_order_whenever_the_tokens_came(shm_dir):
    a, b = link_pair("shm")
    for value, tag in ((1.0, 0), (2.0, 5), (3.0, 0)):  # all sent before any receive is posted
        a.isend(torch.full((4,), value), a.peer_index, tag).wait()
    late, first, second = torch.empty(4), torch.empty(4), torch.empty(4)
    works = [b.irecv(late, b.peer_index, 5), b.irecv(first, b.peer_index, 0), b.irecv(second, b.peer_index, 0)]
    for work in reversed(works):
        work.wait()
    assert (late[0], first[0], second[0]) == (2.0, 1.0, 3.0)
    a.close(), b.close()


def test_two_threads_receiving_on_one_link_each_get_their_own(shm_dir, either_wait):
    a, b = link_pair("shm")
    got: dict[int, float] = {}

    def receive(tag: int) -> None:
        buf = torch.empty(1000)
        b.recv(buf, b.peer_index, tag)
        got[tag] = float(buf[0])

    threads = [threading.Thread(target=receive, args=(tag,)) for tag in (1, 2)]
    for thread in threads:
        thread.start()
    for tag in (2, 1):
        a.send(torch.full((1000,), float(tag)), a.peer_index, tag)
    for thread in threads:
        thread.join()
    assert got == {1: 1.0, 2: 2.0}
    a.close(), b.close()


def test_a_closed_peer_is_lost_at_once_and_a_silent_one_times_out(shm_dir):
    a, b = link_pair("shm")
    with pytest.raises(CommTimeout, match="b: receive of 16 bytes: a did not answer within 0.2 s"):
        b.recv_from_peer(torch.empty(4), timeout=0.2)
    a.close()
    with pytest.raises(PeerLost, match="lost a"):
        b.recv_from_peer(torch.empty(4), timeout=30)
    b.close()


def test_closing_a_link_ends_a_wait_on_it_in_another_thread(shm_dir, either_wait):
    a, b = link_pair("shm")
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            b.recv_from_peer(torch.empty(4), timeout=30)
        except PeerLost as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert wait_until(lambda: b.shm._reading, 10)  # the waiter reads the FIFO: inside poll(), or polling it
    started = time.monotonic()
    b.close()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and time.monotonic() - started < 5
    assert len(errors) == 1 and "closed here" in str(errors[0])
    a.close()


class _NoSleep:
    """A poll object that fails the test if a receive sleeps in it."""

    def poll(self, *args):
        raise AssertionError("a spinning receive slept in poll()")


class _Counting:
    """A link's poll object that notes, in ``slept``, ``index`` each time a receive sleeps
    in it, and sets ``entered``."""

    def __init__(self, inner, slept: list[int], index: int, entered: threading.Event) -> None:
        self.inner, self.slept, self.index, self.entered = inner, slept, index, entered

    def poll(self, *args):
        self.slept.append(self.index)
        self.entered.set()
        return self.inner.poll(*args)


def test_a_spinning_receive_reads_its_message_without_sleeping_in_poll(shm_dir, spinning):
    a, b = link_pair("shm")
    b.shm._poll_in = _NoSleep()

    def send_once_polling() -> None:  # the receive polls the FIFO by now (it holds the one spin)
        assert wait_until(shm_channel._spinner.locked, 10)
        a.send_to_peer(torch.full((1000,), 7.0))

    sender = threading.Thread(target=send_once_polling)
    sender.start()
    got = torch.empty(1000)
    b.recv_from_peer(got, timeout=10)
    sender.join()
    assert float(got[0]) == 7.0
    a.close(), b.close()


def test_threads_waiting_on_two_links_at_once_take_turns_to_poll(shm_dir, spinning):
    """One thread of a process polls at a time (a server's threads, one per worker, must
    not all spin): the other sleeps in poll() and still gets its message."""
    pairs = [link_pair("shm") for _ in range(2)]
    slept: list[int] = []
    entered = threading.Event()
    for i, (_, b) in enumerate(pairs):
        b.shm._poll_in = _Counting(b.shm._poll_in, slept, i, entered)
    got = [torch.empty(100) for _ in pairs]
    threads = [threading.Thread(target=b.recv_from_peer, args=(into,), kwargs={"timeout": 30})
               for (_, b), into in zip(pairs, got)]
    for thread in threads:
        thread.start()
    assert entered.wait(10)  # one receive sleeps in poll(), so the other holds the spin: both wait
    for i, (a, _) in enumerate(pairs):
        a.send_to_peer(torch.full((100,), float(i)))
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert [float(g[0]) for g in got] == [0.0, 1.0]
    assert len(set(slept)) == 1  # one receive slept in poll(), the other polled
    for a, b in pairs:
        a.close(), b.close()


def test_a_spinning_receive_keeps_its_timeout(shm_dir, spinning):
    a, b = link_pair("shm")
    started = time.monotonic()
    with pytest.raises(CommTimeout, match="a did not answer within 0.2 s"):
        b.recv_from_peer(torch.empty(4), timeout=0.2)
    assert time.monotonic() - started < 5  # the spin stops at the receive's deadline
    a.close(), b.close()


@pytest.mark.parametrize("spin, here, threads, cores, seconds", [
    ("on", None, 0, 1, 0.01), ("off", 2, 1, 64, 0.0),
    ("auto", 3, 1, 8, 0.01),    # a core to poll on beside every computing one
    ("auto", 2, 1, 2, 0.0),     # two processes, two cores (which may share one's speed)
    ("auto", 2, 2, 6, 0.0),     # four threads want eight cores
    ("auto", None, 1, 64, 0.0),  # not known how many processes run here
    ("auto", 2, 0, 64, 0.0),    # torch's own threads: as many as the cores
])
def test_spin_auto_polls_only_where_a_core_is_free_for_it(spin, here, threads, cores, seconds):
    assert spin_seconds(spin, here, threads, cores) == seconds


def test_closing_a_link_twice_touches_no_other_file(shm_dir, tmp_path):
    """A second close (an owner's, then one on the way out) once wrote its wake-up byte to
    a descriptor number already freed: EBADF, or a byte in whatever file took the number."""
    a, b = link_pair("shm")
    b.close()
    files = [open(tmp_path / f"f{i}", "wb") for i in range(8)]  # they take the freed numbers
    try:
        b.close()
    finally:
        for f in files:
            f.close()
    assert all((tmp_path / f"f{i}").read_bytes() == b"" for i in range(8))
    a.close()


def test_a_message_longer_than_posted_is_a_protocol_error_not_a_crash(shm_dir):
    a, b = link_pair("shm")
    work = a.isend(torch.zeros(100), a.peer_index)
    with pytest.raises(ProtocolError, match="400 bytes where 40 were posted"):
        b.recv_from_peer(torch.empty(10))
    work.wait()
    a.close(), b.close()


def test_socket_transport_and_bad_transport(shm_dir):
    a, b = link_pair("socket")
    assert a.transport == "socket" and not os.listdir(shm_dir)
    a.close(), b.close()
    with pytest.raises(ConfigError, match="transport must be one of auto, socket, shm"):
        Link(None, "a", "b", traffic=Traffic(), timeout=1, transport="carrier-pigeon")


def test_shm_transport_refuses_ends_that_cannot_share_memory(shm_dir, monkeypatch):
    real = shm.host_id()  # the thread called b sees another machine
    monkeypatch.setattr("plexus.cluster.group.host_id", lambda: real + (threading.current_thread().name == "b"))
    errors: list[str] = []
    store = _store(10)

    def make(me: str, peer: str) -> None:
        try:
            Link(store.clone(), me, peer, traffic=Traffic(), timeout=10, transport="shm").close()
        except ConfigError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=make, args=names, name=names[0]) for names in (("a", "b"), ("b", "a"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 2 and all("cannot use shared memory" in e for e in errors), errors
    assert not os.listdir(shm_dir)


# --- between processes ------------------------------------------------------------------

@pytest.mark.slow
def test_link_between_processes_uses_shared_memory_by_default(tmp_path):
    results = spawn("dist_fns:link_pair", 2, {}, env={"PLEXUS_SHM_DIR": str(tmp_path)})
    assert results[1]["got"] == [1.0, 2.0, 3.0] and results[0]["got"] == [10.0, 20.0, 30.0]
    assert results[0]["transport"] == results[1]["transport"] == "shm"
    assert not os.listdir(tmp_path)
