"""The judging report of ``plexus compare --seeds N`` (plexus.report.judging): the four
criteria and the ranking on hand-made runs (fast, no training), the CPU-seconds a job's
processes report, the HTML table, bad input, and one short end-to-end compare."""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from plexus.config import ClusterConfig, JobConfig, ModelConfig, StrategyConfig
from plexus.config.applies import STRATEGY_NAMES
from plexus.errors import ConfigError
from plexus.report import write_report
from plexus.report.judging import TABLE_HEAD, Stat, extra_hyperparameters, judge, judging_target, table_cells
from test_cli import assert_usage_error, plexus_cli


@dataclass
class FakeRun:
    """What judging reads of a run directory."""

    summary: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)


def run(strategy: str = "allreduce", evals: tuple[tuple[float, float], ...] = ((1.0, 0.5), (2.0, 0.92)),
        target: float | None = 0.9, **summary: Any) -> FakeRun:
    """A completed run whose global model was evaluated at (time, accuracy) ``evals``."""
    return FakeRun(
        summary={"strategy": strategy, "status": "completed", "health": "ok", "final_test_accuracy": evals[-1][1],
                 "wall_seconds": 3.0, "processes": 2, "cpu_seconds": 5.0, "bytes_sent_total": 2**20, **summary},
        config={"strategy": {"strategy": strategy}, "run": {"target_accuracy": target}},
        events=[{"event": "eval", "time": t, "test_accuracy": acc, "model": "global"} for t, acc in evals])


def reaching(strategy: str, seconds: float, **summary: Any) -> FakeRun:
    """A run that reaches 90% at ``seconds``."""
    return run(strategy, ((seconds / 2, 0.5), (seconds, 0.93)), **summary)


def failed(strategy: str) -> FakeRun:
    return FakeRun(summary={"status": "failed", "error": "boom"}, config={"strategy": {"strategy": strategy}})


# --- hyper-parameters from the schema ------------------------------------------------

def test_allreduce_is_sgd_and_adds_no_hyperparameter():
    assert extra_hyperparameters("allreduce") == ()


def test_hyperparameters_are_strategy_knobs_the_strategy_reads():
    strategy_fields = {f.name for f in dataclasses.fields(StrategyConfig)}
    other_components = {f.name for c in (ClusterConfig, ModelConfig) for f in dataclasses.fields(c)}
    for name in STRATEGY_NAMES:
        counted = set(extra_hyperparameters(name))
        assert counted <= strategy_fields, name
        assert not counted & other_components, name  # servers, place, peer_timeout, dtype: not tuned for accuracy
        # the all-reduce's own knobs change speed only (contract 1), under local-sgd too
        assert not counted & {"algorithm", "bucket_mb", "local_size", "strategy"}, name
    assert extra_hyperparameters("easgd") == ("period", "elastic_alpha")
    assert set(extra_hyperparameters("gossip")) == {"topology", "mixing", "gossip_order", "async_gossip"}
    assert {"history", "lbfgs", "line_search"} <= set(extra_hyperparameters("sandblaster"))
    assert "staleness" in extra_hyperparameters("ps") and "staleness" not in extra_hyperparameters("tree-ps")
    assert "fanout" in extra_hyperparameters("tree-ps") and "fanout" not in extra_hyperparameters("ps")


def test_unknown_strategy_has_no_count():
    assert extra_hyperparameters("mypkg.strategies:make") is None
    j, = judge([("mine", [run("mypkg.strategies:make")])])
    assert j.hyperparameters is None and table_cells(j)[6][0] == "?"


# --- the figures -----------------------------------------------------------------------

def test_stat_is_mean_and_sample_sd_of_the_numbers():
    s = Stat.of([1.0, 2.0, None, 4.0, float("nan")])
    assert s.n == 3 and s.mean == pytest.approx(7 / 3) and s.sd == pytest.approx(statistics.stdev([1, 2, 4]))
    assert Stat.of([2.5]) == Stat(2.5, None, 1) and Stat.of([2.5]).text() == "2.50"
    assert Stat.of([]).text() == "–"
    assert Stat.of([1.0, 3.0]).text() == f"2.00 ± {math.sqrt(2):.2f}"


