"""torch tensors as the library's arrays, for the torch adapters (:mod:`.torch`,
:mod:`.torch_backend`, :mod:`.horovod`): zero-copy views, and the stream a CUDA
tensor's work runs on."""

import contextlib

import torch

from .. import device
from ..dtypes import BFLOAT16

# torch dtypes NumPy has no twin for: viewed as same-sized integers (broadcast moves
# bytes); bfloat16 as ml_dtypes' bfloat16 where installed, so its gradients can be averaged
BIT_TWINS = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}


def to_array(tensor, name, what):
    """A NumPy view sharing ``tensor``'s memory (no copy); for a CUDA tensor a
    :class:`~collectives.device.DeviceArray` (CuPy, through DLPack)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}[{name!r}] must be a torch.Tensor; got {type(tensor).__name__}")
    if tensor.device.type == "cuda":
        tensor = tensor.detach()
        if tensor.dtype == torch.bool:  # moved as bytes (broadcast); never reduced
            tensor = tensor.view(torch.uint8)
        return device.as_device_array(tensor, f"{what}[{name!r}]")
    if tensor.device.type != "cpu":
        raise TypeError(f"{what}[{name!r}] is on {tensor.device}: collectives takes CPU and CUDA tensors")
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16 and BFLOAT16 is None and what in ("named_parameters", "grad"):
        raise TypeError(f"{what}[{name!r}] is bfloat16: averaging bfloat16 gradients needs ml_dtypes "
                        "(pip install ml_dtypes)")
    if tensor.dtype in BIT_TWINS:
        array = tensor.view(BIT_TWINS[tensor.dtype]).numpy()
        return array.view(BFLOAT16) if tensor.dtype == torch.bfloat16 and BFLOAT16 is not None else array
    return tensor.numpy()



def torch_stream(tensor):
    """For a CUDA tensor, CuPy's current stream made torch's current one (the reducer's
    kernels and copies then follow the backward pass's work); else nothing."""
    if tensor.device.type != "cuda":
        return contextlib.nullcontext()
    from ..device.cupy_backend import external_stream

    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    return external_stream(torch.cuda.current_stream(tensor.device).cuda_stream, index)
