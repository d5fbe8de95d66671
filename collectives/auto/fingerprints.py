"""Where a table or a calibration was measured: this machine and node layout as a
fingerprint (CPU model, logical CPUs, MPI library, nodes, ranks per node; for several
nodes the link between them, for device tables the GPUs), and the table keys that name
a layout (``"4"``, ``"2x4"``, ``"3+1"``)."""

import functools
import os
import platform
import re

from .. import mpi_library as mpi_library_module
from ..device.gpus import GPU_NAME_BYTES, gpu_stamp  # noqa: F401 (a device table's stamp, named here too)

# A several-node entry's measured link (MB/s) in its fingerprint, and how far a job's
# own measurement may stray from it: a run's measurements differ by a few percent
# (113-118 MB/s in bench/results/testbed-1gbit), networks by factors of 10.
LINK = "link_MBps"
LINK_TOLERANCE = 1.5
GPU = "gpu"  # a device table entry's stamp of the ranks' GPUs (gpu_stamp), checked at the first device call

# A node layout as Topology.key() writes it: nodes x ranks per node, or the node sizes.
LAYOUT_KEY = re.compile(r"[1-9][0-9]*x[1-9][0-9]*|[1-9][0-9]*(\+[1-9][0-9]*)+")


def _squeeze(text):
    return " ".join(str(text).split())


@functools.lru_cache(maxsize=None)
def cpu_model():
    """The CPU model: ``/proc/cpuinfo``'s first "model name" where there is one (Linux
    x86), else ``platform.processor()`` or ``platform.machine()``; spaces squeezed."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return _squeeze(value)
    except OSError:
        pass
    return _squeeze(platform.processor() or platform.machine() or "unknown")


def mpi_library():
    """The MPI library's family and version as fingerprints hold them: "MPICH 5.0.2",
    "Open MPI 5.0.11", "Intel MPI 2021.18.1" (:mod:`collectives.mpi_library`)."""
    return str(mpi_library_module.library())


def canonical(stamp):
    """``stamp`` (a fingerprint) with its MPI library written as :func:`mpi_library`
    writes it: a table stamped before fingerprints named the family ("MPICH Version:
    5.0.2", the version string's first line) still matches the same library."""
    if not isinstance(stamp, dict) or "mpi" not in stamp:
        return stamp
    return {**stamp, "mpi": str(mpi_library_module.parse(stamp["mpi"]))}


def _layout(topology, world_size):
    """``{"nodes": N, "ranks_per_node": k}``; k is an int where every node holds the
    same number of ranks, else the layout key (``"3+1"``)."""
    if topology is None:
        return {"nodes": 1, "ranks_per_node": world_size}
    sizes = topology.ranks_per_node
    return {"nodes": len(sizes), "ranks_per_node": sizes[0] if len(set(sizes)) == 1 else topology.key()}


def _machine():
    """The machine's part of a fingerprint: CPU model, logical CPUs, MPI library."""
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "mpi": mpi_library()}


def fingerprint(topology=None, world_size=None):
    """This machine and layout, as a tuning table's entries are stamped with it:
    ``{"cpu", "cpus", "mpi", "nodes", "ranks_per_node"}`` (CPU model, ``os.cpu_count()``,
    the MPI library's first version line, the node count and the ranks per node, from
    ``topology``, a :class:`~collectives.Topology`, or one node of ``world_size`` ranks)."""
    if topology is None and world_size is None:
        raise ValueError("fingerprint needs a topology or a world size")
    return {**_machine(), **_layout(topology, world_size)}


def link_stamp(rate):
    """A link rate in bytes per second as a fingerprint holds it: MB/s, 3 figures."""
    return float(f"{rate / 1e6:.3g}")


def fingerprint_for_key(key, link=None):
    """The fingerprint of this machine for a table key: ``"4"`` (one node of 4 ranks),
    ``"2x4"``, ``"3+1"`` (what ``collectives-bench --tune`` stamps each entry with);
    for several nodes, with ``link`` (bytes per second, measured) as ``link_MBps``."""
    key = str(key)
    if re.fullmatch(r"[1-9][0-9]*", key):
        layout = {"nodes": 1, "ranks_per_node": int(key)}
    elif re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", key):
        nodes, per_node = key.split("x")
        layout = {"nodes": int(nodes), "ranks_per_node": int(per_node)}
    elif LAYOUT_KEY.fullmatch(key):
        layout = {"nodes": key.count("+") + 1, "ranks_per_node": key}
    else:
        raise ValueError(f"{key!r} is not a world size nor a node layout such as 2x4 or 3+1")
    if link is not None and layout["nodes"] > 1:
        layout[LINK] = link_stamp(link)
    return {**_machine(), **layout}


def describe_fingerprint(stamp):
    """A short text: ``AMD EPYC, 2 CPUs, MPICH 5.0.2, 1x4``."""
    mpi = re.sub(r"\s*\bVersion:?\s*", " ", str(stamp.get("mpi", "?"))).split(",")[0].strip()
    rpn = stamp.get("ranks_per_node", "?")
    layout = f"{stamp.get('nodes', '?')}x{rpn}" if isinstance(rpn, int) else f"{stamp.get('nodes', '?')} nodes {rpn}"
    link = f", a {stamp[LINK]:g} MB/s link" if LINK in stamp else ""
    gpus = f", GPUs {stamp[GPU]}" if GPU in stamp else ""
    return f"{stamp.get('cpu', '?')}, {stamp.get('cpus', '?')} CPUs, {mpi}, {layout}{link}{gpus}"
