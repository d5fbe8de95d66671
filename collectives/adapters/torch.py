"""PyTorch adapter: data-parallel training with the collectives, in the Horovod style.

    import collectives.torch as cct
    comm = cc.Communicator()
    cct.broadcast_parameters(model.state_dict(), comm=comm)     # rank 0's weights everywhere
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cct.broadcast_optimizer_state(optimizer, comm=comm)
    optimizer = cct.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), comm=comm)
    for x, y in my_shard:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()   # each gradient starts its bucket's allreduce as it is accumulated
        optimizer.step()                  # waits for the averaged gradients, then steps

CPU tensors are shared with the library zero-copy through NumPy (``Tensor.numpy()``),
CUDA tensors through DLPack as CuPy arrays (``pip install collectives[torch,cuda12]``):
then the gradient buckets live on the GPU, and the reducer's copies, casts and
collectives follow torch's current stream. torch is an optional extra (``pip install
collectives[torch]``): importing :mod:`collectives` never imports it.

Importing this module also registers the torch.distributed backend ``"collectives"``
(:mod:`collectives.torch_backend`) and, under ``mpiexec`` with several ranks and no
``MASTER_ADDR``, agrees on a rendezvous address: a gather and a broadcast on
``MPI.COMM_WORLD``, so every rank must import it, at the same point relative to its
own COMM_WORLD collectives.
"""

import collections

import torch

from . import optimizer_wrapping, training
from .tensors import to_array
from .training import TrainingError, default_communicator

__all__ = ["DistributedOptimizer", "TrainingError", "broadcast_optimizer_state", "broadcast_parameters",
           "check_parameters"]

def _named(params, what):
    """``(name, NumPy view)`` pairs, named and checked as ``training.named_arrays`` does."""
    return training.named_arrays(params, what, convert=lambda name, tensor: to_array(tensor, name, what))


def _by_place(named):
    """``named`` split into its CPU and its CUDA tensors (each group broadcast on its own:
    a ``state_dict`` or optimizer state may hold both, e.g. Adam's step counts)."""
    cpu = [(n, t) for n, t in named if not (isinstance(t, torch.Tensor) and t.device.type == "cuda")]
    cuda = [(n, t) for n, t in named if isinstance(t, torch.Tensor) and t.device.type == "cuda"]
    return [group for group in (cpu, cuda) if group]


def _pairs(params):
    items = list(params.items()) if hasattr(params, "items") else list(params)
    return [item if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) else (str(i), item)
            for i, item in enumerate(items)]


def broadcast_parameters(params, root=0, comm=None):
    """Overwrite ``params`` on every rank with ``root``'s values, in place: a
    ``state_dict()`` (parameters and buffers), ``named_parameters()`` or a list of
    tensors, on the CPU or on a GPU. Collective; every rank must pass the same names,
    shapes, dtypes and devices."""
    for group in _by_place(_pairs(params)):
        training.broadcast_parameters(_named(group, "params"), root=root, comm=comm)
    return params


def check_parameters(params, comm=None):
    """Raise :class:`TrainingError` on every rank unless every rank's ``params`` (a
    ``state_dict()``, ``named_parameters()`` or a list of tensors) have the same names,
    shapes, dtypes and bits; the message names the parameters and ranks that differ."""
    training.check_parameters(_named(params, "params"), comm)


_Placeholder = collections.namedtuple("_Placeholder", "shape dtype device")  # a tensor, in traversal order
_Refused = collections.namedtuple("_Refused", "reason")


def _rebuild(value, items):
    """``value``'s container type filled with ``items`` (namedtuples take them spread)."""
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)


