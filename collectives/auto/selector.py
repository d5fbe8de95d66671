"""The selector: what ``auto`` picks for one communicator, by the rules in the order
:mod:`collectives.auto` lists them, its decisions cached. It is made from two records:
what ``auto`` is told (:class:`Settings`: the tables, the overrides, the rule, read
from the environment by :meth:`Selector.from_environment`) and the ranks it chooses for
(:class:`Job`: their number, layout and machine, and the collective steps the selector
takes with them when it is made)."""

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..algorithms import BUILDERS, ORDERED, check_ordered
from ..cache import BoundedCache
from . import calibration as calibration_module
from .calibration import calibrated_choice
from .cost_model_rule import cost_model_choice
from .device_model import SHIPPED_DEVICE_MODEL, device_choice
from .fingerprints import GPU, canonical, describe_fingerprint
from .fingerprints import fingerprint as machine_fingerprint
from .host_model import GAIN_NEEDED, conservative_choice
from .table import TUNING_ENV, concrete, link_verdict, tables_from_environment, usable

RULE_ENV = "COLLECTIVES_AUTO_RULE"  # "conservative" (the default) or "cost-model"
RULES = ("conservative", "cost-model")
QUIET_ENV = "COLLECTIVES_QUIET"  # hides the one-line hint

# The bits the ranks AND when a selector is made (Job.agree): each table usable here,
# each usable if this job's link is the one its entry holds, and this rank calibrates.
_USABLE = (1, 2)  # host table, device table
_IF_LINK = (4, 8)
_CALIBRATES = 16


def override_variable(collective):
    """The environment variable that forces ``collective``'s algorithm."""
    return f"COLLECTIVES_{collective.upper()}_ALGORITHM"


def _check_rule(rule):
    if rule not in RULES:
        raise ValueError(f"{RULE_ENV} must be one of {', '.join(RULES)}; got {rule!r}")
    return rule


@dataclass(frozen=True)
class Settings:
    """What ``auto`` is told. ``table`` and ``device_table``: the measured tables
    (:class:`~collectives.auto.table.TuningTable`, for host and for device arrays; None:
    none), whose entries without a fingerprint count where ``unstamped`` (a file the
    user named); ``overrides``: collective -> the algorithm forced for it; ``rule``:
    what answers where no table or calibration does, ``"conservative"`` or
    ``"cost-model"``; ``deterministic``: a choice must reduce in rank order
    (deterministic mode)."""

    table: Any = None
    device_table: Any = None
    unstamped: bool = True
    overrides: Mapping[str, str] = field(default_factory=dict)
    rule: str = "conservative"
    deterministic: bool = False

    def __post_init__(self):
        _check_rule(self.rule)

    @classmethod
    def from_environment(cls, environ=None, deterministic=False):
        """The settings the environment asks for (see :mod:`collectives.auto`):
        ``COLLECTIVES_<COLLECTIVE>_ALGORITHM``, ``COLLECTIVES_AUTO_RULE`` and the tuning
        file; a ``ValueError`` naming the variable for a bad value."""
        environ = os.environ if environ is None else environ
        overrides = {}
        for collective in BUILDERS:  # alltoallv too
            variable = override_variable(collective)
            value = environ.get(variable, "").strip()
            if value and value != "auto":
                if value not in concrete(collective):
                    raise ValueError(f"{variable} must be one of {', '.join(concrete(collective))}; got {value!r}")
                if deterministic:
                    try:
                        check_ordered(collective, value)
                    except ValueError as exc:
                        raise ValueError(f"{variable}={value}: {exc}") from None
                overrides[collective] = value
        rule = _check_rule(environ.get(RULE_ENV, "").strip() or "conservative")
        table, device_table, named = tables_from_environment(environ)
        return cls(table, device_table, unstamped=named, overrides=overrides, rule=rule, deterministic=deterministic)


