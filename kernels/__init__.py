"""CUDA sources for on-GPU reductions and chunking (installed as ``collectives.kernels``).

Empty until the GPU issue lands; the packaging ships this folder already so that
adding ``.cu`` files needs no change to ``setup.py``.
"""
