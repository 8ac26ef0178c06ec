"""Heartbeats: how servers and aggregators tell a live peer from a silent one, and how
long the beats really took.

A process that others must watch (a worker, an aggregator) runs a ``Heartbeat``: a thread
that bumps the counter ``ps/hb/<role>/<rank>`` in the job's store every ``interval``
seconds (``--peer-timeout`` / 5) on a store connection of its own. A server's or an
aggregator's monitor reads the counters of its peers every quarter of a second or so and
judges them with a ``Watch``: a peer whose counter stood still for ``--peer-timeout``
seconds (``--timeout`` before its first beat) is lost.

On a loaded machine (two cores shared by fifteen processes of the job and whatever else
runs there) a beat that is due is not a beat that is sent: the beating thread waits for a
core and for its interpreter's GIL, and the monitor that reads it waits the same way. The
time a monitor itself spent not running says nothing about its peers, so ``Watch`` does
not count it as the peers' silence: when the monitor's own loop came round late by more
than twice its period, the excess is taken off every peer's silence (``Watch.tick``). A
peer is declared lost only if it stayed silent for ``--peer-timeout`` seconds of the
monitor's own running time (five beat periods): a killed or stopped process still goes
silent for good and is dropped within the limit, plus at most the monitor's own stalls.
The stall this guards against was the store itself: every store call of the job, the
beats and the monitors' reads alike, waited 5 s for a reverse DNS lookup in the store's
server thread (``cluster/rendezvous.py``, ``_listen``).

Both ends record the gaps between beats (``GapStats``): the sender the interval between
two successful bumps, the receiver the interval between two changes of a peer's counter
that it saw, and its own stalls. Their maxima, percentiles and a histogram in fractions of
the limit go into each process's final record (``record()``), a gap longer than
``WARN_FRACTION`` of the limit into a ``heartbeat`` event of metrics.jsonl, and
``heartbeat_summary`` folds the records into the summary.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

__all__ = ["Heartbeat", "Watch", "GapStats", "beat_key", "heartbeat_summary", "WARN_FRACTION"]

logger = logging.getLogger(__name__)

# A gap longer than this fraction of the limit is logged as a ``heartbeat`` event: it is
# the warning that a loaded machine came that close to a false loss.
WARN_FRACTION = 0.5
# Histogram edges, in fractions of the limit (a gap of exactly one beat period is 0.2).
EDGES = (0.25, 0.5, 0.75, 1.0)
# Percentiles are taken over the last this many gaps (a run of an hour beats 1,800 times
# at the default 2 s period, so this keeps whole runs of ordinary length).
KEEP = 4096

Log = Callable[..., None]   # MetricsLog.log: (event, **fields)


def beat_key(role: str, rank: int) -> str:
    """The store counter that ``role`` ``rank`` bumps."""
    return f"ps/hb/{role}/{rank}"


def _run_delay() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a core, since it
    started (Linux schedstat); None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class GapStats:
    """Intervals between successive events (seconds), measured against ``limit`` seconds:
    the count, the maximum, percentiles over the last ``KEEP`` and a histogram of
    fractions of the limit. Not thread-safe: one thread adds."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.count = 0
        self.max = 0.0
        self.recent: deque[float] = deque(maxlen=KEEP)
        self.histogram = [0] * (len(EDGES) + 1)

    def add(self, gap: float) -> None:
        self.count += 1
        self.max = max(self.max, gap)
        self.recent.append(gap)
        fraction = gap / self.limit if self.limit > 0 else float("inf")
        self.histogram[sum(fraction >= e for e in EDGES)] += 1

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile (0 to 100) of the recent gaps, nearest rank."""
        if not self.recent:
            return None
        ordered = sorted(self.recent)
        return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]

    def record(self) -> dict[str, Any]:
        labels = [f"<{EDGES[0]:g}"] + [f"{a:g}-{b:g}" for a, b in zip(EDGES, EDGES[1:])] + [f">={EDGES[-1]:g}"]
        return {"count": self.count, "max_seconds": round(self.max, 4), "limit_seconds": self.limit,
                "p50_seconds": _round(self.percentile(50)), "p90_seconds": _round(self.percentile(90)),
                "p99_seconds": _round(self.percentile(99)),
                "histogram_of_limit": dict(zip(labels, self.histogram))}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


class _Events:
    """Writes ``heartbeat`` events, with the time since the job's start (``train/t0``, once
    worker 0 has set it) as every event has, and the wall clock besides."""

    def __init__(self, log: Log | None, store: dist.Store | None) -> None:
        self.log, self.store, self.t0 = log, store, None

    def __call__(self, **fields: Any) -> None:
        if self.log is None:
            return
        now = time.time()
        try:
            if self.t0 is None and self.store is not None and self.store.check(["train/t0"]):
                self.t0 = float(self.store.get("train/t0").decode())
            self.log("heartbeat", time=None if self.t0 is None else round(now - self.t0, 4), unix_time=now,
                     **fields)
        except (OSError, RuntimeError, ValueError) as exc:  # a closed log or a gone store: the job is ending
            logger.debug("heartbeat event not written: %s", exc)


class Heartbeat:
    """Bumps ``ps/hb/<role>/<rank>`` every ``interval`` seconds on its own store connection
    (a blocking store call elsewhere must not hold the beats up), so servers and
    aggregators can tell a live worker (or aggregator) from a silent one.

    ``limit``: the silence after which the watchers drop us (``--peer-timeout``, by default
    five periods), for the gap statistics and their warning events, written to ``log``."""

    def __init__(self, store: dist.Store, rank: int, interval: float, role: str = "worker", *,
                 limit: float | None = None, log: Log | None = None) -> None:
        self._store, self._key, self._interval = store.clone(), beat_key(role, rank), interval
        self.name = f"{role} {rank}"
        self.limit = limit if limit is not None else 5 * interval
        self.gaps = GapStats(self.limit)
        self.store_max = 0.0     # the longest single bump (seconds): a store that answers late
        self.late_max = 0.0      # the longest oversleep past the period (seconds): a thread not run
        self._events = _Events(log, self._store)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{role} {rank} heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last: float | None = None
        delay = _run_delay()
        while not self._stop.is_set():
            before = time.monotonic()
            try:
                self._store.add(self._key, 1)
            except RuntimeError as exc:  # the store went away: the job is over
                logger.debug("heartbeat %s stopped: %s", self._key, exc)
                return
            sent = time.monotonic()
            with self._lock:
                self.store_max = max(self.store_max, sent - before)
                if last is not None:
                    self._gap(sent - last, sent - before, delay)
            last, delay = sent, _run_delay()
            self._stop.wait(self._interval)
            with self._lock:
                self.late_max = max(self.late_max, time.monotonic() - sent - self._interval)

    def _gap(self, gap: float, store_seconds: float, delay: float | None) -> None:
        """Under the lock: record one gap; a long one becomes an event that says where the
        time went: in the store call, or waiting for a core (run delay), or neither (the
        GIL, or the whole machine stopped)."""
        self.gaps.add(gap)
        if gap > WARN_FRACTION * self.limit:
            now_delay = _run_delay()
            run_delay = None if delay is None or now_delay is None else round(now_delay - delay, 4)
            self._events(side="sent", process=self.name, gap_seconds=round(gap, 4), limit_seconds=self.limit,
                         store_seconds=round(store_seconds, 4), run_delay_seconds=run_delay)
            logger.info("%s: a heartbeat gap of %.2f s (limit %g s; store call %.2f s, waiting for a core %s s)",
                        self.name, gap, self.limit, store_seconds, run_delay)

    def record(self) -> dict[str, Any]:
        """The sender's side for the final record (JSON data)."""
        with self._lock:
            return {"sent": self.gaps.record(), "store_max_seconds": round(self.store_max, 4),
                    "late_max_seconds": round(self.late_max, 4)}

    def stop(self, timeout: float) -> None:
        """Stop and join: a thread still inside a store call while the interpreter tears down
        aborts the process ("terminate called" at exit)."""
        self._stop.set()
        self._thread.join(timeout=timeout)


