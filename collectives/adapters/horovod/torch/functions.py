"""Whole models, optimizers and Python objects from one rank to the others:
``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object`` and
``allgather_object``."""

import pickle

import numpy as np
import torch

from ... import torch as cct
from .mpi_ops import _check_name
from .negotiation import _negotiate, _record
from .optimizer import _HorovodOptimizer
from .process_sets import _global_rank_in, _ranks, _set_of, global_process_set
from .runtime import start_queued

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def _blocking(kind, hset, root=-1):
    """Before a blocking call that does not go through the queue (objects,
    parameters): the queued calls start, and the ranks negotiate this one."""
    start_queued()
    _negotiate(hset, _record(kind, root=root))


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``obj`` (pickled) on every rank of the process set."""
    hset = _set_of(process_set)
    _check_name(name)
    root = _global_rank_in(hset, root_rank)
    _blocking("broadcast_object", hset, root)
    return hset.comm.broadcast_object(obj, root=root)


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's ``obj`` (pickled), as a list in rank order."""
    hset = _set_of(process_set)
    _check_name(name)
    _blocking("allgather_object", hset)
    comm = hset.comm
    try:
        payload, problem = pickle.dumps(obj), None
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not wait for data
        payload, problem = b"", exc
    lengths = comm.allgather(np.array([len(payload) if problem is None else -1], np.int64)).ravel()
    failed = [r for r in range(comm.size) if lengths[r] < 0]
    if failed:
        raise TypeError(f"allgather_object: the object on rank(s) {_ranks(failed)} cannot be pickled") from problem
    longest = int(lengths.max())
    padded = np.zeros(longest, np.uint8)
    padded[:len(payload)] = np.frombuffer(payload, np.uint8)
    gathered = comm.allgather(padded)
    return [pickle.loads(gathered[r, :lengths[r]].tobytes()) for r in range(comm.size)]


def broadcast_parameters(params, root_rank):
    """Overwrite ``params`` on every rank with rank ``root_rank``'s, in place: a
    ``state_dict()``, ``named_parameters()``, ``parameters()`` or a list of tensors
    (``collectives.torch.broadcast_parameters``)."""
    if isinstance(params, torch.Tensor) or not (hasattr(params, "items") or hasattr(params, "__iter__")):
        raise ValueError(f"invalid params of type: {type(params).__name__} (pass a state_dict(), "
                         "named_parameters(), parameters() or a list of tensors)")
    hset = _set_of(global_process_set)
    root = _global_rank_in(hset, root_rank)
    _blocking("broadcast_parameters", hset, root)
    cct.broadcast_parameters(params, root=root, comm=hset.comm)


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Give every rank rank ``root_rank``'s optimizer state and hyperparameters
    (``collectives.torch.broadcast_optimizer_state``). As in Horovod, an optimizer
    without state first takes one step on zero gradients, which creates its state (its
    own step, not the DistributedOptimizer's: nothing is reduced); ``model`` tells
    which parameters have sparse gradients (``nn.Embedding(sparse=True)``), whose
    zero gradients are then sparse too."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    hset = _set_of(global_process_set)
    root = _global_rank_in(hset, root_rank)
    if not optimizer.state_dict()["state"]:  # Horovod's zero-gradient step
        sparse = {id(p) for m in (model.modules() if model is not None else ())
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse for p in m.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = p.detach().new_zeros(p.shape)
                    if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                        p.grad = p.grad.to_sparse()
        if isinstance(optimizer, _HorovodOptimizer):
            super(_HorovodOptimizer, optimizer).step()  # the wrapped optimizer's step: no reduction
        else:
            optimizer.step()
    _blocking("broadcast_parameters", hset, root)
    cct.broadcast_optimizer_state(optimizer, root=root, comm=hset.comm)
