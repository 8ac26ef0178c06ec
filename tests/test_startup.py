"""Fast start-up (issue 19, item 6): what the path to the first step no longer pays, and
``plexus bench startup``, which measures it against ``import torch``."""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import numpy as np
import pytest

PY = sys.executable
ENV = {**os.environ, "MPLCONFIGDIR": os.environ.get("MPLCONFIGDIR", "/tmp/plexus-mpl")}


def test_digits_load_without_importing_sklearn():
    """sklearn's import (scipy.stats and more) cost more than torch's on the way to the
    first step of every digits run; the data is the same CSV load_digits reads."""
    code = ("import sys; from plexus.train.data import _digits_arrays; x, y = _digits_arrays(); "
            "print(x.shape, y.shape, 'sklearn' in sys.modules)")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["(1797,", "64)", "(1797,)", "False"]
    from sklearn.datasets import load_digits
    from plexus.train.data import _digits_arrays
    x, y = _digits_arrays()
    bunch = load_digits()
    assert np.array_equal(x, bunch.data) and np.array_equal(y, bunch.target) and y.dtype == np.int64


@pytest.mark.parametrize("flags, says", [
    (["--strategy", "nope"], "unknown strategy 'nope'"),
    (["--workers", "3", "--batch-size", "64"], "batch_size"),
])
def test_a_bad_configuration_is_reported_before_torch_is_imported(flags, says):
    """A mistake in the configuration costs the user a line, not torch's import (3 s of
    CPU here): plexus train checks names and values first."""
    code = ("import sys, plexus.cli; rc = plexus.cli.main(['train', *sys.argv[1:]]); "
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([PY, "-c", code, *flags], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def _records_dynamo() -> int:
    """A child: says whether torch._dynamo came with the fork (imported by the warm-up) and
    builds an optimizer, which needs it."""
    import torch
    already = "torch._dynamo" in sys.modules
    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    print(f"dynamo before the optimizer: {already}")
    return 0


def test_the_launcher_imports_torch_dynamo_once_for_every_child_and_job():
    """torch.optim imports torch._dynamo on first use, which costs as much as torch itself;
    each child paid it on its own, all at once, on the path to the first step, and then
    each job's fork server once. Run in a fresh interpreter, so that this test process's
    own imports do not count."""
    script = (f"import io, sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
              "import torch; assert 'torch._dynamo' not in sys.modules\n"
              "from plexus.cluster.launcher import RoleSpec, launch\n"
              "from plexus.train.process import warm\n"
              "from test_startup import _records_dynamo\n"
              "sink = io.StringIO()\n"
              "status = launch([sys.executable], [RoleSpec('worker', r) for r in range(2)], sink=sink,\n"
              "                entry=_records_dynamo, warm=warm)\n"
              "print(status); print(sink.getvalue()); print('launcher has dynamo', 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, env={**ENV, "PLEXUS_START": "fork"},
                         timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "0", out.stdout
    assert out.stdout.count("dynamo before the optimizer: True") == 2, out.stdout
    # Paid in the launcher, before it forks the fork server: a later job of the same process
    # pays nothing (plexus compare, the Python API).
    assert "launcher has dynamo True" in out.stdout


@pytest.mark.slow
def test_bench_startup_prints_the_table_with_ratios(tmp_path):
    out = subprocess.run([PY, "-m", "plexus.cli", "bench", "startup", "--workers", "1", "--strategies", "allreduce",
                          "--repeats", "1", "--json"], capture_output=True, text=True, env=ENV, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("| allreduce | 1 | ") for line in lines), out.stdout
    data = json.loads(lines[-1])
    (row,) = data["rows"]
    assert data["torch_import_seconds"] > 0
    # Measured from outside: the first step comes after the command starts and before it ends.
    assert 0 < row["first_step_seconds"] <= row["command_seconds"]
    # The machine's speed before and after, on stderr (stdout's last line is the JSON).
    assert re.search(r"reference op .* [0-9.]+ ms before the benchmark, [0-9.]+ ms after", out.stderr), out.stderr

