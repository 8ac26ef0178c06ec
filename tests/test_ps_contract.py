"""Contract 1 for the parameter server: bsp (and what equals it) is one-process training.

One spawned job of 4 workers and 3 servers runs every case in turn (``ps_fns.ps_cases``):
bsp for S in 1..3 and P in 1..4 with server-side momentum and with Adagrad, ssp with
T = 0, softsync with N = P, and asp with one worker, every other case over gloo's sockets
and the rest over shared memory. Each must give the model that one process gets by
training with the whole global batch and ``torch.optim``.
"""
from __future__ import annotations

import json

import pytest
import torch

from plexus.cluster.spawn import spawn
from plexus.config import JobConfig
from plexus.train.batches import GlobalBatches
from plexus.train.data import load_dataset
from plexus.train.evaluation import loss_fn
from plexus.train.models import build_model
from test_contract import assert_same_model

BASE = dict(strategy="ps", dataset="digits", model="mlp", hidden=32, lr=0.05, momentum=0.9, batch_size=48,
            steps=30, eval_every=0, log_every=30, save_model=True, seed=3, timeout=30, peer_timeout=10)


def one_process(flat: dict) -> dict[str, torch.Tensor]:
    """Plain PyTorch with the global batch: torch.optim.SGD (momentum) or Adagrad.

    With ``fetch_every`` / ``push_every`` it is DistBelief's schedule in one process: the
    gradient is computed on a replica refreshed every ``fetch_every`` steps, and the
    optimizer steps on the mean of the last ``push_every`` gradients (and on what is left
    at the end)."""
    cfg = JobConfig.from_flat({**flat, "workers": 1, "servers": 0})
    fetch_every, push_every = cfg.strategy.fetch_every, cfg.strategy.push_every
    data = load_dataset(cfg.data, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, data)
    replica = build_model(cfg.model, data)
    if cfg.optim.optimizer == "adagrad":
        opt = torch.optim.Adagrad(model.parameters(), lr=cfg.optim.lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    batches = GlobalBatches(len(data.x_train), cfg.run.batch_size, cfg.run.seed)
    sums, count = [torch.zeros_like(p) for p in model.parameters()], 0

    def update() -> None:
        for p, g in zip(model.parameters(), sums):
            p.grad = g / count
        opt.step()
        for g in sums:
            g.zero_()

    for step in range(cfg.run.steps):
        if step % fetch_every == 0:
            replica.load_state_dict(model.state_dict())
        idx = batches.indices(step)
        replica.zero_grad()
        loss_fn(replica, data.x_train[idx], data.y_train[idx]).backward()
        for g, p in zip(sums, replica.parameters()):
            g.add_(p.grad)
        count += 1
        if count == push_every:
            update()
            count = 0
    if count:
        update()
    return model.state_dict()


def _cases(tmp_path) -> list[dict]:
    cases = []
    for optimizer in ("sgd", "adagrad"):
        for servers in (1, 2, 3):
            for workers in (1, 2, 3, 4):
                cases.append({**BASE, "optimizer": optimizer, "consistency": "bsp", "workers": workers,
                              "servers": servers})
    cases += [
        {**BASE, "optimizer": "sgd", "consistency": "ssp", "staleness": 0, "workers": 3, "servers": 2},
        {**BASE, "optimizer": "sgd", "consistency": "softsync", "softsync": 3, "workers": 3, "servers": 2},
        {**BASE, "optimizer": "adagrad", "consistency": "softsync", "softsync": 0, "workers": 4, "servers": 3},
        {**BASE, "optimizer": "sgd", "consistency": "asp", "workers": 1, "servers": 2},
        {**BASE, "optimizer": "adagrad", "consistency": "asp", "workers": 1, "servers": 3},
        # DistBelief's n_fetch and n_push.
        {**BASE, "optimizer": "sgd", "consistency": "bsp", "workers": 2, "servers": 2, "fetch_every": 2,
         "push_every": 2},
        {**BASE, "optimizer": "sgd", "consistency": "asp", "workers": 1, "servers": 1, "fetch_every": 3},
        {**BASE, "optimizer": "adagrad", "consistency": "asp", "workers": 1, "servers": 2, "push_every": 4,
         "steps": 31},
    ]
    for i, case in enumerate(cases):
        # Half the cases over gloo's sockets, half over shared memory (the default on one
        # machine): both transports must give the same model. Every other shared-memory
        # case has its receives poll before they sleep (--spin on; a server's threads, one
        # per worker, take turns to poll).
        case["transport"] = "socket" if i % 2 else "auto"
        if i % 4 == 0:
            case["spin"] = "on"
        case["out"] = str(tmp_path / f"{i:02d}-{case['consistency']}-{case['optimizer']}-p{case['workers']}"
                                     f"-s{case['servers']}")
    return cases


@pytest.mark.slow
def test_synchronous_ps_equals_one_process(tmp_path):
    cases = _cases(tmp_path)
    spawn("ps_fns:ps_cases", 7, {"workers": 4, "servers": 3, "cases": cases}, timeout=400, comm_timeout=60)
    oracles: dict[tuple, dict[str, torch.Tensor]] = {}
    for case in cases:
        schedule = (case["optimizer"], case.get("fetch_every", 1), case.get("push_every", 1), case["steps"])
        if schedule not in oracles:
            oracles[schedule] = one_process({**BASE, "optimizer": schedule[0], "fetch_every": schedule[1],
                                             "push_every": schedule[2], "steps": schedule[3]})
        summary = json.loads(open(f"{case['out']}/summary.json").read())
        got = torch.load(f"{case['out']}/model.pt")
        try:
            assert_same_model(got, oracles[schedule])
        except AssertionError as exc:
            raise AssertionError(f"{case['out']}: {exc}") from None
        pushes = -(-case["steps"] // case.get("push_every", 1)) * case["workers"]
        assert summary["updates_applied"] == summary["pushes_acknowledged"] == pushes, (case["out"], summary)
        assert summary["lost_workers"] == [] and summary["servers"] == case["servers"], (case["out"], summary)
        assert summary["steps"] == case["steps"]
        if case.get("fetch_every", 1) == 1:
            assert summary["staleness_max"] == 0, (case["out"], summary)


def test_oracle_tells_optimizers_apart():
    """The comparison would catch a server applying the wrong optimizer."""
    with pytest.raises(AssertionError):
        assert_same_model(one_process({**BASE, "optimizer": "adagrad"}), one_process({**BASE, "optimizer": "sgd"}))
