"""Wrapping a torch optimizer so that its step applies gradients reduced over the
ranks: what :func:`collectives.torch.DistributedOptimizer` and Horovod's
(:mod:`collectives.horovod.torch`) have in common. The wrapper is an instance of a new
subclass of a mixin and the optimizer's class that shares the optimizer's attributes;
autograd hooks hand each gradient to a :class:`~collectives.training.GradientReducer`
as soon as backward has accumulated it."""

import torch

from .tensors import to_array, torch_stream


class WrappedOptimizer:
    """The base of the mixins that :func:`wrap` puts before an optimizer's class."""

    def add_param_group(self, param_group):
        raise ValueError("add_param_group on a DistributedOptimizer: its gradients would never be averaged; add "
                         "every parameter group to the optimizer before wrapping it")


def check_wrappable(optimizer, mixin, marker):
    """Raise unless ``optimizer`` is a torch optimizer that ``mixin`` may wrap: not one
    already (``marker``: an attribute the mixin sets, which the wrapped optimizer then
    shares), and with its own ``step`` (an LR scheduler made before wrapping replaces
    it on the instance, and that step would skip the reduction)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if isinstance(optimizer, mixin) or marker in optimizer.__dict__:
        raise ValueError("optimizer is already a DistributedOptimizer (or wrapped by one)")
    if "step" in optimizer.__dict__:
        raise ValueError("optimizer.step was replaced on the instance (by an LR scheduler created before "
                         "DistributedOptimizer?): its step would skip the gradient averaging; wrap the optimizer "
                         "first, then create schedulers on the DistributedOptimizer")


def wrap(optimizer, mixin, class_name):
    """An instance of a new class ``class_name`` (``mixin``, then ``optimizer``'s class)
    with ``optimizer``'s attributes: one attribute dict for both objects, so that
    parameter groups, state and hooks stay shared even when ``load_state_dict``
    replaces them (it assigns new ones)."""
    cls = type(class_name, (mixin, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__
    return wrapped


def hook_gradients(named, on_gradient):
    """Call ``on_gradient(name, param)`` each time autograd has accumulated a backward
    pass into ``param.grad``, for every ``(name, param)`` of ``named``; the hooks'
    handles (``remove()`` them to stop)."""
    return [param.register_post_accumulate_grad_hook(lambda param, name=name: on_gradient(name, param))
            for name, param in named]


def hand_over(reducer, name, param, grad):
    """Give ``grad`` to ``reducer`` as ``name``'s gradient; a CUDA gradient on torch's
    current stream (the reducer's copies and collectives follow it)."""
    with torch_stream(param):
        reducer.gradient_ready(name, to_array(grad, name, "grad"))
