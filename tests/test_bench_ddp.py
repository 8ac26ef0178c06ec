"""``plexus bench ddp``: one tiny run produces a row per (model, workers, algorithm)."""
from __future__ import annotations

import json
import math

import pytest

from plexus.cli import main


@pytest.mark.slow
def test_bench_ddp_rows(capsys):
    status = main(["bench", "ddp", "--models", "mlp,cnn", "--workers", "2", "--algorithms", "native,ring",
                   "--dataset", "digits", "--batch-size", "32", "--steps", "6", "--warmup", "2", "--repeats", "1",
                   "--json"])
    out = capsys.readouterr().out
    assert status == 0
    rows = json.loads(out.strip().splitlines()[-1])
    assert [(r["model"], r["workers"], r["algorithm"]) for r in rows] == [
        ("mlp", 2, "native"), ("mlp", 2, "ring"), ("cnn", 2, "native"), ("cnn", 2, "ring")]
    for row in rows:
        for key in ("ours_samples_per_s", "ddp_samples_per_s", "ratio"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["ratio"] == pytest.approx(row["ours_samples_per_s"] / row["ddp_samples_per_s"])
    assert "ours / DDP" in out  # the table


@pytest.mark.slow
def test_bench_ddp_takes_the_transport_of_our_messages(capsys):
    status = main(["bench", "ddp", "--models", "mlp", "--workers", "2", "--algorithms", "ring", "--dataset", "digits",
                   "--batch-size", "32", "--steps", "4", "--warmup", "1", "--repeats", "1", "--transport", "socket",
                   "--json"])
    assert status == 0
    [row] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["algorithm"] == "ring" and row["ratio"] > 0


@pytest.mark.parametrize("flags, word", [(["--workers", "3"], "--workers 3"), (["--models", "gpt"], "gpt"),
                                         (["--algorithms", "smoke"], "smoke"), (["--repeats", "0"], "--repeats")])
def test_bench_ddp_bad_flags(flags, word, capsys):
    assert main(["bench", "ddp", *flags]) == 2
    err = capsys.readouterr().err
    assert word in err and len(err.strip().splitlines()) == 1
