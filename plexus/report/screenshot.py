"""A PNG of a report page, taken by headless Chromium (the system package ``chromium``).

Used by ``benchmarks/report_screenshot.py`` (the README's screenshot) and by the test that
checks the ranking table fits a 1,400 px window. Chromium runs with no network services,
no sandbox (containers rarely allow one) and a throw-away profile, so it leaves nothing
behind and needs nothing from outside the machine.
"""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from plexus.errors import ConfigError

__all__ = ["find_chromium", "screenshot", "measure"]

_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> str | None:
    """The path of a Chromium binary on PATH, or None."""
    return next((path for name in _NAMES if (path := shutil.which(name))), None)


def _run(args: list[str], width: int, height: int, timeout: float) -> subprocess.CompletedProcess:
    browser = find_chromium()
    if browser is None:
        raise ConfigError("no Chromium on PATH: install the system package (apt-get install chromium) "
                          "to take a screenshot of the report")
    with tempfile.TemporaryDirectory(prefix="plexus-chromium-") as profile:
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={width},{height}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def measure(page: str | Path, selector: str, width: int = 1400, height: int = 900,
            timeout: float = 60.0) -> dict[str, float]:
    """The bounding box (CSS px: left, top, right, bottom, width, height) of the first
    element matching ``selector`` once ``page`` is laid out at ``width`` x ``height``, and
    the page's own scroll width (``page_width``): measured by a script in a copy of the
    page, whose result Chromium's ``--dump-dom`` prints."""
    page = Path(page).resolve()
    probe = page.with_name(f".measure-{page.name}")
    script = ("<script>window.addEventListener('load',function(){var e=document.querySelector(%s);"
              "var r=e?e.getBoundingClientRect():null;var o=document.createElement('pre');o.id='plexus-measure';"
              "o.textContent=JSON.stringify(r?{left:r.left,top:r.top,right:r.right,bottom:r.bottom,width:r.width,"
              "height:r.height,page_width:document.documentElement.scrollWidth}:null);"
              "document.body.appendChild(o);});</script>" % json.dumps(selector))
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", script + "</body>"), encoding="utf-8")
    try:
        done = _run(["--virtual-time-budget=5000", "--dump-dom", probe.as_uri()], width, height, timeout)
    finally:
        probe.unlink(missing_ok=True)
    found = re.search(r'<pre id="plexus-measure">(.*?)</pre>', done.stdout, re.S)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"chromium could not lay out {page} (status {done.returncode})")
    box = json.loads(html.unescape(found.group(1)))
    if box is None:
        raise RuntimeError(f"{page} has no element matching {selector!r}")
    return box


def screenshot(page: str | Path, png: str | Path, width: int = 1400, height: int = 900,
               timeout: float = 60.0) -> Path:
    """Render ``page`` (an HTML file) at ``width`` x ``height`` CSS pixels into ``png``."""
    page, png = Path(page).resolve(), Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    done = _run([f"--screenshot={png}", page.as_uri()], width, height, timeout)
    if done.returncode != 0 or not png.is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"chromium could not screenshot {page} (status {done.returncode}): {last}")
    return png
