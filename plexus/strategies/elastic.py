"""Elastic all-reduce (``--strategy allreduce --elastic``): a group of workers that
re-forms, without restarting anyone, when a worker dies or joins.

The workers train in *generations*. Generation n is a sorted list of worker ranks with a
backend group of their own (``workers-g<n>``); the global batch of each step is split
over its members, so P - 1 survivors keep the global batch of P workers and each one's
share grows (contract 1 holds: each gradient is weighted by its share, below).

A worker dies. Its neighbours' sends and receives fail at once (its connections close);
each worker whose collective failed drops its backend group, which closes its own
connections, so that every member waiting on it fails too: the failure spreads along the
waits in milliseconds, and every survivor arrives at ``Membership.next`` within one
step. There, through the job's store:

1. each survivor registers under generation n + 1 with the steps it has completed;
2. every member of generation n is resolved as either registered or dead (the launcher
   records an exit under ``exited/<name>``; elsewhere a pulse that stopped,
   ``cluster/liveness.py``);
3. the first survivor to resolve everyone writes the new member list by compare-and-set,
   so every survivor reads the same one;
4. the member that completed the most steps (the lowest rank among equals) is the
   reference. A survivor behind it (its last all-reduce failed where the reference's
   had finished) loads the reference's model and optimizer state through the store, and
   its step counts as done. When no survivor finished the step, every survivor **redoes**
   it, with the global batch split over the survivors: no step is dropped, and the dead
   worker's share of that batch is trained on by the others.

A worker joins (``plexus worker --join``): it takes a rank and asks through the store.
At a step boundary the generation's leader (its lowest rank) plans the growth for the
next step; every member sees the plan by then (a member cannot finish a step before the
leader joined its all-reduce, which happened after the leader wrote the plan), so they
all switch at the same step. The joiner loads the reference's state and starts there.

Only algorithms made of point-to-point messages can be abandoned halfway: ``native``
runs inside the backend's own threads, which wait out their timeout before a group can be
dropped; ``hier`` and ``auto`` are refused for the same reason (hier's inner groups are
made by host, auto may pick native).
"""
from __future__ import annotations

import gc
import io
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from plexus.cluster.liveness import exited_key, silent
from plexus.cluster.rendezvous import store_get_json, store_set_json, wait_keys
from plexus.errors import CommTimeout, PlexusError

__all__ = ["ELASTIC_ALGORITHMS", "Generation", "Membership", "JOB_KEY", "JOINS_KEY", "RANKS_KEY", "discard",
           "pack_state", "unpack_state"]

logger = logging.getLogger(__name__)

# The algorithms whose calls a survivor can abandon halfway (point-to-point messages only).
ELASTIC_ALGORITHMS = ("ring", "rhd", "dbtree", "master", "ps")

JOB_KEY = "elastic/job"        # the job's config and run directory, for workers that join
RANKS_KEY = "elastic/ranks"    # ranks given to workers that join
JOINS_KEY = "elastic/joins"    # how many of them are ready to enter the group
_CURRENT = "elastic/current"   # the newest generation's number
# Seconds a survivor waits for a member to register or be reported exited before it asks
# the pulses which members went silent.
_PULSE_AFTER = 2.0


def _key(number: int, what: str) -> str:
    return f"elastic/g/{number}/{what}"


@dataclass
class Generation:
    number: int
    members: list[int]
    # Join requests handled up to this generation (the leader's next plan starts here).
    joins_seen: int = 0
    # Completed steps of each member when it registered (-1: a worker that joined).
    steps: dict[int, int] = field(default_factory=dict)

    @property
    def leader(self) -> int:
        return self.members[0]

    def reference(self) -> int:
        """The member whose state every member adopts: the most steps, then the lowest rank."""
        return min(self.members, key=lambda r: (-self.steps.get(r, -1), r))

    def record(self) -> dict[str, Any]:
        return {"number": self.number, "members": self.members, "joins_seen": self.joins_seen,
                "steps": {str(r): s for r, s in self.steps.items()}}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "Generation":
        return cls(rec["number"], list(rec["members"]), rec["joins_seen"], {int(r): s for r, s in rec["steps"].items()})


def pack_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> bytes:
    """A replica's whole training state as ``torch.save`` bytes of tensors and numbers."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "steps": steps}, buf)
    return buf.getvalue()


def unpack_state(raw: bytes, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load ``pack_state`` bytes (``weights_only``: no arbitrary pickle); returns the steps."""
    state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["steps"])


