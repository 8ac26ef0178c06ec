"""``plexus bench``: bad input is one line on stderr and exit 2, before anything is printed
or measured; a benchmark that ran ends with the machine's speed (``plexus.bench.machine_line``)."""
from __future__ import annotations

import os
import re

import pytest

from plexus.bench import machine_line, reference_op_ms
from plexus.errors import ConfigError
from plexus.cli import main


@pytest.mark.parametrize("args, needle", [
    (["startup", "--workers", "0"], "--workers must be at least 1"),
    (["startup", "--strategies", "ps,allredux"], "unknown strategy 'allredux'"),
    (["defaults", "--workers", "0"], "--workers must be at least 1"),
    (["defaults", "--steps", "0"], "--steps must be at least 1"),
    (["defaults", "--datasets", "nope"], "unknown dataset 'nope'"),
    (["defaults", "--only", "zzz"], "matches no configuration"),
    (["simulate", "--steps", "0"], "--steps must be at least 1"),
    (["simulate", "--rows", "99"], "rows are numbered 0 to"),
    (["collectives", "--sizes", "0"], "every size must be at least 4 bytes"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, needle):
    code = main(["bench", *args])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert out == ""  # no table header, no machine line


def test_a_factory_dataset_passes_the_check_the_matrix_and_a_job_share():
    from plexus.train.data import check_dataset
    check_dataset("mypkg.data:make")  # loaded when the job runs, as with --dataset
    with pytest.raises(ConfigError, match="pass --datasets with one of digits"):
        check_dataset("nope", "--datasets")


def test_machine_line_gives_the_reference_op_before_and_after_alone_and_on_every_core():
    assert 0 < reference_op_ms(repeats=5) < 1000 and 0 < reference_op_ms(repeats=5, copies=2) < 1000
    line = machine_line(1.25)
    assert re.fullmatch(r"machine: \d+ cores?, torch \S+; reference op \(32 x 1024 by 1024 x 1024, one thread\) "
                        r"1\.25 ms before the benchmark, [0-9.]+ ms after, [0-9.]+ ms with one on each core at once",
                        line), line


def test_the_matrix_removes_its_run_directories(monkeypatch):
    """``plexus bench defaults`` trains about 80 jobs: their run directories go in a
    temporary folder that is gone once the table is done."""
    import plexus.bench.defaults as defaults
    seen = []

    def train_one(dataset, label, out, **_):
        seen.append(out)
        raise RuntimeError("not trained here")
    monkeypatch.setattr(defaults, "train_one", train_one)
    rows = list(defaults.run_matrix(["digits"], ["easgd"]))
    assert [r.label for r in rows] == [defaults.REFERENCE, "easgd"] and all(r.health == "failed" for r in rows)
    parent = os.path.dirname(seen[0])
    assert os.path.basename(parent).startswith("plexus-defaults-") and not os.path.exists(parent)
