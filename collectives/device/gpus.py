"""The GPUs a job's ranks run on, named as the ranks exchange them: the device
negotiation (:mod:`collectives.transport.device`) sends each rank's GPU model and uuid,
and ``auto``'s device tables (:mod:`collectives.auto.fingerprints`) are stamped with the
result."""

GPU_NAME_BYTES = 64  # of a GPU's model name (and its uuid), as the device negotiation exchanges it


def gpu_stamp(names, uuids):
    """The ranks' GPUs as a device table's entry is stamped with them: their models and
    how many distinct ones the ranks use, ``"NVIDIA H200 x1"`` (the ranks share one) or
    ``"NVIDIA H100 80GB HBM3 x4"``; ``names`` and ``uuids``: each rank's device's (a
    node's PCI address: on several alike nodes, the GPUs of one). A name counts by its
    first ``GPU_NAME_BYTES`` bytes, as the ranks exchange it."""
    names = {str(name).encode()[:GPU_NAME_BYTES].decode(errors="replace") for name in names}
    return f"{' + '.join(sorted(names))} x{len(set(uuids))}"
