"""Run one function in P worker processes joined in a ``Group``: the helper behind
multi-process tests and benchmarks.

``spawn("pkg.module:function", procs=4, args={...})`` hosts a store on a free loopback
port, starts P children through the launcher (timeout, no orphans), and in each child calls
``function(group, **args)`` with a ready gloo ``Group`` of the P workers. Each child's
return value must be JSON data; the parent returns them in rank order.
"""
from __future__ import annotations

import importlib
import io
import json
import os
import sys
from typing import Any

from plexus.errors import JobFailed

__all__ = ["spawn"]


def spawn(target: str, procs: int, args: dict[str, Any] | None = None, *, timeout: float = 120.0,
          comm_timeout: float = 30.0, env: dict[str, str] | None = None, net: str | None = None) -> list[Any]:
    """Call ``target`` in ``procs`` processes; return their results in rank order.

    Raises JobFailed (with the children's output) if any child fails or the whole run
    takes longer than ``timeout`` seconds.
    """
    from plexus.cluster.launcher import RoleSpec, launch
    from plexus.cluster.rendezvous import host_store, job_namespace, new_token, store_get_json
    import torch.distributed as dist

    token = new_token()
    store = host_store("127.0.0.1", 0, token, comm_timeout)
    job = dist.PrefixStore(job_namespace(token), store)
    base = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "WORLD_SIZE": str(procs), "PLEXUS_TOKEN": token, "PLEXUS_SPAWN_TARGET": target,
            "PLEXUS_SPAWN_ARGS": json.dumps(args or {}), "PLEXUS_COMM_TIMEOUT": str(comm_timeout),
            "PLEXUS_NET": net or ""}
    roles = [RoleSpec("worker", r, {"RANK": str(r)}) for r in range(procs)]
    log = io.StringIO()
    status = launch([sys.executable, "-m", "plexus.cluster.spawn"], roles, env=base, sink=log,
                    time_limit=timeout, grace=1.0, entry=_child)
    if status != 0:
        raise JobFailed(f"spawn of {target} on {procs} processes failed with status {status}:\n"
                        f"{log.getvalue()}", exit_code=status)
    return [store_get_json(job, f"spawn/result/{r}") for r in range(procs)]


def _child() -> None:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from plexus.cluster.child import prepare_child
    prepare_child()
    from plexus.cluster.group import Group
    from plexus.cluster.rendezvous import ProcessInfo, connect_store, store_barrier, store_set_json
    from plexus.cluster.traffic import Traffic
    from plexus.config import parse_net

    info = ProcessInfo.from_env()
    timeout = float(os.environ["PLEXUS_COMM_TIMEOUT"])
    store = connect_store(info, timeout)
    net = parse_net(os.environ["PLEXUS_NET"]) if os.environ.get("PLEXUS_NET") else None
    group = Group(store, "spawn", info.rank, [f"worker {r}" for r in range(info.world_size)],
                  traffic=Traffic(), timeout=timeout, net=net)
    module_name, _, func_name = os.environ["PLEXUS_SPAWN_TARGET"].partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(group, **json.loads(os.environ["PLEXUS_SPAWN_ARGS"]))
    store_set_json(store, f"spawn/result/{info.rank}", result)
    # Keep the group alive until every member has finished using it.
    store_barrier(store, "spawn/done", info.world_size, timeout)
    group.close()


if __name__ == "__main__":
    _child()
