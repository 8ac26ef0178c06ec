"""cluster/: launcher hygiene, rendezvous and tokens, links, counters, timeouts, emulation."""
from __future__ import annotations

import dataclasses
import datetime as dt
import io
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from plexus.cluster.emulation import Emulator
from plexus.cluster.launcher import RoleSpec, launch
from plexus.cluster.liveness import exited_key, name_first_exit
from plexus.cluster.rendezvous import ProcessInfo, connect_store, host_store, new_token
from plexus.cluster.spawn import spawn
from plexus.config import ClusterConfig, parse_kill, parse_net, parse_slow
from plexus.errors import ConfigError, PeerLost
from procs import alive, role_processes
import warm_cli

PY = sys.executable


def processes_of(launcher_pid: int) -> list[int]:
    """Live role processes the launcher with this PID started (forked or spawned)."""
    return sorted(role_processes(launcher_pid).values())


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# --- launcher -------------------------------------------------------------------------

def test_launcher_returns_first_failure_and_stops_the_rest(capsys):
    code = "import os, sys, time\nr = int(os.environ['PLEXUS_ROLE_RANK'])\nprint('hello from', r)\n" \
           "if r == 1: sys.exit(7)\ntime.sleep(60)\n"
    start = time.monotonic()
    status = launch([PY, "-c", code], [RoleSpec("worker", r) for r in range(3)], sink=sys.stdout)
    assert status == 7
    assert time.monotonic() - start < 10
    out = capsys.readouterr().out
    assert "[worker 1] hello from 1" in out and "worker 1 exited with status 7" in out
    assert processes_of(os.getpid()) == []


def test_launcher_hears_the_exits_just_after_the_first_failure(tmp_path):
    """A process's peers exit on losing it, and the fork server may report a peer's exit
    before the lost process's own: the launcher keeps hearing exits for a moment after the
    first failure, so that the job can name the first to die. Rank 0 fails; rank 1 dies by
    a signal once the launcher has heard that (as a process the OOM killer took would,
    while its peers exit on losing it); rank 2 would sleep on and is stopped."""
    heard_path = tmp_path / "heard"
    code = (f"import os, signal, sys, time\nr = int(os.environ['PLEXUS_ROLE_RANK'])\n"
            f"if r == 0:\n    sys.exit(1)\nif r == 2:\n    time.sleep(60)\n"
            f"while not os.path.exists({str(heard_path)!r}):\n    time.sleep(0.005)\n"
            f"os.kill(os.getpid(), signal.SIGKILL)\n")
    heard, said = [], io.StringIO()

    def on_exit(spec, code):
        heard.append((spec.rank, code))
        heard_path.touch()  # rank 1 dies only after the launcher has heard rank 0

    status = launch([PY, "-c", code], [RoleSpec("worker", r) for r in range(3)], sink=said, on_exit=on_exit)
    assert heard == [(0, 1), (1, 137)], heard
    # The signal death is the likelier cause: it is the one named, and its status returned.
    assert status == 137 and "worker 1 exited with status 137; stopping the job" in said.getvalue()
    assert "worker 0 exited" not in said.getvalue()
    assert processes_of(os.getpid()) == []


def test_launcher_kills_a_child_that_ignores_sigterm(tmp_path):
    # Rank 1 says it ignores SIGTERM by creating `ready`; rank 0 fails only then (status 4
    # if it never does), so the launcher's SIGTERM is the one rank 1 ignores.
    ready = str(tmp_path / "ready")
    code = f"import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nopen({ready!r}, 'w').close()\n" \
           "time.sleep(60)\n"
    fail = f"import os, sys, time\nend = time.monotonic() + 4\n" \
           f"while not os.path.exists({ready!r}) and time.monotonic() < end:\n    time.sleep(0.01)\n" \
           f"sys.exit(3 if os.path.exists({ready!r}) else 4)\n"
    start = time.monotonic()
    status = launch([PY, "-c", f"import os\nexec({fail!r} if os.environ['PLEXUS_ROLE_RANK'] == '0' else {code!r})"],
                    [RoleSpec("worker", 0), RoleSpec("worker", 1)], grace=1.0, sink=open(os.devnull, "w"))
    assert status == 3
    assert time.monotonic() - start < 5
    assert processes_of(os.getpid()) == []