@dataclass
class _Seen:
    beats: int = 0            # the last counter value read
    heard: float = 0.0        # monotonic time it last moved (or the peer was registered)
    excused: float = 0.0      # the monitor's own stall total at ``heard``


class Watch:
    """A monitor's judge of its peers' heartbeats: ``me`` reads them every ``period``
    seconds, drops a peer silent for ``peer_timeout`` seconds (``timeout`` before its first
    beat), and does not count its own stalls as the peers' silence (module docstring).
    Used by one monitor thread."""

    def __init__(self, me: str, peer_timeout: float, timeout: float, period: float, *, log: Log | None = None
                 ) -> None:
        self.me, self.peer_timeout, self.timeout, self.period = me, peer_timeout, timeout, period
        self.seen = GapStats(peer_timeout)      # gaps between counter changes, every peer
        self.loop = GapStats(peer_timeout)      # the monitor's own period, as it ran
        self.excused = 0.0                      # seconds the monitor itself did not run, in all
        self._last: float | None = None
        self._peers: dict[str, _Seen] = {}
        self._events = _Events(log, None)

    def attach(self, store: dist.Store) -> dist.Store:
        """The monitor's own store connection, for the job's start time in events; returned."""
        self._events.store = store
        return store

    def tick(self, now: float) -> None:
        """Once per monitor round, before reading the counters, at monotonic ``now``: the
        part of the round's length beyond twice the period (a round also reads the store
        once per peer) is the monitor's own stall, excused from every peer's silence."""
        if self._last is not None:
            gap = now - self._last
            self.loop.add(gap)
            stall = max(0.0, gap - 2 * self.period)
            self.excused += stall
            if stall > WARN_FRACTION * self.peer_timeout:
                self._events(side="monitor", process=self.me, gap_seconds=round(gap, 4),
                             limit_seconds=self.peer_timeout, run_delay_seconds=None)
        self._last = now

    def judge(self, peer: str, beats: int, now: float, since: float) -> str | None:
        """Record ``beats``, ``peer``'s counter read at ``now`` (``since``: when it was
        registered); returns why the peer counts as lost, or None."""
        seen = self._peers.get(peer)
        if seen is None:
            seen = self._peers[peer] = _Seen(0, since, self.excused)
        if beats != seen.beats:
            if seen.beats:
                gap = now - seen.heard
                self.seen.add(gap)
                if gap > WARN_FRACTION * self.peer_timeout:
                    self._events(side="seen", process=self.me, peer=peer, gap_seconds=round(gap, 4),
                                 limit_seconds=self.peer_timeout, excused_seconds=round(self.excused - seen.excused, 4))
            seen.beats, seen.heard, seen.excused = beats, now, self.excused
        stalled = self.excused - seen.excused
        silent = now - seen.heard - stalled
        limit = self.peer_timeout if seen.beats else self.timeout
        if silent <= limit:
            return None
        aside = f", besides {stalled:.1f} s that {self.me} itself stalled" if stalled >= 0.05 else ""
        return f"no heartbeat for {silent:.1f} s (limit {limit:g} s{aside})"

    def record(self) -> dict[str, Any]:
        """The receiver's side for the final record (JSON data)."""
        return {"seen": self.seen.record(), "monitor": self.loop.record(), "excused_seconds": round(self.excused, 4)}


