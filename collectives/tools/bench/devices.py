"""Devices for the benchmarks (``--device cuda`` or ``standin``): moving the cases'
buffers to and from the device, and waiting for a call to finish on it.

A collective on device arrays returns once its result is ready on the user's stream
(as NCCL's do), not once the device has written it: so every timed call here ends by
synchronizing that stream, as nccl-tests does. The stand-in runs anything (in CI) but
its times mean nothing.
"""

import numpy as np


class BenchDevice:
    """The device of this rank: ``cuda`` (through CuPy; ranks share the GPUs round
    robin) or ``standin``."""

    def __init__(self, kind, rank=0):
        self.kind = kind
        if kind == "cuda":
            import cupy

            from ...device import cupy_backend

            self.cupy = cupy
            device_id = rank % cupy.cuda.runtime.getDeviceCount()
            cupy.cuda.Device(device_id).use()
            self.backend = cupy_backend.backend(device_id)
            self.name = f"{self.backend.name} (cuda:{device_id})"
        elif kind == "standin":
            from ...device import standin

            self.backend = standin.device()
            self.name = "the CPU stand-in device (times mean nothing)"
        else:
            raise ValueError(f"device must be 'cuda' or 'standin'; got {kind!r}")

    def gpus(self, world):
        """The GPUs of ``world``'s ranks as a device table is stamped with them
        (:func:`~collectives.device.gpus.gpu_stamp`; collective)."""
        from ...device.gpus import gpu_stamp

        everyone = world.allgather((self.backend.name, self.backend.uuid))
        return gpu_stamp([name for name, _ in everyone], [uuid for _, uuid in everyone])

    @property
    def stream(self):
        return self.backend.current_stream()

    def empty(self, shape, dtype):
        return self.backend.empty(shape, self.backend.storage_dtype(dtype))

    def upload(self, dst, host):
        """``dst`` (device) = ``host``, finished when this returns."""
        if dst.size:
            self.backend.copy(dst.reshape(-1), np.ascontiguousarray(host).reshape(-1), self.stream)
        self.sync()

    def download(self, host, src):
        """``host`` = ``src`` (device), finished when this returns."""
        if src.size:
            self.backend.copy(host.reshape(-1), src.reshape(-1), self.stream)
        self.sync()

    def sync(self):
        self.backend.synchronize_stream(self.stream)

    def versions(self):
        """What produced the figures: the device and its software."""
        info = {"device": self.name}
        if self.kind == "cuda":
            runtime = self.cupy.cuda.runtime
            info.update(cupy=self.cupy.__version__, cuda_runtime=runtime.runtimeGetVersion(),
                        cuda_driver=runtime.driverGetVersion())
        return info
