"""A new user's first hour (issue 19): no run is lost, nothing silently does nothing, and
every mistake is one line naming the field, the rule, the value and the fix.

Validation errors run in-process (``plexus.cli.main``), since they fail before any
process starts; what needs a job (Ctrl-C, --debug, a user's package) runs the CLI."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plexus.train.job import DATA_CACHE
import warm_cli
from test_cli import assert_usage_error, plexus_cli

BIN = Path(sys.executable).parent


def _main(capsys, *argv: str) -> subprocess.CompletedProcess:
    """``plexus ARGV`` in-process, as (status, stdout, stderr)."""
    from plexus.cli import main
    try:
        status = main(list(argv))
    except SystemExit as exc:  # argparse's own exits
        status = exc.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), status, out, err)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- 1. never lose a run -----------------------------------------------------------------


def test_an_out_directory_holding_a_run_is_refused(tmp_path, capsys):
    (tmp_path / "summary.json").write_text("{}")
    result = _main(capsys, "train", "--steps", "5", "--out", str(tmp_path))
    assert_usage_error(result, "--out", str(tmp_path), "already holds files", "--overwrite", "new directory name")
    assert (tmp_path / "summary.json").read_text() == "{}"  # untouched


def test_a_file_as_out_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert_usage_error(_main(capsys, "train", "--out", str(tmp_path / "f")), "is a file")


def test_overwrite_replaces_only_the_earlier_runs_results(tmp_path):
    from plexus.config import JobConfig
    from plexus.train.job import prepare_run_dir
    for name in ("summary.json", "metrics.jsonl", "model.pt", "index.html", "accuracy_time.png", "notes.txt"):
        (tmp_path / name).write_text("old")
    cfg = JobConfig.from_flat({"out": str(tmp_path), "overwrite": True})
    assert prepare_run_dir(cfg) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "notes.txt"]
    assert cfg.source("overwrite") == "api" and JobConfig().run.overwrite is False


def test_the_default_run_directory_never_reuses_one(tmp_path, monkeypatch):
    from plexus.config import JobConfig
    from plexus.train.job import prepare_run_dir
    monkeypatch.chdir(tmp_path)
    cfg = JobConfig.from_flat({})
    first = prepare_run_dir(cfg)
    second = prepare_run_dir(cfg)  # within the same second: the same default name
    assert first != second and (first / "config.json").exists() and (second / "config.json").exists()


def test_compare_refuses_an_out_holding_an_earlier_compare(tmp_path, capsys):
    (tmp_path / "01-allreduce").mkdir()
    result = _main(capsys, "compare", "allreduce", "ps", "--steps", "5", "--out", str(tmp_path))
    assert_usage_error(result, "already holds files", "--overwrite")


# --- 2. nothing silently does nothing ------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["--strategy", "ps", "--algorithm", "ring"], ["--algorithm ring", "strategy ps", "allreduce, local-sgd"]),
    (["--strategy", "allreduce", "--consistency", "ssp"], ["--consistency ssp", "strategy allreduce", "ps, tree-ps"]),
    (["--strategy", "allreduce", "--topology", "torus"], ["--topology torus", "gossip only"]),
    (["--strategy", "allreduce", "--servers", "3"], ["--servers 3", "ps, tree-ps"]),
    (["--strategy", "ps", "--async"], ["--async", "strategy ps", "gossip only"]),
    (["--strategy", "easgd", "--servers", "2"], ["--servers 2", "strategy easgd"]),
    (["--strategy", "tree-ps", "--staleness", "2"], ["--staleness 2", "strategy tree-ps", "ps only"]),
    (["--strategy", "gossip", "--warmup-steps", "5"], ["--warmup-steps 5", "local-sgd only"]),
    (["--strategy", "allreduce", "--peer-timeout", "3"], ["--peer-timeout 3", "ps, tree-ps"]),
])
def test_a_flag_the_strategy_ignores_is_refused(args, words, capsys):
    assert_usage_error(_main(capsys, "train", *args), "does not apply", *words)


def test_a_toml_key_the_strategy_ignores_names_its_file(tmp_path, capsys):
    toml = tmp_path / "job.toml"
    toml.write_text('strategy = "ps"\nalgorithm = "ring"\n')
    assert_usage_error(_main(capsys, "train", "--config", str(toml)), "algorithm = 'ring' (file)", "strategy ps")


def test_defaults_never_count_as_set(capsys):
    """Every strategy with nothing but --strategy passes the table (its defaults, and the
    per-strategy defaults of defaults.py, are not the user's)."""
    from plexus.config import JobConfig
    from plexus.config.applies import STRATEGY_NAMES
    from plexus.train.preflight import check_applies
    for name in STRATEGY_NAMES:
        check_applies(JobConfig.from_flat({"strategy": name}, {"strategy": "flag"}))


def test_one_table_for_the_check_print_config_and_the_report(capsys):
    from plexus.config.applies import APPLIES, STRATEGY_NAMES, strategy_keys
    from plexus.report.analysis import STRATEGY_KEYS
    from plexus.strategies import STRATEGIES
    assert set(STRATEGY_NAMES) == set(STRATEGIES)
    assert dict(STRATEGY_KEYS) == strategy_keys()
    result = _main(capsys, "train", "--strategy", "allreduce", "--consistency", "ssp", "--print-config")
    assert result.returncode == 0
    lines = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines() if line.startswith("  ")}
    for key in APPLIES:
        assert (lines[key][0] == "n/a") == ("allreduce" not in APPLIES[key]), (key, lines[key])
    assert lines["consistency"] == ["n/a", "flag", '"ssp",', "refused:", "applies", "to", "ps,", "tree-ps"]
    assert lines["algorithm"][:2] == ['"native"', "default"] and "ring" in " ".join(lines["algorithm"])