@dataclass(frozen=True)
class Job:
    """The ranks ``auto`` chooses for: ``world_size`` of them, on the node layout
    ``topology`` (a :class:`~collectives.Topology`; None: one node), on machines of
    ``fingerprint`` (None: :func:`~collectives.auto.fingerprints.fingerprint` of this
    machine and layout); and the collective steps the selector takes with them when it
    is made (None: this rank is alone in deciding):

    - ``agree(bits)``: this rank's bits ANDed over the ranks (the
      :class:`~collectives.Communicator` passes an allreduce), so that every rank
      decides alike: 1 the host table is usable here, 2 the device table is, 4 and 8
      each is if this job's link is the one its entry holds (every rank then measures
      the link and they agree once more on 1 and 2), 16 this rank would calibrate;
    - ``measure_link()``: bytes per second between the nodes (the same on every rank),
      called where every rank's entry of several nodes holds a link;
    - ``calibrate(fingerprint, key, link)``: a
      :class:`~collectives.auto.calibration.Calibration` (the same on every rank),
      called where no host table is usable and every rank would calibrate: the
      calibrated model then answers before the rule."""

    world_size: int
    topology: Any = None
    fingerprint: Mapping[str, Any] | None = None
    agree: Callable[[int], int] | None = None
    measure_link: Callable[[], float] | None = None
    calibrate: Callable[[Any, Any, Any], Any] | None = None


_hinted = False  # the one-line hint: printed once per process


