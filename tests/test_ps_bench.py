"""``plexus bench ps``: one tiny run (over sockets: the rest of the suite uses shared
memory) gives a row per (size, workers, servers) with every contender measured."""
from __future__ import annotations

import json
import math

import pytest

from plexus.cli import main


@pytest.mark.slow
def test_bench_ps_rows(capsys):
    status = main(["bench", "ps", "--sizes", "20k", "--workers", "2", "--servers", "2", "--rounds", "3",
                   "--warmup", "1", "--repeats", "1", "--transport", "socket", "--json"])
    out = capsys.readouterr().out
    assert status == 0
    rows = json.loads(out.strip().splitlines()[-1])
    assert [(r["size"], r["workers"], r["servers"]) for r in rows] == [(20_000, 2, 2)]
    for key in ("ours_rt_per_s", "ours_gb_per_s", "rpc_rt_per_s", "rpc_gb_per_s", "ratio", "link_gb_per_s"):
        assert math.isfinite(rows[0][key]) and rows[0][key] > 0, key
    assert rows[0]["ours_gb_per_s"] == pytest.approx(rows[0]["ours_rt_per_s"] * 8 * 20_000 / 1e9)
    assert rows[0]["transport"] == "socket"
    assert "ours" in out and "rpc" in out  # the table


@pytest.mark.parametrize("flags, word", [(["--sizes", "lots"], "--sizes"), (["--workers", "0"], "--workers"),
                                         (["--rounds", "0"], "--rounds"), (["--repeats", "0"], "--repeats")])
def test_bench_ps_bad_flags(flags, word, capsys):
    assert main(["bench", "ps", *flags]) == 2
    err = capsys.readouterr().err
    assert word in err and len(err.strip().splitlines()) == 1
