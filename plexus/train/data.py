"""Datasets that work offline: built-in generators, local-file loaders and user factories.

``load_dataset(cfg, seed)`` returns a ``Dataset`` holding the whole train and test split
as tensors. Every built-in is a pure function of ``(cfg, seed)``: numpy ``Generator``s
seeded from ``seed`` make the same tensors in every process and on every call, and no
loader touches torch's or numpy's global random state, so the caller's
``torch.manual_seed`` before building the model still gives the same initial model.

Built-ins (``KNOWN_DATASETS``):

- ``digits``: scikit-learn's 8x8 handwritten digits (1,797 images shipped with sklearn),
  float32 [N, 64] in [0, 1], stratified 80/20 split.
- ``mnist1d``: MNIST-1D (Greydanus 2020) generated locally, float32 [N, 40], 80/20 split.
- ``teacher``: Gaussian inputs labelled by a fixed random teacher MLP, float32 [N, 32].
- ``text``: a character language model over the Python standard library's sources (or
  the files under ``data_dir``), int64 ids [N, 64] with next-character targets.
- ``sparse``: a click-through task with Zipf-distributed feature ids, int64 [N, 16].
- ``mnist`` and ``cifar10``: loaders for the usual files in a local folder.

Nothing here downloads: a dataset that needs files asks for ``--data-dir``.
"""
from __future__ import annotations

import dataclasses

import functools
import gzip
import importlib
import importlib.util
import os
import pickle
import sys
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import numpy as np
import torch

from plexus.config import DataConfig
from plexus.errors import ConfigError

__all__ = ["Dataset", "load_dataset", "check_dataset", "KNOWN_DATASETS"]

KNOWN_DATASETS: tuple[str, ...] = ("digits", "mnist1d", "teacher", "text", "sparse", "mnist", "cifar10")

_TASKS = ("classification", "lm")


@dataclass(frozen=True, eq=False)
class Dataset:
    """A whole dataset in memory: train and test tensors plus what a model needs to know.

    ``x`` is float32 features, or int64 ids (text: [N, T] character ids; sparse: [N, F]
    feature ids). ``y`` is int64: [N] class ids for classification, [N, T] next-character
    ids for ``lm``. ``eq=False`` because comparing tensors with ``==`` is elementwise.
    """

    name: str
    task: Literal["classification", "lm"]
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    # Number of classes; for lm the vocabulary size.
    num_classes: int
    # Shape of one sample of x.
    input_shape: tuple[int, ...]
    # Sparse inputs only: size of the feature-id vocabulary (ids lie in [0, num_features)).
    num_features: int | None = None

    def to_dtype(self, dtype: torch.dtype) -> "Dataset":
        """The same dataset with floating-point features in ``dtype`` (ids stay int64)."""
        cast = lambda x: x.to(dtype) if x.is_floating_point() else x  # noqa: E731
        return dataclasses.replace(self, x_train=cast(self.x_train), x_test=cast(self.x_test))

    def __post_init__(self) -> None:
        where = f"dataset {self.name!r}"
        if self.task not in _TASKS:
            raise ConfigError(f"{where}: task must be 'classification' or 'lm', got {self.task!r}")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 2:
            raise ConfigError(f"{where}: num_classes must be an int of at least 2, got {self.num_classes!r}")
        # Accept a list for input_shape but store the tuple the type promises.
        object.__setattr__(self, "input_shape", tuple(int(s) for s in self.input_shape))
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
                raise ConfigError(f"{where}: x_{split} and y_{split} must be torch tensors, got "
                                  f"{type(x).__name__} and {type(y).__name__}")
            if x.ndim == 0 or len(x) != len(y):
                raise ConfigError(f"{where}: x_{split} and y_{split} must hold the same number of samples, "
                                  f"got shapes {tuple(x.shape)} and {tuple(y.shape)}")
            if len(x) == 0:
                raise ConfigError(f"{where}: the {split} split is empty; it needs at least one sample")
            if tuple(x.shape[1:]) != self.input_shape:
                raise ConfigError(f"{where}: every sample of x_{split} must have input_shape {self.input_shape}, "
                                  f"got x_{split} of shape {tuple(x.shape)}")
            if not (x.is_floating_point() or x.dtype == torch.int64):
                raise ConfigError(f"{where}: x_{split} must be floating point features or int64 ids, got {x.dtype}")
            if y.dtype != torch.int64:
                raise ConfigError(f"{where}: y_{split} must hold int64 class ids, got {y.dtype}")
            want = tuple(x.shape[:2]) if self.task == "lm" else (len(x),)
            if tuple(y.shape) != want:
                rule = "[N, T] next-token ids matching x" if self.task == "lm" else "[N] class ids"
                raise ConfigError(f"{where}: y_{split} must be {rule}, shape {want}, got {tuple(y.shape)}")
            if int(y.min()) < 0 or int(y.max()) >= self.num_classes:
                raise ConfigError(f"{where}: labels in y_{split} must lie in [0, {self.num_classes}), got "
                                  f"[{int(y.min())}, {int(y.max())}]; raise num_classes or fix the labels")
            if self.task == "lm" and (x.dtype != torch.int64 or x.ndim != 2):
                raise ConfigError(f"{where}: an lm task needs int64 token ids [N, T] in x_{split}, "
                                  f"got {x.dtype} of shape {tuple(x.shape)}")
            if self.num_features is not None:
                if x.dtype != torch.int64:
                    raise ConfigError(f"{where}: num_features is set, so x_{split} must hold int64 feature ids, "
                                      f"got {x.dtype}")
                if int(x.min()) < 0 or int(x.max()) >= self.num_features:
                    raise ConfigError(f"{where}: feature ids in x_{split} must lie in [0, {self.num_features}), "
                                      f"got [{int(x.min())}, {int(x.max())}]")

    def __repr__(self) -> str:
        # The dataclass repr would print every tensor.
        return (f"Dataset(name={self.name!r}, task={self.task!r}, train={len(self.x_train)}, "
                f"test={len(self.x_test)}, input_shape={self.input_shape}, x_dtype={self.x_train.dtype}, "
                f"num_classes={self.num_classes}, num_features={self.num_features})")


