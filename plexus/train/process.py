"""Entry point of a process started by the local launcher (``python -m plexus.train.process``).

Reads who it is from the environment, the job from ``PLEXUS_CONFIG``, joins the store,
runs its role, and turns a plexus error into one line on stderr and its exit status.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path


def main() -> int:
    from plexus.cluster.child import prepare_child
    prepare_child()
    debug = bool(os.environ.get("PLEXUS_DEBUG"))
    logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(message)s", stream=sys.stderr,
                        force=True)  # a forked child replaces the handlers it inherited
    from plexus.cluster.rendezvous import ProcessInfo, connect_store
    from plexus.config import JobConfig
    from plexus.errors import CommError, PlexusError
    from plexus.train.runner import load_saved_dataset, role_main, worker_main
    from plexus.train.progress import JOINED_KEY

    info = ProcessInfo.from_env()
    store = None
    try:
        cfg = JobConfig.from_dict(json.loads(Path(os.environ["PLEXUS_CONFIG"]).read_text()))
        store = connect_store(info, cfg.cluster.timeout)
        store.add(JOINED_KEY, 1)  # start-up progress: this process is up (train/progress.py)
        run_dir = Path(os.environ["PLEXUS_RUN_DIR"]) if os.environ.get("PLEXUS_RUN_DIR") else None
        arm_kill(cfg, info, store)
        if info.role in ("worker", "stage"):
            data = load_saved_dataset(Path(os.environ["PLEXUS_DATA"])) if os.environ.get("PLEXUS_DATA") else None
            if info.role == "stage":  # one stage of a replica cut by --stages (train/stage_runner.py)
                from plexus.train.stage_runner import stage_main
                stage_main(cfg, info, store, run_dir, data)
            else:
                worker_main(cfg, info, store, run_dir, data)
        else:
            role_main(cfg, info, store, run_dir)
        report_cpu(store, info.role, info.rank)
    except PlexusError as exc:
        if isinstance(exc, CommError) and exc.peer and store is not None:
            # A loss travels along links: name the process that exited first, not only
            # the neighbour that exited on losing it.
            from plexus.cluster.liveness import name_first_exit
            from plexus.train.plan import role_plan
            exc = name_first_exit(exc, store, info.name, [slot.name for slot in role_plan(cfg)])
        if debug:
            logging.exception("%s failed", info.name)
        else:
            print(f"{exc}" if str(exc).startswith(info.name) else f"{info.name}: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def arm_kill(cfg, info, store) -> None:
    """``--kill ROLE:K@time=S`` for this process: a timer from training's start (worker
    0 publishes it), which records the time of death in the store before it fires."""
    from plexus.cluster.emulation import Emulator
    from plexus.cluster.liveness import exited_key
    from plexus.cluster.rendezvous import wait_keys
    emulator = Emulator(cfg.cluster, info.role, info.rank)
    if emulator.kill_seconds is None:
        return
    own = store.clone()  # the timer's thread must not share the main thread's connection

    def started() -> float:
        wait_keys(own, ["train/t0"], 10 * cfg.cluster.timeout, "the start of training")
        return float(own.get("train/t0").decode())

    emulator.before_kill = lambda: own.set(exited_key(info.name), repr(time.time()))
    emulator.arm_timer(started)


def report_cpu(store, role: str, rank: int) -> None:
    """Leave this process's CPU time (user + system, every thread, in seconds) in the store
    as ``cpu/<role>/<rank>``, once its role has returned; the launcher reads it after every
    process has ended (``summary.collect_records``). A forked child's counters start at
    zero (POSIX ``fork``), so the imports the fork server made once are not counted.
    Best effort: a store already gone costs the figure (null in the summary), never the
    process's status."""
    from plexus.cluster.rendezvous import store_set_json
    from plexus.train.summary import cpu_key
    try:
        store_set_json(store, cpu_key(role, rank), {"cpu_seconds": time.process_time()})
    except RuntimeError as exc:  # c10d's DistStoreError
        logging.getLogger(__name__).debug("%s %d: CPU time not reported: %s", role, rank, exc)


def warm() -> None:
    """Imports that every child pays, done once in the launcher before it forks the fork
    server, so that its children inherit them (and a later job of the same process too).

    ``torch._dynamo`` above all: torch.optim imports it on an optimizer's first
    ``add_param_group`` and ``step`` (``torch._disable_dynamo``), and it costs as much as
    ``import torch`` itself (1.8 s of CPU here, with sympy). Paid in each of 4 children at
    once on 2 cores, it was most of a 4-worker allreduce job's time to its first step."""
    import torch._dynamo  # noqa: F401
    import plexus.strategies  # noqa: F401
    import plexus.train.runner  # noqa: F401


def _run_and_exit() -> None:
    """``python -m plexus.train.process``: run ``main`` and leave with ``os._exit``, as a
    forked child does (``cluster/forkserver.py``). A normal interpreter exit runs C++
    static destructors while gloo and TCPStore threads may still be alive (a SIGTERM from
    the launcher arrives at any time), and a joinable ``std::thread`` destroyed that way
    aborts the process with "terminate called without an active exception"."""
    code = 1
    try:
        code = main()
    except SystemExit as exc:  # SIGTERM (child.py) or an explicit exit
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - report, then leave the same way
        import traceback
        traceback.print_exc()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


if __name__ == "__main__":
    _run_and_exit()
