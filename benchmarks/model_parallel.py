"""Model parallelism measured: every data-parallel strategy over 2 replicas x 2 stages
against the same strategy over 2 whole-model workers (each with its own defaults, equal
steps), and tensor-parallel splits against their predicted traffic and one process.

    python benchmarks/model_parallel.py          # about two minutes

Prints two markdown tables (the ones in docs/results/model-parallel.md).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mpl"))
os.environ.setdefault("PLEXUS_NO_REPORT", "1")

import torch  # noqa: E402

import plexus  # noqa: E402

BASE = dict(dataset="digits", quiet=True, eval_every=0, seed=1)
STRATEGIES = [
    ("allreduce", {"strategy": "allreduce"}),
    ("ps bsp, 2 servers", {"strategy": "ps", "consistency": "bsp", "servers": 2}),
    ("ps asp, 2 servers", {"strategy": "ps", "consistency": "asp", "servers": 2}),
    ("tree-ps", {"strategy": "tree-ps"}),
    ("gossip", {"strategy": "gossip"}),
    ("local-sgd", {"strategy": "local-sgd"}),
    ("easgd", {"strategy": "easgd"}),
]
# (label, flags): one process against T-way and K x T splits, plain SGD so that they agree.
ORACLE = dict(optimizer="sgd", momentum=0.0, lr=0.05, batch_size=32, steps=20, hidden=32, save_model=True, seed=5)
SPLITS = [
    ("mlp, --tensor-parallel 2", {"model": "mlp", "tensor_parallel": 2}),
    ("cnn, --tensor-parallel 2", {"model": "cnn", "tensor_parallel": 2}),
    ("deep-mlp, --stages 2 --tensor-parallel 2", {"model": "deep-mlp", "stages": 2, "tensor_parallel": 2}),
]


def _run(root: Path, name: str, **flat) -> tuple[dict, float]:
    start = time.time()
    summary = plexus.run({**BASE, **flat, "out": str(root / name)})
    return summary, time.time() - start


def _servers(summary: dict) -> str:
    matrix = summary.get("stage_server_traffic")
    if not matrix:
        return "-"
    return "; ".join(f"{stage} → {', '.join(row)}" for stage, row in matrix.items())


def hybrid_table(root: Path) -> list[str]:
    lines = ["| strategy | whole model, 2 workers: accuracy | 2 replicas x 2 stages: accuracy | ratio | steps "
             "| processes | cut-edge MiB | stage groups' sync MiB | each stage's servers | wall s (whole / cut) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for label, flags in STRATEGIES:
        flat, t_flat = _run(root, f"{label}-flat", **flags, workers=2)
        cut, t_cut = _run(root, f"{label}-cut", **flags, workers=2, stages=2)
        edges = sum(s["bytes_sent"] for s in cut["stages"]) / 2**20
        sync = sum(g["bytes_sent"] for g in cut["stage_groups"]) / 2**20
        ratio = cut["final_test_accuracy"] / flat["final_test_accuracy"]
        lines.append(f"| {label} | {flat['final_test_accuracy']:.4f} | {cut['final_test_accuracy']:.4f} | {ratio:.3f} "
                     f"| {cut['steps']} | {cut['processes']} | {edges:.2f} | {sync:.2f} | {_servers(cut)} "
                     f"| {t_flat:.1f} / {t_cut:.1f} |")
        print(lines[-1], file=sys.stderr)
    return lines


def split_table(root: Path) -> list[str]:
    lines = ["| split | processes | largest relative difference from one process (20 steps) "
             "| collectives' bytes per process, measured | predicted | cut-edge traffic = plan |",
             "|---|---:|---:|---:|---:|---|"]
    for label, flags in SPLITS:
        plexus.run({**BASE, **ORACLE, "model": flags["model"], "out": str(root / f"{label}-one")})
        split = plexus.run({**BASE, **ORACLE, **flags, "out": str(root / label)})
        want = torch.load(root / f"{label}-one" / "model.pt", weights_only=True)
        got = torch.load(root / label / "model.pt", weights_only=True)
        worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
        measured = sorted({s["tensor_bytes_sent"] for s in split["stages"]})
        predicted = sorted({s["predicted_tensor_bytes"] for s in split["stages"]})
        lines.append(f"| {label} | {split['processes']} | {worst:.1e} | {' / '.join(f'{b:,}' for b in measured)} "
                     f"| {' / '.join(f'{b:,}' for b in predicted)} | {split['traffic_matches_plan']} |")
        print(lines[-1], file=sys.stderr)
    return lines


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("\n".join(hybrid_table(root)))
        print()
        print("\n".join(split_table(root)))


if __name__ == "__main__":
    main()
