"""Which MPI library this process runs on, read once, and what differs between them.

The library runs on any MPI that mpi4py loads. The few places where MPI libraries
behave differently ask this module instead of assuming one:

- :func:`library`: the family and version, parsed once from
  ``MPI.Get_library_version()`` (:func:`parse`). ``comm.choose`` and the tuning
  fingerprint name it ("MPICH 5.0.2", "Open MPI 5.0.11", "Intel MPI 2021.18.1").
- :func:`tag_ub`: the largest tag, read where the MPI standard promises it, on
  ``MPI_COMM_WORLD``. (Open MPI does not attach ``MPI_TAG_UB`` to communicators made
  by ``Split``, ``Create`` or ``Split_type``.)
- :func:`native_checked`: which of MPI's own collectives must be told of a size
  mismatch before they run (see ``collectives.transport.native``).
- :func:`prepare`: runs when this module is imported, which ``import collectives``
  does before anything imports ``mpi4py.MPI``; it quiets Open MPI's one-sided UCX
  component where it can only fail (below).

This module imports mpi4py only inside its functions: :func:`prepare` must run
before ``mpi4py.MPI`` is first imported, which initialises MPI.
"""

import functools
import os
import re
import sys
from dataclasses import dataclass

# Display names of the families :func:`parse` recognises.
NAMES = {"mpich": "MPICH", "openmpi": "Open MPI", "impi": "Intel MPI", "mvapich": "MVAPICH", "cray": "Cray MPICH",
         "msmpi": "Microsoft MPI", "unknown": "an unknown MPI"}

# MPI's own collectives called with different sizes on different ranks, measured
# (every collective, 250 000 against 262 144 float32s, each way round, guard bytes after
# every buffer; tests/harness/native_mismatch.py):
# - MPICH 5.0.2 ends the job ("Fatal error ...: Message truncated"), writing nothing
#   outside the buffers, in allreduce, reduce_scatter, allgather, reduce and alltoall;
#   broadcast raises on some ranks only, and gather and scatter return short data
#   without an error;
# - Open MPI 5.0.11 writes up to 48 576 B past the receive buffer, or corrupts the heap
#   (allreduce, reduce_scatter), or returns wrong data without an error;
# - Intel MPI 2021.18 returns wrong data without an error (allreduce, broadcast, gather,
#   scatter) or waits for ever (reduce).
# Every collective is checked before or as MPI's collective runs (transport.native: the
# ranks agree on the size first, or a blocking broadcast sends the root's size ahead)
# except those a family was measured to stop on by itself.
NATIVE_STOPS_ON_MISMATCH = {"mpich": frozenset({"allreduce", "reduce_scatter", "allgather", "reduce", "alltoall"})}
NATIVE_CHECK_ENV = "COLLECTIVES_NATIVE_SIZE_CHECK"  # 1: every collective checked; 0: none

# Open MPI's one-sided UCX component (osc/ucx) prints "osc_ucx_component.c:375 Error:
# OSC UCX component priority set inside component query failed" at every window made,
# on a machine where UCX finds no device it supports for RMA. Those devices are
# InfiniBand ones (UCX's default device list is mlx*, found under
# /sys/class/infiniband), or a GPU's IPC; without any, osc/ucx is never selected, so
# leaving it out changes nothing but the message.
OSC_ENV = "OMPI_MCA_osc"
UCX_DEVICE_DIRS = ("/sys/class/infiniband",)
GPU_DEVICES = ("/dev/nvidia0", "/dev/kfd")


@dataclass(frozen=True)
class Library:
    """An MPI library: ``family`` (a key of :data:`NAMES`), ``version`` ("5.0.2"; ""
    where unknown) and ``text`` (the first line of its version string)."""

    family: str
    version: str
    text: str

    def __str__(self):
        if self.family == "unknown":
            return self.text or NAMES["unknown"]
        return f"{NAMES[self.family]} {self.version}".strip()


def _squeeze(text):
    return " ".join(str(text).replace("\x00", " ").split())


