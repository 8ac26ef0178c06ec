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
    args = parser.parse_args()
    before = reference_op_ms()
    schedules = [s for s in args.schedules.split(",") if s]
    # interleaved: 2 chunks per process, and only where M is a multiple of K (whole rounds).
    cases = [(k, m, schedule) for k in (int(k) for k in args.stages.split(",")) for m in (4, 8)
             for schedule in schedules
             if schedule != "interleaved" or m % k == 0]
    lines = ["| stages | micro-batches | schedule | bubble predicted | simulated with measured op costs "
             "| replayed with each op's own duration | bubble measured | per stage | of it, starting sends "
             "| gap to predicted | most micro-batches held | step ms "
             "| backward (after its sends) / W op ms per stage |",
             "|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for k, m, schedule in cases:
            runs = [plexus.run({**BASE, "hidden": args.hidden, "batch_size": args.batch_size,
                                "stages": k, "microbatches": m, "schedule": schedule,
                                **({"chunks": 2} if schedule == "interleaved" else {}),
                                "out": str(Path(tmp) / f"{k}-{m}-{schedule}-{r}")}) for r in range(args.repeat)]
            s = sorted(runs, key=lambda run: run["pipeline"]["bubble_measured"])[len(runs) // 2]  # the median run
            p = s["pipeline"]
            per_stage = " / ".join(f"{x['bubble']:.3f}" for x in s["stages"])
            sends = sum(x["send_seconds"] / x["pipeline_seconds"] for x in s["stages"]) / len(s["stages"])
            lines.append(f"| {k} | {m} | {schedule} | {p['bubble_predicted']:.3f} | {p['bubble_simulated']:.3f} "
                         f"| {p['bubble_replayed']:.3f} | {p['bubble_measured']:.3f} "
                         f"| {per_stage} | {sends:.3f} | {p['bubble_measured'] - p['bubble_predicted']:+.3f} "
                         f"| {' / '.join(str(x['max_in_flight']) for x in s['stages'])} "
                         f"| {1000 * s['wall_seconds'] / s['steps']:.1f} "
                         f"| {' / '.join(_ops(x) for x in s['stages'])} |")
            print(lines[-1], file=sys.stderr)
    print("\n".join(lines))
    print(f"\n{machine_line(before)}")


if __name__ == "__main__":
    main()