class Membership:
    """One worker's view of the elastic group: the current generation, and the store
    protocol that makes the next one (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, workers: int, timeout: float) -> None:
        self.store, self.rank, self.timeout = store, rank, timeout
        if rank < workers:
            self.current = Generation(0, list(range(workers)), steps={r: 0 for r in range(workers)})
            if rank == 0:
                store.set(_key(0, "members"), json.dumps(self.current.record()))
                store.set(_CURRENT, "0")
        else:  # ready: ask the leader to add this worker at its next step boundary
            asked = int(store.add(JOINS_KEY, 1))
            store.set(f"elastic/join/{asked - 1}", str(rank))
            self.current = self._admission()
        # (generation, lost ranks, seconds from the failure seen to the new group formed)
        self.history: list[dict[str, Any]] = []

    @property
    def index(self) -> int:
        return self.current.members.index(self.rank)

    @property
    def size(self) -> int:
        return len(self.current.members)

    # --- growth -----------------------------------------------------------------------

    def plan_growth(self, step: int) -> None:
        """On the leader, at the boundary before ``step``: when workers asked to join,
        plan the switch to a generation with them before step ``step + 1``."""
        gen = self.current
        if self.rank != gen.leader or self.store.check([_key(gen.number, "grow")]):
            return
        asked = int(self.store.add(JOINS_KEY, 0))
        if asked <= gen.joins_seen:
            return
        joining = [int(self.store.get(f"elastic/join/{i}").decode()) for i in range(gen.joins_seen, asked)]
        store_set_json(self.store, _key(gen.number, "grow"), {"at": step + 1, "join": joining, "joins_seen": asked})

    def growth_due(self, step: int) -> dict[str, Any] | None:
        """The growth plan when the group must switch before ``step``, else None."""
        key = _key(self.current.number, "grow")
        if not self.store.check([key]):
            return None
        plan = store_get_json(self.store, key)
        return plan if step >= plan["at"] else None

    def _admission(self) -> Generation:
        """On a worker that joined: wait for a growth plan that names this rank; the
        generation it grows from (the caller then calls ``next``)."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            number = int(self.store.get(_CURRENT).decode()) if self.store.check([_CURRENT]) else 0
            key = _key(number, "grow")
            if self.store.check([key, _key(number, "members")]) and self.rank in store_get_json(self.store, key)["join"]:
                return Generation.from_record(store_get_json(self.store, _key(number, "members")))
            time.sleep(0.05)
        raise CommTimeout(f"worker {self.rank}: no generation of the elastic group admitted it within "
                          f"{self.timeout:g} s (is the job still training?)", peer="worker 0")

    # --- the next generation ----------------------------------------------------------

    def next(self, steps_done: int) -> Generation:
        """Register with ``steps_done`` completed steps, resolve every candidate as alive
        or dead, and agree on the next generation (``steps_done`` -1: a joining worker)."""
        old = self.current
        number = old.number + 1
        candidates = list(old.members)
        grow_key = _key(old.number, "grow")
        plan = store_get_json(self.store, grow_key) if self.store.check([grow_key]) else None
        if plan is not None:
            candidates += [r for r in plan["join"] if r not in candidates]
        self.store.set(_key(number, f"here/{self.rank}"), str(steps_done))
        decision = _key(number, "members")
        alive: dict[int, int] = {}
        dead: set[int] = set()
        start = time.monotonic()
        asked_pulses = False
        while not self.store.check([decision]):
            for r in candidates:
                if r in alive or r in dead:
                    continue
                here = _key(number, f"here/{r}")
                if self.store.check([here]):
                    alive[r] = int(self.store.get(here).decode())
                elif self.store.check([exited_key(f"worker {r}")]):
                    dead.add(r)
            pending = [r for r in candidates if r not in alive and r not in dead]
            if not pending:
                gen = Generation(number, sorted(alive), plan["joins_seen"] if plan else old.joins_seen, alive)
                self.store.compare_set(decision, "", json.dumps(gen.record()))
                break
            waited = time.monotonic() - start
            if waited > _PULSE_AFTER and not asked_pulses:
                asked_pulses = True  # one look at the pulses (it takes a few beats), where they beat:
                pulsing = [f"worker {r}" for r in pending if self.store.check([f"pulse/worker {r}"])]
                dead.update(int(n.split()[-1]) for n in (silent(self.store, pulsing) if pulsing else []))
            if waited > self.timeout:
                raise CommTimeout(f"worker {self.rank}: re-forming the group: worker(s) "
                                  f"{', '.join(map(str, pending))} neither registered nor exited within "
                                  f"{self.timeout:g} s", peer=", ".join(f"worker {r}" for r in pending))
            time.sleep(0.01)
        gen = Generation.from_record(store_get_json(self.store, decision))
        if self.rank not in gen.members:
            raise PlexusError(f"worker {self.rank} was left out of generation {number} of the elastic group "
                              f"(its peers took it for dead)")
        if self.rank == gen.leader:
            self.store.set(_CURRENT, str(number))
        self.history.append({"generation": number, "members": gen.members,
                             "lost": sorted(set(old.members) - set(gen.members)),
                             "joined": sorted(set(gen.members) - set(old.members)),
                             "reform_seconds": time.monotonic() - start})
        self.current = gen
        return gen

    def share_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> int:
        """Make every member's state the reference's (see the module docstring); returns
        the steps completed after it."""
        gen = self.current
        ref = gen.reference()
        behind = [r for r in gen.members if gen.steps.get(r, -1) < gen.steps[ref]]
        if not behind:
            return steps
        key = _key(gen.number, "state")
        if self.rank == ref:
            self.store.set(key, pack_state(model, optimizer, steps))
        elif self.rank in behind:
            wait_keys(self.store, [key], self.timeout, f"the state of worker {ref}, the reference of generation "
                                                       f"{gen.number}")
            return unpack_state(self.store.get(key), model, optimizer)
        return steps


def discard(group: Any) -> None:
    """Drop a broken backend group now, so its connections close and every peer still
    waiting on this process fails at once instead of at its timeout. Its shared-memory
    links (``Group.connect``) close their FIFOs, which ends the peers' waits the same way."""
    for link in getattr(group, "links", {}).values():
        if link.shm is not None:
            link.shm.close()
        link.pg = None
    group.pg = None
    gc.collect()