def test_compare_leaves_a_shared_flag_out_of_the_specs_that_ignore_it(capsys):
    from plexus.cli import build_parser, job_config
    args = build_parser().parse_args(["compare", "ps", "allreduce", "--servers", "2", "--consistency", "bsp"])
    ps = job_config(args, {"strategy": "ps"})
    allreduce = job_config(args, {"strategy": "allreduce"})
    assert ps.cluster.servers == 2 and ps.strategy.consistency == "bsp"
    assert allreduce.source("servers") == "default" and allreduce.source("consistency") == "default"
    # ... but one that applies to no spec of the compare is refused.
    result = _main(capsys, "compare", "allreduce", "local-sgd", "--topology", "torus", "--steps", "5")
    assert_usage_error(result, "--topology torus", "no spec of this compare runs one")


def test_the_summary_records_no_algorithm_or_servers_a_strategy_lacks():
    from plexus.config import JobConfig
    from plexus.train.summary import assemble_summary
    worker = {"steps": 3, "wall_seconds": 1.0, "bytes_sent": 10, "bytes_recv": 10, "slept": 0.0}
    records = {"worker": {0: worker}, "eval": {}, "target": {}}
    allreduce = assemble_summary(JobConfig.from_flat({"algorithm": "ring"}), records)
    assert allreduce["algorithm"] == "ring" and allreduce["servers"] is None
    ps = assemble_summary(JobConfig.from_flat({"strategy": "ps"}), {**records, "server": {}})
    assert ps["algorithm"] is None and ps["servers"] == 1


