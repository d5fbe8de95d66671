"""CUDA sources for on-GPU reductions, casts and chunking (installed as
``collectives.kernels``): see README.md here and ``collectives/device/kernels.py``."""
