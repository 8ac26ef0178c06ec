import time, torch, cProfile, pstats, io
def sendcost(group) -> dict:
    from plexus.cluster.group import Link
    from plexus.cluster.traffic import Traffic
    torch.set_num_threads(1)
    me, peer = group.names[group.rank], group.names[1 - group.rank]
    link = Link(group.store, me, peer, traffic=Traffic(), timeout=10)
    n = 32 * 1024
    buf = torch.ones(n); got = torch.empty(n)
    out = {}
    for rep in range(2):
        ts, tr = [], []
        for i in range(200):
            if group.rank == 0:
                t = time.perf_counter(); w = link.isend(buf, link.peer_index, i); w.wait(); ts.append(time.perf_counter() - t)
                link.recv_from_peer(got, tag=10**6 + i)  # ack
            else:
                time.sleep(0.0005)  # the message is there before we ask
                t = time.perf_counter(); link.recv_from_peer(got, tag=i); tr.append(time.perf_counter() - t)
                link.send_to_peer(buf[:1], tag=10**6 + i)
        (ts if ts else tr).sort()
        v = ts if ts else tr
        out[rep] = 1e6 * v[len(v)//2]
    if group.rank == 0:
        pr = cProfile.Profile(); pr.enable()
        for i in range(200):
            link.isend(buf, link.peer_index, 5000 + i).wait(); link.recv_from_peer(got, tag=10**7 + i)
        pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12); out["prof"] = s.getvalue()
    else:
        for i in range(200):
            link.recv_from_peer(got, tag=5000 + i); link.send_to_peer(buf[:1], tag=10**7 + i)
    link.close()
    return out