def heartbeat_summary(records: dict[str, dict[Any, dict[str, Any]]]) -> dict[str, Any]:
    """Summary fields from the ``heartbeat`` entries of every process's final record: the
    longest gap a sender made and a receiver saw (seconds), the longest stall of a monitor,
    and how many gaps came within ``WARN_FRACTION`` of the limit."""
    sent, seen, monitor, late = 0.0, 0.0, 0.0, 0
    for by_rank in records.values():
        for rec in by_rank.values():
            hb = rec.get("heartbeat") if isinstance(rec, dict) else None
            if not hb:
                continue
            for side in ("sent", "seen"):
                if side in hb:
                    hist = hb[side]["histogram_of_limit"]
                    late += sum(n for label, n in hist.items() if _at_least(label, WARN_FRACTION))
            sent = max(sent, hb.get("sent", {}).get("max_seconds", 0.0))
            seen = max(seen, hb.get("seen", {}).get("max_seconds", 0.0))
            monitor = max(monitor, hb.get("monitor", {}).get("max_seconds", 0.0))
    return {"heartbeat_gap_max_seconds": {"sent": sent, "seen": seen}, "heartbeat_monitor_gap_max_seconds": monitor,
            "heartbeat_late_gaps": late}


def _at_least(label: str, fraction: float) -> bool:
    """Whether the histogram bucket ``label`` holds only gaps of at least ``fraction``."""
    low = label[2:] if label.startswith(">=") else label.split("-")[0] if "-" in label else None
    return low is not None and float(low) >= fraction
