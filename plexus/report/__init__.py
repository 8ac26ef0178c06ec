"""Reports of finished runs: plots and a self-contained HTML page from run directories.

``write_report(["runs/a", "runs/b"], out_dir="runs/compare")`` overlays the runs on the
same axes and writes ``index.html`` with a summary table; see ``plexus.report.html`` for
the page and ``plexus.report.plots`` for what each plot shows.
"""
from __future__ import annotations

from plexus.report.html import RunDir, load_run, run_labels, write_report
from plexus.report.plots import Plot, PlotRun, write_plots

__all__ = ["write_report", "load_run", "run_labels", "RunDir", "write_plots", "PlotRun", "Plot"]
