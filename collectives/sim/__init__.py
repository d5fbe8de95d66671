"""The simulator: the library's own schedules, run for thousands of virtual ranks in
one process, without MPI, with exact cost counters and a timing model.

    import collectives as cc
    r = cc.sim.run("allreduce", "ring", world_size=64, count=4096)
    r.bytes_sent[0], r.rounds, r.time(alpha=5e-6, beta=1 / 12.5e9, gamma=1 / 50e9)

:func:`run` builds every rank's plan with the same code the MPI transport runs, moves
real NumPy data between the virtual ranks and checks every result against NumPy.
:func:`costs` gives the same counters and times without the data (for sweeps).

The timing model (:mod:`collectives.sim.timing`): a message of m bytes costs α + m·β;
a rank sends one message and receives one at a time; a reduction of m bytes costs m·γ
on its rank's processor; everything starts as soon as the schedule's dependencies
allow, and the predicted time is the critical path through them. Optionally two
levels: ranks per node (or one node label per rank), with inter-node α and β on a
link each node shares.

``python -m collectives.tools.sim`` projects time and bus bandwidth to thousands of ranks
(see :mod:`collectives.sim.project`).
"""

from .simulate import Costs, SimResult, algorithms, alltoallv_counts, costs, reference, run
from .timing import Model

__all__ = ["Costs", "Model", "SimResult", "algorithms", "alltoallv_counts", "costs", "reference", "run"]