def test_four_criteria_of_one_configuration():
    runs = [run("ps", ((1.0, 0.6), (2.0, 0.95), (3.0, 0.94)), wall_seconds=4.0, processes=3, cpu_seconds=6.0,
                bytes_sent_total=3 * 2**20),
            run("ps", ((1.0, 0.7), (4.0, 0.91)), wall_seconds=5.0, processes=3, cpu_seconds=8.0,
                bytes_sent_total=5 * 2**20, health="diverging"),
            run("ps", ((1.0, 0.5), (2.0, 0.6)), wall_seconds=6.0, processes=3, cpu_seconds=7.0,
                bytes_sent_total=4 * 2**20, health="stalled"),
            failed("ps")]
    j, = judge([("ps:consistency=asp", runs)])
    assert (j.name, j.strategy, j.runs, j.failed, j.completed) == ("ps:consistency=asp", "ps", 4, 1, 3)
    # speed: time to each run's best (2.0, 4.0, 2.0) and to the runs' --target-accuracy 90% (2.0, 4.0; one never)
    assert j.target == 0.9 and j.reached == 2
    assert (j.time_to_target.mean, j.time_to_target.n) == (3.0, 2)
    assert j.time_to_best.mean == pytest.approx(8 / 3)
    assert j.best_accuracy.mean == pytest.approx((0.95 + 0.91 + 0.6) / 3)
    # hyper-parameters, stability, cost
    assert len(j.hyperparameters) == len(extra_hyperparameters("ps")) == int(table_cells(j)[6][0])
    assert j.unstable == 2 and j.final_accuracy.sd == pytest.approx(statistics.stdev([0.94, 0.91, 0.6]))
    assert j.process_seconds.mean == pytest.approx((12 + 15 + 18) / 3)
    assert (j.cpu_seconds.mean, j.mib_sent.mean) == (7.0, 4.0)
    cells = dict(zip((h for h, _ in TABLE_HEAD), (text for text, _ in table_cells(j))))
    assert cells["runs ok"] == "3/4" and cells["stalled or diverged"] == "2/4"
    assert cells["time to target s"] == "3.00 ± 1.41 (2/4)"


def test_target_is_the_highest_threshold_every_run_reached_without_target_accuracy():
    j, = judge([("a", [run(evals=((1.0, 0.85),), target=None), run(evals=((1.5, 0.82),), target=None)])])
    assert j.target == 0.8 and j.reached == 2 and j.time_to_target.mean == 1.25
    high = [run(evals=((1.0, 0.91), (2.0, 0.96)), target=None), run(evals=((1.0, 0.93),), target=None)]
    assert judging_target(high) == 0.9  # not 95%, which one run touched
    low = [*high, run(evals=((1.0, 0.6),), target=None)]
    assert judging_target(low) == 0.8  # and the run that never reached it counts against its configuration
    a, b = judge([("high", high), ("low", low[2:])])
    assert (a.name, a.reached, b.name, b.reached) == ("high", 2, "low", 0)
    assert judging_target([FakeRun(summary={"status": "completed"})]) is None


# --- the ranking -----------------------------------------------------------------------

def test_faster_beyond_noise_wins_whatever_its_hyperparameters():
    fast = [reaching("ps", t) for t in (2.0, 2.1, 1.9)]
    slow = [reaching("allreduce", t) for t in (6.0, 6.1, 5.9)]
    first, second = judge([("allreduce", slow), ("ps", fast)])
    assert (first.name, first.place, second.name, second.place) == ("ps", 1, "allreduce", 2)
    assert first.why.startswith("90% in 2.00 ± 0.10 s (3/3 seeds), the fastest")
    assert second.why.startswith("90% in 6.00 ± 0.10 s (3/3 seeds), 3.0x the fastest")
    assert "tied" not in first.why + second.why


def test_a_tie_on_speed_goes_to_fewer_hyperparameters():
    # ps is 0.05 s faster on average, far less than one standard error of the difference
    ps = [reaching("ps", t) for t in (1.0, 2.0, 3.0)]
    allreduce = [reaching("allreduce", t) for t in (1.2, 2.0, 2.95)]
    first, second = judge([("ps", ps), ("allreduce", allreduce)])
    assert (first.name, second.name) == ("allreduce", "ps")
    n = len(extra_hyperparameters("ps"))
    assert f"tied on speed with #2 (within noise), ahead on fewer hyper-parameters (0 vs {n})" in first.why
    assert f"tied on speed with #1 (within noise), which has fewer hyper-parameters (0 vs {n})" in second.why
    assert second.why.startswith("90% in 2.00 ± 1.00 s (3/3 seeds), the fastest")  # it is, and says so