def load_dataset(cfg: DataConfig, seed: int = 0) -> Dataset:
    """Load or generate ``cfg.dataset``; the same ``(cfg, seed)`` gives the same tensors."""
    name = cfg.dataset
    check_dataset(name)
    if ":" in name:
        return _from_factory(cfg, seed)
    loaders: dict[str, Callable[[DataConfig, int], Dataset]] = {
        "digits": _digits, "mnist1d": _mnist1d, "teacher": _teacher, "text": _text,
        "sparse": _sparse, "mnist": _mnist, "cifar10": _cifar10,
    }
    return loaders[name](cfg, seed)


def check_dataset(name: str, flag: str = "--dataset") -> None:
    """ConfigError unless ``name`` is a built-in dataset or a factory (``pkg.module:function``)."""
    if ":" not in name and name not in KNOWN_DATASETS:
        raise ConfigError(f"unknown dataset {name!r}: pass {flag} with one of {', '.join(KNOWN_DATASETS)}, "
                          f"or a factory as 'pkg.module:function'")


# ---------------------------------------------------------------------------------------
# helpers


def _cwd_importable() -> None:
    """Let ``--model mypkg.nets:make_model`` import from the current directory, as
    ``python -m`` does: the ``plexus`` console script's sys.path starts at its own bin
    folder, not here. Appended, so it never shadows an installed module; the launcher
    passes sys.path on to its children (``job._python_path``)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _resolve_factory(spec: str, what: str) -> Callable[..., Any]:
    """Import ``pkg.module:attr`` and return the callable; ``what`` names the flag for errors."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ConfigError(f"--{what} {spec!r} must look like 'pkg.module:function'")
    _cwd_importable()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code is a usage error
        raise ConfigError(f"--{what} {spec!r}: cannot import module {module_name!r} "
                          f"({type(exc).__name__}: {exc}); check the name and that it is on PYTHONPATH") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"--{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"--{what} {spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def _from_factory(cfg: DataConfig, seed: int) -> Dataset:
    factory = _resolve_factory(cfg.dataset, "dataset")
    out = factory(cfg, seed)
    if isinstance(out, Dataset):
        return out
    if not (isinstance(out, (tuple, list)) and len(out) == 4):
        raise ConfigError(f"dataset factory {cfg.dataset!r} must return a plexus.train.data.Dataset or a tuple "
                          f"(x_train, y_train, x_test, y_test), got {type(out).__name__}")
    try:
        x_train, y_train, x_test, y_test = (torch.as_tensor(t) for t in out)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"dataset factory {cfg.dataset!r} returned something that is not tensor-like: {exc}") from exc
    if y_train.is_floating_point() or y_test.is_floating_point() or y_train.numel() == 0:
        raise ConfigError(f"dataset factory {cfg.dataset!r}: labels must be non-empty integer class ids, "
                          f"got {y_train.dtype} and {y_test.dtype}")
    y_train, y_test = y_train.long(), y_test.long()
    # Models are built in float32; float64 arrays from numpy would not match their weights.
    if x_train.is_floating_point():
        x_train, x_test = x_train.float(), x_test.float()
    top = max(int(y_train.max()), int(y_test.max()) if y_test.numel() else 0)
    return Dataset(name=cfg.dataset, task="classification", x_train=x_train, y_train=y_train,
                   x_test=x_test, y_test=y_test, num_classes=top + 1, input_shape=tuple(x_train.shape[1:]))