@pytest.mark.parametrize("args, words", [
    (["--workers", "2", "--steps", "20", "--kill", "worker:1@step=500"],
     ["--kill worker:1@step=500 cannot fire", "20 steps per worker (--steps 20)", "below 20", "--steps 501"]),
    (["--workers", "2", "--epochs", "1", "--kill", "worker:1@step=50"],
     ["cannot fire", "22 steps per worker (--epochs 1)"]),
    (["--strategy", "tree-ps", "--workers", "4", "--steps", "10", "--kill", "aggregator:0@step=25"],
     ["--kill aggregator:0@step=25 cannot fire", "at most 20 pushes"]),
    (["--strategy", "local-sgd", "--workers", "2", "--steps", "40", "--warmup-steps", "50"],
     ["--warmup-steps 50 leaves no local step", "40 steps per worker"]),
    (["--strategy", "local-sgd", "--workers", "2", "--steps", "40", "--period", "64"], ["--period 64 never averages"]),
    (["--strategy", "easgd", "--workers", "2", "--steps", "10", "--period", "16"], ["--period 16 never pulls"]),
    (["--strategy", "ps", "--steps", "10", "--push-every", "20"], ["--push-every 20 never fires"]),
    (["--steps", "10", "--eval-every", "50"], ["--eval-every 50 takes no snapshot"]),
    (["--kill", "server:0@step=5"], ["--kill server:0@step=5", "strategy allreduce has no servers",
                                     "--kill worker:0@step=5"]),
    (["--strategy", "easgd", "--kill", "server:0@step=5"], ["servers count no steps"]),
    (["--strategy", "ps", "--workers", "2", "--steps", "10", "--kill", "server:0@step=20"],
     ["--kill server:0@step=20 cannot fire", "at most 20 updates"]),
    (["--strategy", "ps", "--servers", "2", "--kill", "server:2@step=5"], ["has 2 server(s)", "below 2"]),
    (["--strategy", "tree-ps", "--variant", "base", "--workers", "4", "--kill", "aggregator:0@step=5"],
     ["strategy tree-ps has no aggregators"]),
    (["--strategy", "ps", "--slow", "server:0=2"], ["would run at full speed"]),
])
def test_a_fault_or_schedule_that_cannot_happen_is_refused(args, words, capsys):
    assert_usage_error(_main(capsys, "train", *args), *words)


def test_a_fault_within_the_default_length_passes():
    """The default run is one epoch or 300 steps, whichever is longer: a README kill at step
    50 fires, and so does one at step 299; time-limited runs are not checked."""
    from plexus.config import JobConfig
    from plexus.train.job import validate
    for kill in ("worker:1@step=50", "worker:1@step=299"):
        validate(JobConfig.from_flat({"strategy": "ps", "workers": 4, "servers": 2, "kill": kill}))
    validate(JobConfig.from_flat({"workers": 2, "time_limit": 5, "kill": "worker:1@step=100000"}))
    validate(JobConfig.from_flat({"strategy": "easgd", "workers": 2, "slow": "server:0=2"}))


# --- 7. one line, exit 2, for every remaining traceback --------------------------------------


def test_config_pointing_at_a_directory(tmp_path, capsys):
    assert_usage_error(_main(capsys, "train", "--config", str(tmp_path)), "is a directory", "--config FILE")


def test_a_negative_seed(capsys):
    assert_usage_error(_main(capsys, "train", "--seed", "-1"), "seed must lie in [0, 2**32 - 1]", "got -1",
                       "--seed 0")


def test_report_out_that_cannot_be_written(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"strategy": "allreduce"}))
    (run / "metrics.jsonl").write_text("")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = _main(capsys, "report", str(run), "--out", str(blocker / "sub"))
    assert_usage_error(result, str(blocker / "sub"), "--out")
    taken = tmp_path / "taken"
    (taken / "index.html").mkdir(parents=True)  # a folder where the page must go
    result = _main(capsys, "report", str(run), "--out", str(taken))
    assert_usage_error(result, "cannot write the report", "index.html", "--out DIR")


def test_data_dir_that_is_a_file_says_so(tmp_path, capsys):
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(b"")
    for dataset in ("mnist", "cifar10", "text"):
        assert_usage_error(_main(capsys, "train", "--dataset", dataset, "--data-dir", str(path)), "is a file",
                           "not a folder")