def test_a_tie_with_equal_hyperparameters_goes_to_the_stabler():
    shaky = [reaching("gossip", t, health=h) for t, h in ((1.0, "ok"), (2.0, "diverging"), (3.0, "ok"))]
    steady = [reaching("gossip", t) for t in (1.1, 2.0, 3.0)]
    first, second = judge([("gossip:topology=ring", shaky), ("gossip:topology=exp", steady)])
    assert first.name == "gossip:topology=exp"
    assert "ahead on fewer stalled, diverged or failed runs (0/3 vs 1/3)" in first.why
    assert "1/3 runs stalled or diverged" in second.why


def test_more_seeds_at_the_target_beat_a_faster_mean():
    sure = [reaching("allreduce", t) for t in (5.0, 5.0, 5.0)]
    lucky = [reaching("ps", 1.0), reaching("ps", 1.0), run("ps", ((1.0, 0.5), (2.0, 0.6)))]
    first, second = judge([("ps", lucky), ("allreduce", sure)])
    assert (first.name, second.name) == ("allreduce", "ps")
    assert first.why == "90% in 5.00 ± 0.00 s (3/3 seeds), the most seeds at the target"  # costs equal: unsaid
    assert second.why.startswith("90% in 1.00 ± 0.00 s (2/3 seeds)")


def test_never_reached_ranks_by_best_accuracy_and_all_failed_comes_last():
    reached = [reaching("allreduce", 2.0)]
    better = [run("easgd", ((1.0, 0.85),))]
    worse = [run("gossip", ((1.0, 0.7),))]
    dead = [failed("ps"), failed("ps")]
    order = judge([("dead", dead), ("worse", worse), ("better", better), ("reached", reached)])
    assert [j.name for j in order] == ["reached", "better", "worse", "dead"]
    assert [j.place for j in order] == [1, 2, 3, 4]
    assert order[1].why.startswith("never reached 90%; best 85.00 %")
    assert order[3].why == "every run failed (2/2)" and order[3].best_accuracy.n == 0


def test_cost_is_named_where_a_configuration_is_cheapest():
    a = [reaching("allreduce", 1.0, cpu_seconds=2.0, bytes_sent_total=10 * 2**20)]
    b = [reaching("ps", 5.0, cpu_seconds=9.0, bytes_sent_total=2 * 2**20)]
    first, second = judge([("a", a), ("b", b)])
    assert "least CPU (2.00 s)" in first.why and "fewest bytes (2.0 MiB)" in second.why
    close = [reaching("easgd", 9.0, cpu_seconds=2.05, bytes_sent_total=10 * 2**20)]  # within 5%: not worth a word
    assert not any("least CPU" in j.why for j in judge([("a", a), ("b", b), ("close", close)]))


# --- CPU-seconds in the summary --------------------------------------------------------