def _rng(seed: int, stream: int) -> np.random.Generator:
    # A separate stream per dataset, so adding a dataset never shifts another's numbers.
    return np.random.default_rng([seed, stream])


def _split(x: np.ndarray, y: np.ndarray, rng: np.random.Generator, test_fraction: float = 0.2,
           stratify: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A seeded train/test split; stratified keeps each class's share the same in both."""
    if stratify:
        test_idx = []
        for c in np.unique(y):
            members = rng.permutation(np.flatnonzero(y == c))
            test_idx.append(members[: int(round(len(members) * test_fraction))])
        is_test = np.zeros(len(y), dtype=bool)
        is_test[np.concatenate(test_idx)] = True
        train_idx, test = rng.permutation(np.flatnonzero(~is_test)), rng.permutation(np.flatnonzero(is_test))
    else:
        order = rng.permutation(len(y))
        n_test = max(1, int(round(len(y) * test_fraction)))
        test, train_idx = order[:n_test], order[n_test:]
    return x[train_idx], y[train_idx], x[test], y[test]


def _classification(name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                    num_classes: int, num_features: int | None = None) -> Dataset:
    # torch.tensor copies, so callers may change their tensors without touching caches.
    xt = torch.tensor(x_train)
    return Dataset(name=name, task="classification", x_train=xt, y_train=torch.tensor(y_train, dtype=torch.int64),
                   x_test=torch.tensor(x_test), y_test=torch.tensor(y_test, dtype=torch.int64),
                   num_classes=num_classes, input_shape=tuple(xt.shape[1:]), num_features=num_features)


# ---------------------------------------------------------------------------------------
# generated and shipped datasets


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (pixels [1797, 64] float64, labels [1797] int64).

    Read straight from the CSV that ships with scikit-learn, as ``load_digits`` does, but
    without importing sklearn: that import (scipy.stats and more) took 1.5 s on an idle
    core and 14 s under load here, longer than ``import torch``, on the path to the first
    step of every digits run. ``load_digits`` is the fallback should the file move."""
    spec = importlib.util.find_spec("sklearn")  # locates the package without running it
    csv = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if csv is None or not csv.is_file():
        from sklearn.datasets import load_digits  # ships with scikit-learn, nothing to fetch
        bunch = load_digits()
        return np.asarray(bunch.data), np.asarray(bunch.target, dtype=np.int64)
    with gzip.open(csv, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def _digits(cfg: DataConfig, seed: int) -> Dataset:
    pixels, labels = _digits_arrays()
    x = (np.asarray(pixels, dtype=np.float32) / 16.0).astype(np.float32)  # pixels are 0..16
    y = np.asarray(labels, dtype=np.int64)
    return _classification("digits", *_split(x, y, _rng(seed, 1), stratify=True), num_classes=10)


@functools.lru_cache(maxsize=4)
def _mnist1d_arrays(num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    # mnist1d imports matplotlib, which wants a writable config folder.
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mplconfig"))
    import random

    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    args.seed = seed
    # make_dataset reseeds the global `random` and numpy generators; put them back so
    # loading data never changes what the caller's own random draws would be.
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        # Never get_dataset(): it downloads a pickle. make_dataset generates locally.
        d = make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    # make_dataset already centres and scales the whole set to unit standard deviation.
    return (d["x"].astype(np.float32), d["y"].astype(np.int64),
            d["x_test"].astype(np.float32), d["y_test"].astype(np.int64))


def _mnist1d(cfg: DataConfig, seed: int) -> Dataset:
    # mnist1d makes num_samples // 10 per class, so the total rounds down to a multiple
    # of 10. About 2 s for 10,000 samples on one core, hence the in-process cache.
    return _classification("mnist1d", *_mnist1d_arrays(cfg.num_samples or 10_000, seed), num_classes=10)


def _teacher(cfg: DataConfig, seed: int, dim: int = 32, width: int = 64, classes: int = 10) -> Dataset:
    """Teacher-student classification: a fixed random tanh MLP labels Gaussian inputs.

    The teacher is drawn before the inputs, so it is the same function for every
    num_samples. A 2x128 ReLU student reaches about 74% test accuracy after 300 SGD
    steps (batch 64, lr 0.1; chance is 10%, the largest class 13%).
    """
    n = cfg.num_samples or 10_000
    rng = _rng(seed, 3)
    w1 = rng.standard_normal((dim, width)) / np.sqrt(dim)
    b1 = 0.1 * rng.standard_normal(width)
    w2 = rng.standard_normal((width, classes)) / np.sqrt(width)
    # Centre the teacher's logits on a reference sample so no class dominates.
    centre = (np.tanh(rng.standard_normal((4096, dim)) @ w1 + b1) @ w2).mean(0)
    x = rng.standard_normal((n, dim))
    y = (np.tanh(x @ w1 + b1) @ w2 - centre).argmax(1).astype(np.int64)
    return _classification("teacher", *_split(x.astype(np.float32), y, rng), num_classes=classes)


def _sparse(cfg: DataConfig, seed: int, num_features: int = 100_000, per_sample: int = 16,
            zipf_s: float = 1.1) -> Dataset:
    """Click-through prediction with power-law feature frequencies.

    Each sample holds ``per_sample`` feature ids drawn with P(rank k) ~ 1 / k**zipf_s, as
    in real click logs, where a few features occur in most samples and most occur almost
    never; a seeded permutation spreads the ranks over the id space. Each feature has a
    hidden weight and the label is Bernoulli(sigmoid(scaled sum of weights)). With
    50,000 samples, logistic regression reaches about 77% test accuracy after 2,000 SGD
    steps (batch 64, lr 0.5) against a majority-class rate of about 50%. The most
    frequent id fills ~13% of all slots while most ids never occur, so each step's
    gradient touches only a few rows.
    """
    n = cfg.num_samples or 50_000
    rng = _rng(seed, 5)
    rank_p = 1.0 / np.arange(1, num_features + 1, dtype=np.float64) ** zipf_s
    rank_p /= rank_p.sum()
    rank_to_id = rng.permutation(num_features)
    true_w = rng.standard_normal(num_features)
    # Subtract the expected logit so the classes come out close to balanced.
    mean_logit = per_sample * float(rank_p @ true_w[rank_to_id])
    ids = rank_to_id[rng.choice(num_features, size=(n, per_sample), p=rank_p)].astype(np.int64)
    logit = 3.0 * (true_w[ids].sum(1) - mean_logit) / np.sqrt(per_sample)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    return _classification("sparse", *_split(ids, y, rng), num_classes=2, num_features=num_features)


# ---------------------------------------------------------------------------------------
# text


_SEQ_LEN = 64
_CORPUS_BYTES = 2 * 1024 * 1024
# Printable ASCII and newline get their own ids; every other byte shares one unknown id.
_KEPT_BYTES = frozenset([10, *range(32, 127)])
_SKIP_DIRS = frozenset(["site-packages", "dist-packages", "__pycache__"])


def _sorted_files(root: Path, suffix: str | None) -> Iterator[Path]:
    """Files under ``root`` in sorted path order, lazily, so reading can stop early."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(".") or entry.name in _SKIP_DIRS:
            continue
        if entry.is_dir(follow_symlinks=False):
            yield from _sorted_files(Path(entry.path), suffix)
        elif entry.is_file() and (suffix is None or entry.name.endswith(suffix)):
            yield Path(entry.path)


@functools.lru_cache(maxsize=1)
def _stdlib_corpus() -> tuple[bytes, int]:
    # Cached because the standard library does not change while we run; a user's
    # folder is read afresh each time.
    return _corpus(sysconfig.get_paths()["stdlib"], ".py")


def _corpus(root: str, suffix: str | None) -> tuple[bytes, int]:
    """The first ``_CORPUS_BYTES`` of the sorted files under ``root``, and the file count."""
    chunks, total, files = [], 0, 0
    for path in _sorted_files(Path(root), suffix):
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable files (permissions, races) are simply not part of the corpus
        chunks.append(data[: _CORPUS_BYTES - total])
        total += len(chunks[-1])
        files += 1
        if total >= _CORPUS_BYTES:
            break
    return b"".join(chunks), files


def _text(cfg: DataConfig, seed: int) -> Dataset:
    """Character language model: x = chars[i:i+T], y = chars[i+1:i+T+1], T = 64.

    The corpus is split by position, the first 90% for training and the last 10% for
    testing, so no test window overlaps a training window; offsets within each part are
    drawn with a seeded generator.
    """
    if cfg.data_dir is not None:
        root = Path(cfg.data_dir)
        if root.exists() and not root.is_dir():
            raise ConfigError(f"--data-dir {str(root)!r} for dataset 'text' is a file, not a folder: pass "
                              f"--data-dir DIR, the folder holding the text files")
        if not root.is_dir():
            raise ConfigError(f"text corpus folder {str(root)!r} does not exist or is not a folder: pass "
                              f"--data-dir DIR containing text files, or leave it out to use the Python "
                              f"standard library's sources")
        data, files = _corpus(str(root), None)
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        data, files = _stdlib_corpus()
    n = cfg.num_samples or 20_000
    n_test = max(1, n // 10)
    raw = np.frombuffer(data, dtype=np.uint8)
    cut = int(len(raw) * 0.9)
    # Each part must hold at least one window of T + 1 characters.
    if min(cut, len(raw) - cut) < _SEQ_LEN + 1:
        raise ConfigError(f"text corpus under {str(root)!r} has {len(raw)} bytes in {files} files; it needs at "
                          f"least {10 * (_SEQ_LEN + 1)} for a 90/10 split of {_SEQ_LEN}-character windows: "
                          f"pass --data-dir DIR containing more text")
    present = sorted(set(np.unique(raw).tolist()) & _KEPT_BYTES)
    unknown = len(present)
    table = np.full(256, unknown, dtype=np.int64)
    table[present] = np.arange(len(present))
    ids = table[raw]
    rng = _rng(seed, 4)
    steps = np.arange(_SEQ_LEN + 1)

    def windows(lo: int, hi: int, count: int) -> np.ndarray:
        starts = rng.integers(lo, hi - _SEQ_LEN, size=count)
        return ids[starts[:, None] + steps]  # [count, T + 1]

    train, test = windows(0, cut, n - n_test), windows(cut, len(ids), n_test)
    return Dataset(name="text", task="lm",
                   x_train=torch.tensor(train[:, :-1]), y_train=torch.tensor(train[:, 1:]),
                   x_test=torch.tensor(test[:, :-1]), y_test=torch.tensor(test[:, 1:]),
                   num_classes=len(present) + 1, input_shape=(_SEQ_LEN,))


# ---------------------------------------------------------------------------------------
# local-file loaders


def _require_dir(cfg: DataConfig, needs: str) -> Path:
    if cfg.data_dir is None:
        raise ConfigError(f"dataset {cfg.dataset!r} reads local files and nothing is downloaded: "
                          f"pass --data-dir DIR containing {needs}")
    root = Path(cfg.data_dir)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--data-dir {str(root)!r} for dataset {cfg.dataset!r} is a file, not a folder: "
                          f"pass --data-dir DIR, the folder containing {needs}")
    if not root.is_dir():
        raise ConfigError(f"data folder {str(root)!r} for dataset {cfg.dataset!r} does not exist: "
                          f"pass --data-dir DIR containing {needs}")
    return root


_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def _read_idx(path: Path) -> np.ndarray:
    """Parse an IDX file (LeCun's MNIST format): magic 0x0000TTDD, DD big-endian int32 dims."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise ConfigError(f"cannot read IDX file {str(path)!r}: {exc}") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ConfigError(f"{str(path)!r} is not an IDX file (bad magic number {raw[:4].hex()!r}): "
                          f"use the original MNIST files, gzipped or not")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise ConfigError(f"IDX file {str(path)!r} is truncated or has no dimensions")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ConfigError(f"IDX file {str(path)!r} holds {len(raw) - header} data bytes but its header "
                          f"{dims} needs {expected}: the file is truncated or corrupt")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)


def _mnist(cfg: DataConfig, seed: int) -> Dataset:
    names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    needs = "the MNIST files " + ", ".join(names) + " (each may be .gz)"
    root = _require_dir(cfg, needs)
    arrays = []
    for name in names:
        path = next((p for p in (root / name, root / f"{name}.gz") if p.is_file()), None)
        if path is None:
            raise ConfigError(f"MNIST file {str(root / name)!r} (or .gz) is missing: pass --data-dir DIR "
                              f"containing {needs}")
        arrays.append(_read_idx(path))
    x_train, y_train, x_test, y_test = arrays
    for x, y, split in ((x_train, y_train, "train"), (x_test, y_test, "t10k")):
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y) or x.dtype != np.uint8:
            raise ConfigError(f"MNIST {split} files in {str(root)!r} do not match: images must be uint8 [N, H, W] "
                              f"and labels [N], got {x.dtype} {x.shape} and {y.shape}")
        if len(y) and (y.min() < 0 or y.max() > 9):
            raise ConfigError(f"MNIST {split} labels in {str(root)!r} must be digits 0..9")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ConfigError(f"MNIST train and test images in {str(root)!r} differ in size: "
                          f"{x_train.shape[1:]} and {x_test.shape[1:]}")

    def images(x: np.ndarray) -> np.ndarray:
        return (x.astype(np.float32) / 255.0)[:, None]  # [N, 1, H, W] in [0, 1]

    return _classification("mnist", images(x_train), y_train.astype(np.int64), images(x_test),
                           y_test.astype(np.int64), num_classes=10)


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only.

    CIFAR-10 batches are pickles; a pickle can run any code on load, so even for files
    the user named we refuse every global except those numpy needs to rebuild an array.
    """

    _ALLOWED = {
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        # Protocol-2 pickles written by Python 3 spell bytes as _codecs.encode(str, "latin1").
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a CIFAR-10 batch holds only arrays")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2 renamed numpy.core
            return super().find_class(module, name)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError, ImportError,
            IndexError, KeyError) as exc:
        raise ConfigError(f"cannot read CIFAR-10 batch {str(path)!r}: {exc}") from exc
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ConfigError(f"CIFAR-10 batch {str(path)!r} must be a dict with b'data' and b'labels'")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[b"labels"])
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.shape != (len(data),) or data.dtype != np.uint8:
        raise ConfigError(f"CIFAR-10 batch {str(path)!r} must hold uint8 data [N, 3072] and N labels, "
                          f"got {data.dtype} {data.shape} and {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise ConfigError(f"CIFAR-10 labels in {str(path)!r} must lie in 0..9")
    # Rows are 1024 red, then 1024 green, then 1024 blue values, each row-major 32x32.
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _cifar10(cfg: DataConfig, seed: int) -> Dataset:
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    needs = "the CIFAR-10 python batches data_batch_1..5 and test_batch (or their folder cifar-10-batches-py)"
    root = _require_dir(cfg, needs)
    if not (root / names[0]).is_file() and (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    for name in names:
        if not (root / name).is_file():
            raise ConfigError(f"CIFAR-10 file {str(root / name)!r} is missing: pass --data-dir DIR containing "
                              f"{needs}")
    train = [_read_cifar_batch(root / name) for name in names[:-1]]
    x_test, y_test = _read_cifar_batch(root / names[-1])
    x_train = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])

    def images(x: np.ndarray) -> np.ndarray:
        return x.astype(np.float32) / 255.0

    return _classification("cifar10", images(x_train), y_train, images(x_test), y_test, num_classes=10)
