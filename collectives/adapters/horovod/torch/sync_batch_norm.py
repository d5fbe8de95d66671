"""Horovod's ``SyncBatchNorm``, which this package does not implement."""

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("hvd.SyncBatchNorm is not implemented by collectives.horovod")
