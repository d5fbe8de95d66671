"""A parameter-server allreduce, as a schedule: the baseline the projections compare
the allreduce algorithms with (the architecture allreduce replaced).

    servers  0 .. S-1        hold one shard each (the buffer cut into S blocks)
    workers  S .. p-1        push: send shard s of the gradient to server s
                             pull: receive shard s of the result from server s

A server receives the W = p - S workers' shards one at a time, adds them up in arrival
order (two receive slots, double buffered) and sends the sum back to every worker.
Worker w starts with server w mod S so that the servers' first pushes are spread out.
Each server receives and sends W·n/S bytes: with one server that is W·n each way,
the bottleneck that grows with the workers; the allreduce algorithms send
≈ 2(p-1)/p·n per rank whatever p is. Servers contribute no data: the result on every
worker is the reduction over the workers' inputs. Any S < p works (the shards differ
by one element at most). The update rule a real server applies (SGD) is not modelled.
"""

from ..algorithms import block_bounds
from ..schedule import Schedule, sl


def allreduce(rank, size, count, *, servers, **_):
    s = Schedule([])
    workers = size - servers
    bounds = block_bounds(count, servers)
    if rank < servers:
        lo, hi = bounds[rank], bounds[rank + 1]
        width = hi - lo
        s.need_tmp(2 * width)
        acc = sl("out", lo, hi)
        order = [servers + (rank + k) % workers for k in range(workers)]
        for k, worker in enumerate(order):
            slot = sl("tmp", (k % 2) * width, (k % 2) * width + width)
            s.recv(worker, slot)
            if k == 0:
                s.copy(acc, slot)
            else:
                s.reduce(acc, acc, slot)
        for worker in order:
            s.send(worker, acc)
        return s
    w = rank - servers
    order = [(w + k) % servers for k in range(servers)]
    for server in order:
        s.send(server, sl("in", bounds[server], bounds[server + 1]))
    for server in order:
        s.recv(server, sl("out", bounds[server], bounds[server + 1]))
    return s