_PATTERNS = (  # (family, pattern whose group 1 is the version), first match wins
    ("impi", r"Intel\(R\) MPI Library\s+([0-9][0-9.]*)"),
    ("mvapich", r"MVAPICH2?\s+Version\s*:?\s*([0-9][0-9a-z.]*)"),
    ("cray", r"CRAY MPICH\s+version\s+([0-9][0-9.]*)"),
    ("msmpi", r"Microsoft MPI\s+([0-9][0-9.]*)"),
    ("openmpi", r"Open MPI\s+v?([0-9][0-9a-z.]*)"),
    ("mpich", r"MPICH\s+Version\s*:?\s*([0-9][0-9a-z.]*)"),
)


def parse(text):
    """The :class:`Library` a version string names: ``MPI.Get_library_version()``'s,
    or a tuning file's ``mpi`` field (the first line, in either form a fingerprint
    holds: "MPICH Version: 5.0.2" or "MPICH 5.0.2")."""
    text = str(text)
    first = _squeeze(text.strip().split("\n")[0]) if text.strip() else ""
    for family, pattern in _PATTERNS:
        found = re.search(pattern, text, re.IGNORECASE)
        if found:
            return Library(family, found.group(1).rstrip("."), first)
    for family, name in NAMES.items():  # the short form this module writes: "Open MPI 5.0.11"
        found = re.fullmatch(re.escape(name) + r"\s+([0-9][0-9a-z.]*)", first)
        if found and family != "unknown":
            return Library(family, found.group(1), first)
    return Library("unknown", "", first)


@functools.lru_cache(maxsize=None)
def library():
    """This process's MPI library (read once)."""
    from mpi4py import MPI

    return parse(MPI.Get_library_version())


@functools.lru_cache(maxsize=None)
def tag_ub():
    """The largest tag MPI allows: ``MPI_TAG_UB`` of ``MPI_COMM_WORLD``, where the
    standard puts it (it holds for every communicator of the job)."""
    from mpi4py import MPI

    value = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    if value is None:  # not even there: the standard's minimum
        return 32767
    return int(value)


def native_checked(collectives, environ=None):
    """Which of ``collectives`` (names) are checked for a size mismatch around MPI's own
    collective (``transport.native``: the ranks agree on the size first, or the root's
    size goes ahead): ``COLLECTIVES_NATIVE_SIZE_CHECK`` 1 (all) or 0 (none) decides,
    else all but those this MPI family was measured to stop on by itself
    (:data:`NATIVE_STOPS_ON_MISMATCH`)."""
    environ = os.environ if environ is None else environ
    text = environ.get(NATIVE_CHECK_ENV, "").strip()
    if text:
        if text not in ("0", "1"):
            raise ValueError(f"{NATIVE_CHECK_ENV} must be 1 or 0; got {text!r}")
        return frozenset(collectives) if text == "1" else frozenset()
    return frozenset(collectives) - NATIVE_STOPS_ON_MISMATCH.get(library().family, frozenset())


def _has_any(directory):
    try:
        return any(True for _ in os.scandir(directory))
    except OSError:
        return False


def quiet_ucx(environ=None):
    """Leave Open MPI's osc/ucx out (``OMPI_MCA_osc=^ucx``) where it can only fail and
    print its error: no InfiniBand device and no GPU, and the user has not chosen the
    one-sided components. Returns whether it did. A no-op for other MPIs, which never
    read the variable."""
    environ = os.environ if environ is None else environ
    if OSC_ENV in environ or any(_has_any(d) for d in UCX_DEVICE_DIRS) or any(os.path.exists(d) for d in GPU_DEVICES):
        return False
    environ[OSC_ENV] = "^ucx"
    return True


def prepare():
    """What must happen before MPI is initialised, if it has not been yet (mpi4py
    initialises it when ``mpi4py.MPI`` is first imported)."""
    if "mpi4py.MPI" not in sys.modules:
        quiet_ucx()


prepare()
