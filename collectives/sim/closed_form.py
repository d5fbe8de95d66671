"""Closed forms under the α-β-γ model, for calls whose simulation grows too fast.

The simulator times a call by list scheduling every message (:mod:`.timing`). Where the
call is symmetric it works from representatives (``simulate.symmetry``), and p = 4096
takes seconds. Three rooted algorithms have no such symmetry: the root's ranks differ
in when they hear from it. Yet they send O(p²) messages. At p = 4096 that is 16 million
messages, and building every rank's plan alone would take minutes:

    broadcast direct            the root hands out p blocks, then every non-root
                                sends its block to the p-2 others
    broadcast scatter_allgather a binomial scatter, then a ring allgather
    reduce direct               a direct reduce_scatter, then every block to the root

For these, with equal blocks (p divides count) and folds in any order, this module
gives every rank's counters and the call's time in closed form. The counters are
each rank's, exact. ``tests/unit/test_sim.py`` holds both equal to the simulation at every p
from 2 to 40 and at 63, 64 and 100, with four roots, in place and not, and random α, β
and γ. ``costs`` uses
them above ``SIMULATED_UP_TO`` ranks. Beyond that size a two-level model (``ranks_per_node``)
still needs every rank's plan, since node links break the closed forms.

With c = α + b·β for a block of b bytes and g = b·γ:

- broadcast direct: the root sends 2(p-1) blocks one after another. The last rank gets
  its own block at (2p-3)c and then sends it to the p-2 other non-roots, one after
  another: max(2(p-1), 3p-5)·c.
- broadcast scatter_allgather: ⌈lg p⌉ scatter steps, then p-1 ring steps, one block
  each: (⌈lg p⌉ + p-1)·α + 2(p-1)·b·β.
- reduce direct: the direct reduce_scatter, max((p-1)c + g, c + (p-1)g), then the root
  receives the p-1 other blocks one after another, (p-1)c.
"""

import math

ROOTED = (("broadcast", "direct"), ("broadcast", "scatter_allgather"), ("reduce", "direct"))
SIMULATED_UP_TO = 128  # ranks: simulated up to this size (about a second here), closed forms above


def applies(collective, algorithm, world_size, count, ordered=False):
    """Whether :func:`rooted_counters` and :func:`rooted_time` give this call: one of
    ``ROOTED``, with equal blocks and its reduction in any order."""
    # count > 0: a plan drops its operations on zero elements, which the forms count.
    return (collective, algorithm) in ROOTED and world_size > 1 and count > 0 and count % world_size == 0 \
        and not ordered


def rooted_counters(collective, algorithm, world_size, count, itemsize, root):
    """``(messages sent, bytes sent, bytes received, bytes reduced)``, each a list with
    one entry per rank, for a call that :func:`applies`."""
    p, b = world_size, count // world_size * itemsize
    rows = []
    for r in range(p):
        vr = (r - root) % p  # the rank counted from the root
        if (collective, algorithm) == ("broadcast", "direct"):
            row = (2 * (p - 1), 2 * (p - 1) * b, 0, 0) if vr == 0 else (p - 2, (p - 2) * b, p * b, 0)
        elif (collective, algorithm) == ("reduce", "direct"):
            row = (p - 1, (p - 1) * b, 2 * (p - 1) * b, (p - 1) * b) if vr == 0 else (p, p * b, (p - 1) * b,
                                                                                      (p - 1) * b)
        else:  # scatter_allgather: this rank's subtree of the binomial scatter, then the ring's p-1 blocks
            lowest = vr & -vr if vr else 1 << (p - 1).bit_length()  # the scatter's step it receives at
            subtree = min(lowest, p - vr) if vr else p  # the blocks it gets (the root: has)
            children = sum(1 for k in range(lowest.bit_length() - 1) if vr + (1 << k) < p)
            row = (children + p - 1, (subtree - 1 + p - 1) * b, ((subtree if vr else 0) + p - 1) * b, 0)
        rows.append(row)
    return [list(column) for column in zip(*rows)]


def rooted_time(collective, algorithm, world_size, count, itemsize, alpha, beta, gamma):
    """The completion time in seconds of a call that :func:`applies`, under one level
    of the model (no ``ranks_per_node``)."""
    p, b = world_size, count // world_size * itemsize
    c, g = alpha + b * beta, b * gamma
    if (collective, algorithm) == ("broadcast", "direct"):
        return max(2 * (p - 1), 3 * p - 5) * c
    if (collective, algorithm) == ("broadcast", "scatter_allgather"):
        return ((p - 1).bit_length() + p - 1) * alpha + 2 * (p - 1) * b * beta
    if (collective, algorithm) == ("reduce", "direct"):
        return max((p - 1) * c + g, c + (p - 1) * g) + (p - 1) * c
    raise ValueError(f"no closed form for {collective} {algorithm}")


def allreduce_time(algorithm, p, nbytes, alpha, beta, gamma):
    """Allreduce time under the α-β-γ model for p a power of two and ``nbytes`` a
    multiple of 4·p (equal blocks); None where there is no closed form."""
    if p & (p - 1) or nbytes % (4 * p):
        return None
    b, lg = nbytes / p, int(math.log2(p))
    c, g = alpha + b * beta, b * gamma
    if algorithm == "ring":
        return (p - 1) * (c + g) + (p - 1) * c
    if algorithm == "direct":
        return (p - 1) * c + max((p - 1) * c + g, c + (p - 1) * g)
    if algorithm == "recursive_halving":
        return 2 * lg * alpha + 2 * (p - 1) * b * beta + (p - 1) * b * gamma
    if algorithm == "recursive_doubling":
        return lg * (alpha + nbytes * beta + nbytes * gamma)
    return None
