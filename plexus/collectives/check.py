"""Agreement on the arguments of a collective before any payload moves.

Why every call: gloo aborts the receiving *process* (``EnforceNotMet``, "Received data
size doesn't match expected size") when a message is larger than the buffer posted for
it, and a smaller one is silently half-filled, so lengths must agree before the first
payload message, on every call. Checking only the first call per (group, shape, dtype) is
not enough: whether a call is "new" is decided by each rank from its own arguments, so
ranks that disagree also disagree on whether to check, and the one that checks waits
forever.

How: every rank holds its signature (elements, dtype, algorithm, op and two
algorithm-specific options) twice, as a running minimum and maximum, and merges them in
ceil(log2 P) rounds of dissemination (Hensgen, Finkel and Manber 1988; the Bruck
all-gather pattern): in round k it sends to rank - 2^k and receives from rank + 2^k. The
merge is idempotent, so any P works, and the message has a fixed size of 96 bytes. After
the last round every rank holds the same minimum and maximum; if they differ, every rank
knows it at once, all of them exchange their full signatures in the same pattern and
raise the same ``ProtocolError`` naming the ranks and values, and no payload message was
ever sent, so the group stays usable. Cost: ceil(log2 P) latency-bound steps of 96 bytes
per call (2 steps at P = 4; measured in ``plexus bench collectives`` as part of every
algorithm's time, native's included).
"""
from __future__ import annotations

import hashlib

import torch

from plexus.errors import ProtocolError
from plexus.collectives.schedule import ceil_log2

__all__ = ["FIELDS", "MESSAGE_BYTES", "TAG_CHECK", "signature", "verify", "check_bytes"]

# The tag of the check's messages; payload tags of the algorithms are in base.py.
TAG_CHECK = 0x7C00
FIELDS = ("elements", "dtype", "algorithm", "op", "option", "option2")
MESSAGE_BYTES = 2 * len(FIELDS) * 8

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_OPS = ("sum", "mean")
_NAMES: dict[int, str] = {}


def _name_code(name: str) -> int:
    code = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=6).digest(), "big")
    _NAMES[code] = name
    return code


def signature(tensor: torch.Tensor, algorithm: str, op: str, options: tuple[int, int] = (0, 0)) -> list[int]:
    """The values every rank must agree on, as int64s in the order of ``FIELDS``."""
    dtype = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else 99
    return [tensor.numel(), dtype, _name_code(algorithm), _OPS.index(op), int(options[0]), int(options[1])]


def check_bytes(procs: int) -> int:
    """Bytes each rank sends for one check: one fixed-size message per round."""
    return ceil_log2(procs) * MESSAGE_BYTES if procs > 1 else 0


def _disseminate(group, box: torch.Tensor, merge) -> torch.Tensor:
    """ceil(log2 P) rounds: send to rank - 2^k, receive from rank + 2^k, merge."""
    p, r = group.size, group.rank
    rounds = ceil_log2(p)
    incoming = [torch.empty_like(box) for _ in range(rounds)]
    # Post every receive first, so that a message never waits for its buffer.
    recvs = [group.irecv(incoming[k], (r + (1 << k)) % p, TAG_CHECK) for k in range(rounds)]
    sends = []
    for k in range(rounds):
        outgoing = box.clone()  # the message must not change while it is in flight
        sends.append(group.isend(outgoing, (r - (1 << k)) % p, TAG_CHECK))
        recvs[k].wait()
        box = merge(box, incoming[k])
    for work in sends:
        work.wait()
    return box


def _merge_bounds(box: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return torch.maximum(box, other)


def _merge_rows(table: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    known = other[:, 0] >= 0
    table[known] = other[known]
    return table


def verify(group, values: list[int], device: torch.device | str = "cpu") -> None:
    """Return when every member passed the same ``values``; otherwise raise the same
    ProtocolError on every member. Collective: every member must call it. ``device``:
    where the group's backend takes its tensors."""
    if group.size == 1:
        return
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    # Row 0 tracks the maximum, row 1 the negated minimum: one elementwise max merges both.
    bounds = _disseminate(group, torch.stack([mine, -mine]), _merge_bounds)
    if torch.equal(bounds[0], -bounds[1]):
        return
    table = torch.full((group.size, len(FIELDS)), -1, dtype=torch.int64, device=device)
    table[group.rank] = mine
    table = _disseminate(group, table, _merge_rows)
    raise _mismatch(group, table.cpu().tolist())


def _describe(row: list[int]) -> str:
    elements, dtype, algorithm, op, option, option2 = row
    dtype_name = str(_DTYPES[dtype]).replace("torch.", "") if dtype < len(_DTYPES) else f"dtype #{dtype}"
    text = (f"{elements} {dtype_name} elements, algorithm {_NAMES.get(algorithm, hex(algorithm))}, "
            f"op {_OPS[op] if 0 <= op < len(_OPS) else op}")
    if option or option2:
        text += f", options ({option}, {option2})"
    return text


def _mismatch(group, rows: list[list[int]]) -> ProtocolError:
    by_value: dict[tuple[int, ...], list[int]] = {}
    for rank, row in enumerate(rows):
        by_value.setdefault(tuple(row), []).append(rank)
    parts = [f"{', '.join(group.names[r] for r in ranks)}: {_describe(list(row))}"
             for row, ranks in sorted(by_value.items(), key=lambda kv: kv[1][0])]
    # The peer to blame: the first rank whose arguments differ from rank 0's.
    odd = next(r for r, row in enumerate(rows) if row != rows[0])
    return ProtocolError(f"{group.me}: all-reduce arguments differ across the group ({'; '.join(parts)}); "
                         f"every rank must pass a tensor of the same length and dtype with the same "
                         f"algorithm and op", peer=group.names[odd])