def broadcast_optimizer_state(optimizer, root=0, comm=None):
    """Give every rank ``root``'s optimizer state (moments, step counts) and
    hyperparameters (learning rates ...), e.g. after rank 0 loaded a checkpoint.

    The structure of ``optimizer.state_dict()`` (small: names, numbers, shapes) goes
    with ``broadcast_object``; the tensors go as arrays with
    :func:`broadcast_parameters`. Ranks whose optimizer has no state yet get it
    created. Collective."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    comm = comm if comm is not None else default_communicator()
    tensors = []

    def strip(value):  # tensors -> placeholders, on root
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return _Placeholder(tuple(value.shape), str(value.dtype).replace("torch.", ""), value.device.type)
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return _rebuild(value, [strip(v) for v in value])
        return value

    def as_arrays(tensors):  # CPU and CUDA tensors in two groups
        return [_named(group, "optimizer state") for group in _by_place([(f"state.{i}", t)
                                                                        for i, t in enumerate(tensors)])]

    skeleton = None
    if comm.rank == root:
        try:  # the root's tensors are checked before any message, and a refusal reaches every rank
            skeleton = strip(optimizer.state_dict())
            groups = as_arrays(tensors)
        except (TypeError, ValueError) as exc:
            skeleton = _Refused(str(exc))
    skeleton = comm.broadcast_object(skeleton, root=root)
    if isinstance(skeleton, _Refused):
        raise TypeError(f"broadcast_optimizer_state: rank {root}'s state cannot be broadcast: {skeleton.reason}")
    if comm.rank != root:
        tensors = []

        here = next((p.device for g in optimizer.param_groups for p in g["params"] if p.device.type == "cuda"),
                    torch.device("cuda") if torch.cuda.is_available() else None)

        def fill(value):  # placeholders -> new tensors, on the other ranks (CUDA ones on this rank's GPU)
            if isinstance(value, _Placeholder):
                where = here if value.device == "cuda" else "cpu"
                tensors.append(torch.empty(value.shape, dtype=getattr(torch, value.dtype), device=where))
                return tensors[-1]
            if isinstance(value, dict):
                return {k: fill(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return _rebuild(value, [fill(v) for v in value])
            return value

        state = fill(skeleton)
        groups = as_arrays(tensors)
    for arrays in groups:
        training.broadcast_parameters(arrays, root=root, comm=comm)
    if comm.rank != root:
        optimizer.load_state_dict(state)


class _Distributed(optimizer_wrapping.WrappedOptimizer):
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer`."""

    def _setup(self, named_parameters, comm, reducer_options):
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(params)]
        else:
            named = [(n, p) for n, p in named_parameters if p.requires_grad]
            given = {id(p) for _, p in named}
            unnamed = sum(1 for p in params if id(p) not in given)
            if unnamed:
                raise ValueError(f"named_parameters leaves out {unnamed} parameter(s) the optimizer updates: pass "
                                 "model.named_parameters() of the model the optimizer was built from")
            mine = {id(p) for p in params}
            named = [(n, p) for n, p in named if id(p) in mine]
        self._reducer = training.GradientReducer(_named(named, "named_parameters"), comm, **reducer_options)
        self._synchronized = False
        self._hooks = optimizer_wrapping.hook_gradients(named, self._gradient)

    def _gradient(self, name, param):
        optimizer_wrapping.hand_over(self._reducer, name, param, param.grad)

    def synchronize(self):
        """Wait for the averaged gradients (now in every ``.grad``; on a GPU, ready on
        torch's current stream). ``step()`` calls it unless it was called since the last
        step (e.g. to clip the averaged gradients)."""
        self._reducer.synchronize()
        self._synchronized = True

    def step(self, closure=None):
        """Synchronize the gradients, then take the wrapped optimizer's step."""
        if closure is not None:
            raise ValueError("step(closure) is not supported: run the forward and backward pass yourself, "
                             "then call step()")
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        return super().step()

    def no_sync(self):
        """Backward passes inside accumulate into ``.grad`` without communicating."""
        return self._reducer.no_sync()

    def close(self):
        """Remove the gradient hooks and free the reducer (collective)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._reducer.close()


def DistributedOptimizer(optimizer, named_parameters=None, comm=None, *, backward_passes_per_step=1,
                         compression=None, algorithm="auto", first_bucket_bytes=training.FIRST_BUCKET_BYTES,
                         bucket_bytes=training.BUCKET_BYTES, progress_thread=False, poll_interval=50e-6,
                         deterministic=None, op="avg"):
    """Wrap ``optimizer`` so that ``step()`` applies the gradients averaged over ranks.

    Returns an optimizer of a subclass of ``optimizer``'s class sharing its attributes
    (parameter groups, state, hooks: ``state_dict()``/``load_state_dict()`` work as
    before); use it instead of ``optimizer``, and create LR schedulers on it. Every gradient is handed over by an
    autograd hook
    as soon as backward has accumulated it, and its bucket's allreduce starts when the
    bucket is full, overlapping the rest of backward. Options as in
    :class:`collectives.training.GradientReducer` (``backward_passes_per_step=k``:
    call backward k times per step; scale the loss by 1/k for a mean; ``op="sum"``
    sums the gradients instead of averaging them). Collective.
    """
    optimizer_wrapping.check_wrappable(optimizer, _Distributed, "_reducer")
    distributed = optimizer_wrapping.wrap(optimizer, _Distributed, f"Distributed{type(optimizer).__name__}")
    options = dict(backward_passes_per_step=backward_passes_per_step, compression=compression, algorithm=algorithm,
                   first_bucket_bytes=first_bucket_bytes, bucket_bytes=bucket_bytes, progress_thread=progress_thread,
                   poll_interval=poll_interval, deterministic=deterministic, op=op)
    distributed._setup(None if named_parameters is None else list(named_parameters), comm, options)
    return distributed


# The torch.distributed backend "collectives" (see collectives.torch_backend).
from . import torch_backend  # noqa: E402

torch_backend.register()
torch_backend.set_rendezvous_environment()
