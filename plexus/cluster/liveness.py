"""Who is still there: every process of a job spread over hosts says where it runs and
keeps a pulse in the job's store, so that a survivor whose collective timed out can name
the process that went silent, with its host, instead of "one of worker 1, worker 2, ...".

Under the local launcher the launcher sees a child die and names it; under torchrun (and
Ray) nobody does. A host whose processes were killed, or whose link went down, stops
pulsing: its processes' counters stand still in the store, which the survivors still
reach. A process that cannot reach the store itself says so: it is the one cut off.

``Pulse`` bumps ``pulse/<name>`` every ``PERIOD`` seconds from a daemon thread, on a
connection of its own (a clone of the store client); ``where/<name>`` holds
``host (address)``, and ``done/<name>`` marks a process that ended its part normally.
``silent(store, names)`` reads every counter, waits a few periods and reads again: the
names whose counters did not move, and that are not done, are silent.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time

from plexus.cluster.rendezvous import route_address
from plexus.errors import CommError

__all__ = ["Pulse", "silent", "explain_loss", "exited_key", "exit_time", "name_first_exit", "PERIOD"]


PERIOD = 0.5  # seconds between beats
_WATCH = 4 * PERIOD  # how long a survivor watches the counters before it names the silent


def _where(master_addr: str) -> str:
    """``host (address)``: this machine's name and its address on the route to the store."""
    try:
        address = route_address(master_addr)
    except OSError:
        address = "?"
    return f"{socket.gethostname()} ({address})"


class Pulse:
    """This process's pulse in the store, until ``stop``; and its watchdog.

    A store call to a host whose link went down does not fail: TCP retransmits for many
    minutes, and c10d's client applies its timeout to waits, not to every call. So the
    pulse doubles as the process's check on its own link: when one beat has been in flight
    for ``timeout`` seconds, this host is cut off from the job's store, and the process
    says so in one line and exits with status 1, rather than hang in whichever store call
    its main thread is blocked in."""

    def __init__(self, store, name: str, master_addr: str, timeout: float) -> None:
        self.name = name
        self.master_addr = master_addr
        self.timeout = timeout
        self.store = store.clone()
        self.store.set(f"where/{name}", _where(master_addr))
        self.stopped = threading.Event()
        self.in_flight_since: float | None = None
        self.threads = [threading.Thread(target=self._beat, name="plexus-pulse", daemon=True),
                        threading.Thread(target=self._watch, name="plexus-pulse-watch", daemon=True)]
        for thread in self.threads:
            thread.start()

    def _beat(self) -> None:
        key = f"pulse/{self.name}"
        while not self.stopped.is_set():
            self.in_flight_since = time.monotonic()
            try:
                self.store.add(key, 1)
            except RuntimeError:  # the store is gone (the job ended, or its host): calls fail, not hang
                return
            finally:
                self.in_flight_since = None
            self.stopped.wait(PERIOD)

    def _watch(self) -> None:
        while not self.stopped.wait(PERIOD):
            since = self.in_flight_since
            if since is not None and time.monotonic() - since > self.timeout and not self.stopped.is_set():
                print(f"plexus: {self.name} on {socket.gethostname()}: the job's store at {self.master_addr} has "
                      f"not answered for {self.timeout:g} s: this host is cut off from the job (or the store's "
                      f"host is lost); exiting", file=sys.stderr, flush=True)
                os._exit(1)

    def finish(self) -> None:
        """This process ended its part normally: it is done, not silent. Under torchrun
        worker 0 hosts the store and may already have ended the job, every record in hand:
        then there is nobody left to tell, and this process still ended normally."""
        try:
            self.store.set(f"done/{self.name}", "1")
        except RuntimeError:
            pass

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(timeout=2 * PERIOD)


def exited_key(name: str) -> str:
    """Where the local launcher records when process ``name`` (``worker 2``) exited with
    an error: survivors learn of a death there at once, without watching pulses."""
    return f"exited/{name}"


def exit_time(store, name: str) -> float:
    """When process ``name`` exited with an error (``exited_key``); inf while it has not."""
    key = exited_key(name)
    return float(store.get(key).decode()) if store.check([key]) else float("inf")


def name_first_exit(exc: CommError, store, me: str, everyone: list[str]) -> CommError:
    """``exc`` (a lost peer) with the process that exited first named, where that is not
    the peer ``exc`` names. A loss travels along links: with worker 1 killed in a ring,
    worker 2 exits on losing it and worker 0 then sees worker 2's link close, so worker 0's
    own line would blame worker 2. The records are the launcher's (``exited_key``) and a
    ``--kill``'s own, read once: the launcher stops every process right after it records
    a failure, so waiting for more would only lose this line. The same exception where
    the first to exit is that peer, where nothing was recorded (no launcher: torchrun,
    Ray) or where the store is gone."""
    others = [n for n in everyone if n != me]
    try:
        times = {n: exit_time(store, n) for n in others}
    except RuntimeError:  # c10d's DistStoreError: the launcher (and its store) is gone
        return exc
    first = min(others, key=times.__getitem__, default=None)
    if first is None or times[first] == float("inf") or first == exc.peer:
        return exc
    return type(exc)(f"{exc}; {first} exited first", peer=exc.peer)


def silent(store, names: list[str], watch: float = _WATCH) -> list[str]:
    """The processes among ``names`` whose pulse did not move for ``watch`` seconds and
    that did not finish. Raises RuntimeError where the store itself cannot be reached."""
    before = {n: store.add(f"pulse/{n}", 0) for n in names}
    time.sleep(watch)
    return [n for n in names if store.add(f"pulse/{n}", 0) == before[n] and not store.check([f"done/{n}"])]


def _located(store, name: str) -> str:
    key = f"where/{name}"
    return f"{name} on {store.get(key).decode()}" if store.check([key]) else name


def explain_loss(exc: CommError, store, me: str, everyone: list[str], master: str) -> CommError:
    """``exc`` with the processes that went silent named, with their hosts; or, where the
    store cannot be reached, saying that this process is the one cut off. The same
    exception when every process still pulses (a peer that is alive but stuck)."""
    others = [n for n in everyone if n != me]
    try:
        gone = silent(store, others)
        where = [_located(store, n) for n in gone]
    except RuntimeError:
        return type(exc)(f"{exc}; the job's store at {master} cannot be reached either: this host is cut "
                         f"off, or the store's host is lost", peer="store")
    if not gone:
        return exc
    return type(exc)(f"{exc}; silent: {', '.join(where)}", peer=", ".join(gone))
