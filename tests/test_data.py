"""Tests for plexus.train.data: built-ins offline, determinism, local loaders, factories."""
from __future__ import annotations

import gzip
import os
import pickle
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from plexus.config import DataConfig
from plexus.errors import ConfigError
from plexus.train.data import KNOWN_DATASETS, Dataset, load_dataset

# Small sizes keep the whole file to a few seconds on two shared cores.
GENERATED = {"digits": None, "mnist1d": 200, "teacher": 500, "text": 300, "sparse": 2000}


def _load(name: str, num_samples: int | None = None, seed: int = 0, data_dir: Path | None = None) -> Dataset:
    return load_dataset(DataConfig(dataset=name, num_samples=num_samples,
                                   data_dir=None if data_dir is None else str(data_dir)), seed=seed)


def _same(a: Dataset, b: Dataset) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("x_train", "y_train", "x_test", "y_test"))


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_builtin_loads_offline_with_right_shapes(name: str) -> None:
    d = _load(name, GENERATED[name])
    shape = {"digits": (64,), "mnist1d": (40,), "teacher": (32,), "text": (64,), "sparse": (16,)}[name]
    assert d.name == name and d.input_shape == shape
    for x, y in ((d.x_train, d.y_train), (d.x_test, d.y_test)):
        assert tuple(x.shape[1:]) == shape and len(x) == len(y) > 0
        assert y.dtype == torch.int64 and 0 <= int(y.min()) and int(y.max()) < d.num_classes
        if name in ("text", "sparse"):
            assert x.dtype == torch.int64
        else:
            assert x.dtype == torch.float32 and torch.isfinite(x).all()
    if name == "text":
        assert d.task == "lm" and d.y_train.shape == d.x_train.shape
        # y is x shifted by one character.
        assert torch.equal(d.x_train[:, 1:], d.y_train[:, :-1])
        assert int(d.x_train.max()) < d.num_classes
    else:
        assert d.task == "classification" and d.y_train.ndim == 1
    if name == "digits":
        assert d.num_classes == 10 and len(d.x_train) + len(d.x_test) == 1797
        assert float(d.x_train.min()) >= 0.0 and float(d.x_train.max()) <= 1.0
        # Stratified: every class is in the test split.
        assert set(d.y_test.tolist()) == set(range(10))
    if name == "sparse":
        assert d.num_features == 100_000 and d.num_classes == 2
        assert 0 <= int(d.x_train.min()) and int(d.x_train.max()) < d.num_features
    if name in ("mnist1d", "teacher", "sparse"):
        assert len(d.x_train) + len(d.x_test) == GENERATED[name]


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_same_config_and_seed_give_same_tensors(name: str) -> None:
    a, b = _load(name, GENERATED[name]), _load(name, GENERATED[name])
    assert _same(a, b)
    # The loader hands out copies, so a caller's in-place change cannot leak into a cache.
    a.x_train.zero_()
    assert _same(b, _load(name, GENERATED[name]))
    assert not _same(_load(name, GENERATED[name], seed=0), _load(name, GENERATED[name], seed=1))


CHECKSUM = """
import sys, torch
from plexus.config import DataConfig
from plexus.train.data import load_dataset
for name, n in (("teacher", 500), ("text", 300), ("sparse", 2000), ("mnist1d", 200)):
    d = load_dataset(DataConfig(dataset=name, num_samples=n), seed=0)
    print(name, *(float(getattr(d, f).double().sum()) for f in ("x_train", "y_train", "x_test", "y_test")))
"""


