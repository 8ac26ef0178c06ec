"""Time, bandwidth, bytes and steps of every all-reduce algorithm against native.

The same as ``plexus bench collectives``; e.g.
``python benchmarks/collectives.py --procs 4 --sizes 4KB,16MB,64MB --json``.
"""
from __future__ import annotations

import argparse
import sys

from plexus.bench import collectives
from plexus.errors import PlexusError


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/collectives.py", description=__doc__.splitlines()[0])
    collectives.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return collectives.main(args)
    except PlexusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(run())