def test_launcher_tolerates_accepted_failures():
    code = "import os, sys\nsys.exit(9 if os.environ['PLEXUS_ROLE_RANK'] == '0' else 0)"
    status = launch([PY, "-c", code], [RoleSpec("worker", 0), RoleSpec("worker", 1)],
                    may_fail=lambda spec, code: spec.rank == 0, sink=open(os.devnull, "w"))
    assert status == 0


def _start_training(tmp_path: Path, *extra: str) -> warm_cli.Command:
    """``plexus train`` in a session of its own, forked from the tests' warm helper (a
    launcher as the console script's, without paying torch's import again)."""
    out = tmp_path / "run"
    proc = warm_cli.popen(["train", "--workers", "2", "--time-limit", "120", "--out", str(out), "--quiet", *extra])
    assert wait_until(lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0, 60), \
        proc.communicate(timeout=10)[1] if proc.poll() is not None else "training never started"
    assert len(processes_of(proc.pid)) == 2
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_leaves_no_process(tmp_path, sig):
    proc = _start_training(tmp_path)
    started = processes_of(proc.pid)
    proc.send_signal(sig)
    proc.wait(timeout=5)
    assert proc.returncode == 128 + sig
    assert wait_until(lambda: not any(map(alive, started)), 5), [p for p in started if alive(p)]


@pytest.mark.slow
def test_sigkill_of_launcher_takes_children_down(tmp_path):
    proc = _start_training(tmp_path)
    started = processes_of(proc.pid)
    proc.kill()
    proc.wait(timeout=5)
    assert wait_until(lambda: not any(map(alive, started)), 5), [p for p in started if alive(p)]