def test_join_where_nothing_listens_is_one_line_within_its_timeout(capsys, monkeypatch):
    monkeypatch.setenv("PLEXUS_TOKEN", "t")
    port = _free_port()
    started = time.monotonic()
    result = _main(capsys, "worker", "--join", f"127.0.0.1:{port}", "--timeout", "1.5")
    assert time.monotonic() - started < 5
    assert_usage_error(result, f"nothing listens at 127.0.0.1:{port}", "tried for 1.5 s", "--port")


def test_join_to_an_allreduce_job_says_joining_is_for_ps(capsys, monkeypatch):
    from plexus.cluster.rendezvous import host_store, job_namespace, store_set_json
    from plexus.train.job import JOB_KEY
    import torch.distributed as dist
    store = host_store("127.0.0.1", 0, "tok", 10)
    store_set_json(dist.PrefixStore(job_namespace("tok"), store), JOB_KEY, {"strategy": "allreduce",
                                                                            "consistency": "asp"})
    monkeypatch.setenv("PLEXUS_TOKEN", "tok")
    result = _main(capsys, "worker", "--join", f"127.0.0.1:{store.port}", "--timeout", "5")
    assert_usage_error(result, "runs strategy allreduce without --elastic", "--strategy ps", "asp, ssp or softsync")
    # A wrong token: the joiner has no rank yet, and is not called "worker -1".
    monkeypatch.setenv("PLEXUS_TOKEN", "other")
    result = _main(capsys, "worker", "--join", f"127.0.0.1:{store.port}", "--timeout", "5")
    assert_usage_error(result, "joining worker: refused", "PLEXUS_TOKEN")
    assert "-1" not in result.stderr


