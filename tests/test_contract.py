"""Contract 1: synchronous data parallelism equals one process training the whole batch."""
from __future__ import annotations

import pytest
import torch

from plexus.collectives import ALGORITHMS
from plexus.cluster.spawn import spawn
from plexus.config import JobConfig
from plexus.train.batches import GlobalBatches
from plexus.train.data import load_dataset
from plexus.train.evaluation import loss_fn
from plexus.train.models import build_model

BASE = dict(strategy="allreduce", dataset="digits", model="mlp", hidden=32, optimizer="sgd", lr=0.05,
            momentum=0.9, batch_size=48, steps=100, eval_every=0, save_model=True, seed=3)


def one_process_sgd(flat: dict) -> dict[str, torch.Tensor]:
    """The oracle: plain PyTorch, one process, the whole global batch each step."""
    cfg = JobConfig.from_flat({**flat, "workers": 1})
    data = load_dataset(cfg.data, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, data)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    batches = GlobalBatches(len(data.x_train), cfg.run.batch_size, cfg.run.seed)
    for step in range(cfg.run.steps):
        idx = batches.indices(step)
        opt.zero_grad()
        loss_fn(model, data.x_train[idx], data.y_train[idx]).backward()
        opt.step()
    return model.state_dict()


def assert_same_model(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        rel = (got[key] - want[key]).norm() / want[key].norm()
        assert rel < 1e-4, f"{key}: relative difference {rel:.2e}"
        assert torch.allclose(got[key], want[key], rtol=1e-4, atol=1e-5), key


@pytest.mark.slow
@pytest.mark.parametrize("procs", [1, 2, 3, 4])
def test_allreduce_equals_one_process(procs, tmp_path):
    want = one_process_sgd(BASE)
    cases = [{**BASE, "algorithm": algo, "out": str(tmp_path / algo)} for algo in sorted(ALGORITHMS)]
    spawn("dist_fns:train_cases", procs, {"cases": cases}, timeout=240)
    for case in cases:
        got = torch.load(f"{case['out']}/model.pt")
        assert_same_model(got, want)


def test_oracle_is_sensitive():
    """The comparison would catch a wrong model: another seed differs."""
    want = one_process_sgd(BASE)
    other = one_process_sgd({**BASE, "steps": 99})
    with pytest.raises(AssertionError):
        assert_same_model(other, want)
