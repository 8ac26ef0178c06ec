"""All-reduce algorithms, gossip and a two-stage pipeline across two real hosts on a shaped
link, against the link's bound and against ``--net`` emulation on one host.

Two network namespaces on a bridge (``tests/netns.py``: own address, host name and
/dev/shm each), every host's link shaped with tbf to ``--rate``, one torchrun node per
host with one process each. The model is an MLP of width 1024 on digits (about 4.5 MB of
float32 gradients), so each step moves megabytes over the link. For each
configuration the table gives the time per step, the bytes each worker sent per step, the
time those bytes take at the link's rate (the bound), the bound over the measured time,
and the same job on one host with ``--net bandwidth=RATE`` (every send delayed by its
size over the rate).

    sudo python benchmarks/two_hosts.py                 # root: it makes network namespaces
    python benchmarks/two_hosts.py --rate 50mbit --steps 40
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mpl"))

import netns  # noqa: E402

CONFIGS = {
    "allreduce ring": ["--strategy", "allreduce", "--algorithm", "ring"],
    "allreduce native (gloo)": ["--strategy", "allreduce", "--algorithm", "native"],
    "allreduce rhd": ["--strategy", "allreduce", "--algorithm", "rhd"],
    "allreduce ps (reduce-scatter)": ["--strategy", "allreduce", "--algorithm", "ps"],
    "allreduce auto": ["--strategy", "allreduce", "--algorithm", "auto"],
    "gossip ring": ["--strategy", "gossip"],
    "local-sgd --period 8": ["--strategy", "local-sgd", "--period", "8"],
    # One replica cut in two, a stage per host: activations and their gradients cross the
    # link, not the weights' gradients.
    "pipeline, a stage per host (--stages 2 --microbatches 8)": ["--stages", "2", "--microbatches", "8"],
}
_RATES = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}


def _rate_bytes(rate: str) -> float:
    for unit, scale in _RATES.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise SystemExit(f"--rate must end in kbit, mbit or gbit, got {rate!r}")


def two_hosts(flags: list[str], rate: str, out: Path, port: int) -> dict:
    env = {**os.environ, "PLEXUS_TOKEN": "two-hosts"}
    with netns.hosts(2, rate=rate) as found:
        master = found[0].address
        procs = [netns.on_host(host, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                      "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", master,
                                      "--master-port", str(port), "-m", "plexus.cli", "train", *flags, "--host",
                                      master, "--quiet", "--json", "--out", str(out)],
                               env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for node, host in enumerate(found)]
        try:
            results = [p.communicate(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
    for p, (_, err) in zip(procs, results):
        if p.returncode != 0:
            raise SystemExit(f"two-host run {flags} failed:\n{err[-2000:]}")
    return json.loads(next(r[0] for r in results if r[0].strip()).strip().splitlines()[-1])


def one_host(flags: list[str], rate: str, out: Path) -> dict:
    workers = "1" if "--stages" in flags else "2"  # two processes: 2 workers, or one replica's 2 stages
    done = subprocess.run([sys.executable, "-m", "plexus.cli", "train", *flags, "--workers", workers, "--net",
                           f"bandwidth={rate}", "--quiet", "--json", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"one-host run {flags} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _most_sent(summary: dict) -> int:
    """The most bytes one process sent: a worker, or a stage (its hand-offs and its stage
    group's synchronisation; a replica's figure sums its stages)."""
    if summary.get("stages"):
        return max(s["bytes_sent"] + s["sync_bytes_sent"] for s in summary["stages"])
    return max(b for b in summary["bytes_sent_per_worker"] if b is not None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit", help="tbf rate of each host's link (default 100mbit)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--only", default="", help="run the configurations whose label contains this")
    args = parser.parse_args()
    if netns.skip_reason():
        raise SystemExit(f"cannot make hosts here: {netns.skip_reason()}")
    rate = _rate_bytes(args.rate)
    common = ["--dataset", "digits", "--model", "mlp", "--hidden", "1024", "--steps", str(args.steps),
              "--eval-every", "0", "--timeout", "120"]
    rows = ["| configuration | s per step, 2 hosts | KB sent per process per step | link bound (s) | "
            "bound / measured | s per step, --net on one host | two hosts / --net |", "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, flags) in enumerate(CONFIGS.items()):
            if args.only not in label:
                continue
            multi = two_hosts([*flags, *common], args.rate, Path(tmp) / f"m{i}", 29600 + i)
            local = one_host([*flags, *common], args.rate, Path(tmp) / f"l{i}")
            steps = multi["steps"] if multi["steps_kind"] == "global" else multi["steps"] / multi["workers"]
            per_step = multi["wall_seconds"] / steps
            sent = _most_sent(multi) / steps
            bound = sent / rate
            local_steps = local["steps"] if local["steps_kind"] == "global" else local["steps"] / local["workers"]
            local_step = local["wall_seconds"] / local_steps
            chose = f" (chose {', '.join(multi['auto_chose'])})" if multi.get("auto_chose") else ""
            rows.append(f"| {label}{chose} | {per_step:.4f} | {sent / 1e3:.0f} | {bound:.4f} | {bound / per_step:.2f} | "
                        f"{local_step:.4f} | {per_step / local_step:.2f} |")
            print(rows[-1], flush=True)
    text = "\n".join([
        "# Two hosts on a shaped link", "",
        f"Measured {time.strftime('%Y-%m-%d')} on this machine (2 cores) with `python benchmarks/two_hosts.py "
        f"--rate {args.rate} --steps {args.steps}`: two network namespaces on a bridge, each host's link shaped "
        f"with tbf to {args.rate}, torchrun with one node and one process per host; digits, an MLP of width "
        f"1024 (about 4.5 MB of gradients). The bound is the most bytes one process sent per step over the "
        f"link's rate.",
        "", *rows, ""])
    print(text)
    if not args.no_write:
        (ROOT / "docs" / "results" / "two-hosts.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
