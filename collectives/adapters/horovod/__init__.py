"""Horovod-compatible APIs on the collectives.

``import collectives.horovod.torch as hvd`` in place of ``import horovod.torch as hvd``
runs a Horovod PyTorch training script on this library (``mpiexec -n N python train.py``):
docs/reference/horovod.md says what maps and what does not. Importing this package
imports nothing else; the ``torch`` package needs PyTorch (extra ``torch``).
"""
