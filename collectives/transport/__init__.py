"""Transports run compiled plans: ``mpi`` over MPI point-to-point, ``local`` for every
rank inside one process. Both share :class:`~collectives.transport.engine.Execution`."""
