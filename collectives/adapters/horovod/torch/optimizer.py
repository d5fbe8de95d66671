"""Horovod's ``DistributedOptimizer``: a torch optimizer whose ``step()`` applies the
gradients averaged (or summed) over the ranks of a process set."""

import contextlib
import warnings
import weakref

import numpy as np
import torch

from ... import optimizer_wrapping, training
from ...tensors import to_array
from . import runtime
from .basics import Adasum, Average, Sum
from .compression import Compression, FP16Compressor, NoneCompressor
from .mpi_ops import _check_factor, sparse_allreduce_async
from .negotiation import _negotiate, _record
from .process_sets import ProcessSet, _set_of, global_process_set

__all__ = ["DistributedOptimizer"]


def _adapter_compression(compression):
    """The reducer's compression for a Horovod compressor (the class or an instance)."""
    kind = compression if isinstance(compression, type) else type(compression)
    if compression is None or kind is NoneCompressor:
        return None
    if kind is FP16Compressor:
        return "fp16"
    raise ValueError(f"compression must be hvd.Compression.none or hvd.Compression.fp16 for DistributedOptimizer; got "
                     f"{compression!r}: its gradients are compressed a bucket at a time, where a custom "
                     "Compressor cannot run")


class _HorovodOptimizer(optimizer_wrapping.WrappedOptimizer):
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer`: Horovod's
    optimizer on this package's calls. Dense gradients go into the buckets of a
    :class:`collectives.training.GradientReducer` on a duplicate of the process set's
    communicator, laid out at the first :meth:`synchronize` (collective), once the
    ranks have agreed which gradients are sparse; sparse ones go through
    :func:`sparse_allreduce_async` (or densified into the buckets with
    ``sparse_as_dense``)."""

    def _hvd_setup(self, named, hset, options, sparse_as_dense):
        self._hvd_set = hset  # None on ranks outside the process set: they step alone
        self._hvd_params = dict(named)
        self._parameter_names = {p: name for name, p in named}  # Horovod's attribute, which scripts read
        self._hvd_options = options  # the reducer's: compression, op
        self._hvd_sparse_as_dense = sparse_as_dense
        self._hvd_reducer = None  # made at the first synchronize()
        self._hvd_sparse_names = set()  # parameters whose gradients go as sparse tensors (agreed then)
        self._hvd_sparse = {}  # name -> the sparse allreduce in flight this step
        self._hvd_dense = {}  # name -> the dense copy of a sparse gradient handed to the buckets
        self._hvd_passes = {name: 0 for name in self._hvd_params}  # backward passes this step
        self._hvd_handed = set()  # names handed over this step
        self._hvd_synchronized = False
        self._hvd_skip = False
        self.backward_passes_per_step = options.pop("backward_passes_per_step")
        steps = runtime.initialized().optimizer_steps
        self._hvd_number = len(steps)
        steps.append(weakref.WeakMethod(self._hvd_serve_step))
        self._hvd_hooks = []
        if hset is not None:
            self._hvd_hooks = optimizer_wrapping.hook_gradients(named, self._hvd_gradient)

    def _hvd_gradient(self, name, param):
        """One backward pass's gradient of ``name``; the k-th of the step is handed over."""
        if self._hvd_passes[name] >= self.backward_passes_per_step:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call to "
                                 "step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._hvd_passes[name] += 1
        if self._hvd_passes[name] == self.backward_passes_per_step and self._hvd_reducer is not None:
            self._hvd_hand_over(name, param)  # before the first synchronize, that one hands everything over

    def _hvd_hand_over(self, name, param):
        """Start reducing ``name``'s gradient: into its bucket, or as a sparse tensor."""
        self._hvd_handed.add(name)
        grad = param.grad
        if name in self._hvd_sparse_names:
            if grad is None or not grad.is_sparse:  # none on this rank: an empty sparse one, as the others send
                grad = torch.zeros_like(param).to_sparse() if grad is None else grad.to_sparse()
            op = Average if self._hvd_options["op"] == "avg" else Sum
            self._hvd_sparse[name] = sparse_allreduce_async(grad, name, op, self._hvd_set.process_set)
            return
        if grad is None:
            grad = param.grad = torch.zeros_like(param)
        if grad.is_sparse:  # sparse_as_dense, or a gradient that turned sparse after the first step
            if not self._hvd_sparse_as_dense:
                warnings.warn(f"the gradient of {name!r} is sparse, but was dense (or absent) at the first step, when "
                              "the buckets were laid out: it is averaged densified (sparse_as_dense)", stacklevel=3)
            grad = self._hvd_dense[name] = grad.to_dense()
        optimizer_wrapping.hand_over(self._hvd_reducer, name, param, grad)

    def _hvd_build(self):
        """Lay out the buckets (collective over the set): the ranks agree which gradients
        are sparse (an allgather of one flag per parameter), the others get buckets."""
        names = list(self._hvd_params)
        sparse = np.array([0 if self._hvd_sparse_as_dense else
                           int(p.grad is not None and p.grad.is_sparse) for p in self._hvd_params.values()], np.uint8)
        anywhere = self._hvd_set.comm.allgather(sparse).any(axis=0) if names else sparse
        self._hvd_sparse_names = {name for name, flag in zip(names, anywhere) if flag}
        dense = [(name, to_array(p, name, "named_parameters")) for name, p in self._hvd_params.items()
                 if name not in self._hvd_sparse_names]
        self._hvd_reducer = training.GradientReducer(dense, self._hvd_set.comm, **self._hvd_options)

    def _hvd_negotiate_step(self):
        """On the global set, the ranks agree on this step (so that ranks that joined
        take part); elsewhere nothing."""
        if self._hvd_set.process_set is global_process_set:
            _negotiate(self._hvd_set, _record("optimizer step", extra=self._hvd_number))

    def _hvd_reduce(self):
        """The step's reduction: every parameter handed over (those backward did not reach
        with what their .grad holds, zeros if nothing, as Horovod does), then waited for."""
        if self._hvd_reducer is None:
            self._hvd_build()
        for name, param in self._hvd_params.items():
            if name not in self._hvd_handed:
                self._hvd_hand_over(name, param)
        self._hvd_reducer.synchronize()
        for name, dense in self._hvd_dense.items():  # back to sparse, as Horovod does with sparse_as_dense
            self._hvd_params[name].grad.zero_().add_(dense.to_sparse())
        for name, result in self._hvd_sparse.items():
            grad = self._hvd_params[name].grad
            if grad is not None and grad.is_sparse:
                grad.zero_().add_(result())  # Horovod's way: sparse gradients keep their tensor
            else:
                self._hvd_params[name].grad = result()
        self._hvd_sparse, self._hvd_dense, self._hvd_handed = {}, {}, set()
        self._hvd_passes = dict.fromkeys(self._hvd_passes, 0)

    def _hvd_serve_step(self):
        """A rank that joined, in the others' step: zero gradients for every parameter."""
        for param in self._hvd_params.values():
            param.grad = None
        self._hvd_reduce()

    def synchronize(self):
        """Wait for the reduced gradients (now in every ``.grad``). Collective over the
        process set; on ranks outside it, nothing."""
        if self._hvd_set is not None:
            self._hvd_negotiate_step()
            self._hvd_reduce()
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside does not synchronize (call :meth:`synchronize` before)."""
        self._hvd_skip = True
        try:
            yield
        finally:
            self._hvd_skip = False

    def step(self, closure=None):
        """Synchronize the gradients (unless :meth:`skip_synchronize`), then take the
        wrapped optimizer's step."""
        if not self._hvd_skip:
            if self._hvd_synchronized:  # Horovod's warning (Horovod would reduce again; the result is the same)
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
                              "code.", stacklevel=2)
            else:
                self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, *args, **kwargs):
        if any(self._hvd_passes.values()):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                                 "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        return super().zero_grad(*args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        """Expect ``passes`` backward passes per step (the count starts over)."""
        if isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be > 0; got {passes!r}")
        self.backward_passes_per_step = int(passes)
        self._hvd_passes = dict.fromkeys(self._hvd_passes, 0)

    def load_state_dict(self, *args, **kwargs):
        self._hvd_passes = dict.fromkeys(self._hvd_passes, 0)
        self._hvd_synchronized = False
        return super().load_state_dict(*args, **kwargs)

    def close(self):
        """Remove the gradient hooks and free the buckets' communicator (collective over
        the process set, where they were laid out)."""
        for handle in self._hvd_hooks:
            handle.remove()
        self._hvd_hooks = []
        if self._hvd_reducer is not None:
            self._hvd_reducer.close()
            self._hvd_reducer = None


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wrap ``optimizer`` so that ``step()`` applies the gradients averaged (``op=Sum``:
    summed) over the ranks of ``process_set``, with Horovod's ``synchronize()``,
    ``skip_synchronize()`` and ``set_backward_passes_per_step()``. Returns an instance
    of a subclass of ``optimizer``'s class sharing its attributes. Collective at its
    first ``synchronize()``."""
    runtime.initialized()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be an hvd.ProcessSet; got {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(f"process_set: {process_set} is not registered (add it with hvd.add_process_set)")
    hset = _set_of(process_set) if process_set.included() else None  # None: this rank steps alone
    optimizer_wrapping.check_wrappable(optimizer, _HorovodOptimizer, "_hvd_params")
    wire = _adapter_compression(compression)
    if op is Adasum:
        raise NotImplementedError("DistributedOptimizer(op=hvd.Adasum) is not implemented by collectives.horovod")
    if op not in (Average, Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum for DistributedOptimizer; got {op!r}")
    predivide = _check_factor(gradient_predivide_factor, "gradient_predivide_factor")
    if predivide <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive; got {gradient_predivide_factor!r}")
    if predivide != 1.0 and op is not Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, (int, np.integer)) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer; got {backward_passes_per_step!r}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 0:
        raise ValueError(f"num_groups must be a non-negative integer; got {num_groups!r}")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
    if groups is not None:
        if isinstance(groups, list):
            if not all(isinstance(g, (list, tuple)) and all(isinstance(p, torch.Tensor) for p in g) for g in groups):
                raise ValueError("groups must consist of torch.Tensor.")
        elif isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups <= 0:
            raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if not isinstance(sparse_as_dense, bool):
        raise TypeError(f"sparse_as_dense must be True or False; got {sparse_as_dense!r}")
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(optimizer.param_groups)
                 for j, p in enumerate(group["params"])]
    else:
        named = list(named_parameters)
        if not all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in named):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                             "model.named_parameters().")
    seen, duplicates = set(), set()
    for name, _ in named:
        (duplicates if name in seen else seen).add(name)
    if duplicates:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                         f"{', '.join(sorted(duplicates))}")
    given = {id(p) for _, p in named}
    unnamed = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in given]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but {len(unnamed)} model parameter(s) were not named: pass "
                         "model.named_parameters() of the model the optimizer was built from")
    mine = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
    named = [(name, p) for name, p in named if id(p) in mine]
    distributed = optimizer_wrapping.wrap(optimizer, _HorovodOptimizer, type(optimizer).__name__)
    options = dict(backward_passes_per_step=int(backward_passes_per_step), compression=wire,
                   op="avg" if op is Average else "sum")
    distributed._hvd_setup(named, hset, options, sparse_as_dense)
    return distributed