def test_another_process_loads_the_same_tensors() -> None:
    # Contract 2: every worker process sees the same data; the child's hash seed differs
    # from ours, so nothing may depend on set or dict order of strings.
    run = subprocess.run([sys.executable, "-c", CHECKSUM], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 4
    for line in lines:
        name, *sums = line.split()
        d = _load(name, GENERATED[name])
        assert [float(s) for s in sums] == [float(getattr(d, f).double().sum())
                                            for f in ("x_train", "y_train", "x_test", "y_test")]


def test_mnist1d_leaves_global_random_state_alone() -> None:
    # mnist1d reseeds the global generators; the loader must restore them.
    random.seed(123)
    np.random.seed(123)
    expected = (random.random(), np.random.random())
    random.seed(123)
    np.random.seed(123)
    _load("mnist1d", 30, seed=7)
    assert (random.random(), np.random.random()) == expected


def test_default_sizes_are_documented_ones() -> None:
    d = _load("teacher")
    assert len(d.x_train) + len(d.x_test) == 10_000


def test_sparse_feature_frequencies_follow_a_power_law() -> None:
    d = _load("sparse", 5000)
    counts = np.bincount(torch.cat([d.x_train, d.x_test]).flatten().numpy(), minlength=d.num_features)
    seen = np.sort(counts[counts > 0])[::-1]
    assert seen[0] >= 100 * np.median(seen)
    # Rank-frequency on a log-log scale is close to a line of slope -1.1 over the head.
    ranks = np.arange(1, 101)
    slope = np.polyfit(np.log(ranks), np.log(seen[:100]), 1)[0]
    assert -1.5 < slope < -0.7


def test_text_from_data_dir(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("hello world\n" * 200)
    (corpus / "sub" / "b.txt").write_bytes("caf\u00e9 \t tab\n".encode() * 100)
    d = _load("text", 50, data_dir=corpus)
    assert d.task == "lm" and d.x_train.shape == (45, 64) and d.x_test.shape == (5, 64)
    # Letters, space, newline and one unknown id (for tab and the two UTF-8 bytes of e-acute).
    assert d.num_classes == len(set("hello world\ncaf tab")) + 1
    assert _same(d, _load("text", 50, data_dir=corpus))


def test_text_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        _load("text", 50, data_dir=tmp_path / "nope")
    (tmp_path / "tiny.txt").write_text("too short")
    with pytest.raises(ConfigError, match="--data-dir"):
        _load("text", 50, data_dir=tmp_path)


# --- MNIST IDX files --------------------------------------------------------------------

MNIST_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
               "t10k-labels-idx1-ubyte")


def _idx(array: np.ndarray) -> bytes:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write_mnist(folder: Path, compress: bool, n_train: int = 6, n_test: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {
        MNIST_NAMES[0]: rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        MNIST_NAMES[1]: rng.integers(0, 10, n_train, dtype=np.uint8),
        MNIST_NAMES[2]: rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        MNIST_NAMES[3]: rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        data = _idx(array)
        if compress:
            (folder / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / name).write_bytes(data)
    return arrays


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_reads_idx_files(tmp_path: Path, compress: bool) -> None:
    arrays = _write_mnist(tmp_path, compress)
    d = _load("mnist", data_dir=tmp_path)
    assert d.x_train.shape == (6, 1, 28, 28) and d.x_test.shape == (4, 1, 28, 28)
    assert d.x_train.dtype == torch.float32 and d.input_shape == (1, 28, 28) and d.num_classes == 10
    assert torch.allclose(d.x_train[:, 0], torch.tensor(arrays[MNIST_NAMES[0]] / 255.0, dtype=torch.float32))
    assert d.y_test.tolist() == arrays[MNIST_NAMES[3]].tolist()


def test_mnist_missing_folder_or_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--data-dir"):
        _load("mnist")
    with pytest.raises(ConfigError, match="does not exist"):
        _load("mnist", data_dir=tmp_path / "absent")
    _write_mnist(tmp_path, compress=False)
    (tmp_path / MNIST_NAMES[2]).unlink()
    with pytest.raises(ConfigError) as err:
        _load("mnist", data_dir=tmp_path)
    assert str(tmp_path / MNIST_NAMES[2]) in str(err.value) and "--data-dir" in str(err.value)


def test_mnist_malformed_files(tmp_path: Path) -> None:
    _write_mnist(tmp_path, compress=False)
    (tmp_path / MNIST_NAMES[0]).write_bytes(b"\x12\x34\x56\x78" + bytes(100))
    with pytest.raises(ConfigError, match="magic"):
        _load("mnist", data_dir=tmp_path)
    good = _idx(np.zeros((6, 28, 28), dtype=np.uint8))
    (tmp_path / MNIST_NAMES[0]).write_bytes(good[:-10])
    with pytest.raises(ConfigError, match="truncated"):
        _load("mnist", data_dir=tmp_path)
    (tmp_path / MNIST_NAMES[0]).write_bytes(_idx(np.zeros((5, 28, 28), dtype=np.uint8)))  # 5 images, 6 labels
    with pytest.raises(ConfigError, match="do not match"):
        _load("mnist", data_dir=tmp_path)


# --- CIFAR-10 python batches ------------------------------------------------------------

CIFAR_NAMES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def _write_cifar(folder: Path, protocol: int, per_batch: int = 3) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(CIFAR_NAMES):
        data = np.zeros((per_batch, 3072), dtype=np.uint8)
        data[:, :1024] = 255  # red plane first, as in the real files
        data[:, 1024:2048] = i  # green carries the batch number
        batch = {b"data": data, b"labels": [(i + j) % 10 for j in range(per_batch)], b"batch_label": name.encode()}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=protocol)


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_cifar10_reads_python_batches(tmp_path: Path, protocol: int) -> None:
    _write_cifar(tmp_path, protocol)
    d = _load("cifar10", data_dir=tmp_path)
    assert d.x_train.shape == (15, 3, 32, 32) and d.x_test.shape == (3, 3, 32, 32)
    assert d.x_train.dtype == torch.float32 and d.input_shape == (3, 32, 32) and d.num_classes == 10
    assert torch.all(d.x_train[:, 0] == 1.0) and torch.all(d.x_train[:, 2] == 0.0)
    assert d.x_test[0, 1, 0, 0].item() == pytest.approx(5 / 255)
    assert d.y_train[:3].tolist() == [0, 1, 2]


def test_cifar10_accepts_parent_folder(tmp_path: Path) -> None:
    _write_cifar(tmp_path / "cifar-10-batches-py", protocol=2)
    assert _load("cifar10", data_dir=tmp_path).x_train.shape == (15, 3, 32, 32)


def test_cifar10_missing_and_malformed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--data-dir"):
        _load("cifar10")
    _write_cifar(tmp_path, protocol=2)
    (tmp_path / "data_batch_3").unlink()
    with pytest.raises(ConfigError) as err:
        _load("cifar10", data_dir=tmp_path)
    assert str(tmp_path / "data_batch_3") in str(err.value) and "--data-dir" in str(err.value)
    (tmp_path / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match="data_batch_3"):
        _load("cifar10", data_dir=tmp_path)
    with open(tmp_path / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 10), dtype=np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(ConfigError, match="3072"):
        _load("cifar10", data_dir=tmp_path)


class _Sneaky:
    def __reduce__(self) -> tuple:
        return (print, ("a pickle ran code",))


def test_cifar10_refuses_pickles_that_run_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_cifar(tmp_path, protocol=2)
    with open(tmp_path / "test_batch", "wb") as f:
        pickle.dump({b"data": _Sneaky(), b"labels": []}, f)
    with pytest.raises(ConfigError, match="refusing"):
        _load("cifar10", data_dir=tmp_path)
    assert "a pickle ran code" not in capsys.readouterr().out


# --- names and user factories -----------------------------------------------------------


def test_unknown_dataset_names_the_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        _load("imagenet")
    for name in KNOWN_DATASETS:
        assert name in str(err.value)


FACTORY_MODULE = '''
import torch
from plexus.train.data import Dataset

def as_tuple(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(20, 3, generator=g, dtype=torch.float64)
    y = torch.arange(20) % 4
    return x[:15], y[:15], x[15:], y[15:]

def as_dataset(cfg, seed):
    x, y = torch.zeros(8, 2), torch.tensor([0, 1] * 4)
    return Dataset(name="mine", task="classification", x_train=x, y_train=y, x_test=x, y_test=y,
                   num_classes=2, input_shape=(2,))

def wrong(cfg, seed):
    return "nothing useful"

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "plexus_test_user_data.py").write_text(FACTORY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "plexus_test_user_data"


def test_user_factory_returning_a_tuple(user_module: str) -> None:
    d = _load(f"{user_module}:as_tuple", seed=3)
    assert d.task == "classification" and d.num_classes == 4 and d.input_shape == (3,)
    assert d.x_train.shape == (15, 3) and d.y_test.dtype == torch.int64
    assert d.x_train.dtype == torch.float32  # float64 arrays are narrowed for float32 models
    assert _same(d, _load(f"{user_module}:as_tuple", seed=3))


def test_user_factory_returning_a_dataset(user_module: str) -> None:
    d = _load(f"{user_module}:as_dataset")
    assert d.name == "mine" and d.num_classes == 2


def test_user_factory_errors(user_module: str) -> None:
    with pytest.raises(ConfigError, match="cannot import"):
        _load("plexus_no_such_module_xyz:make")
    with pytest.raises(ConfigError, match="no attribute"):
        _load(f"{user_module}:missing")
    with pytest.raises(ConfigError, match="not a function"):
        _load(f"{user_module}:NOT_CALLABLE")
    with pytest.raises(ConfigError, match="must return"):
        _load(f"{user_module}:wrong")
    with pytest.raises(ConfigError, match="pkg.module:function"):
        _load(":make")


def test_dataset_checks_its_shapes() -> None:
    x, y = torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ConfigError, match="same number of samples"):
        Dataset(name="bad", task="classification", x_train=x, y_train=y[:3], x_test=x, y_test=y,
                num_classes=2, input_shape=(2,))
    with pytest.raises(ConfigError, match="input_shape"):
        Dataset(name="bad", task="classification", x_train=x, y_train=y, x_test=x, y_test=y,
                num_classes=2, input_shape=(3,))
    with pytest.raises(ConfigError, match="labels"):
        Dataset(name="bad", task="classification", x_train=x, y_train=y + 5, x_test=x, y_test=y,
                num_classes=2, input_shape=(2,))
    with pytest.raises(ConfigError, match="int64"):
        Dataset(name="bad", task="classification", x_train=x, y_train=y.float(), x_test=x, y_test=y,
                num_classes=2, input_shape=(2,))
    with pytest.raises(ConfigError, match="lm task"):
        Dataset(name="bad", task="lm", x_train=x, y_train=torch.zeros(4, 2, dtype=torch.int64), x_test=x,
                y_test=torch.zeros(4, 2, dtype=torch.int64), num_classes=2, input_shape=(2,))
    ids = torch.tensor([[0, 5]] * 4)
    with pytest.raises(ConfigError, match="feature ids"):
        Dataset(name="bad", task="classification", x_train=ids, y_train=y, x_test=ids, y_test=y,
                num_classes=2, input_shape=(2,), num_features=5)