@pytest.mark.slow
def test_killed_child_ends_job_with_its_status(tmp_path):
    proc = _start_training(tmp_path, "--timeout", "5")
    started = processes_of(proc.pid)
    os.kill(started[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode != 0
    assert "exited with status" in err
    assert wait_until(lambda: not any(map(alive, started)), 5)


# --- rendezvous -----------------------------------------------------------------------

def _info(token: str, port: int) -> ProcessInfo:
    return ProcessInfo(role="worker", rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, token=token)


def test_token_is_checked_at_rendezvous():
    token = new_token()
    store = host_store("127.0.0.1", 0, token, timeout=5)
    connect_store(_info(token, store.port), timeout=5)
    with pytest.raises(ConfigError, match="token does not match"):
        connect_store(_info("wrong-token", store.port), timeout=5)


def test_under_torchrun_the_process_with_the_wrong_token_is_refused_even_when_it_comes_first(monkeypatch):
    """torchrun's agent store holds no token: global rank 0's token is the job's. A rank
    with another token that arrives first waits for rank 0's, and is the one refused."""
    agent = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=dt.timedelta(seconds=5),
                          wait_for_workers=False)
    errors, waiting, store_class = [], threading.Event(), dist.TCPStore

    class Watched:
        """Rank 1's client store, which says when rank 1 starts waiting for the token."""

        def __init__(self, *args, **kwargs) -> None:
            self.store = store_class(*args, **kwargs)

        def wait(self, *args) -> None:
            waiting.set()
            self.store.wait(*args)

        def __getattr__(self, name: str):
            return getattr(self.store, name)

    def early() -> None:
        info = dataclasses.replace(_info("wrong-token", agent.port), rank=1)
        try:
            connect_store(info, timeout=5)
        except ConfigError as exc:
            errors.append(str(exc))

    monkeypatch.setattr(dist, "TCPStore", Watched)
    thread = threading.Thread(target=early)
    thread.start()
    assert waiting.wait(timeout=10), "rank 1 never waited for the token"
    monkeypatch.setattr(dist, "TCPStore", store_class)  # rank 0's store is a real one
    connect_store(dataclasses.replace(_info("right-token", agent.port), stamps_token=True), timeout=5)
    thread.join(timeout=10)
    assert len(errors) == 1 and "worker 1: refused" in errors[0] and "token does not match" in errors[0]


def test_port_in_use_is_a_config_error():
    store = host_store("127.0.0.1", 0, new_token(), timeout=5)
    with pytest.raises(ConfigError, match=f"port {store.port} .* already in use"):
        host_store("127.0.0.1", store.port, new_token(), timeout=5)


def test_job_keys_are_namespaced_by_token():
    a, b = new_token(), new_token()
    store = host_store("127.0.0.1", 0, a, timeout=5)
    ns = connect_store(_info(a, store.port), timeout=5)
    ns.set("secret", "1")
    assert not dist.PrefixStore(f"plexus/{b}/", store).check(["secret"])


# --- links, groups, counters, timeouts ------------------------------------------------

@pytest.mark.slow
def test_timeout_names_the_silent_peer():
    results = spawn("dist_fns:recv_timeout", 2, {"timeout": 1.0})
    assert results[0].startswith("CommTimeout"), results[0]
    assert "worker 1 did not answer within 1 s" in results[0] and "[peer=worker 1]" in results[0]


def test_a_lost_peer_names_the_process_that_exited_first():
    """With worker 1 killed in a ring, worker 2 exits on losing it and worker 0 sees
    worker 2's link close: worker 0's line names worker 1 too, by the launcher's records."""
    everyone = ["worker 0", "worker 1", "worker 2"]
    store = dist.HashStore()
    lost = PeerLost("worker 0: ring all-reduce: lost worker 2 (its end of the link closed)", peer="worker 2")
    assert name_first_exit(lost, store, "worker 0", everyone) is lost  # nothing recorded
    store.set(exited_key("worker 1"), repr(100.0))
    named = name_first_exit(lost, store, "worker 0", everyone)
    assert isinstance(named, PeerLost) and named.peer == "worker 2"
    assert str(named) == f"{lost}; worker 1 exited first"
    store.set(exited_key("worker 2"), repr(100.2))  # recorded later than worker 1: the same
    assert str(name_first_exit(lost, store, "worker 0", everyone)) == str(named)
    # The lost peer itself exited first: the line stands as it was.
    store.set(exited_key("worker 1"), repr(101.0))
    assert name_first_exit(lost, store, "worker 0", everyone) is lost


@pytest.mark.slow
def test_counters_count_every_message():
    numel, messages = 1000, 5
    results = spawn("dist_fns:count_traffic", 3, {"numel": numel, "messages": messages})
    for rank, snap in enumerate(results):
        right, left = f"worker {(rank + 1) % 3}", f"worker {(rank - 1) % 3}"
        assert snap[right]["bytes_sent"] == numel * 4 * messages and snap[right]["msgs_sent"] == messages
        assert snap[left]["bytes_recv"] == numel * 4 * messages and snap[left]["msgs_recv"] == messages


@pytest.mark.slow
def test_link_is_made_lazily_between_two_processes():
    results = spawn("dist_fns:link_pair", 2, {})
    assert results[1]["got"] == [1.0, 2.0, 3.0] and results[0]["got"] == [10.0, 20.0, 30.0]
    assert results[0]["traffic"]["worker 1"] == {"bytes_sent": 12, "bytes_recv": 12, "msgs_sent": 1, "msgs_recv": 1}


@pytest.mark.slow
def test_net_emulation_delays_sends():
    # 5 sends of 40 kB at 50 ms latency + 40 kB / 1 MB/s = 40 ms each: at least 0.45 s.
    results = spawn("dist_fns:timed_sends", 2, {"numel": 10_000, "messages": 5}, net="bandwidth=8mbit,latency=50ms")
    assert results[0] >= 0.45


def test_net_emulation_over_shared_memory_lets_the_sender_go_on_and_delivers_on_arrival():
    """40 kB at 1 MB/s (40 ms on the wire) with 100 ms latency: the first send returns at
    once, its receive completes no earlier than 140 ms; a second send waits for the
    interface to finish the first (40 ms) and arrives 40 ms after the first. Over gloo's
    sockets a send waits the whole 140 ms itself (the test above)."""
    import torch
    from plexus.cluster.group import link_pair
    a, b = link_pair("shm", net=parse_net("bandwidth=8mbit,latency=100ms"))
    try:
        message, into = torch.ones(10_000), torch.empty(10_000)
        start = time.monotonic()
        a.isend(message, a.peer_index).wait()
        first_sent = time.monotonic() - start
        receive = b.irecv(into, b.peer_index)
        assert not receive.is_completed()  # its token is there, the message has not arrived
        a.isend(message * 2, a.peer_index).wait()
        second_sent = time.monotonic() - start
        receive.wait()
        first_in = time.monotonic() - start
        b.irecv(into, b.peer_index).wait()
        second_in = time.monotonic() - start
    finally:
        a.close()
        b.close()
    assert first_sent < 0.1 and 0.04 <= second_sent < 0.14, (first_sent, second_sent)
    assert first_in >= 0.14 and second_in >= 0.18 and into[0].item() == 2.0, (first_in, second_in)


def test_emulated_interface_takes_in_one_message_at_a_time():
    """The receiving side of the emulated interface: three 40 kB messages due at the same
    moment at 1 MB/s (40 ms each on the wire) are in 40 ms apart; one read later whose bytes
    came in before the others' fits in a free span before them, and one that fits in none
    comes in after the last."""
    from plexus.cluster.emulation import Interface
    net, ms = parse_net("bandwidth=8mbit,latency=10ms"), 1_000_000
    card = Interface()
    due = time.monotonic_ns() + 500 * ms
    assert [card.receive(net, 40_000, due) for _ in range(3)] == [due, due + 40 * ms, due + 80 * ms]
    assert card.receive(net, 40_000, due - 100 * ms) == due - 100 * ms  # [-140, -100) ms was free
    assert card.receive(net, 40_000, due - 50 * ms) == due - 50 * ms    # [-90, -50) ms was free too
    assert card.receive(net, 40_000, due - 20 * ms) == due + 120 * ms   # overlaps the first: after the third


@pytest.mark.slow
def test_net_emulation_serialises_messages_that_reach_one_process_together():
    """Incast: two workers send 40 kB each to a third at once, at 1 MB/s and 10 ms latency.
    Each leaves through its own sender's interface at once; the receiver's interface takes
    them in one after another, so the second is in 40 ms after the first (90 ms, not 50)."""
    results = spawn("dist_fns:incast", 3, {"numel": 10_000}, net="bandwidth=8mbit,latency=10ms")
    got = results[0]
    assert got["sums"] == [10_000.0, 20_000.0]
    # Measured from a barrier each process leaves at its own moment: a few ms of slack.
    assert got["first"] >= 0.035 and got["second"] - got["first"] >= 0.025, got


# --- emulation and its flags ----------------------------------------------------------

def test_flag_parsing():
    assert parse_slow("worker:0=4,worker:2=1.5")[1].factor == 1.5
    assert parse_kill("worker:1@step=50")[0].step == 50
    timed = parse_kill("coordinator:0@time=1.5s,server:1@time=2")
    assert [(k.role, k.seconds, k.step) for k in timed] == [("coordinator", 1.5, None), ("server", 2.0, None)]
    for bad in ("worker:1@step=x", "worker:1@when=3", "worker:1"):
        with pytest.raises(ConfigError, match="@step=N or @time=SECONDS"):
            parse_kill(bad)
    net = parse_net("bandwidth=100mbit,latency=2ms")
    assert net.bandwidth == 12.5e6 and net.latency == 0.002
    assert net.delay(12_500_000) == pytest.approx(1.002)
    for bad in ("worker=4", "node:0=2", "worker:0=0.5"):
        with pytest.raises(ConfigError):
            parse_slow(bad)
    with pytest.raises(ConfigError):
        parse_net("bandwidth=fast")
    with pytest.raises(ConfigError, match="must name an existing worker"):
        ClusterConfig(workers=2, slow=parse_slow("worker:5=2"))


def test_slow_worker_sleeps_its_factor():
    emu = Emulator(ClusterConfig(workers=2, slow=parse_slow("worker:1=3")), "worker", 1)
    start = time.perf_counter()
    emu.stretch(0.05)
    assert time.perf_counter() - start >= 0.1 and emu.slept == pytest.approx(0.1)
    assert Emulator(ClusterConfig(workers=2, slow=parse_slow("worker:1=3")), "worker", 0).factor == 1.0
