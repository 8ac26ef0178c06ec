"""``plexus train --launcher ray``: the role plan as Ray actors, the data path as under torchrun.

Ray owns what a cluster manager is good at: placing processes on machines with the
resources they ask for, keeping them alive, and telling the driver at once when one dies.
The job itself runs exactly as under ``torchrun`` (``job.run_torchrun``): every actor is
one global rank of the role plan (``plan.py``), sets the environment torchrun would
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``,
``PLEXUS_TOKEN``), and talks to its peers over the job's TCPStore and gloo links; nothing
of the training traffic goes through Ray.

Placement. Each actor asks for ``--threads`` CPUs (at least 1: one per process by
default). With ``--ray-server-resource NAME`` the roles other than workers (servers,
aggregators, a coordinator) also ask for ``SERVER_SHARE`` of the custom resource NAME, so
they land only on nodes started with ``ray start --resources '{"NAME": 100}'``: the label,
not its amount, decides where they go.

Addresses. When every actor lands on one node the store binds to ``--host`` (loopback by
default, as on one machine); when they span nodes it binds to the address Ray knows global
rank 0's node by, which the other nodes can reach. Global rank 0 hosts the store.

Failures. The driver waits on every actor's call with ``ray.wait`` and a timeout. The
first process to die is the cause, a process that raised because a peer vanished is a
consequence: the driver names the dead one (global rank, role, rank in the role, node) in
one line. A job that may lose the process (``Strategy.tolerates_loss``, as under the local
launcher: a worker of ps, tree-ps, easgd, sandblaster or gossip --async) goes on, and its
summary lists the lost workers, as peers declared them in the store; any other loss stops
every actor and fails the job, and so does the loss of global rank 0 (it hosts the store)
or of worker 0 (it writes the summary). The driver always kills its actors, and shuts
down the Ray instance it started, also on Ctrl-C and SIGTERM (status 130 and 143, as
``plexus train`` reports them).

This lives in ``train/`` beside ``run_local`` and ``run_torchrun`` because it drives the role
plan and the job runner; ``cluster/`` stays below ``train/``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from plexus.cluster.rendezvous import await_listener, new_token
from plexus.config import JobConfig
from plexus.errors import ConfigError, JobFailed, JobInterrupted, PlexusError

__all__ = ["RayOptions", "run_ray"]

logger = logging.getLogger(__name__)

# The share of the custom server resource that each server, aggregator or coordinator asks
# for: small, so that any node that advertises the resource can host many of them.
SERVER_SHARE = 0.01
# Ray's default port of a head node's GCS, as in ``ray start --head``.
RAY_PORT = 6379
# Seconds between two looks at the actors while the job runs (the progress display too).
POLL = 0.25
# Seconds the driver waits, once a process raised, for a peer's death that caused it.
GRACE = 3.0
# Seconds the driver waits for killed actors to report their end.
REAP = 10.0
# Variables of the local launcher that would make an actor's process think it is one of
# its children (``ProcessInfo.from_env``), and torchrun's agent store, which there is none of.
_FOREIGN = ("PLEXUS_ROLE", "PLEXUS_ROLE_RANK", "PLEXUS_WORKERS", "PLEXUS_CONFIG", "PLEXUS_DATA",
            "PLEXUS_RUN_DIR", "PLEXUS_PARENT_PID", "TORCHELASTIC_USE_AGENT_STORE", "LOCAL_WORLD_SIZE")


@dataclass(kw_only=True, frozen=True)
class RayOptions:
    """Where and how ``--launcher ray`` places the job."""

    # The Ray cluster to use: a head's HOST:PORT (``ray start --head`` prints it),
    # ``ray://HOST:10001`` for Ray Client, or ``auto``. None: ``RAY_ADDRESS`` if set, else a
    # Ray instance on this machine, started for the job and stopped after it.
    address: str | None = None
    # A custom resource that only the nodes meant for servers advertise; servers,
    # aggregators and the coordinator ask for SERVER_SHARE of it. None: anywhere.
    server_resource: str | None = None

    def __post_init__(self) -> None:
        if self.address is not None and not self.address.strip():
            raise ConfigError("ray_address must not be empty: pass --ray-address HOST:PORT of the Ray head "
                              "(ray start --head prints it), or leave it out for a Ray instance on this machine")
        name = self.server_resource
        if name is not None and (not name or name.strip() != name or name in ("CPU", "GPU", "memory")):
            raise ConfigError(f"ray_server_resource must name a custom resource, got {name!r}: pass e.g. "
                              f"--ray-server-resource plexus_server and start the server nodes with "
                              f"ray start --resources '{{\"plexus_server\": 100}}'")


def _import_ray():
    # Ray's documented switches: every line of every process, as the local launcher shows
    # them (not "[repeated 2x across cluster]"), and no colour codes in a pipe or a log.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    try:
        import ray
    except ImportError:
        raise ConfigError("--launcher ray needs Ray, which is not installed: pip install 'plexus[ray]'") from None
    return ray


class RoleActor:
    """One global rank of the job, in a process of Ray's (``ray.remote(RoleActor)``).

    ``where`` says where Ray placed it; ``run`` sets torchrun's environment and runs the
    rank as a torchrun process would. The name is Ray's prefix for its output."""

    def __init__(self, global_rank: int, role: str, rank: int) -> None:
        self.global_rank, self.role, self.rank = global_rank, role, rank

    def __repr__(self) -> str:
        return f"{self.role} {self.rank}"

    def where(self) -> dict[str, Any]:
        import ray
        return {"ip": ray.util.get_node_ip_address(), "node": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid()}

    def free_port(self, host: str) -> int:
        """A port free on ``host`` now, for the store this rank will host."""
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    def run(self, config: str, env: dict[str, str]) -> dict[str, Any] | None:
        """The rank's part of the job (``job.run_torchrun``): worker 0 returns the summary."""
        for key in _FOREIGN:
            os.environ.pop(key, None)
        os.environ.update(env)
        os.environ.setdefault("MPLCONFIGDIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "plexus-mpl"))
        debug = bool(env.get("PLEXUS_DEBUG"))
        logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(message)s",
                            stream=sys.stderr, force=True)
        from plexus.train.job import run_torchrun
        return run_torchrun(JobConfig.from_dict(json.loads(config)))


