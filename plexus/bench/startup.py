"""``plexus bench startup``: how long until the first training step, against ``import torch``.

Every row runs ``plexus train --strategy S --workers P --steps 1 --log-every 1`` as a
subprocess, as a user would, and measures from outside:

- **time to first step**: from the moment the ``plexus train`` command is started to the
  moment worker 0's first ``train`` event (written when its step 1 has finished: forward,
  backward and the strategy's exchange) appears in ``metrics.jsonl``, which this process
  watches every 5 ms;
- **command**: the wall time of the whole command, until it exits (summary, report and
  shutdown included).

The reference is ``python -c "import torch"`` in a fresh interpreter, measured in the same
run, interleaved with the rows, so that both see the same load; each figure is the median
over ``--repeats`` rounds. The goal (issue 19): time to first step <= 2x one torch import
at 4 workers.

    plexus bench startup                          # ps and allreduce at 1, 2 and 4 workers
    plexus bench startup --repeats 5 --workers 4 --strategies ps
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Timing", "time_torch_import", "time_first_step", "add_arguments", "main"]

# How often the run directory is checked for the first step, in seconds: small against the
# seconds measured, and cheap (one stat per check).
_WATCH_EVERY = 0.005
GOAL = 2.0  # time to first step at 4 workers / one torch import


@dataclass(frozen=True)
class Timing:
    """One run of ``plexus train --steps 1``, in seconds from the command's start."""

    first_step: float | None  # None: no step was logged (the run failed)
    command: float
    status: int


def time_torch_import(python: str = sys.executable) -> float:
    """Wall seconds of ``python -c "import torch"`` in a fresh interpreter."""
    started = time.perf_counter()
    subprocess.run([python, "-c", "import torch"], check=True, stdin=subprocess.DEVNULL)
    return time.perf_counter() - started


def _first_step_logged(path: Path, seen: int) -> tuple[bool, int]:
    """(whether worker 0's first train event is in ``path``, bytes looked at so far)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False, seen
    if size == seen:
        return False, seen
    text = path.read_bytes()
    for line in text[: text.rfind(b"\n") + 1].splitlines():
        event = json.loads(line)
        if event.get("event") == "train" and event.get("worker") == 0:
            return True, size
    return False, size


def time_first_step(strategy: str, workers: int, out: Path, extra: list[str] | None = None,
                    python: str = sys.executable, timeout: float = 300.0) -> Timing:
    """Run ``plexus train --strategy ... --steps 1`` into ``out`` (a new directory) and time
    it (see the module docstring for what is measured)."""
    argv = [python, "-m", "plexus.cli", "train", "--strategy", strategy, "--workers", str(workers), "--steps", "1",
            "--log-every", "1", "--out", str(out), *(extra or [])]
    metrics = out / "metrics.jsonl"
    first = None
    seen = 0
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while proc.poll() is None:
            if first is None:
                logged, seen = _first_step_logged(metrics, seen)
                if logged:
                    first = time.perf_counter() - started
            if time.perf_counter() - started > timeout:
                proc.kill()
                break
            time.sleep(_WATCH_EVERY)
        proc.wait()
        command = time.perf_counter() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if first is None and proc.returncode == 0:
        first = command  # the last lines were written just before exit, between two looks
    if proc.returncode != 0:
        err = proc.stderr.read().decode(errors="replace").strip().splitlines() if proc.stderr else []
        print(f"plexus bench startup: {strategy} at {workers} workers failed (status {proc.returncode}): "
              f"{err[-1] if err else ''}", file=sys.stderr)
    if proc.stderr:
        proc.stderr.close()
    return Timing(first_step=first, command=command, status=proc.returncode)


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4],
                        help="worker counts, comma-separated (default 1,2,4)")
    parser.add_argument("--strategies", type=lambda s: s.split(","), default=["ps", "allreduce"],
                        help="strategies, comma-separated (default ps,allreduce)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each figure is the median (default 3)")
    parser.add_argument("--json", action="store_true", help="also print the rows as one JSON line")


def main(args: argparse.Namespace) -> int:
    from plexus.errors import ConfigError
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}: pass --repeats 3")
    if min(args.workers) < 1:
        raise ConfigError(f"--workers must be at least 1, got {min(args.workers)}: pass --workers 1,2,4")
    from plexus.config.applies import check_strategy
    for strategy in args.strategies:
        check_strategy(strategy)
    cases = [(s, p) for s in args.strategies for p in args.workers]
    imports: list[float] = []
    runs: dict[tuple[str, int], list[Timing]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory(prefix="plexus-startup-") as root:
        for round_ in range(args.repeats):
            # Interleaved, so that the reference and the rows share the same load.
            imports.append(time_torch_import())
            for strategy, workers in cases:
                out = Path(root) / f"{strategy}-{workers}-{round_}"
                runs[(strategy, workers)].append(time_first_step(strategy, workers, out))
    torch_s = statistics.median(imports)
    print(f"plexus bench startup, {time.strftime('%Y-%m-%d')}: plexus train --steps 1 --log-every 1 on digits, "
          f"median of {args.repeats}; reference python -c \"import torch\": {torch_s:.2f} s "
          f"(range {min(imports):.2f}-{max(imports):.2f}); {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| strategy | workers | time to first step (s) | / torch import | command (s) | / torch import |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    missed = False
    for strategy, workers in cases:
        timings = runs[(strategy, workers)]
        first = _median([t.first_step for t in timings])
        command = _median([t.command for t in timings])
        first_text = "failed" if first is None else f"{first:.2f}"
        ratio = "–" if first is None else f"{first / torch_s:.2f}"
        print(f"| {strategy} | {workers} | {first_text} | {ratio} | {command:.2f} | {command / torch_s:.2f} |")
        rows.append({"strategy": strategy, "workers": workers, "first_step_seconds": first,
                     "command_seconds": command, "torch_import_seconds": torch_s,
                     "runs": [asdict(t) for t in timings]})
        if workers == 4 and (first is None or first / torch_s > GOAL):
            missed = True
    if 4 in args.workers:
        print(f"\ngoal: time to first step <= {GOAL:g}x one torch import at 4 workers: "
              f"{'missed' if missed else 'met'}")
    if args.json:
        print(json.dumps({"torch_import_seconds": torch_s, "torch_imports": imports, "rows": rows}))
    return 0
