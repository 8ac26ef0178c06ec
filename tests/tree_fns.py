"""Functions run inside spawned processes by the tree-ps tests.

``tree_counts`` runs a real tree (ParameterServer at the root, Aggregator processes, and
workers made of a bare PSClient) for several (P, fanout, N) cases in one spawned job:
process i is worker i, then aggregator i - P, then server i - P - A of each case, and
skips cases that have no such process. Worker r pushes ``pushes[r]`` counting payloads:
the indicator vector of its rank plus a 1 in the last slot. The servers apply plain SGD
with lr 1, so the final weights say how many of each worker's gradients reached the root:
- N = 1: an update is the sum of its gradients (divisor 1), so weight r ends at -pushes[r]
  and the last slot at minus the total;
- N = P: an update is the mean of one gradient per worker, so every weight ends at
  -rounds / P and the last slot at -rounds.
"""
from __future__ import annotations

from typing import Any

import torch


def tree_counts(group, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from plexus.cluster.traffic import Traffic
    from plexus.config import JobConfig
    from plexus.ps.aggregator import Aggregator
    from plexus.ps.client import Heartbeat, PSClient
    from plexus.ps.protocol import Op
    from plexus.ps.server import KEYS, ParameterServer
    from plexus.ps.tree import ROOT, Node, Tree
    from plexus.strategies.tree_ps import TreePSStrategy, group_size

    me, out = group.rank, []
    for i, case in enumerate(cases):
        P, K, S = case["workers"], case["fanout"], case.get("servers", 1)
        cfg = TreePSStrategy.effective(JobConfig.from_flat({
            "strategy": "tree-ps", "workers": P, "servers": S, "fanout": K, "softsync": case["softsync"],
            "optimizer": "sgd", "momentum": 0.0, "lr": 1.0, "batch_size": P, "timeout": 60.0, "peer_timeout": 20.0}))
        tree = Tree(P, K)
        A = tree.aggregators
        store = dist.PrefixStore(f"case{i}/", group.store)
        if me < P:
            node = Node("worker", me)
            parent = tree.parent(node)
            # Liveness is not under test here: a generous --peer-timeout (once, in a clean-clone
            # run of the whole suite, two workers' beats stood still for 5 s in this 15-process job).
            beat = Heartbeat(store, me, 1.0)
            client = PSClient(store, me, S, numel=P + 1, dtype=torch.float32, traffic=Traffic(), timeout=30.0,
                              sender=tree.position(node), parent=None if parent == ROOT else parent.name)
            client.connect()
            flat = torch.zeros(P + 1)
            client.init(flat)
            grad = torch.zeros(P + 1)
            grad[me] = grad[P] = 1.0
            for clock in range(case["pushes"][me]):
                client.push_pull(grad, flat, clock, list(client.versions))
            store.set(KEYS.finished(me), "1")
            client.signal(Op.BYE, case["pushes"][me])
            evaluator = client.wait_drained(20.0)
            if evaluator == me:
                client.pull(flat, case["pushes"][me])
            client.signal(Op.SHUTDOWN)
            client.close()
            beat.stop(5.0)
            out.append({"case": i, "role": "worker", "weights": flat.tolist() if evaluator == me else None})
        elif me < P + A:
            record = Aggregator(store, me - P, cfg, Traffic(), group_size(cfg)).serve()
            out.append({"case": i, "role": "aggregator", "record": record})
        elif me < P + A + S:
            children = [n.name for n in tree.children(ROOT)]
            record = ParameterServer(store, me - P - A, cfg, Traffic(), children).serve()
            out.append({"case": i, "role": "server", "record": record})
    return out


def reads(group, transport: str = "auto") -> dict[str, Any]:
    """Rudra-adv*'s weight path at the root, on 4 processes: worker 0 pushes to 2 servers,
    worker 1 only reads them (``ps/readers.py``), then the servers. Worker 1 first reads
    holding version 0 while the shards are at 0, so the answer must wait for worker 0's one
    push (lr 1, gradient 1: weights -1); then it reads holding version 1 with no push to
    come, which the servers answer with the same version after ``READ_WAIT``."""
    import time

    import torch.distributed as dist

    from plexus.cluster.rendezvous import wait_keys
    from plexus.cluster.traffic import Traffic
    from plexus.config import JobConfig
    from plexus.ps.client import Heartbeat, PSClient
    from plexus.ps.protocol import Op
    from plexus.ps.readers import READ_WAIT, WeightReader
    from plexus.ps.server import KEYS, ParameterServer
    from plexus.strategies.tree_ps import TreePSStrategy

    me, S = group.rank, 2
    cfg = TreePSStrategy.effective(JobConfig.from_flat({
        "strategy": "tree-ps", "variant": "adv-star", "workers": 2, "servers": S, "optimizer": "sgd",
        "momentum": 0.0, "lr": 1.0, "batch_size": 2, "timeout": 60.0, "peer_timeout": 20.0, "transport": transport}))
    store = dist.PrefixStore("reads/", group.store)
    if me == 0:
        beat = Heartbeat(store, 0, 1.0)
        client = PSClient(store, 0, S, numel=4, dtype=torch.float32, traffic=Traffic(), timeout=30.0,
                          transport=transport)
        client.connect()
        client.init(torch.zeros(4))
        store.set("inited", "1")
        wait_keys(store, ["reading"], 30.0, "the reader")
        time.sleep(0.3)  # the read is in flight and must wait for this push
        client.push(torch.ones(4), 0, list(client.versions))
        wait_keys(store, ["read"], 30.0, "the reader")
        store.set(KEYS.finished(0), "1")
        client.signal(Op.BYE, 1)
        client.wait_drained(20.0)
        client.signal(Op.SHUTDOWN)
        client.close()
        beat.stop(5.0)
        return {"role": "pusher"}
    if me == 1:
        wait_keys(store, ["inited"], 30.0, "the pusher's INIT")
        reader = WeightReader(store, 1, S, numel=4, dtype=torch.float32, traffic=Traffic(), timeout=30.0,
                              transport=transport)
        reader.connect()
        flat = torch.zeros(4)
        store.set("reading", "1")
        reader.read(flat, [0] * S)
        first = {"versions": list(reader.versions), "weights": flat.tolist()}
        start = time.monotonic()
        reader.read(flat, list(reader.versions))
        second = {"versions": list(reader.versions), "waited": time.monotonic() - start, "least": READ_WAIT}
        reader.signal(Op.SHUTDOWN)
        reader.close()
        store.set("read", "1")
        return {"role": "reader", "first": first, "second": second}
    record = ParameterServer(store, me - 2, cfg, Traffic(), ["worker 0"], readers=["worker 1"]).serve()
    return {"role": "server", "record": record}
