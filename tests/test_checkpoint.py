"""Checkpoints of a whole job and --resume (train/checkpoint.py): a resumed synchronous run
equals the uninterrupted one; half-written, corrupt or pickled checkpoints are skipped or
refused in one line; the cut does not wait for a lost worker."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

import warm_cli
from plexus.config import JobConfig
from plexus.errors import ConfigError
from plexus.train.checkpoint import _seal, latest, parse_every, write_piece

PY = sys.executable
JOB = ["--dataset", "digits", "--model", "mlp", "--workers", "2", "--timeout", "30", "--quiet", "--json"]


def _plexus(*args: str) -> subprocess.CompletedProcess:
    return warm_cli.run(args, timeout=240, env={**os.environ, "PLEXUS_NO_REPORT": "1"})


def _train(*args: str) -> dict:
    result = _plexus("train", *JOB, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _usage_error(result: subprocess.CompletedProcess, *words: str) -> None:
    err = result.stderr.strip()
    assert result.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err


def _same(a, b) -> bool:
    x, y = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    return all(torch.equal(x[k], y[k]) for k in x)


def _checkpoint(root, step: int, payload: dict | None = None):
    tmp = root / "checkpoints" / f".tmp-{step}"
    tmp.mkdir(parents=True)
    write_piece(tmp, "worker-0", payload or {"steps": step, "w": torch.ones(3) * step})
    _seal(tmp, root / "checkpoints" / f"step-{step:08d}", step, JobConfig.from_flat({}).to_dict(), "allreduce")
    return root / "checkpoints" / f"step-{step:08d}"


def test_every_is_steps_or_seconds():
    assert parse_every("100") == (100, None) and parse_every("30s") == (None, 30.0)
    for bad in ("0", "-5", "abc", "s", "1.5"):
        with pytest.raises(ConfigError, match="--checkpoint-every"):
            parse_every(bad)


def test_the_newest_whole_checkpoint_wins_and_broken_ones_are_skipped(tmp_path, caplog):
    good = _checkpoint(tmp_path, 10)
    flipped = _checkpoint(tmp_path, 20)
    raw = bytearray((flipped / "worker-0.pt").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (flipped / "worker-0.pt").write_bytes(bytes(raw))
    unsealed = _checkpoint(tmp_path, 30)
    (unsealed / "manifest.json").unlink()     # a writer killed before its manifest
    (tmp_path / "checkpoints" / ".tmp-40").mkdir()  # a writer killed before its rename
    assert latest(tmp_path) == good
    text = caplog.text
    assert "step-00000030: no manifest.json" in text and "worker-0.pt does not match its sha256" in text
    # Nothing whole left: one line naming what is wrong with each.
    (good / "worker-0.pt").write_bytes(b"truncated")
    with pytest.raises(ConfigError, match="no whole checkpoint to resume from .*step-00000010: worker-0.pt"):
        latest(tmp_path)


def test_a_pickled_object_is_never_loaded(tmp_path):
    folder = _checkpoint(tmp_path, 10)
    (folder / "worker-0.pt").write_bytes(pickle.dumps({"steps": 10, "evil": ConfigError("x")}))
    _seal(folder, tmp_path / "checkpoints" / "step-00000011", 11, {"run": {}}, "allreduce")  # a manifest that matches
    with pytest.raises(ConfigError, match="not plain tensors .*weights_only"):
        latest(tmp_path)


@pytest.mark.parallel
@pytest.mark.parametrize("strategy", [["--strategy", "allreduce"], ["--strategy", "ps", "--consistency", "bsp",
                                                                     "--servers", "2"]])
def test_a_resumed_synchronous_run_equals_the_uninterrupted_one(tmp_path, strategy):
    whole, half, resumed = tmp_path / "whole", tmp_path / "half", tmp_path / "resumed"
    _train(*strategy, "--steps", "40", "--save-model", "--out", str(whole))
    first = _train(*strategy, "--steps", "20", "--checkpoint-every", "10", "--out", str(half))
    assert first["checkpoints"] == [10, 20]
    assert sorted(p.name for p in (half / "checkpoints" / "step-00000020").iterdir()) == sorted(
        ["config.json", "manifest.json", "worker-0.pt", "worker-1.pt"]
        + (["server-0.pt", "server-1.pt"] if "ps" in strategy else []))
    summary = _train("--resume", str(half), "--steps", "40", "--save-model", "--out", str(resumed))
    assert summary["resumed_from"]["step"] == 20 and summary["steps"] == 40
    assert _same(whole, resumed)


@pytest.mark.parallel
def test_an_asynchronous_run_checkpoints_past_a_lost_worker_and_resumes(tmp_path):
    first = _train("--strategy", "ps", "--consistency", "asp", "--steps", "30", "--checkpoint-every", "5",
                   "--kill", "worker:1@step=12", "--out", str(tmp_path / "a"))
    assert first["lost_workers"] == [1] and first["checkpoints"][-1] >= 25
    summary = _train("--resume", str(tmp_path / "a"), "--steps", "60", "--out", str(tmp_path / "b"))
    assert summary["resumed_from"]["step"] >= 25 and summary["final_test_accuracy"] > 0.8


@pytest.mark.parametrize("args, words", [
    (["--resume", "{tmp}/nothing"], ["no such run directory"]),
    (["--resume", "{tmp}"], ["holds no checkpoint", "--checkpoint-every"]),
    (["--strategy", "gossip", "--checkpoint-every", "10"], ["does not apply to strategy gossip", "allreduce, ps"]),
    (["--checkpoint-every", "soon"], ["--checkpoint-every must be a number of steps or of seconds"]),
])
def test_bad_checkpoint_input_is_one_line_and_status_2(tmp_path, args, words):
    _usage_error(_plexus("train", "--steps", "5", *[a.format(tmp=tmp_path) for a in args]), *words)


def test_resume_refuses_to_change_the_job(tmp_path):
    _checkpoint(tmp_path, 10)
    _usage_error(_plexus("train", "--resume", str(tmp_path), "--lr", "0.5", "--workers", "3", "--model", "mlp"),
                 "--lr, --workers cannot change")
