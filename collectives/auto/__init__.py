"""``auto``: what ``algorithm="auto"`` picks, per (collective, bytes, world size).

In order, the first that answers:

1. ``COLLECTIVES_<COLLECTIVE>_ALGORITHM`` (e.g. ``COLLECTIVES_ALLREDUCE_ALGORITHM=ring``)
   forces one algorithm for every size, like ``NCCL_ALGO`` or MPICH's CVARs;
2. a measured tuning table, **if it was measured here**: the file named by
   ``COLLECTIVES_TUNING``, else the table that ships with the package
   (``collectives/data/tuning.json``, measured on the development machine), if it
   has the world size (one node) or the node layout (several) and that entry's
   fingerprint (:func:`~collectives.auto.fingerprints.fingerprint`: CPU model, logical CPUs, ranks per node, nodes,
   MPI library and version) equals this job's on *every* rank. The ranks agree on
   it when the :class:`~collectives.Communicator` is made (one allreduce), so a job
   whose nodes differ falls back on all ranks together. An entry of several nodes
   also holds the node-to-node link ``--tune`` measured (``link_MBps``,
   :func:`collectives.topology.measure_link`): the job measures its own link when it
   is made (about 10 ms per MiB the probe sends, at 1 Gbit/s), only where such an entry
   matches it otherwise, and uses the entry only where its link is within
   ``LINK_TOLERANCE`` (1.5x either way, :mod:`~collectives.auto.table`) of it. Choices that win on a 1 Gbit/s network
   need not win on a 100 Gbit/s one. An entry without a
   fingerprint (a file written before fingerprints) is used only from a file named
   by ``COLLECTIVES_TUNING``: the user chose it;
3. where no host table matches, the cost model **calibrated on this machine**
   (:mod:`collectives.auto.calibration`; :func:`~collectives.auto.calibration.calibrated_choice`): measured by the ranks
   together when the communicator is made, in well under a second, and cached per
   user for the fingerprint and layout; ``native`` below 64 KiB, above it the
   library's algorithm expected fastest (the model, scaled by the timings of the
   library's calls made while calibrating) where MPI's own, timed, takes 1.1x as
   long. ``COLLECTIVES_CALIBRATE=0``, or choosing a rule with
   ``COLLECTIVES_AUTO_RULE``, leaves it out;
4. the conservative rule (:func:`~collectives.auto.host_model.conservative_choice`): ``native`` unless the cost
   model predicts at least ``GAIN_NEEDED`` (2x) for one of the library's algorithms.
   ``COLLECTIVES_AUTO_RULE=cost-model`` asks for the older rule of
   :func:`~collectives.auto.cost_model_rule.cost_model_choice` here instead (latency- then
   bandwidth-optimal algorithms, the two-level ones on several nodes).

Device arrays have tables of their own (``device_tables``, same fingerprint rule, and
an entry names the GPUs it was measured on, :func:`~collectives.device.gpus.gpu_stamp`: the first call on a
device learns the ranks' GPUs, and a table of others is put aside from then on);
without one they take the device cost model (:func:`~collectives.auto.device_model.device_choice`): on one node the
fastest predicted of the peer-read algorithms (``one_shot``, ``two_shot``, ``leader``: the
last only where the ranks share a GPU, which the first peer-read call learns and tells
the selector, :meth:`~collectives.auto.selector.Selector.learn_gpus`; until then they are taken to share one), the ring
over CUDA IPC and ``native`` staged (MPI's own collective on host copies), from the
parameters of :class:`~collectives.auto.device_model.DeviceCostModel`; across nodes the cost-model rule (the
conservative rule's model is calibrated for host buffers, and ``native`` there means
MPI on host copies).

In deterministic mode a choice that cannot reduce in rank order (see
``collectives.algorithms.ORDERED``) gives way to one that can, and an override that
names one is refused. ``comm.choose(collective, nbytes)`` says which rule decided.

Where no table matches, rank 0 of the first such communicator prints one line to
stderr (once per process) saying so (and, where it calibrated, how long that took)
and how to tune; ``COLLECTIVES_QUIET=1`` (or choosing a rule with
``COLLECTIVES_AUTO_RULE``) hides it. A calibration read from the cache says nothing.

Its modules: :mod:`~collectives.auto.fingerprints` (where a table was
measured), :mod:`~collectives.auto.table` (the measured tables: reading them, and
whether one was measured here), :mod:`~collectives.auto.host_model` (the host cost model
and the conservative rule), :mod:`~collectives.auto.device_model` (the device cost
model), :mod:`~collectives.auto.cost_model_rule` (the cost-model rule),
:mod:`~collectives.auto.calibration` (the host model calibrated here) and
:mod:`~collectives.auto.selector` (the rules in order, per communicator). Their public
names are importable from ``collectives.auto`` itself (and from ``collectives.tuning``,
the same module). The environment is read when a :class:`~collectives.Communicator`
is created, and bad values raise there, before any message is sent.
"""

from .calibration import Calibration, calibrated_choice
from .cost_model_rule import COST_MODEL_RULES, CostModelRule, cost_model_choice, two_level
from .device_model import (
    DEVICE_COSTS,
    DEVICE_NAMES,
    SHIPPED_DEVICE_MODEL,
    STAGED_BYTES,
    DeviceCostModel,
    device_choice,
    predict_device,
)
from .fingerprints import (
    GPU,
    GPU_NAME_BYTES,
    LAYOUT_KEY,
    LINK,
    LINK_TOLERANCE,
    canonical,
    cpu_model,
    describe_fingerprint,
    fingerprint,
    fingerprint_for_key,
    gpu_stamp,
    link_stamp,
    mpi_library,
)
from .host_model import FLAT_TIMES, GAIN_NEEDED, SHIPPED_MODEL, TWO_LEVEL_TIMES, CostModel, conservative_choice, predict
from .selector import QUIET_ENV, RULE_ENV, RULES, Job, Selector, Settings, override_variable
from .table import DEFAULT_TABLE, FORMAT, TUNING_ENV, TuningTable, concrete, tables_from_environment

__all__ = [
    "COST_MODEL_RULES", "DEFAULT_TABLE", "DEVICE_COSTS", "DEVICE_NAMES", "FLAT_TIMES", "FORMAT", "GAIN_NEEDED", "GPU",
    "GPU_NAME_BYTES", "LAYOUT_KEY", "LINK", "LINK_TOLERANCE", "QUIET_ENV", "RULES", "RULE_ENV", "SHIPPED_DEVICE_MODEL",
    "SHIPPED_MODEL", "STAGED_BYTES", "TUNING_ENV", "TWO_LEVEL_TIMES", "Calibration", "CostModel", "CostModelRule",
    "DeviceCostModel", "Job", "Selector", "Settings", "TuningTable", "calibrated_choice", "canonical", "concrete",
    "conservative_choice", "cost_model_choice", "cpu_model", "describe_fingerprint", "device_choice", "fingerprint",
    "fingerprint_for_key", "gpu_stamp", "link_stamp", "mpi_library", "override_variable", "predict", "predict_device",
    "tables_from_environment", "two_level",
]
