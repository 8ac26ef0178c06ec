"""The pipeline bubble, measured against each schedule's closed form: deep-mlp (hidden
1024, batch 256, one thread per process) cut into K stages, M micro-batches, 40 steps.

    python benchmarks/pipeline_bubble.py        # about a minute
    python benchmarks/pipeline_bubble.py --schedules 1f1b,zb-h1
    python benchmarks/pipeline_bubble.py --schedules 1f1b,interleaved   # --chunks 2

Prints the markdown table of docs/results/pipeline.md. *Simulated*: the schedule in
virtual time with each stage's mean op costs, communication free; *replayed*: the same with
each op's own duration in the last steps (the summary's ``bubble_replayed``), so that what
the measured bubble adds to it is the time from an op's end to its dependent's start, not
the ops' costs or how much they vary. *Of it, starting sends*: the
share of the pipelined time the stages spent in their send calls (``send_seconds``: the
transport's copy of each message; receiving an arrived one costs about as much, see
``benchmarks/hand_off.py``), averaged over the stages. The last column is each stage's
mean micro-batch backward (in brackets the part after it sent its input gradients: the
weight gradients' addition, which the previous stage does not wait for) and, under zb-h1,
its W (weight gradient) apart, in ms.
``--hidden H`` widens the model (ops cost more, a hand-off the same); ``--batch-size B``
gives each micro-batch B / M rows (ops and hand-offs both grow with it).
``--stages 2`` keeps the rows of two stages (a machine with two cores cannot give three
stage processes a core each); ``--repeat N`` runs each row N times and prints the run
whose measured bubble is the median.
``--spin off,on`` gives each row once per --spin setting, their runs alternating: whether
receives that poll before they sleep shorten the hand-offs on this machine's cores.
``--op-ms F,B,W`` pads every op to at least those milliseconds (``PLEXUS_PIPELINE_OP_MS``),
its core asleep for the rest: with ``--hidden 32`` the ops cost what the padding says on
any machine, so the closed form's equal costs hold and a gap is what the executor and its
hand-offs add; the stage processes need no free core each (three stages run on two).

    python benchmarks/pipeline_bubble.py --hidden 32 --op-ms 4,4,4 --schedules 1f1b,zb-h1 --spin off,on
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mpl"))
os.environ.setdefault("PLEXUS_NO_REPORT", "1")

import plexus  # noqa: E402
from plexus.bench import machine_line, reference_op_ms  # noqa: E402
from plexus.config import SPIN_MODES  # noqa: E402
from plexus.errors import ConfigError  # noqa: E402
from plexus.parallel.executor import op_padding  # noqa: E402

BASE = dict(dataset="digits", model="deep-mlp", hidden=1024, batch_size=256, threads=1, steps=40, eval_every=0,
            device="cpu", backend="gloo",
            quiet=True, seed=1)


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{1000 * seconds:.1f}"


def _ops(stage: dict) -> str:
    """A stage's mean micro-batch backward in ms (in brackets the part after its sends),
    and under zb-h1 its W after a +."""
    w, after = stage.get("weight_op_seconds"), stage.get("backward_after_send_seconds")
    return _ms(stage["backward_op_seconds"]) + (f" ({_ms(after)})" if after else "") + \
        ("" if w is None else f" + {_ms(w)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated schedules (default gpipe,1f1b)")
    parser.add_argument("--stages", default="2,3", help="comma-separated stage counts (default 2,3)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each row; the table gives their median")
    parser.add_argument("--hidden", type=int, default=BASE["hidden"],
                        help=f"deep-mlp's width (default {BASE['hidden']}); each op's cost grows as its square")
    parser.add_argument("--batch-size", type=int, default=BASE["batch_size"],
                        help=f"the global batch (default {BASE['batch_size']}); a micro-batch is batch / M rows")
    parser.add_argument("--spin", default="auto",
                        help="comma-separated --spin settings, each a row, their runs alternating (default auto)")
    parser.add_argument("--op-ms", default="", metavar="F,B,W",
                        help="pad each forward, input-gradient and weight-gradient op to at least F, B and W ms "
                             "(PLEXUS_PIPELINE_OP_MS): equal ops of known cost, with --hidden 32 to keep the "
                             "computing under them small")
    args = parser.parse_args()
    spins = [s for s in args.spin.split(",") if s]
    if not spins or any(s not in SPIN_MODES for s in spins):
        parser.error(f"--spin takes auto, on or off, comma-separated; got {args.spin!r}")
    try:
        op_padding(args.op_ms)
    except ConfigError as exc:
        parser.error(str(exc).replace("PLEXUS_PIPELINE_OP_MS", "--op-ms"))
    if args.op_ms:
        os.environ["PLEXUS_PIPELINE_OP_MS"] = args.op_ms  # the jobs' processes inherit it
    before = reference_op_ms()
    schedules = [s for s in args.schedules.split(",") if s]
    # interleaved: 2 chunks per process, and only where M is a multiple of K (whole rounds).
    cases = [(k, m, schedule) for k in (int(k) for k in args.stages.split(",")) for m in (4, 8)
             for schedule in schedules
             if schedule != "interleaved" or m % k == 0]
    lines = ["| stages | micro-batches | schedule | spin | bubble predicted | simulated with measured op costs "
             "| replayed with each op's own duration | bubble measured | per stage | of it, starting sends "
             "| gap to predicted | most micro-batches held | step ms "
             "| backward (after its sends) / W op ms per stage |",
             "|---:|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for k, m, schedule in cases:
            runs: dict[str, list[dict]] = {spin: [] for spin in spins}
            for r in range(args.repeat):
                for spin in spins:
                    runs[spin].append(plexus.run({
                        **BASE, "hidden": args.hidden, "batch_size": args.batch_size, "stages": k, "microbatches": m,
                        "schedule": schedule, "spin": spin, **({"chunks": 2} if schedule == "interleaved" else {}),
                        "out": str(Path(tmp) / f"{k}-{m}-{schedule}-{spin}-{r}")}))
            for spin in spins:
                lines.append(_row(k, m, schedule, spin, runs[spin]))
                print(lines[-1], file=sys.stderr)
    print("\n".join(lines))
    print(f"\n{machine_line(before)}")


def _row(k: int, m: int, schedule: str, spin: str, runs: list[dict]) -> str:
    """The table's row of the run whose measured bubble is the median of ``runs``."""
    s = sorted(runs, key=lambda run: run["pipeline"]["bubble_measured"])[len(runs) // 2]
    p = s["pipeline"]
    per_stage = " / ".join(f"{x['bubble']:.3f}" for x in s["stages"])
    sends = sum(x["send_seconds"] / x["pipeline_seconds"] for x in s["stages"]) / len(s["stages"])
    return (f"| {k} | {m} | {schedule} | {spin} | {p['bubble_predicted']:.3f} | {p['bubble_simulated']:.3f} "
            f"| {p['bubble_replayed']:.3f} | {p['bubble_measured']:.3f} "
            f"| {per_stage} | {sends:.3f} | {p['bubble_measured'] - p['bubble_predicted']:+.3f} "
            f"| {' / '.join(str(x['max_in_flight']) for x in s['stages'])} "
            f"| {1000 * s['wall_seconds'] / s['steps']:.1f} "
            f"| {' / '.join(_ops(x) for x in s['stages'])} |")


if __name__ == "__main__":
    main()