class DictStore:
    """The store calls summary.collect_records and process.report_cpu make."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value


def test_each_process_reports_its_cpu_and_the_summary_sums_them():
    from plexus.train.process import report_cpu
    from plexus.train.summary import assemble_summary, collect_records
    store = DictStore()
    begin = time.process_time()
    sum(i * i for i in range(200_000))  # some CPU work
    report_cpu(store, "worker", 0)
    own = json.loads(store.get("cpu/worker/0"))["cpu_seconds"]
    assert begin < own <= time.process_time()
    store.set("cpu/worker/0", json.dumps({"cpu_seconds": 1.5}))
    store.set("cpu/worker/1", json.dumps({"cpu_seconds": 2.0}))
    for r in (0, 1, 2):  # worker 2 left its record but no CPU time
        store.set(f"stats/worker/{r}", json.dumps({"steps": 10, "wall_seconds": 0.5, "bytes_sent": 100, "slept": 0}))
    store.set("stats/eval", json.dumps({"steps": 10, "wall_seconds": 0.5, "final_test_accuracy": 0.9}))
    cfg = JobConfig.from_flat({"strategy": "allreduce", "workers": 3, "batch_size": 63})
    summary = assemble_summary(cfg, collect_records(cfg, store))
    assert summary["processes"] == 3 and summary["cpu_seconds"] == 3.5
    assert summary["cpu_seconds_by_role"] == {"worker": 3.5}
    store = DictStore()
    for r in (0, 1, 2):
        store.set(f"stats/worker/{r}", json.dumps({"steps": 10, "wall_seconds": 0.5, "bytes_sent": 100, "slept": 0}))
    none = assemble_summary(cfg, collect_records(cfg, store))
    assert none["cpu_seconds"] is None and none["cpu_seconds_by_role"] == {}  # torchrun, Ray: not measured


# --- the HTML report -------------------------------------------------------------------

def write_run_dir(root: Path, name: str, fake: FakeRun) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(fake.summary))
    (folder / "config.json").write_text(json.dumps({**fake.config, "run": {**fake.config["run"], "seed": 0}}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in fake.events))
    return folder


def test_report_opens_with_the_judging_table(tmp_path):
    dirs = {"ps": [write_run_dir(tmp_path, f"ps-{s}", reaching("ps", t)) for s, t in enumerate((1.0, 1.2))],
            "allreduce": [write_run_dir(tmp_path, f"ar-{s}", reaching("allreduce", t)) for s, t in enumerate((3, 3.3))]}
    index = write_report([d for ds in dirs.values() for d in ds], tmp_path / "out", title="plexus compare",
                         configurations=list(dirs.items()))
    page = index.read_text()
    assert page.index("<h2>Judging (2 seeds per configuration)</h2>") < page.index("<h2>Ranking</h2>")
    table = page[page.index("<h2>Judging"):page.index("<h2>Ranking</h2>")]
    assert table.index(">ps<") < table.index(">allreduce<") and "time to 90% s" in table
    names = extra_hyperparameters("ps")
    assert f'title="{", ".join(names)}">{len(names)}<' in table  # the names on hover
    assert "90% in 1.10 ± 0.14 s (2/2 seeds), the fastest" in table
    plain = write_report([d for ds in dirs.values() for d in ds], tmp_path / "plain").read_text()
    assert "<h2>Judging" not in plain


def test_report_refuses_a_configuration_run_it_was_not_given(tmp_path):
    a = write_run_dir(tmp_path, "a", reaching("ps", 1.0))
    with pytest.raises(ConfigError, match="not one of the report's run directories"):
        write_report([a], tmp_path / "out", configurations=[("ps", [a, tmp_path / "b"])])
    assert not (tmp_path / "out").exists()  # refused before anything is written


# --- the command line ------------------------------------------------------------------

def test_seeds_below_one_is_a_usage_error(tmp_path):
    assert_usage_error(plexus_cli("compare", "allreduce", "--seeds", "0", "--out", str(tmp_path)),
                       "--seeds must be at least 1, got 0")
    assert not list(tmp_path.iterdir())
    assert_usage_error(plexus_cli("train", "--seeds", "3"), "unrecognized arguments: --seeds")


@pytest.mark.slow
def test_compare_seeds_judges_each_spec_over_its_seeds(tmp_path):
    result = plexus_cli("compare", "allreduce", "ps", "--seeds", "2", "--steps", "30", "--workers", "2",
                        "--eval-every", "10", "--out", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert {j["name"] for j in out["configurations"]} == {"allreduce", "ps"}
    for j in out["configurations"]:
        assert j["runs"] == 2 and j["failed"] == 0 and j["best_accuracy"]["n"] == 2
        assert j["hyperparameter_count"] == len(extra_hyperparameters(j["name"]))
        assert j["cpu_seconds"]["mean"] > 0 and j["process_seconds"]["mean"] > 0 and j["why"]
    assert sorted(j["place"] for j in out["configurations"]) == [1, 2]
    runs = {(Path(r["run_dir"]).parent.name, Path(r["run_dir"]).name): r for r in out["runs"]}
    assert set(runs) == {("01-allreduce", "seed-0"), ("01-allreduce", "seed-1"), ("02-ps", "seed-0"),
                         ("02-ps", "seed-1")}
    assert [runs[("02-ps", f"seed-{s}")]["settings"]["seed"]["value"] for s in (0, 1)] == [0, 1]
    assert runs[("01-allreduce", "seed-0")]["processes"] == 2 and runs[("02-ps", "seed-0")]["processes"] == 3
    assert all(r["cpu_seconds"] > 0 for r in out["runs"])
    text = result.stdout
    assert "plexus compare: judging" in text and "extra hyper-params" in text and "CPU-s" in text
    assert "<h2>Judging (2 seeds per configuration)</h2>" in (tmp_path / "index.html").read_text()
