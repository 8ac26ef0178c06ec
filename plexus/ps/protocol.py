"""Wire format of the parameter server: a fixed-layout int64 header, then raw payload tensors.

Every message on a worker-server ``Link`` is one header tensor of ``HEADER_LEN`` int64
fields followed by the payload tensors that the header's operation and counts determine
(``request_payloads``, ``reply_payloads``). Nothing else crosses the link: no pickle, no
JSON, so a peer can only ever make us read numbers, never run code (ARCHITECTURE.md,
contract 5). Operations follow Li et al. 2014 (push and pull of key ranges and of sparse
(key, value) lists) and Dean et al. 2012 (Downpour's fused push-and-fetch):

=============  ====================================  ======================================
op             request payloads                      reply payloads (status OK)
=============  ====================================  ======================================
INIT           dense values, keys, rows              dense params, rows (current values)
PUSH           dense gradient[, members]             none (acknowledgement)
PULL           none                                  dense params
PUSH_PULL      dense gradient[, members]             dense params
SPARSE_PUSH    dense gradient, keys, row gradients   none (acknowledgement)
SPARSE_PULL    keys                                  dense params, rows
CLOCK          none                                  none (heartbeat; reply says the state)
BYE            none                                  none (worker stops pushing)
SHUTDOWN       none                                  none (worker closes the link)
=============  ====================================  ======================================

Header fields (``Field``): ``count`` dense elements starting at ``offset`` of the flat
buffer, ``keys`` sparse rows of ``width`` elements each. A reply carries op REPLY, the
server's version, and in ``staleness`` the staleness of the push it answers plus one
(0: not known yet). Replies with a status other than OK carry no payload.

Tree pushes. In a hierarchical PS (``tree.py``) an aggregator pushes the *sum* of several
workers' gradients; its header says how many in ``members``, and a payload of ``members``
x (worker, clock, version) int64 rows after the gradient says whose they are and which
shard version each was computed on, so the root counts and measures every worker gradient
(``members`` = 0 is a worker's own push: one gradient, the sender's).

Robustness. gloo terminates the receiving *process* when a message is longer than the
buffer posted for it (measured on torch 2.13: ``op.preamble.length <= op.nbytes`` is
enforced in its I/O thread). Headers are therefore received into a buffer of
``RECV_CAP`` int64 pre-filled with a sentinel: a header that is too long leaves its mark
past ``HEADER_LEN``, one that is too short leaves the checksum slot wrong, and both raise
``ProtocolError`` instead of killing the server. Payload receives are posted only after the
header has been checked against the shard (``check_request``), at exactly the size the
header announced; a peer that then sends *more* than it announced is beyond what any gloo
receiver can survive, which is why servers should be reachable only by the job's own
processes (loopback or a private network, contract 5).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from enum import IntEnum

import torch

from plexus.errors import ProtocolError

__all__ = ["HEADER_LEN", "HEADER_BYTES", "RECV_CAP", "MAGIC", "Op", "Status", "Header", "ShardSpec", "encode", "decode",
           "dtype_code", "code_dtype", "check_request", "check_reply", "request_payloads", "reply_payloads",
           "header_buffer", "SENTINEL", "mark_payload", "payload_short", "MEMBER_FIELDS"]

HEADER_LEN = 17
HEADER_BYTES = HEADER_LEN * 8
# Header receives use a buffer this many int64 long (32 KiB): see the module docstring.
RECV_CAP = 4096
MAGIC = 0x504C5853_0002  # "PLXS", protocol version 2
SENTINEL = -0x5A5A5A5A5A5A5A5A
# A tree push's members payload: (worker, clock, version) per worker gradient it sums.
MEMBER_FIELDS = 3


class Op(IntEnum):
    INIT = 1
    PUSH = 2
    PULL = 3
    PUSH_PULL = 4
    SPARSE_PUSH = 5
    SPARSE_PULL = 6
    CLOCK = 7
    BYE = 8
    SHUTDOWN = 9
    REPLY = 10


class Status(IntEnum):
    OK = 0
    # The server will not serve this request (a join under bsp, or after the job drained).
    REFUSED = 1
    # The server declared this worker lost (it was silent for --peer-timeout); it may not come back.
    LOST = 2
    # The request broke the protocol; the server closes the link after this reply.
    ERROR = 3
    # The shard moved to another server (a drain); send the request there (``ps/owner/<s>``).
    MOVED = 4


_DTYPES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4}
_CODES = {code: dtype for dtype, code in _DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} cannot travel to a parameter server: use float32, float64, "
                            f"float16 or bfloat16 parameters") from None


def code_dtype(code: int) -> torch.dtype:
    try:
        return _CODES[code]
    except KeyError:
        raise ProtocolError(f"unknown dtype code {code}") from None


@dataclass(frozen=True)
class Header:
    """One message header; every field is an int64 on the wire, in this order after the
    magic number, and a checksum follows them."""

    op: int
    sender: int                 # worker rank (requests) or server index (replies)
    shard: int                  # the server the message concerns
    clock: int = 0              # worker clock: pushes it completed before this message
    version: int = 0            # request: shard version its gradient was computed on; reply: server version
    offset: int = 0             # first dense element, in the model's flat buffer
    count: int = 0              # dense elements in the payload
    keys: int = 0               # sparse rows in the payload
    width: int = 0              # elements per sparse row
    dtype: int = 0              # dtype code of float payloads (dtype_code)
    total: int = 0              # INIT: dense elements of the whole model
    rows: int = 0               # INIT: rows of the whole sparse table
    staleness: int = 0          # reply: staleness of the answered push + 1 (0: not known)
    status: int = Status.OK
    members: int = 0            # tree push: worker gradients summed in the payload (0: one, the sender's)

    def describe(self) -> str:
        name = Op(self.op).name if self.op in Op._value2member_map_ else f"op {self.op}"
        return f"{name} clock {self.clock} [{self.offset}:{self.offset + self.count}) keys {self.keys}"


_NAMES = [f.name for f in fields(Header)]
assert len(_NAMES) == HEADER_LEN - 2  # magic + fields + checksum
_MASK = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >> 63 else value


def _checksum(values: list[int]) -> int:
    """FNV-1a over the 64-bit fields: catches truncated, shifted and garbled headers."""
    acc = 0xCBF29CE484222325
    for v in values:
        acc = ((acc ^ (v & _MASK)) * 0x100000001B3) & _MASK
    return _signed(acc)


def encode(header: Header) -> torch.Tensor:
    values = [MAGIC] + [int(getattr(header, name)) for name in _NAMES]
    return torch.tensor(values + [_checksum(values)], dtype=torch.int64)


def header_buffer() -> torch.Tensor:
    """A receive buffer for one header, filled with the sentinel (see the module docstring)."""
    return torch.full((RECV_CAP,), SENTINEL, dtype=torch.int64)


def decode(buffer: torch.Tensor, peer: str = "peer") -> Header:
    """Parse a received header; ProtocolError names ``peer`` and what is wrong with it.

    ``buffer`` is either exactly ``HEADER_LEN`` long or a ``header_buffer()`` it was
    received into."""
    if buffer.dtype != torch.int64 or buffer.dim() != 1 or buffer.numel() < HEADER_LEN:
        raise ProtocolError(f"header from {peer} is not {HEADER_LEN} int64 values", peer=peer)
    if buffer.numel() > HEADER_LEN and bool((buffer[HEADER_LEN:] != SENTINEL).any()):
        raise ProtocolError(f"header from {peer} is longer than {HEADER_LEN} int64 values", peer=peer)
    values = buffer[:HEADER_LEN].tolist()
    if values[0] != MAGIC:
        raise ProtocolError(f"message from {peer} does not start with the plexus magic number "
                            f"(got {values[0]:#x}): not a parameter-server message, or another protocol version",
                            peer=peer)
    if _checksum(values[:-1]) != values[-1]:
        raise ProtocolError(f"header from {peer} fails its checksum: truncated or garbled", peer=peer)
    header = Header(**dict(zip(_NAMES, values[1:-1])))
    if header.op not in Op._value2member_map_:
        raise ProtocolError(f"{peer} sent an unknown operation {header.op}", peer=peer)
    if header.status not in Status._value2member_map_:
        raise ProtocolError(f"{peer} sent an unknown status {header.status}", peer=peer)
    for name in ("clock", "version", "offset", "count", "keys", "width", "total", "rows", "staleness", "members"):
        if getattr(header, name) < 0:
            raise ProtocolError(f"{peer} sent a negative {name} ({getattr(header, name)}) in {header.describe()}",
                                peer=peer)
    return header


@dataclass(frozen=True)
class ShardSpec:
    """What one server holds, against which requests are checked."""

    index: int
    start: int                  # dense range [start, stop) of the flat buffer
    stop: int
    dtype: torch.dtype
    total: int                  # dense elements of the whole model
    rows: int = 0               # rows of the whole sparse table (0: no sparse part)
    width: int = 0              # elements per sparse row
    owned_rows: int = 0         # sparse rows this server owns

    @property
    def count(self) -> int:
        return self.stop - self.start


_DENSE_IN = {Op.INIT, Op.PUSH, Op.PUSH_PULL, Op.SPARSE_PUSH}
_KEYS_IN = {Op.INIT, Op.SPARSE_PUSH, Op.SPARSE_PULL}
_ROWS_IN = {Op.INIT, Op.SPARSE_PUSH}
_MEMBERS_IN = {Op.PUSH, Op.PUSH_PULL}
_DENSE_OUT = {Op.INIT, Op.PULL, Op.PUSH_PULL, Op.SPARSE_PULL}
_ROWS_OUT = {Op.INIT, Op.SPARSE_PULL}


def check_request(header: Header, spec: ShardSpec, sender: int, peer: str) -> None:
    """Raise ProtocolError unless ``header`` is a request this shard can serve from ``sender``.

    Dense requests must cover exactly this shard's range (a worker always pushes and pulls
    its whole slice of every shard); sparse ones must use the table's row width and at
    most as many keys as the shard owns (the keys themselves are checked on arrival)."""
    def bad(why: str) -> ProtocolError:
        return ProtocolError(f"{peer}: {why} in {header.describe()}", peer=peer)

    if header.op == Op.REPLY:
        raise bad("a worker may not send replies")
    if header.sender != sender:
        raise bad(f"sender field says worker {header.sender} but the link belongs to worker {sender}")
    if header.shard != spec.index:
        raise bad(f"message addressed to server {header.shard} arrived at server {spec.index}")
    op = Op(header.op)
    if op in _DENSE_IN or op in _KEYS_IN or op in _DENSE_OUT:
        if header.dtype != dtype_code(spec.dtype):
            raise bad(f"dtype code {header.dtype} differs from the shard's {spec.dtype} "
                      f"(code {dtype_code(spec.dtype)})")
        if (header.offset, header.count) != (spec.start, spec.count):
            raise bad(f"dense range [{header.offset}:{header.offset + header.count}) is not this shard's "
                      f"[{spec.start}:{spec.stop})")
    else:
        if header.count or header.keys:
            raise bad(f"{op.name} carries no payload, but the header announces "
                      f"{header.count} dense elements and {header.keys} keys")
    if op in _KEYS_IN:
        if header.keys and header.width != spec.width:
            raise bad(f"row width {header.width} differs from the table's {spec.width}")
        if header.keys > spec.owned_rows:
            raise bad(f"{header.keys} keys exceed the {spec.owned_rows} rows this shard owns")
    elif header.keys:
        raise bad(f"{op.name} carries no keys but the header announces {header.keys}")
    if header.members and op not in _MEMBERS_IN:
        raise bad(f"{op.name} carries no tree members but the header announces {header.members}")
    if op == Op.INIT and (header.total != spec.total or header.rows != spec.rows):
        raise bad(f"model layout ({header.total} dense elements, {header.rows} rows) differs from the job's "
                  f"({spec.total}, {spec.rows})")


def check_reply(header: Header, request: Header, peer: str) -> None:
    """Raise ProtocolError unless ``header`` answers ``request`` (status is checked by the caller)."""
    if header.op != Op.REPLY or header.shard != request.shard or header.sender != request.shard:
        raise ProtocolError(f"{peer} answered {request.describe()} with {header.describe()} "
                            f"from server {header.sender}", peer=peer)
    op = Op(request.op)
    want = (request.count if op in _DENSE_OUT else 0, request.keys if op in _ROWS_OUT else 0)
    if header.status == Status.OK and (header.count, header.keys) != want:
        raise ProtocolError(f"{peer} answered {request.describe()} with {header.count} dense elements and "
                            f"{header.keys} rows, expected {want[0]} and {want[1]}", peer=peer)


def request_payloads(header: Header) -> list[tuple[int, torch.dtype]]:
    """(elements, dtype) of each payload tensor that follows a request header, in order."""
    op, out = Op(header.op), []
    dtype = code_dtype(header.dtype) if header.count or header.keys else torch.float32
    if op in _DENSE_IN and header.count:
        out.append((header.count, dtype))
    if op in _KEYS_IN and header.keys:
        out.append((header.keys, torch.int64))
    if op in _ROWS_IN and header.keys:
        out.append((header.keys * header.width, dtype))
    if op in _MEMBERS_IN and header.members:
        out.append((header.members * MEMBER_FIELDS, torch.int64))
    return out


def reply_payloads(request: Header) -> list[tuple[int, torch.dtype]]:
    """(elements, dtype) of each payload tensor of an OK reply to ``request``, in order."""
    op, out = Op(request.op), []
    dtype = code_dtype(request.dtype) if request.count or request.keys else torch.float32
    if op in _DENSE_OUT and request.count:
        out.append((request.count, dtype))
    if op in _ROWS_OUT and request.keys:
        out.append((request.keys * request.width, dtype))
    return out


def mark_payload(buf: torch.Tensor) -> None:
    """Put a sentinel in the last element of a receive buffer: gloo fills a buffer only as
    far as the message goes, so a message shorter than announced leaves the mark in place
    (a signalling NaN with a payload no computation produces, or a negative int64, which
    no row key is)."""
    if buf.numel():
        _bits(buf)[-1] = _PAYLOAD_MARKS[buf.element_size()]


def payload_short(buf: torch.Tensor) -> bool:
    """Whether the message received into ``buf`` was shorter than the buffer."""
    return bool(buf.numel()) and int(_bits(buf)[-1]) == _PAYLOAD_MARKS[buf.element_size()]


def _bits(buf: torch.Tensor) -> torch.Tensor:
    return buf.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[buf.element_size()])


_PAYLOAD_MARKS = {8: -0x000A_5A5A_5A5A_5A5B, 4: 0x7FA5A5A5, 2: 0x7FA5}
