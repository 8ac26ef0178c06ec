"""``plexus bench pipeline``: one tiny run gives a row per (K, M, schedule) with numbers
on our side and, on torch's, numbers or the line that says why there are none."""
from __future__ import annotations

import json
import math

import pytest

from plexus.cli import main


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_bench_pipeline_rows(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps the ten headers at 80 columns
    status = main(["bench", "pipeline", "--hidden", "32", "--batch-size", "32", "--stages", "2",
                   "--microbatches", "4", "--schedules", "gpipe,1f1b", "--steps", "4", "--warmup", "2",
                   "--repeats", "1", "--timeout", "120", "--json"])
    out = capsys.readouterr().out
    assert status == 0
    rows = json.loads(out.strip().splitlines()[-1])
    assert [(r["schedule"], r["stages"], r["microbatches"]) for r in rows] == [("gpipe", 2, 4), ("1f1b", 2, 4)]
    for row in rows:
        assert row["plexus_error"] is None, row
        assert _positive(row["plexus_samples_per_s"]) and 0 <= row["plexus_bubble"] < 1, row
        assert row["plexus_bubble_predicted"] == pytest.approx(1 / 5)  # (K-1)/(M+K-1)
        assert len(row["plexus_peak_mib"]) == 2 and all(_positive(b) for b in row["plexus_peak_mib"]), row
        assert row["plexus_runs_samples_per_s"] == [pytest.approx(row["plexus_samples_per_s"])]  # one repeat
        if row["torch_error"] is None:  # torch ran: the same columns, and the ratio between them
            assert _positive(row["torch_samples_per_s"]), row
            assert row["torch_bubble"] is None or 0 <= row["torch_bubble"] < 1, row
            assert len(row["torch_peak_mib"]) == 2 and all(_positive(b) for b in row["torch_peak_mib"]), row
            assert row["ratio"] == pytest.approx(row["plexus_samples_per_s"] / row["torch_samples_per_s"])
        else:  # it hung or failed: one line that says which, and no ratio
            assert row["torch_error"].startswith(("hung after", "failed: ")), row
            assert "\n" not in row["torch_error"] and row["ratio"] is None, row
    assert "plexus / torch" in out  # the table


@pytest.mark.parametrize("flags, word", [(["--stages", "1"], "--stages"), (["--schedules", "zb-h1"], "zb-h1"),
                                         (["--model", "cnn"], "cnn"), (["--microbatches", "3"], "--microbatches 3"),
                                         (["--warmup", "0"], "--warmup")])
def test_bench_pipeline_bad_flags(flags, word, capsys):
    assert main(["bench", "pipeline", *flags]) == 2
    err = capsys.readouterr().err
    assert word in err and len(err.strip().splitlines()) == 1
