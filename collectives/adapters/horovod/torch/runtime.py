"""What ``init`` made on this process: the communicators, the registered
process sets, and the calls made but not finished (the queue that every wait starts).
One state per process, None before ``init`` and after ``shutdown``."""


class State:
    def __init__(self, mpi_comm, global_set, local_rank, local_size, cross_rank, cross_size, homogeneous, check):
        self.mpi_comm = mpi_comm  # this package's duplicate of init's comm: process sets are made from it
        self.local_rank, self.local_size = local_rank, local_size
        self.cross_rank, self.cross_size = cross_rank, cross_size
        self.homogeneous = homogeneous
        self.check = check  # negotiation before every call (COLLECTIVES_HOROVOD_CHECK)
        self.sets = {0: global_set}  # process set id -> its registered set
        self.next_id = 1
        self.queue = []  # calls made but not started, in call order
        self.running = []  # calls started, not yet finished
        self.names = {}  # (process set id, name) -> the call in flight under that name
        self.optimizer_steps = []  # per DistributedOptimizer made, by number: its step as join serves it (weakly)

    @property
    def comm(self):
        return self.sets[0].comm


_current = None


def current():
    """This process's state; None before ``init`` and after ``shutdown``."""
    return _current


def initialized():
    """This process's state; raises Horovod's ValueError before ``init``."""
    if _current is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _current


def begin(state):
    global _current
    _current = state


def end():
    """Forget the state (``shutdown``) and return it."""
    global _current
    state, _current = _current, None
    return state


def start_queued():
    """Start every queued call, in call order; then finish those whose messages are in
    (which frees their names)."""
    state = initialized()
    while state.queue:
        state.queue.pop(0).start()
    for call in list(state.running):
        call.done()
