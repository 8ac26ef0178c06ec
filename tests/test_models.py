"""Tests for plexus.train.models: shapes, determinism, learning, mismatches, factories."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F

from plexus.config import DataConfig, ModelConfig
from plexus.errors import ConfigError
from plexus.train.data import Dataset, load_dataset
from plexus.train.models import KNOWN_MODELS, build_model


def _data(name: str, num_samples: int | None = None) -> Dataset:
    return load_dataset(DataConfig(dataset=name, num_samples=num_samples), seed=0)


def _images() -> Dataset:
    # CIFAR-shaped images without files: the cnn's Conv2d path on [N, 3, 32, 32].
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(12, 3, 32, 32, generator=g), torch.arange(12) % 10
    return Dataset(name="images", task="classification", x_train=x, y_train=y, x_test=x, y_test=y,
                   num_classes=10, input_shape=(3, 32, 32))


def _build(model: str, data: Dataset, hidden: int = 32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(model=model, hidden=hidden), data)


FITS = [
    ("mlp", "digits", None), ("mlp", "teacher", 200), ("mlp", "mnist1d", 100), ("mlp", "images", None),
    ("cnn", "digits", None), ("cnn", "mnist1d", 100), ("cnn", "teacher", 200), ("cnn", "images", None),
    ("lm", "text", 40), ("logreg", "sparse", 500),
]


@pytest.mark.parametrize(("model", "dataset", "n"), FITS)
def test_builtin_model_gives_logits_of_the_right_shape(model: str, dataset: str, n: int | None) -> None:
    data = _images() if dataset == "images" else _data(dataset, n)
    net = _build(model, data)
    x, y = data.x_train[:8], data.y_train[:8]
    logits = net(x)
    assert logits.shape == (*y.shape, data.num_classes)
    loss = F.cross_entropy(logits.reshape(-1, data.num_classes), y.reshape(-1))
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


@pytest.mark.parametrize(("model", "dataset", "n"), [f for f in FITS if f[1] != "images"])
def test_same_seed_gives_identical_parameters(model: str, dataset: str, n: int | None) -> None:
    data = _data(dataset, n)
    a, b = _build(model, data, seed=5), _build(model, data, seed=5)
    for (name_a, pa), (name_b, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert name_a == name_b and torch.equal(pa, pb)
    if model != "logreg":  # logreg starts at zero whatever the seed
        c = _build(model, data, seed=6)
        assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_lm_is_causal() -> None:
    data = _data("text", 40)
    net = _build("lm", data)
    x = data.x_train[:2].clone()
    before = net(x)
    x[:, 40] = (x[:, 40] + 1) % data.num_classes
    after = net(x)
    # Changing character 40 may change predictions from position 40 on, never before it.
    assert torch.allclose(before[:, :40], after[:, :40], atol=1e-5)
    assert not torch.allclose(before[:, 40:], after[:, 40:])


@pytest.fixture
def one_thread() -> Iterator[None]:
    # Tiny matmuls only slow down with two threads on two cores shared with other tests.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sgd_test_accuracy(net: torch.nn.Module, data, lr: float, steps: int) -> float:
    """Train ``net`` with plain SGD on seeded batches of 64, then return its test accuracy."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(data.x_train), (64,), generator=g)
        loss = F.cross_entropy(net(data.x_train[idx]), data.y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = (net(data.x_test).argmax(1) == data.y_test).float().mean().item()
    return accuracy


@pytest.mark.usefixtures("one_thread")
def test_mlp_learns_digits() -> None:
    data = _data("digits")
    net = _build("mlp", data, hidden=64)
    accuracy = _sgd_test_accuracy(net, data, lr=0.1, steps=300)
    assert accuracy > 0.9


@pytest.mark.usefixtures("one_thread")
def test_logreg_learns_sparse_above_majority_rate() -> None:
    data = _data("sparse", 20_000)
    net = _build("logreg", data)
    accuracy = _sgd_test_accuracy(net, data, lr=0.5, steps=600)
    majority = max(data.y_test.float().mean().item(), 1 - data.y_test.float().mean().item())
    assert accuracy > majority + 0.1


@pytest.mark.parametrize(("model", "dataset", "n"), [
    ("lm", "digits", None), ("logreg", "digits", None), ("mlp", "text", 40), ("cnn", "text", 40),
    ("mlp", "sparse", 200), ("lm", "sparse", 200), ("logreg", "text", 40),
])
def test_mismatched_model_and_dataset(model: str, dataset: str, n: int | None) -> None:
    with pytest.raises(ConfigError) as err:
        _build(model, _data(dataset, n))
    message = str(err.value)
    assert model in message and dataset in message and "logreg takes" in message


def test_lm_hidden_must_split_over_heads() -> None:
    with pytest.raises(ConfigError, match="divisible"):
        _build("lm", _data("text", 40), hidden=30)


def test_unknown_model_names_the_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        _build("resnet", _data("digits"))
    assert all(name in str(err.value) for name in KNOWN_MODELS)


FACTORY_MODULE = '''
import torch

def linear(data):
    return torch.nn.Linear(data.input_shape[0], data.num_classes)

def not_a_module(data):
    return 42
'''


def test_user_model_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "plexus_test_user_models.py").write_text(FACTORY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _data("digits")
    net = _build("plexus_test_user_models:linear", data)
    assert net(data.x_test[:3]).shape == (3, 10)
    with pytest.raises(ConfigError, match="nn.Module"):
        _build("plexus_test_user_models:not_a_module", data)
    with pytest.raises(ConfigError, match="no attribute"):
        _build("plexus_test_user_models:missing", data)
    with pytest.raises(ConfigError, match="cannot import"):
        _build("plexus_no_such_models_xyz:linear", data)