class Selector:
    """Resolves ``auto`` for one communicator's ranks (:class:`Job`) as it is told
    (:class:`Settings`); its decisions are cached.

    A table answers where its entry for this world size (one node) or layout (several)
    is stamped with the job's fingerprint (or, if ``unstamped``, has no stamp), on every
    rank (``Job.agree``); an entry of several nodes that holds a link answers where the
    job's own link, measured, is within ``LINK_TOLERANCE`` of it. Where no host table
    answers, the job's calibration does (``Job.calibrate``), else the rule."""

    def __init__(self, job, settings=None):
        settings = Settings() if settings is None else settings
        self.world_size = job.world_size
        self.topology = topology = job.topology  # the node layout (None: one node)
        self.deterministic = settings.deterministic
        self.table = settings.table
        self.device_table = settings.device_table  # measured on device arrays (collectives-bench --device --tune)
        self.overrides = dict(settings.overrides)
        self.rule = settings.rule
        self.unstamped = settings.unstamped  # entries without a fingerprint count (a file the user named)
        self.several = topology is not None and topology.node_count > 1
        # A table keyed by the world size alone was measured on one node; several
        # nodes need one keyed by their layout ("2x4", "3+1").
        self.key = topology.key() if self.several else job.world_size
        self.fingerprint = canonical(dict(job.fingerprint)) if job.fingerprint is not None else machine_fingerprint(
            topology if self.several else None, job.world_size)
        tables = (self.table, self.device_table)
        suffixes = ("", " device")
        agree = job.agree or (lambda bits: bits)
        here = [usable(table, self.key, self.fingerprint, self.unstamped, suffix)
                for table, suffix in zip(tables, suffixes)]
        agreed = agree(sum(bit for bit, (ok, _) in zip(_USABLE, here) if ok is True)
                       + sum(bit for bit, (ok, _) in zip(_IF_LINK, here) if ok == "link")
                       + (_CALIBRATES if job.calibrate is not None else 0))
        self.link = None
        if agreed & sum(_IF_LINK):  # every rank is waiting on the link: every rank measures it, together
            self.link = job.measure_link() if job.measure_link is not None else None
            here = [link_verdict(table, self.key, self.link, suffix) if agreed & if_link else verdict
                    for table, suffix, if_link, verdict in zip(tables, suffixes, _IF_LINK, here)]
            agreed |= agree(sum(bit for bit, if_link, (ok, _) in zip(_USABLE, _IF_LINK, here)
                                if agreed & if_link and ok is True))
        self.in_use = [bool(agreed & bit) for bit in _USABLE]  # [host table, device table]
        self._why_not = [why if ok is False else None if self.in_use[i] else "another rank's machine or layout "
                         f"differs from the one {tables[i].source} was measured on"
                         for i, (ok, why) in enumerate(here)]
        # why the device table was put aside at the first call on a device: measured on
        # other GPUs (learn_gpu_stamp; a communicator is made without touching the device)
        self._other_gpus = None
        # No host table here: calibrate the cost model on this machine (every rank, or none).
        self.calibration = None
        if (agreed & _CALIBRATES and not self.in_use[0] and job.world_size > 1
                and set(BUILDERS) - set(self.overrides)):
            self.calibration = job.calibrate(self.fingerprint, self.key, self.link)
        self._cache = BoundedCache(4096)  # (collective, nbytes, device) -> choice
        # The node's GPUs, ranks and fence mechanism: None until a device call learns them
        # (the device model meanwhile takes the ranks to share one GPU, as on the GPU it was
        # measured on).
        self.gpus = None
        self.device_model = SHIPPED_DEVICE_MODEL  # the device rule's parameters

    @classmethod
    def from_environment(cls, job, environ=None, deterministic=False, hint=False):
        """The selector the environment asks for (:meth:`Settings.from_environment`)
        for ``job``, whose ``calibrate`` is left out where ``COLLECTIVES_CALIBRATE=0`` or
        a rule is chosen with ``COLLECTIVES_AUTO_RULE``; ``hint``: this process may print
        the one-line note where no table matches (rank 0 of a communicator)."""
        environ = os.environ if environ is None else environ
        settings = Settings.from_environment(environ, deterministic)
        rule_chosen = bool(environ.get(RULE_ENV, "").strip())
        if not calibration_module.wanted(environ) or rule_chosen:
            job = replace(job, calibrate=None)
        selector = cls(job, settings)
        quiet = environ.get(QUIET_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
        if hint and not quiet and not rule_chosen:
            global _hinted
            note = selector.hint()
            if note and not _hinted:
                _hinted = True
                print(note, file=sys.stderr, flush=True)
        return selector

    def learn_gpu_stamp(self, stamp, agree=None):
        """The ranks' GPUs are ``stamp`` (:func:`~collectives.device.gpus.gpu_stamp`), as the first call on a device
        learnt (the same on every rank): a device table whose entry names other GPUs is
        no longer used. ``agree(fits)``: every rank's verdict ANDed (collective; called
        on every rank where the device table is in use, which the ranks agreed on), so
        that ranks whose table files differ decide alike. True if that changed what
        ``auto`` picks."""
        if not self.in_use[1]:
            return False
        measured_on = (self.device_table.stamp(f"{self.key} device") or {}).get(GPU)  # (None: it names none)
        fits = measured_on is None or stamp == measured_on
        if (agree(fits) if agree is not None else fits):
            return False
        self.in_use[1] = False
        self._other_gpus = (f"{self.device_table.source} was measured on GPUs {measured_on}, these are {stamp}"
                            if not fits else "another rank's device table was measured on other GPUs")
        self._cache.clear()
        return True

    def learn_gpus(self, gpus, ranks, fences):
        """The node's ``ranks`` are on ``gpus`` GPUs and meet at ``fences`` (the node's
        fence mechanism, a :class:`~collectives.transport.peer_fences.Fences`: its
        ``name``, and whether it waits ``in_kernel``), as the first peer-read call
        learnt (the same on every rank): the device cost model predicts for that from
        now on (the leader only where every rank is on one GPU; each GPU's processes
        switching where it carries several ranks; a fence's cost by its mechanism)."""
        known = (int(gpus), int(ranks), fences.name)
        if known != self.gpus:
            self.gpus = known
            self.device_model = replace(self.device_model, shared=gpus < ranks, one_gpu=gpus == 1,
                                        kernel_fences=fences.in_kernel)
            self._cache.clear()

    def _describe_gpus(self):
        if self.gpus is None:
            return "the node's ranks taken to share one GPU until a device call learns it"
        gpus, ranks, mechanism = self.gpus
        where = "the node's ranks share one GPU" if gpus == 1 else \
            "each of the node's ranks has a GPU of its own" if gpus >= ranks else \
            f"the node's {ranks} ranks share {gpus} GPUs"
        return f"{where}, {mechanism} fences"

    def hint(self):
        """The one-line note shown where the conservative rule is in force because no
        host table matches this machine and layout; None where one does (or where
        nothing is left to choose: one rank, every collective forced)."""
        if self.rule != "conservative" or self.in_use[0] or self.world_size < 2 or set(BUILDERS) <= set(self.overrides):
            return None
        calibrated = self.calibration
        if calibrated is not None:  # said once, where it was measured now (a cached one says nothing)
            if calibrated.source != "measured now":
                return None
            return (f"collectives: no tuning table measured on this machine and layout "
                    f"({describe_fingerprint(self.fingerprint)}); auto's cost model was calibrated here in "
                    f"{calibrated.seconds:.2f} s (cached for later jobs; {calibration_module.CALIBRATE_ENV}=0 turns "
                    f"it off). `make tune` measures a full table; {QUIET_ENV}=1 hides this.")
        return (f"collectives: no tuning table measured on this machine and layout "
                f"({describe_fingerprint(self.fingerprint)}); auto uses MPI's own collectives unless the cost "
                f"model predicts a {GAIN_NEEDED:g}x gain. Run `make tune` (or collectives-bench --tune FILE, then "
                f"{TUNING_ENV}=FILE) to tune; {QUIET_ENV}=1 hides this.")

    def choose(self, collective, nbytes, device=False):
        key = (collective, nbytes, device)
        choice = self._cache.get(key)
        if choice is None:
            choice = self._cache.put(key, self.explain(collective, nbytes, device)[0])
        return choice

    def explain(self, collective, nbytes, device=False):
        """``(algorithm, why)``: what ``auto`` picks and which rule decided. Device
        arrays have tables of their own (a host table says nothing of them)."""
        choice, why = self._explain(collective, nbytes, device)
        if self.deterministic and collective in ORDERED and choice not in ORDERED[collective]:
            return ORDERED[collective][0], f"deterministic mode (reduces in rank order; else {choice}, by the {why})"
        return choice, why

    def _explain(self, collective, nbytes, device):
        if collective in self.overrides:
            return self.overrides[collective], f"forced by {override_variable(collective)}"
        table = self.device_table if device else self.table
        if table is not None and self.in_use[device]:
            choice = table.lookup(collective, nbytes, self.key)
            if choice is not None:
                return choice, f"measured table {table.source}" + (f" (layout {self.key})" if self.several else "")
        if device:
            choice, why = device_choice(collective, nbytes, self.world_size, self.topology, self.device_model)
            other = f": {self._other_gpus}" if self._other_gpus else ""
            why += f" (no measured table for device arrays{other}; {self._describe_gpus()})"
            if self.several:
                why += f" for {self.topology.describe()}"
            return choice, why
        if self.calibration is not None:
            return calibrated_choice(self.calibration, collective, nbytes, self.world_size,
                                     self.topology if self.several else None)
        if self.rule == "cost-model":
            why = "cost-model rule" + (f" for {self.topology.describe()}" if self.several else "")
            return cost_model_choice(collective, nbytes, self.world_size, topology=self.topology), why
        choice, gain, best = conservative_choice(collective, nbytes, self.world_size, self.topology)
        if self.in_use[0]:
            missing = f"{table.source} has no {collective} table for " + \
                (f"layout {self.key}" if self.several else f"world size {self.key}")
        else:
            missing = f"no measured table for this machine and layout ({describe_fingerprint(self.fingerprint)}" + \
                (f"; {self._why_not[0]})" if self._why_not[0] else ")")
        if choice == "native":
            said = f"native (the cost model predicts at most {gain:.2f}x gain" + (f", {best})" if best else ")")
        else:
            said = f"{choice} (the cost model predicts {gain:.2f}x gain over native)"
        return choice, f"conservative rule: {missing}; {said}"
