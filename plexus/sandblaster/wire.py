"""Messages between Sandblaster's coordinator, replicas and server shards.

Every message is an int64 header of ``HEADER_LEN`` fields, then the payloads its kind and
counts announce; replies are a header, then float64 results or a parameter slice. No
pickle crosses a link (ARCHITECTURE.md, contract 5).

==========  =========================================  =====================================
kind        request (header fields a, b, c; payloads)  reply
==========  =========================================  =====================================
INIT        a = numel; the shard's initial parameters   header
COMMANDS    a = commands, b = ints, c = floats;         header (a = results); float64
            int64 program, float64 arguments            results when a > 0
PULL        a = slot, b = batch                         header (a = numel); the slot's slice
PUSH        a = batch, b = unit, c = numel; gradient    header (a = ``Accepted``)
            slice, then [loss sum] (float64)
BYE         none                                        none (the replica stops)
STOP        none                                        header (the coordinator is done)
==========  =========================================  =====================================

A command program is a stream of int64 ``(op, dst, src, other, n)`` records, each followed
by ``n`` extra ints (the slots of a Gram matrix, or of a linear combination), with its
float arguments (alpha, or the combination's coefficients) in the float stream in order.
"""
from __future__ import annotations

from enum import IntEnum

import torch

from plexus.errors import ProtocolError

__all__ = ["HEADER_LEN", "MAGIC", "Kind", "Op", "Accepted", "header", "check", "Program"]

HEADER_LEN = 6
MAGIC = 0x53424C53_0001  # "SBLS", version 1
# Bounds a header is checked against before any payload is posted for it.
MAX_PROGRAM = 1 << 20


class Kind(IntEnum):
    INIT = 1
    COMMANDS = 2
    PULL = 3
    PUSH = 4
    BYE = 5
    STOP = 6
    REPLY = 7


class Op(IntEnum):
    COPY = 1  # dst = src
    SCALE = 2  # dst *= alpha
    AXPY = 3  # dst += alpha src
    MUL = 4  # dst *= src, elementwise
    LINCOMB = 5  # dst = sum_j c_j slot_j
    DOT = 6  # -> src . other
    ABSMAX = 7  # -> max |src|
    ABSSUM = 8  # -> sum |src|
    GRAM = 9  # -> [slot_i . slot_j] for the n slots
    OPEN = 10  # open batch `other`: the accumulator and loss start again at 0
    LOSS = 11  # -> the open batch's loss sum


class Accepted(IntEnum):
    YES = 1
    DUPLICATE = 2  # the unit was counted already (a backup copy, or a re-run)
    STALE = 3  # the unit belongs to a batch that is no longer open


def header(kind: Kind, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> torch.Tensor:
    return torch.tensor([MAGIC, int(kind), a, b, c, d], dtype=torch.int64)


def check(head: torch.Tensor, who: str) -> tuple[Kind, int, int, int, int]:
    """(kind, a, b, c, d) of a received header; ProtocolError for a malformed one."""
    fields = head.tolist()
    if fields[0] != MAGIC:
        raise ProtocolError(f"{who}: a message without the sandblaster magic number")
    try:
        kind = Kind(fields[1])
    except ValueError:
        raise ProtocolError(f"{who}: unknown message kind {fields[1]}") from None
    a, b, c, d = fields[2:]
    if min(a, c) < 0 or b < -1 or max(a, b, c) > MAX_PROGRAM * 64:
        raise ProtocolError(f"{who}: header counts out of range ({a}, {b}, {c})")
    return kind, a, b, c, d


# How each op's result combines over shards.
REDUCTIONS = {Op.DOT: "sum", Op.ABSMAX: "max", Op.ABSSUM: "sum", Op.GRAM: "sum", Op.LOSS: "first"}


class Program:
    """Commands queued on the coordinator, sent as one message to every shard."""

    def __init__(self) -> None:
        self.ints: list[int] = []
        self.floats: list[float] = []
        self.count = 0
        # (op, number of results) per reduction, in order.
        self.results: list[tuple[Op, int]] = []

    def add(self, op: Op, dst: int = 0, src: int = 0, other: int = 0, alpha: float | None = None,
            extra: list[int] = (), coefs: list[float] = ()) -> None:
        self.ints += [int(op), dst, src, other, len(extra), *extra]
        if alpha is not None:
            self.floats.append(alpha)
        self.floats += list(coefs)
        self.count += 1
        if op in REDUCTIONS:
            self.results.append((op, len(extra) ** 2 if op == Op.GRAM else 1))

    def __bool__(self) -> bool:
        return self.count > 0
