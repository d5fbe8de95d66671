"""The framework adapters, built on the public API of the core library: data-parallel
training (:mod:`.training`, :mod:`.torch`), the torch.distributed backend
(:mod:`.torch_backend`), Horovod's API (:mod:`.horovod`) and the parameter server
(:mod:`.ps`). Scripts import them by their short names (``collectives.torch``, ...)."""