class _Interrupts:
    """SIGINT and SIGTERM while the driver runs: remember which came first and raise
    KeyboardInterrupt, which stops the actors (Ray turns whatever a handler raises inside
    its own calls into a plain KeyboardInterrupt, so the signal is kept here)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "_Interrupts":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        raise KeyboardInterrupt

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


@dataclass
class _Slot:
    """One actor of the job, as the driver tracks it."""

    global_rank: int
    role: str
    rank: int
    actor: Any
    place: dict[str, Any] | None = None

    def describe(self, world: int) -> str:
        node = f" on node {self.place['ip']}" if self.place else ""
        return f"{self.role} {self.rank} (global rank {self.global_rank} of {world}){node}"


def run_ray(cfg: JobConfig, options: RayOptions, poll: Callable[[Path], None] | None = None
            ) -> tuple[str, dict[str, Any]]:
    """Run the job as Ray actors; returns (run directory, as the user should read it, summary).

    ``poll(run_dir)`` is called about four times a second while the job runs (the progress
    display; the run directory is worker 0's, so it shows progress where that is this
    machine). Raises ConfigError before anything starts, JobFailed when a process the job
    cannot lose fails, and JobInterrupted on SIGINT/SIGTERM, once the actors are stopped."""
    from plexus.train.job import validate
    from plexus.train.plan import role_plan
    ray = _import_ray()
    validate(cfg)  # worker 0 warns of risky values (job.warn_risks), as under torchrun
    cfg = _with_absolute_out(cfg)
    plan = role_plan(cfg)
    if options.server_resource and all(slot.role == "worker" for slot in plan):
        raise ConfigError(f"--ray-server-resource places servers, aggregators and coordinators, and strategy "
                          f"{cfg.strategy.strategy} has only workers: drop --ray-server-resource")
    threads = max(1, cfg.cluster.threads)
    connect = not ray.is_initialized()  # else the caller's connection, which stays
    slots: list[_Slot] = []
    interrupts = _Interrupts()
    try:
        with interrupts:
            if connect:
                _connect(ray, options, cpus=threads * len(plan), debug=cfg.run.debug, timeout=cfg.cluster.timeout)
            try:
                for g, slot in enumerate(plan):
                    resources = {options.server_resource: SERVER_SHARE} \
                        if options.server_resource and slot.role != "worker" else None
                    actor = ray.remote(RoleActor).options(num_cpus=threads, resources=resources, max_restarts=0,
                                                          max_task_retries=0).remote(g, slot.role, slot.rank)
                    slots.append(_Slot(g, slot.role, slot.rank, actor))
                summary, lost = _run(ray, cfg, options, slots, threads, poll)
                here = _driver_ip(ray)
            finally:
                _stop(ray, slots)
                if connect and ray.is_initialized():
                    ray.shutdown()
    except KeyboardInterrupt:
        signum = interrupts.signum or signal.SIGINT
        raise JobInterrupted(f"interrupted by {signal.Signals(signum).name}; stopped the job's {len(plan)} "
                             f"processes", signum) from None
    workers = cfg.cluster.workers
    if len(lost.get("worker", [])) == workers:
        raise JobFailed(f"every worker was lost ({workers} of {workers}); nothing is left to finish the job")
    if summary is None:  # worker 0 ended without error yet without its summary: not a run_torchrun of worker 0
        raise JobFailed("worker 0 returned no summary; see the messages above")
    zero = next(s for s in slots if s.role == "worker" and s.rank == 0)
    where = f" (on node {zero.place['ip']})" if zero.place and zero.place["ip"] != here else ""
    return cfg.run.out + where, summary


def _run(ray, cfg: JobConfig, options: RayOptions, slots: list[_Slot], threads: int,
         poll: Callable[[Path], None] | None) -> tuple[dict[str, Any] | None, dict[str, list[int]]]:
    """Place the actors, give each torchrun's environment, run them and watch them."""
    from plexus.strategies import strategy_class
    _place(ray, slots, options, threads, cfg.cluster.timeout)
    envs = _environments(ray, cfg, slots)
    config = json.dumps(cfg.to_dict())
    calls = {s.actor.run.remote(config, env): s for s, env in zip(slots, envs)}
    cls = strategy_class(cfg.strategy.strategy)
    return _watch(ray, cfg, calls, lambda s: cls.tolerates_loss(cfg, s.role, s.rank), poll)