def test_version(capsys):
    from plexus import __version__
    result = _main(capsys, "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"plexus {__version__}"


def test_async_is_a_toml_key(tmp_path, capsys):
    from plexus.config import JobConfig
    assert JobConfig.from_flat({"strategy": "gossip", "async": True}).strategy.async_gossip is True
    toml = tmp_path / "job.toml"
    toml.write_text('strategy = "gossip"\nasync = true\n')
    result = _main(capsys, "train", "--config", str(toml), "--print-config")
    assert result.returncode == 0
    line = next(line for line in result.stdout.splitlines() if line.split()[0] == "async_gossip")
    assert line.split()[1:] == ["true", "file"]


def test_user_factories_import_from_the_current_directory(tmp_path, monkeypatch):
    """As ``python -m`` does: the console script's sys.path does not hold the cwd."""
    from plexus.train.data import _resolve_factory
    pkg = tmp_path / "firsthourpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text("def make_model(data):\n    return 'a model'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert _resolve_factory("firsthourpkg.nets:make_model", "model")(None) == "a model"
    assert sys.path[-1] == str(tmp_path)  # appended: it never shadows an installed module


@pytest.mark.slow
def test_a_users_package_trains_from_its_own_folder_through_the_console_script(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text("import torch\n\ndef make_model(data):\n"
                                 "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(BIN / "plexus"), "train", "--model", "mypkg.nets:make_model", "--steps", "3",
                             "--out", str(tmp_path / "run"), "--quiet"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=180, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3


@pytest.mark.slow
def test_debug_says_what_it_did_on_success(tmp_path):
    result = plexus_cli("train", "--workers", "2", "--steps", "5", "--lr", "0.05", "--out", str(tmp_path), "--debug")
    assert result.returncode == 0, result.stderr
    settings = next(line for line in result.stderr.splitlines() if line.startswith("plexus: settings:"))
    assert "workers=2 (flag)" in settings and "lr=0.05 (flag)" in settings and "momentum" not in settings
    phases = next(line for line in result.stderr.splitlines() if line.startswith("plexus: phases (s):"))
    for phase in ("validate", "prepare", "start-up", "training", "summary", "total"):
        assert phase in phases, phases


# --- 1 and 6. Ctrl-C and SIGTERM -------------------------------------------------------------


def _interrupt(tmp_path: Path, sig: int, *extra: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess,
                                                                                          Path]:
    from plexus.train.metrics import read_events
    out = tmp_path / "run"
    argv = ["train", "--strategy", "ps", "--workers", "2", "--steps", "1000000",
            "--eval-every", "20", "--log-every", "5", "--out", str(out), "--quiet", *extra]
    job = warm_cli.popen(argv, env={**os.environ, **(env or {})})  # a launcher forked warm (--debug: a fresh one)
    try:
        deadline = time.monotonic() + 120
        # Something measured to keep: 20 steps, and the first evaluation (its snapshot is
        # evaluated beside training, and may land after step 20 on a loaded machine).
        while not (any(e["step"] >= 20 for e in read_events(out, "train")) and any(read_events(out, "eval"))) \
                and job.poll() is None:
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        job.send_signal(sig)
        stdout, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return subprocess.CompletedProcess(argv, job.returncode, stdout, stderr), out


@pytest.mark.slow
@pytest.mark.parametrize("sig, start", [(signal.SIGINT, "fork"), (signal.SIGTERM, "fork"), (signal.SIGINT, "spawn")])
def test_an_interrupted_run_keeps_what_it_measured(tmp_path, sig, start):
    result, out = _interrupt(tmp_path, sig, env={"PLEXUS_START": start})
    name = signal.Signals(sig).name
    assert result.returncode == 128 + sig, result.stderr
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"plexus: interrupted by {name} after "), result.stderr
    assert "terminate called" not in result.stderr and "failed" not in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["interrupted_by"] == name
    assert summary["steps"] >= 20 and summary["lost_workers"] == []
    assert summary["final_test_accuracy"] is not None and summary["evaluations"] >= 1
    assert all(b for b in summary["bytes_sent_per_worker"])
    assert not (out / DATA_CACHE).exists()  # the launcher's copy of the dataset
    report = plexus_cli("report", str(out))
    assert report.returncode == 0 and (out / "index.html").exists(), report.stderr


@pytest.mark.slow
def test_a_stopped_child_leaves_without_a_cpp_abort(tmp_path):
    """A fresh-interpreter child (PLEXUS_START=spawn) that the launcher stops with SIGTERM
    used to exit through the interpreter's shutdown while gloo threads lived, and the ps
    server aborted with "terminate called without an active exception". --debug keeps the
    children's output after the signal, so the abort would show."""
    result, out = _interrupt(tmp_path, signal.SIGINT, "--debug", env={"PLEXUS_START": "spawn"})
    assert "terminate called" not in result.stderr, result.stderr
    assert "exited with status 134" not in result.stderr
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
def test_a_launcher_killed_with_sigkill_leaves_its_data_beside_the_run(tmp_path):
    """The launcher writes the loaded dataset for its processes to read and removes it when
    the job ends; a SIGKILL gives it no chance to. The copy is in the run directory, not the
    system's temporary folder (where killed launchers left one folder each), and the next
    run there removes it."""
    from plexus.config import JobConfig
    from plexus.train.job import prepare_run_dir
    from plexus.train.metrics import read_events
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    job = warm_cli.popen(["train", "--workers", "2", "--steps", "1000000", "--eval-every", "0", "--log-every", "5",
                          "--out", str(out), "--quiet"], env={**os.environ, "TMPDIR": str(tmp)})
    try:
        deadline = time.monotonic() + 120
        while not read_events(out, "train") and job.poll() is None:
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        training = job.poll() is None
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        _, err = job.communicate(timeout=60)
    assert training, err[-3000:]
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("plexus-data")]
    assert (out / DATA_CACHE / "meta.json").exists()
    prepare_run_dir(JobConfig.from_flat({"out": str(out), "overwrite": True}))
    assert not (out / DATA_CACHE).exists()
