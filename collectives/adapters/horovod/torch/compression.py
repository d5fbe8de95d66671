"""Horovod's compression of the tensors a reduction sends: ``Compression.none`` and
``Compression.fp16``."""

import torch

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """Horovod's compression interface: ``compress(tensor) -> (tensor, context)`` and
    ``decompress(tensor, context) -> tensor``, both static."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors sent as float16 and cast back; others as they are."""

    @staticmethod
    def compress(tensor):
        return (tensor.to(torch.float16) if tensor.dtype.is_floating_point else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) if ctx.is_floating_point and tensor.dtype != ctx else tensor


class Compression:
    """Gradient compression: ``Compression.none`` (the default) or ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
