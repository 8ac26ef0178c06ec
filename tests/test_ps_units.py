"""The parameter server's pure parts: protocol, sharding, consistency gates, staleness,
server optimizers, and the ps strategy's configuration checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from plexus.config import JobConfig, OptimConfig
from plexus.errors import ConfigError, ProtocolError
from plexus.ps.consistency import ASP, BSP, SSP, Push, SoftSync, is_synchronous, make_consistency
from plexus.ps.optimizers import make_server_optimizer
from plexus.ps.protocol import (HEADER_LEN, Header, Op, ShardSpec, Status, check_reply, check_request, decode,
                                encode, header_buffer, request_payloads, reply_payloads)
from plexus.ps.sharding import HashRing, RangeSharding
from plexus.ps.staleness import StalenessHistogram, staleness_lr_scale
from plexus.strategies import strategy_class

SPEC = ShardSpec(index=1, start=10, stop=25, dtype=torch.float32, total=40, rows=1000, width=4, owned_rows=300)


def _request(**kw) -> Header:
    fields = dict(op=Op.PUSH_PULL, sender=3, shard=1, clock=7, version=5, offset=10, count=15, dtype=1, total=40,
                  rows=1000)
    fields.update(kw)
    return Header(**fields)


# --- protocol --------------------------------------------------------------------------

def test_header_round_trip_through_an_oversized_buffer():
    header = _request(keys=12, width=4, op=Op.SPARSE_PUSH)
    buf = header_buffer()
    buf[:HEADER_LEN] = encode(header)
    assert decode(buf) == header
    assert decode(encode(header)) == header
    assert request_payloads(header) == [(15, torch.float32), (12, torch.int64), (48, torch.float32)]
    assert reply_payloads(_request(op=Op.SPARSE_PULL, keys=12, width=4)) == [(15, torch.float32),
                                                                              (48, torch.float32)]


def _tamper(index: int, value: int, resign: bool = True) -> torch.Tensor:
    from plexus.ps.protocol import _checksum
    message = encode(_request())
    message[index] = value
    if resign:
        message[-1] = _checksum(message[:-1].tolist())
    return message


@pytest.mark.parametrize("message, words", [
    (_tamper(1, 99), "unknown operation 99"),                      # unknown op
    (_tamper(0, 12345), "magic"),                                  # not our protocol
    (_tamper(5, 8, resign=False), "checksum"),                     # garbled
    (encode(_request())[:HEADER_LEN - 3], f"not {HEADER_LEN} int64"),         # too short (exact buffer)
    (_tamper(7, -4), "negative count"),                            # negative length
    (_tamper(14, 9), "unknown status"),
])
def test_decode_rejects_malformed_headers(message, words):
    with pytest.raises(ProtocolError, match=words):
        decode(message, "worker 3")


def test_decode_detects_long_and_short_headers_in_a_receive_buffer():
    long = header_buffer()
    long[:HEADER_LEN + 4] = torch.cat([encode(_request()), torch.arange(4)])
    with pytest.raises(ProtocolError, match=f"longer than {HEADER_LEN}"):
        decode(long, "worker 3")
    short = header_buffer()
    short[:HEADER_LEN - 2] = encode(_request())[:HEADER_LEN - 2]
    with pytest.raises(ProtocolError, match="checksum"):
        decode(short, "worker 3")


@pytest.mark.parametrize("header, words", [
    (_request(sender=4), "link belongs to worker 3"),
    (_request(shard=0), "arrived at server 1"),
    (_request(dtype=2), "dtype code 2"),
    (_request(offset=11), "not this shard's"),                     # range outside the shard
    (_request(count=16), "not this shard's"),                      # wrong length
    (_request(op=Op.SPARSE_PULL, keys=301, width=4), "exceed the 300 rows"),
    (_request(op=Op.SPARSE_PULL, keys=3, width=5), "row width 5"),
    (_request(op=Op.BYE, count=3), "carries no payload"),
    (_request(op=Op.REPLY), "may not send replies"),
    (_request(op=Op.INIT, total=41), "layout"),
])
def test_check_request_rejects_what_the_shard_cannot_serve(header, words):
    with pytest.raises(ProtocolError, match=words):
        check_request(header, SPEC, 3, "worker 3")


def test_check_request_accepts_well_formed_requests():
    for header in (_request(), _request(op=Op.PULL), _request(op=Op.SPARSE_PULL, keys=300, width=4),
                   _request(op=Op.BYE, count=0, offset=0), _request(op=Op.INIT, keys=300, width=4)):
        check_request(header, SPEC, 3, "worker 3")


def test_check_reply_matches_the_request():
    request = _request()
    ok = Header(op=Op.REPLY, sender=1, shard=1, count=15, status=Status.OK)
    check_reply(ok, request, "server 1")
    with pytest.raises(ProtocolError):
        check_reply(Header(op=Op.REPLY, sender=1, shard=1, count=14), request, "server 1")
    check_reply(Header(op=Op.REPLY, sender=1, shard=1, status=Status.LOST), request, "server 1")


# --- sharding ------------------------------------------------------------------------------

@pytest.mark.parametrize("numel, servers", [(0, 1), (1, 3), (7, 3), (13, 5), (1001, 2), (4, 9), (12345, 7)])
def test_every_element_has_exactly_one_owner_and_ranges_balance(numel, servers):
    sharding = RangeSharding(numel, servers)
    owners = [sharding.owner(i) for i in range(numel)]
    for s in range(servers):
        start, stop = sharding.range(s)
        assert owners[start:stop] == [s] * (stop - start)
    assert sum(sharding.size(s) for s in range(servers)) == numel
    sizes = [sharding.size(s) for s in range(servers)]
    assert max(sizes) - min(sizes) <= 1


def test_tensor_boundaries_do_not_matter_with_more_servers_than_tensors():
    """A model with 3 tensors of odd sizes over 5 servers: the ranges tile the flat buffer."""
    sizes = [3, 7, 1]
    sharding = RangeSharding(sum(sizes), 5)
    covered = sorted(i for s in range(5) for i in range(*sharding.range(s)))
    assert covered == list(range(sum(sizes)))


def test_hash_ring_is_deterministic_balanced_and_consistent():
    keys = torch.arange(60_000)
    ring = HashRing(4, vnodes=64)
    owners = ring.owners(keys)
    assert torch.equal(owners, HashRing(4, vnodes=64).owners(keys))
    counts = torch.bincount(owners, minlength=4).tolist()
    assert min(counts) > 0.6 * 15_000 and max(counts) < 1.4 * 15_000, counts
    parts = [ring.keys_of(s, 60_000) for s in range(4)]
    assert sorted(torch.cat(parts).tolist()) == keys.tolist()
    # Adding a fifth server moves only the rows it takes over (about a fifth).
    moved = ring.owners(keys) != HashRing(5, vnodes=64).owners(keys)
    assert bool((HashRing(5, vnodes=64).owners(keys)[moved] == 4).all())
    assert 0.1 < moved.float().mean().item() < 0.3


# --- consistency ---------------------------------------------------------------------------

def _push(worker: int, clock: int, version: int = 0) -> Push:
    return Push(worker, clock, version, f"w{worker}c{clock}")


def _gate(gate, workers: int):
    for w in range(workers):
        gate.join(w, 0)
    return gate


def test_bsp_averages_each_clock_once_in_rank_order_and_survives_a_loss():
    gate = _gate(BSP(), 3)
    assert gate.push(_push(2, 0)) == [] and gate.push(_push(0, 0)) == []
    assert not gate.may_serve(0, 1)
    assert gate.blockers(0, 1) == [1]
    (group,) = gate.push(_push(1, 0))
    assert [p.worker for p in group] == [0, 1, 2] and gate.may_serve(2, 1)
    gate.push(_push(0, 1))
    gate.push(_push(1, 1))
    assert gate.pending() == 2
    (group,) = gate.leave(2)  # worker 2 lost: clock 1 goes on without it
    assert [p.worker for p in group] == [0, 1] and gate.may_serve(0, 2)
    assert not BSP.accepts_joins


def test_bsp_flushes_every_pending_clock_when_the_last_worker_leaves():
    gate = _gate(BSP(), 2)
    gate.push(_push(0, 0))
    gate.push(_push(0, 1))
    assert gate.leave(1) == [[_push(0, 0)], [_push(0, 1)]]
    assert gate.leave(0) == [] and gate.pending() == 0


def test_asp_applies_on_arrival():
    gate = _gate(ASP(), 2)
    assert gate.push(_push(1, 0)) == [[_push(1, 0)]]
    assert gate.may_serve(1, 100)


def test_pushes_must_come_in_clock_order_from_live_workers():
    gate = _gate(ASP(), 1)
    with pytest.raises(ValueError, match="expected clock 0"):
        gate.push(_push(0, 1))
    with pytest.raises(ValueError, match="not live"):
        gate.push(_push(5, 0))


def test_ssp_bounds_how_far_ahead_a_worker_reads():
    gate = _gate(SSP(2), 3)
    for clock in range(4):
        assert gate.push(_push(0, clock)) == [[_push(0, clock)]]
    assert gate.may_serve(0, 2) and not gate.may_serve(0, 3)  # slowest at 0: 3 - 2 > 0
    assert gate.blockers(0, 4) == [1, 2]
    gate.push(_push(1, 0))
    gate.push(_push(2, 0))
    assert gate.may_serve(0, 3) and not gate.may_serve(0, 4)
    gate.leave(1)
    gate.leave(2)
    assert gate.may_serve(0, 4)
    # A worker joining later starts at the slowest live clock and holds nobody back.
    assert gate.join(7) == 4


def test_ssp_zero_is_bsp_and_synchrony_is_recognised():
    assert isinstance(make_consistency("ssp", 4, staleness=0), BSP)
    assert isinstance(make_consistency("softsync", 4), SoftSync) and make_consistency("softsync", 4).n == 4
    assert is_synchronous("bsp", 4) and is_synchronous("ssp", 4, 0) and is_synchronous("softsync", 4, 0, 4)
    assert is_synchronous("asp", 1) and not is_synchronous("asp", 2) and not is_synchronous("ssp", 2, 1)
    assert not is_synchronous("softsync", 4, 0, 2)


def test_softsync_groups_n_pushes_and_answers_after_the_group():
    gate = _gate(SoftSync(2), 4)
    assert gate.push(_push(3, 0)) == [] and not gate.may_serve(3, 1)
    (group,) = gate.push(_push(1, 0))
    assert [p.worker for p in group] == [1, 3] and gate.may_serve(3, 1)
    gate.push(_push(0, 0))
    # Workers 1, 2 and 3 finish: worker 0 waits alone on a group nobody can fill.
    gate.leave(1)
    gate.leave(2)
    assert gate.leave(3) == [[_push(0, 0)]]


def test_softsync_with_n_equal_to_workers_is_bsp_and_n_one_is_asp():
    sync, bsp = _gate(SoftSync(3), 3), _gate(BSP(), 3)
    for w in (2, 0, 1):
        a, b = sync.push(_push(w, 0)), bsp.push(_push(w, 0))
    assert a == b and len(a[0]) == 3
    assert _gate(SoftSync(1), 3).push(_push(1, 0)) == [[_push(1, 0)]]


# --- staleness ------------------------------------------------------------------------------

def test_staleness_histogram_and_lr_scale():
    hist = StalenessHistogram()
    for s in (0, 3, 3, 1):
        hist.record(s)
    assert hist.counts == [1, 1, 0, 2] and hist.total == 4 and hist.mean == pytest.approx(1.75) and hist.max == 3
    merged = hist.merge(StalenessHistogram([0, 0, 0, 0, 0, 1]))
    assert merged.counts == [1, 1, 0, 2, 0, 1] and hist.counts == [1, 1, 0, 2]
    assert staleness_lr_scale([4]) == 0.25 and staleness_lr_scale([0]) == 1.0
    assert staleness_lr_scale([1, 3]) == 0.5 and staleness_lr_scale([]) == 1.0


# --- server optimizers ---------------------------------------------------------------------

@pytest.mark.parametrize("optimizer, momentum, wd", [("sgd", 0.0, 0.0), ("sgd", 0.9, 0.0), ("sgd", 0.9, 0.01),
                                                     ("adagrad", 0.9, 0.0), ("adam", 0.9, 0.01)])
def test_server_optimizers_follow_torch_optim(optimizer, momentum, wd):
    cfg = OptimConfig(optimizer=optimizer, lr=0.05, momentum=momentum, weight_decay=wd)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(37, generator=gen)
    grads = [torch.randn(37, generator=gen) for _ in range(6)]
    theirs = torch.nn.Parameter(start.clone())
    klass = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[optimizer]
    kwargs = {"momentum": momentum} if optimizer == "sgd" else {}
    opt = klass([theirs], lr=0.05, weight_decay=wd, **kwargs)
    ours = start.clone()
    server = make_server_optimizer(cfg, 37)
    for g in grads:
        theirs.grad = g.clone()
        opt.step()
        server.step(ours, g)
        server.tick()
    assert torch.allclose(ours, theirs.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("optimizer, momentum", [("sgd", 0.0), ("sgd", 0.9), ("adagrad", 0.0), ("adam", 0.0)])
def test_sparse_rows_update_like_the_dense_rows_they_touch(optimizer, momentum):
    """When every step touches the same rows, the lazy row update equals the dense one."""
    cfg = OptimConfig(optimizer=optimizer, lr=0.1, momentum=momentum)
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(10, 3, generator=gen)
    dense = table.clone().reshape(-1)
    rows = torch.tensor([1, 4, 7])
    sparse_opt, dense_opt = make_server_optimizer(cfg, 0, 10, 3), make_server_optimizer(cfg, 30)
    for _ in range(4):
        g = torch.randn(3, 3, generator=gen)
        sparse_opt.step_rows(table, rows, g)
        sparse_opt.tick()
        full = torch.zeros(10, 3)
        full[rows] = g
        if optimizer in ("sgd",):
            dense_opt.step(dense, full.reshape(-1))
            dense_opt.tick()
    if optimizer == "sgd":
        assert torch.allclose(table.reshape(-1), dense, atol=1e-6)
    untouched = [0, 2, 3, 5, 6, 8, 9]
    assert torch.equal(table[untouched], torch.randn(10, 3, generator=torch.Generator().manual_seed(1))[untouched])


def test_staleness_lr_scale_scales_the_step():
    cfg = OptimConfig(optimizer="sgd", lr=0.5, momentum=0.0)
    params = torch.ones(4)
    make_server_optimizer(cfg, 4).step(params, torch.ones(4), lr_scale=0.5)
    assert torch.allclose(params, torch.full((4,), 0.75))


# --- configuration ---------------------------------------------------------------------------

@pytest.mark.parametrize("flat, words", [
    (dict(workers=2, softsync=3), "softsync must not exceed workers"),
    (dict(workers=2, peer_timeout=60, timeout=30), "peer_timeout must be shorter"),
])
def test_ps_rejects_impossible_combinations(flat, words):
    cfg = JobConfig.from_flat({"strategy": "ps", "batch_size": 8, **flat})
    with pytest.raises(ConfigError, match=words):
        strategy_class("ps").check_config(cfg)


def test_ps_roles_and_fault_tolerance():
    cls = strategy_class("ps")
    cfg = JobConfig.from_flat({"strategy": "ps", "workers": 2, "batch_size": 8})
    assert cls.extra_roles(cfg) == [("server", 1)]
    assert cls.extra_roles(cfg.replace(servers=3)) == [("server", 3)]
    assert cls.tolerates_loss(cfg, "worker", 0) and not cls.tolerates_loss(cfg, "server", 0)


def test_summary_counts_a_push_once_whatever_the_shards():
    cls = strategy_class("ps")
    cfg = JobConfig.from_flat({"strategy": "ps", "workers": 2, "servers": 2, "batch_size": 8, "consistency": "asp"})
    server = {"applied": {"0": 10, "1": 7}, "acked": {"0": 10, "1": 6}, "staleness_counts": [3, 10, 4],
              "lost": {"1": "no heartbeat"}, "joined": {}, "protocol_errors": 0, "version": 17, "bytes_recv": 5}
    other = {**server, "applied": {"0": 10, "1": 6}, "acked": {"0": 10, "1": 6}, "staleness_counts": [1]}
    fields = cls.summary_fields(cfg, {"worker": {0: {"steps": 10, "wall_seconds": 2.0}}, "server": {0: server, 1: other},
                                      "eval": {}})
    assert fields["updates_applied"] == 17 and fields["pushes_acknowledged"] == 16
    assert fields["staleness_histogram"] == [4, 10, 4] and fields["staleness_max"] == 2
    assert fields["lost_workers"] == [1] and fields["server_versions"] == [17, 17]
    assert fields["wall_seconds"] == 2.0 and fields["samples"] == 40 and fields["samples_per_second"] == 20.0


def test_hash_ring_rejects_negative_keys():
    with pytest.raises(ValueError):
        HashRing(2).owners(np.array([-1]))


def test_server_divides_the_lr_of_stale_pushes_with_staleness_lr():
    """--staleness-lr: an update whose push is 4 versions stale moves the weights a quarter
    as far (Zhang et al. 2016); without it, as far as a fresh one."""
    import torch.distributed as dist

    from plexus.cluster.rendezvous import host_store
    from plexus.cluster.traffic import Traffic
    from plexus.ps.server import ParameterServer, _Payload

    store = dist.PrefixStore("job/", host_store("127.0.0.1", 0, "t", 10))
    moved = {}
    for flag in (False, True):
        cfg = JobConfig.from_flat({"strategy": "ps", "workers": 1, "batch_size": 1, "optimizer": "sgd",
                                   "momentum": 0.0, "lr": 1.0, "staleness_lr": flag})
        server = ParameterServer(store, 0, cfg, Traffic())
        server._layout(Header(op=Op.INIT, sender=0, shard=0, total=3, dtype=1), "worker 0")
        server.optimizer = make_server_optimizer(cfg.optim, 3)
        server.version = 4
        server._apply([[Push(0, 0, 0, _Payload(torch.ones(3), None, None, [(0, 0)]))]])
        moved[flag] = -server.params[0].item()
        assert server.histogram.counts == [0, 0, 0, 0, 1] and server.version == 5
    assert moved == {False: 1.0, True: 0.25}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64])
def test_payload_mark_tells_a_short_message(dtype):
    from plexus.ps.protocol import mark_payload, payload_short
    buf = torch.zeros(5, dtype=dtype)
    mark_payload(buf)
    assert payload_short(buf)
    buf[:4] = 1  # a message one element short
    assert payload_short(buf)
    buf[4] = 1   # the full message
    assert not payload_short(buf)
