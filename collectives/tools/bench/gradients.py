"""The reference the training benchmarks check gradients against."""

import numpy as np
from mpi4py import MPI


def mean_gradients(named_parameters, world):
    """``{name: the mean over ranks of its .grad}`` (float64, MPI's own allreduce)."""
    mean = {}
    for name, p in named_parameters:
        total = np.empty(tuple(p.shape), np.float64)
        world.Allreduce(p.grad.detach().cpu().numpy().astype(np.float64), total, op=MPI.SUM)
        mean[name] = total / world.Get_size()
    return mean
