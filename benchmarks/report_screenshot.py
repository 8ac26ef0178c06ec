"""The README's report screenshot: a seven-strategy ``plexus compare``, opened in headless
Chromium at 1,400 x 900 px.

    python benchmarks/report_screenshot.py                       # compare, then screenshot
    python benchmarks/report_screenshot.py --report runs/cmp     # screenshot an existing report

It writes ``docs/results/report.png`` (reduced to a 64-colour palette to keep it small) and
fails, naming the sizes, when the ranking table does not fit the window in full. Needs
the system package ``chromium`` (``apt-get install chromium``).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from plexus.report.screenshot import measure, screenshot

SPECS = ("ps", "ps:consistency=bsp", "tree-ps", "allreduce:algorithm=ring", "gossip", "local-sgd:period=4",
         "easgd:period=4")
JOB = ("--workers", "2", "--dataset", "digits", "--steps", "150", "--eval-every", "10", "--quiet")
WIDTH, HEIGHT = 1400, 900  # CSS px: a laptop's browser window


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", help="folder holding an index.html (default: run a new compare)")
    parser.add_argument("--out", default="docs/results/report.png", help="PNG to write")
    args = parser.parse_args()
    folder = Path(args.report) if args.report else Path(tempfile.mkdtemp(prefix="plexus-report-")) / "cmp"
    if not args.report:
        done = subprocess.run([sys.executable, "-m", "plexus.cli", "compare", *SPECS, *JOB, "--out", str(folder)])
        if done.returncode != 0:
            print(f"plexus compare failed (status {done.returncode})", file=sys.stderr)
            return done.returncode
    page = folder / "index.html"
    box = measure(page, "table.ranking", WIDTH, HEIGHT)
    png = screenshot(page, args.out, WIDTH, HEIGHT)
    from PIL import Image
    with Image.open(png) as image:
        image.convert("RGB").quantize(colors=64).save(png, optimize=True)
    print(f"screenshot: {png} ({png.stat().st_size:,} bytes); ranking table right edge {box['right']:.0f} px, "
          f"bottom {box['bottom']:.0f} px; report: {page}")
    if box["right"] > WIDTH or box["bottom"] > HEIGHT:
        print(f"the ranking table does not fit {WIDTH} x {HEIGHT} px", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
