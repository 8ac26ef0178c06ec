"""What one pipeline hand-off costs beside a micro-batch's ops: a send over a shared-memory
Link, and the receive of a message that has already arrived, for a micro-batch's
activations (rows x 1024 float32), measured warm (back to back) and right after a stage's
work (three 1024-wide matrix products, which leave the caches cold, as in a pipeline),
beside the floor: the copy into the ring and the token's write alone. Then a 1024-wide
Linear's three products at the same rows, one thread: the forward (``F.linear``, x W^T;
and the same product from a row-major copy of W^T, since some CPUs' GEMMs are slower with a
transposed operand), B's input gradient (dY W) and W's weight gradient added into an
accumulator (dY^T X), and what B's split plan (``SplitBackward``, made for every
micro-batch before its sends) costs on a stage of two and of four such layers, planned and
following the first micro-batch's plan.

    python benchmarks/hand_off.py              # about 40 seconds

Both ends live in this process (two Links over one store), so no process wakes another:
what is timed is the work of each call. Prints markdown tables, medians of 500 after
100 to warm up (200 after 20 for the products and the plan).

A third table times a hand-off between two processes, as a pipeline makes one: the sender
idles 2 ms (a stage's op, its core free), sends a 32 x 32 float32 micro-batch, and the
receiver, waiting for it all along, notes when its receive returns; the median and 90th
percentile of that delay over 250 hand-offs, once with receives that sleep in ``poll()``
until the message comes and once with receives that poll the link first (``--spin on``,
``shm_channel.set_spin``). The difference is the time a sleeping receiver takes to wake.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import multiprocessing as mp
import os
import statistics
import time

import torch
import torch.distributed as dist

from plexus.cluster.group import Link, link_pair
from plexus.cluster.shm_channel import set_spin
from plexus.cluster.traffic import Traffic
from plexus.parallel.split_backward import SplitBackward
from plexus.train.runner import SPIN_SECONDS

WIDTH = 1024
HAND_OFFS = 300


def _median_us(samples: list[float]) -> float:
    return 1e6 * statistics.median(samples[100:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,64,128", help="comma-separated rows per message (default 32,64,128)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    a, b = link_pair("shm", timeout=30)
    weight = torch.randn(WIDTH, WIDTH)
    ring = torch.empty(8 << 20, dtype=torch.uint8)
    rfd, wfd = os.pipe()
    token = bytes(48)
    print("| rows | KiB | caches | send us | receive (arrived) us | floor us (copy + token) | send / floor |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, WIDTH)
        for cold in (False, True):
            send, recv, floor = [], [], []
            for i in range(600):
                y = x
                if cold:
                    for _ in range(3):
                        y = x @ weight
                t0 = time.perf_counter()
                work = a.isend(y, a.peer_index, i % 8)
                t1 = time.perf_counter()
                into = torch.empty(rows, WIDTH)
                b.irecv(into, b.peer_index, i % 8).wait()
                t2 = time.perf_counter()
                work.wait()
                send.append(t1 - t0)
                recv.append(t2 - t1)
                if cold:
                    for _ in range(3):
                        y = x @ weight
                t0 = time.perf_counter()
                ctypes.memmove(ring.data_ptr(), y.data_ptr(), y.numel() * 4)
                os.write(wfd, token)
                floor.append(time.perf_counter() - t0)
                os.read(rfd, 48)
            s, f = _median_us(send), _median_us(floor)
            print(f"| {rows} | {rows * WIDTH * 4 // 1024} | {'after 3 matmuls' if cold else 'warm'} | {s:.1f} "
                  f"| {_median_us(recv):.1f} | {f:.1f} | {s / f:.2f} |", flush=True)
    a.close(), b.close()
    os.close(rfd), os.close(wfd)
    print()
    print("| rows | forward x W^T ms | forward from a copy of W^T ms | B: dY W ms | W: acc += dY^T X ms "
          "| forward / B |")
    print("|---:|---:|---:|---:|---:|---:|")
    bias, acc = torch.randn(WIDTH), torch.zeros(WIDTH, WIDTH)
    weight_t = weight.t().contiguous()  # the same product with both operands row-major
    for rows in (int(r) for r in args.rows.split(",")):
        x, dy = torch.randn(rows, WIDTH), torch.randn(rows, WIDTH)
        f = _time_ms(lambda: torch.nn.functional.linear(x, weight, bias))
        f_copy = _time_ms(lambda: torch.addmm(bias, x, weight_t))
        bw = _time_ms(lambda: torch.mm(dy, weight))
        w = _time_ms(lambda: acc.addmm_(dy.t(), x))
        print(f"| {rows} | {f:.3f} | {f_copy:.3f} | {bw:.3f} | {w:.3f} | {f / bw:.2f} |", flush=True)
    print()
    print("| Linear + ReLU layers in the stage | B's split plan us (SplitBackward, before its sends) "
          "| following the first micro-batch's plan us |")
    print("|---:|---:|---:|")
    for layers in (2, 4):
        print(f"| {layers} | {1e3 * _plan_ms(layers, False):.0f} | {1e3 * _plan_ms(layers, True):.0f} |", flush=True)
    print()
    print("| receive waits by | hand-off median us | p90 us |")
    print("|---|---:|---:|")
    for label, spin in (("sleeping in poll()", 0.0), ("polling the link first (--spin on)", SPIN_SECONDS)):
        got = _hand_offs(spin)
        print(f"| {label} | {statistics.median(got):.0f} | {got[int(0.9 * len(got))]:.0f} |", flush=True)


def _receiver(port: int, spin: float, delays) -> None:
    """The receiving process of ``_hand_offs``: each delay, in us, from the sender's stamp
    before its send to the end of the receive here."""
    torch.set_num_threads(1)
    set_spin(spin)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=dt.timedelta(seconds=60))
    link = Link(store, "b", "a", traffic=Traffic(), timeout=60, transport="shm")
    value, stamp, got = torch.empty(32, 32), torch.empty(1, dtype=torch.float64), []
    for _ in range(HAND_OFFS):
        link.recv_from_peer(value, 1)
        arrived = time.time()
        link.recv_from_peer(stamp, 2)
        got.append(1e6 * (arrived - stamp.item()))
        link.send_to_peer(stamp, 3)  # the next op starts after this one's hand-off
    delays.put(got)
    link.close()


def _hand_offs(spin: float) -> list[float]:
    """One-way hand-off delays, in us, between this process and a receiver (``_receiver``)
    that waits with ``set_spin(spin)``."""
    set_spin(spin)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=dt.timedelta(seconds=60), wait_for_workers=False)
    context = mp.get_context("spawn")
    delays = context.Queue()
    child = context.Process(target=_receiver, args=(store.port, spin, delays))
    child.start()
    link = Link(store, "a", "b", traffic=Traffic(), timeout=60, transport="shm")
    value, stamp = torch.randn(32, 32), torch.empty(1, dtype=torch.float64)
    for _ in range(HAND_OFFS):
        time.sleep(0.002)
        stamp[0] = time.time()
        link.send_to_peer(value, 1)
        link.send_to_peer(stamp, 2)
        link.recv_from_peer(stamp, 3)
    got = delays.get(timeout=60)
    child.join(timeout=30)
    link.close()
    set_spin(0.0)
    return sorted(got[50:])


def _plan_ms(layers: int, follow: bool, rows: int = 32) -> float:
    """The median time of one micro-batch's SplitBackward plan (zb-h1's B, and the
    B-then-W backward of a stage of Linears) over a stage of ``layers`` Linear + ReLU
    layers, on a fresh graph each time as each micro-batch makes one (its forward not
    timed): planned, or (``follow``) following the first micro-batch's plan, as the
    executor's later micro-batches do (``SplitBackward.template``)."""
    stage = torch.nn.Sequential(*(m for _ in range(layers) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())))
    params = list(stage.parameters())
    samples, template = [], None
    for _ in range(220):
        x = torch.randn(rows, WIDTH, requires_grad=True)
        out = stage(x)
        seed = torch.ones_like(out)
        t0 = time.perf_counter()
        plan = SplitBackward([out], [seed], [x], params, template)
        samples.append(time.perf_counter() - t0)
        if follow and template is None:
            template = plan.template
    return 1e3 * statistics.median(samples[20:])


def _time_ms(op) -> float:
    for _ in range(20):
        op()
    samples = []
    for _ in range(200):
        t0 = time.perf_counter()
        op()
        samples.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(samples)


if __name__ == "__main__":
    main()