def _with_absolute_out(cfg: JobConfig) -> JobConfig:
    """Worker 0 writes the run directory from an actor whose working directory is not
    necessarily the driver's: give it the absolute path, the default one included."""
    out = Path(cfg.run.out) if cfg.run.out else None
    if out is None:
        base = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.strategy.strategy}"
        out, n = base, 1
        while out.exists():
            n += 1
            out = base.with_name(f"{base.name}-{n}")
    # dataclasses.replace, not JobConfig.replace: --out keeps its source (flag, file, default).
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out=str(out.absolute())))


def _address(options: RayOptions) -> str | None:
    return options.address or os.environ.get("RAY_ADDRESS") or None


def _connect(ray, options: RayOptions, cpus: int, debug: bool, timeout: float) -> None:
    """Join the cluster at ``--ray-address`` (else RAY_ADDRESS), or start a Ray instance on
    this machine with CPUs enough for every process (the local launcher, too, starts them
    all however many cores there are). Ray's own logs stay quiet unless --debug.

    ray.init replaces the SIGTERM handler with one that exits on the spot (with a C++ stack
    on stderr); the caller's is put back, so that SIGTERM, like Ctrl-C, stops the actors
    first (``plexus train`` turns both into KeyboardInterrupt)."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        _init(ray, options, cpus, debug, timeout)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _init(ray, options: RayOptions, cpus: int, debug: bool, timeout: float) -> None:
    address = _address(options)
    quiet = {"include_dashboard": False, "logging_level": logging.INFO if debug else logging.ERROR,
             "log_to_driver": True}
    if address is None:
        ray.init(address="local", num_cpus=max(cpus, os.cpu_count() or 1), **quiet)
        return
    if address != "auto":
        # ray.init waits minutes for a head that is not there, and prints C++ warnings.
        host, port = _host_port(address)
        await_listener(host, port, min(timeout, 10.0),
                       f"start a Ray head there (ray start --head --port {port}), or pass --ray-address with "
                       f"the address it printed")
    try:
        ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        # Ray sends a token only when told to: a head started with token authentication
        # (the default of `ray start` where ~/.ray/auth_token exists) refuses a driver without.
        raise ConfigError(f"cannot join the Ray cluster at {address}: {str(exc).strip().splitlines()[0]}; if the "
                          f"cluster uses token authentication, set RAY_AUTH_MODE=token and its token "
                          f"(RAY_AUTH_TOKEN, or ~/.ray/auth_token; `ray get-auth-token` on the head prints it)") \
            from None


def _host_port(address: str) -> tuple[str, int]:
    rest = address.split("://", 1)[1] if "://" in address else address
    host, _, port = rest.rstrip("/").rpartition(":")
    if not host:
        return rest, 10001 if address.startswith("ray://") else RAY_PORT
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ConfigError(f"ray_address {address!r} is not HOST:PORT: pass e.g. --ray-address 10.0.0.1:6379") \
            from None


def _place(ray, slots: list[_Slot], options: RayOptions, threads: int, timeout: float) -> None:
    """Wait up to ``timeout`` seconds until every actor is up and says where it runs."""
    calls = {s.actor.where.remote(): s for s in slots}
    deadline = time.monotonic() + timeout
    while calls:
        ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=min(POLL * 4, timeout))
        for ref in ready:
            slot = calls.pop(ref)
            try:
                slot.place = ray.get(ref, timeout=timeout)
            except ray.exceptions.RayError as exc:
                raise JobFailed(f"{slot.describe(len(slots))} did not start: {_reason(ray, exc, slot)}") from None
        if calls and time.monotonic() >= deadline:
            waiting = sorted(calls.values(), key=lambda s: s.global_rank)
            names = ", ".join(f"{s.role} {s.rank}" for s in waiting[:6]) + (" ..." if len(waiting) > 6 else "")
            free = ray.available_resources()
            label = options.server_resource
            if label and free.get(label, 0) < SERVER_SHARE and any(s.role != "worker" for s in waiting):
                raise ConfigError(f"Ray placed no process for {names} within {timeout:g} s: no node has resource "
                                  f"{label} free; start the servers' nodes with ray start --resources "
                                  f"'{{\"{label}\": 100}}', or drop --ray-server-resource")
            cpus = f"{threads} CPU{'s' if threads > 1 else ''}"
            raise ConfigError(f"Ray placed no process for {names} within {timeout:g} s: each asks for {cpus} and the "
                              f"cluster has {free.get('CPU', 0):g} free; add nodes, or ask for fewer processes or "
                              f"--threads")


def _environments(ray, cfg: JobConfig, slots: list[_Slot]) -> list[dict[str, str]]:
    """torchrun's environment for every actor. Global rank 0 hosts the store: on ``--host``
    when the job is on one node, else on its node's address. LOCAL_RANK counts the ranks
    on each node; LOCAL_WORLD_SIZE is set only where the layout is torchrun's (the same
    number of consecutive ranks on every node), which ``hier`` takes as one machine."""
    nodes = [s.place["node"] for s in slots]
    one_node = len(set(nodes)) == 1
    master = cfg.cluster.host if one_node else slots[0].place["ip"]
    port = cfg.cluster.port or ray.get(slots[0].actor.free_port.remote(master), timeout=cfg.cluster.timeout)
    token = os.environ.get("PLEXUS_TOKEN") or new_token()
    world = len(slots)
    counts = Counter(nodes)
    runs = sum(1 for i in range(world) if i == 0 or nodes[i] != nodes[i - 1])
    torchrun_layout = not one_node and runs == len(counts) and len(set(counts.values())) == 1
    envs = []
    for i, slot in enumerate(slots):
        env = {"RANK": str(slot.global_rank), "WORLD_SIZE": str(world), "MASTER_ADDR": master,
               "MASTER_PORT": str(port), "LOCAL_RANK": str(nodes[:i].count(nodes[i])), "PLEXUS_TOKEN": token,
               "PLEXUS_DEBUG": "1" if cfg.run.debug else ""}
        if torchrun_layout:
            env["LOCAL_WORLD_SIZE"] = str(counts[nodes[i]])
        envs.append(env)
    return envs


def _essential(slot: _Slot) -> str | None:
    """Why the job cannot lose ``slot`` whatever the strategy tolerates (as under torchrun),
    or None."""
    if slot.global_rank == 0:
        return "global rank 0 hosts the job's store"
    if slot.role == "worker" and slot.rank == 0:
        return "worker 0 writes the summary"
    return None


def _others(world: int) -> str:
    return "" if world == 1 else "; stopped the other process" if world == 2 else \
        f"; stopped the other {world - 1} processes"


def _watch(ray, cfg: JobConfig, calls: dict[Any, _Slot], tolerates: Callable[[_Slot], bool],
           poll: Callable[[Path], None] | None) -> tuple[dict[str, Any] | None, dict[str, list[int]]]:
    """Wait for every actor's call, POLL seconds at a time; returns (worker 0's summary,
    {role: lost ranks}). A loss the strategy tolerates is reported and waited past, unless
    it is an essential process (``_essential``); any other failure raises, naming the
    process that died first."""
    world = len(calls)
    pending = dict(calls)
    summary: dict[str, Any] | None = None
    lost: dict[str, list[int]] = {}
    limit = None if cfg.run.time_limit is None else time.monotonic() + cfg.run.time_limit + 10 * cfg.cluster.timeout
    run_dir = Path(cfg.run.out)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL)
        if poll is not None:
            poll(run_dir)
        if limit is not None and time.monotonic() > limit:
            raise JobFailed(f"the job ran past --time-limit plus 10 x --timeout ({cfg.run.time_limit:g} + "
                            f"10 x {cfg.cluster.timeout:g} s) without ending; stopped its {world} processes")
        for ref in ready:
            slot = pending.pop(ref)
            try:
                result = ray.get(ref, timeout=cfg.cluster.timeout)
            except ray.exceptions.RayError as exc:
                died = isinstance(exc, ray.exceptions.RayActorError)
                if tolerates(slot) and _essential(slot) is None:
                    lost.setdefault(slot.role, []).append(slot.rank)
                    logger.warning("plexus: %s %s: %s; the job goes on without it (%s tolerates a lost %s)",
                                   slot.describe(world), "died" if died else "failed", _reason(ray, exc, slot),
                                   cfg.strategy.strategy, slot.role)
                    continue
                if not died:
                    slot, exc = _first_death(ray, pending, slot, exc)
                    died = isinstance(exc, ray.exceptions.RayActorError)
                cause = getattr(exc, "cause", None)
                if isinstance(cause, ConfigError):
                    raise ConfigError(str(cause)) from None
                why = _essential(slot) if tolerates(slot) else None
                raise JobFailed(f"{slot.describe(world)} {'died' if died else 'failed'}: {_reason(ray, exc, slot)}"
                                f"{f'; the job cannot go on without it: {why}' if why else ''}{_others(world)}") \
                    from None
            if result is not None:
                summary = result
    return summary, lost


def _first_death(ray, pending: dict[Any, _Slot], slot: _Slot, exc: BaseException) -> tuple[_Slot, BaseException]:
    """A process raised (a peer it waited for vanished, say): wait GRACE seconds for the
    death that may have caused it, which Ray reports a moment after the peers notice."""
    if not pending:
        return slot, exc
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=GRACE)
    for ref in ready:
        try:
            ray.get(ref, timeout=GRACE)
        except ray.exceptions.RayActorError as death:
            return pending.pop(ref), death
        except ray.exceptions.RayError:
            continue
    return slot, exc


def _reason(ray, exc: BaseException, slot: _Slot) -> str:
    """One line: the rank's own error message, or how its process ended."""
    if isinstance(exc, ray.exceptions.RayActorError):
        pid = f" (pid {slot.place['pid']})" if slot.place else ""
        return f"its process{pid} ended mid-job (killed or crashed: Ray's log of that worker says which)"
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        text = str(cause).strip()
        line = text.splitlines()[0] if text else type(cause).__name__
        return line if isinstance(cause, PlexusError) else f"{type(cause).__name__}: {line}"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _stop(ray, slots: list[_Slot]) -> None:
    """Kill every actor of the job (their processes with them) and wait up to REAP seconds
    for Ray to report each one ended, so that no rank outlives the driver."""
    ends = []
    for slot in slots:
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - an actor already gone; keep killing the rest
            logger.debug("plexus: %s %s: %s", slot.role, slot.rank, exc)
            continue
        ends.append(slot.actor.where.remote())
    if ends:
        ready, _ = ray.wait(ends, num_returns=len(ends), timeout=REAP)
        for ref in ready:
            try:
                ray.get(ref, timeout=1.0)
            except ray.exceptions.RayError:
                pass  # killed, as meant


def _driver_ip(ray) -> str:
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - a Ray Client driver is on no node
        return ""
