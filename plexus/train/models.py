"""Models for the offline datasets: MLP, small CNN, small causal transformer LM,
embedding-bag logistic regression, and two models for model parallelism (a two-tower
network joined late, a deep MLP).

``build_model(cfg, data)`` draws every initial weight from torch's global generator
and nothing else, so a caller that runs ``torch.manual_seed(seed)`` first gets the same
model in every process (contract 2). Every model returns logits with the classes in
the last dimension and leading dimensions matching ``y``: [N, C] for classification,
[N, T, V] for the language model, so one loss,
``F.cross_entropy(logits.reshape(-1, C), y.reshape(-1))``, fits all of them.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from plexus.config import ModelConfig
from plexus.errors import ConfigError
from plexus.train.data import Dataset, _resolve_factory

__all__ = ["build_model", "KNOWN_MODELS", "MLP", "CNN", "CharTransformer", "SparseLogReg", "Towers", "DeepMLP"]

KNOWN_MODELS: tuple[str, ...] = ("mlp", "cnn", "lm", "logreg", "towers", "deep-mlp")

# Which built-in model fits which kind of data, quoted by every mismatch error.
_FITS = ("mlp, cnn, towers and deep-mlp take dense float inputs (digits, mnist1d, teacher, mnist, cifar10); "
         "lm takes int64 character ids (text); logreg takes int64 sparse feature ids (sparse)")


class MLP(nn.Module):
    """Flatten, then Linear-ReLU-Linear-ReLU-Linear: works for any dense input shape."""

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Two conv-ReLU-maxpool stages and a linear head, for 1-D signals or images.

    ``input_shape`` is [L] (one channel), [C, L] (Conv1d) or [C, H, W] (Conv2d);
    ``image_shape`` reshapes flat inputs first (digits arrive as [64] and are 1x8x8).
    Pooling halves each spatial size while it is at least 2.
    """

    def __init__(self, input_shape: tuple[int, ...], width: int, num_classes: int,
                 image_shape: tuple[int, ...] | None = None) -> None:
        super().__init__()
        shape = image_shape or (input_shape if len(input_shape) > 1 else (1, *input_shape))
        channels, spatial = shape[0], list(shape[1:])
        conv, pool = (nn.Conv1d, nn.MaxPool1d) if len(spatial) == 1 else (nn.Conv2d, nn.MaxPool2d)
        layers: list[nn.Module] = [nn.Unflatten(1, shape)] if tuple(shape) != tuple(input_shape) else []
        for _ in range(2):
            layers += [conv(channels, width, kernel_size=3, padding=1), nn.ReLU()]
            channels = width
            if min(spatial) >= 2:
                layers.append(pool(2))
                spatial = [s // 2 for s in spatial]
        layers += [nn.Flatten(), nn.Linear(width * math.prod(spatial), num_classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CharTransformer(nn.Module):
    """A small pre-norm causal transformer over character ids: [N, T] int64 -> [N, T, V].

    Token and learned position embeddings, ``layers`` encoder blocks with a causal mask
    (position t attends to positions <= t only, so logits at t predict character t + 1),
    a final LayerNorm and a linear head. Dropout is 0 so that replicas given the same
    weights and batch compute the same gradient.
    """

    def __init__(self, vocab: int, max_len: int, hidden: int, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.max_len = max_len
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        # A ModuleList rather than nn.TransformerEncoder, whose nested-tensor fast path
        # warns and is disabled with norm_first anyway.
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(hidden, heads, dim_feedforward=4 * hidden, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        # Not persistent: derived from max_len, so it stays out of state_dict and of
        # anything that averages or ships parameters and buffers.
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(max_len),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.int64 or x.ndim != 2 or x.shape[1] > self.max_len:
            raise ValueError(f"CharTransformer takes int64 ids [N, T] with T <= {self.max_len}, "
                             f"got {x.dtype} of shape {tuple(x.shape)}")
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        mask = self.causal_mask[:t, :t]
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


class SparseLogReg(nn.Module):
    """Logistic regression over bags of feature ids: logits = sum of rows + bias.

    ``embedding.weight`` [num_features, num_classes] is the one large parameter; a batch
    touches only the rows of its ids, which sparse push/pull strategies exploit. Its
    gradient is dense by default (``sparse=False``) so every optimizer and all-reduce
    works unchanged. Weights start at zero: the problem is convex, and zero logits give
    the uninformed loss log(C) instead of the large random logits a sum of 16 N(0, 1)
    rows would give.
    """

    def __init__(self, num_features: int, num_classes: int, sparse: bool = False) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(num_features, num_classes, mode="sum", sparse=sparse)
        nn.init.zeros_(self.embedding.weight)
        self.bias = nn.Parameter(torch.zeros(num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A 2-D input is read as N bags of F ids each.
        return self.embedding(x) + self.bias


class Towers(nn.Module):
    """Two (or more) independent MLP columns on the same input, joined late by a shared head.

    The shape of AlexNet's two GPU columns (Krizhevsky et al. 2012) and of an inception
    block: a graph with parallel branches rather than a chain, so that a partition plan
    may place the columns on different stages and the flattened input fans out to every
    column (one transfer per receiving stage, however many of its nodes read it).
    """

    def __init__(self, in_features: int, hidden: int, num_classes: int, towers: int = 2) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
            for _ in range(towers))
        self.head = nn.Linear(towers * hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.flatten(x)
        return self.head(torch.cat([tower(h) for tower in self.towers], dim=1))


class DeepMLP(nn.Module):
    """Flatten, then ``layers`` Linear layers of width ``hidden`` with ReLUs between them.

    Deep enough that under a small ``--stage-memory`` its layers do not fit one process
    and a partition plan must spread them over several stages. The layers before a ReLU
    take He et al. (2015) initialisation (variance 2 / fan_in): torch's default has a
    sixth of that variance, so behind each ReLU the signal's power falls sixfold and eight
    layers barely train (digits: 53% after 300 steps, against 96%).
    """

    def __init__(self, in_features: int, hidden: int, num_classes: int, layers: int = 8) -> None:
        super().__init__()
        if layers < 2:
            raise ValueError(f"DeepMLP needs at least 2 layers, got {layers}")
        widths = [in_features] + [hidden] * (layers - 1)
        body: list[nn.Module] = [nn.Flatten()]
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            linear = nn.Linear(fan_in, fan_out)
            nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
            nn.init.zeros_(linear.bias)
            body += [linear, nn.ReLU()]
        body.append(nn.Linear(hidden, num_classes))
        self.net = nn.Sequential(*body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _mismatch(model: str, data: Dataset, needs: str) -> ConfigError:
    kind = "int64 ids" if data.x_train.dtype == torch.int64 else f"{data.x_train.dtype} features"
    return ConfigError(f"model {model!r} needs {needs}, but dataset {data.name!r} is a {data.task} task with "
                       f"{kind} of shape {list(data.input_shape)}: {_FITS}")


def _dense_classification(model: str, data: Dataset) -> None:
    if data.task != "classification" or not data.x_train.is_floating_point():
        raise _mismatch(model, data, "dense float inputs and class labels")


def build_model(cfg: ModelConfig, data: Dataset) -> nn.Module:
    """Build ``cfg.model`` for ``data``; seed torch's generator first for a reproducible model."""
    name = cfg.model
    if ":" in name:
        factory = _resolve_factory(name, "model")
        model = factory(data)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model factory {name!r} must return a torch.nn.Module, got {type(model).__name__}")
        return model
    if name == "mlp":
        _dense_classification(name, data)
        return MLP(math.prod(data.input_shape), cfg.hidden, data.num_classes)
    if name == "towers":
        _dense_classification(name, data)
        return Towers(math.prod(data.input_shape), cfg.hidden, data.num_classes)
    if name == "deep-mlp":
        _dense_classification(name, data)
        return DeepMLP(math.prod(data.input_shape), cfg.hidden, data.num_classes)
    if name == "cnn":
        _dense_classification(name, data)
        if not 1 <= len(data.input_shape) <= 3:
            raise _mismatch(name, data, "inputs shaped [L], [C, L] or [C, H, W]")
        # digits arrive flat but are 8x8 images; 32 channels keep it fast on a CPU core.
        image = (1, 8, 8) if data.name == "digits" and data.input_shape == (64,) else None
        return CNN(data.input_shape, min(cfg.hidden, 32), data.num_classes, image_shape=image)
    if name == "lm":
        if data.task != "lm" or data.x_train.dtype != torch.int64 or len(data.input_shape) != 1:
            raise _mismatch(name, data, "an lm task with int64 token ids [N, T]")
        heads = 4
        if cfg.hidden % heads:
            raise ConfigError(f"hidden must be divisible by the lm's {heads} attention heads, got {cfg.hidden}: "
                              f"pass --hidden {max(heads, cfg.hidden - cfg.hidden % heads)} for example")
        return CharTransformer(data.num_classes, data.input_shape[0], cfg.hidden, heads=heads)
    if name == "logreg":
        if data.task != "classification" or data.num_features is None or len(data.input_shape) != 1:
            raise _mismatch(name, data, "int64 feature ids [N, F] with num_features set")
        return SparseLogReg(data.num_features, data.num_classes)
    raise ConfigError(f"unknown model {name!r}: pass --model with one of {', '.join(KNOWN_MODELS)}, or a factory "
                      f"as 'pkg.module:function'. {_FITS}")
