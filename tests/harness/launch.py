"""How the tests start MPI jobs of their own: one helper that knows each launcher's flags.

Every test that runs ``mpiexec`` itself builds its command here, so that the suite runs
under each MPI's launcher:

==============  ==========================  ===============  ==============================
launcher        how it is told apart        per-process env  keep survivors of a dead rank
==============  ==========================  ===============  ==============================
MPICH hydra     ``--version``: "HYDRA"      ``-env K V``     ``-disable-auto-cleanup``
Intel MPI       ``--version``: "Intel(R)"   ``-env K V``     ``-disable-auto-cleanup``
Open MPI        ``--version``: "Open MPI"   ``-x K=V``       ``--enable-recovery``
==============  ==========================  ===============  ==============================

Open MPI also gets ``--oversubscribe`` (the tests run more ranks than cores) and, as
root, ``--allow-run-as-root``. Without the keep-survivors flag every one of these
launchers ends the whole job within a second of a rank's death (measured with
tests/harness/dead_rank_job.py: hydra and Intel MPI's hydra send SIGKILL, Open MPI's
prterun too), which is what test_dead_rank.py relies on not happening.

``MPIEXEC`` names the launcher (else the ``mpiexec`` beside this Python: the venv's).
"""

import functools
import os
import subprocess

from collectives.tools.run import default_mpiexec, family_of

# An outer job's launcher variables must not reach a job started from inside it.
_JOB_VARIABLES = ("PMI_", "PMIX_", "MPIR_", "HYDRA_", "HYDI_", "PRTE_", "OMPI_COMM_WORLD", "OMPI_UNIVERSE",
                  "OMPI_APP_CTX", "OMPI_FIRST_RANKS", "OMPI_NUM_APP_CTX", "OMPI_ARGV", "OMPI_COMMAND",
                  "OMPI_FILE_LOCATION", "OMPI_MCA_ess", "OMPI_MCA_orte", "OMPI_MCA_pmix", "OMPI_MCA_prte",
                  "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def path():
    """The launcher: ``$MPIEXEC``, else ``collectives-run``'s (the ``mpiexec`` beside this Python)."""
    return os.environ.get("MPIEXEC") or default_mpiexec()


@functools.lru_cache(maxsize=None)
def kind(mpiexec=None):
    """The launcher's MPI family, ``"mpich"``, ``"impi"`` or ``"openmpi"``, as
    ``collectives-run`` tells it from ``mpiexec --version``; ValueError for another
    launcher."""
    return family_of(mpiexec or path(), env=environment())


def environment(extra=None):
    """This process's environment without an outer job's launcher variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_JOB_VARIABLES)}
    env.update(extra or {})
    return env


def command(parts, keep_survivors=False, mpiexec=None):
    """The command line of a job of ``parts``, each ``(ranks, env, argv)`` (``env``: a
    dict for those processes alone; several parts make an MPMD job). With
    ``keep_survivors`` the launcher leaves the other ranks running when one dies."""
    mpiexec = mpiexec or path()
    which = kind(mpiexec)
    line = [mpiexec]
    if which == "openmpi":
        line.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            line.append("--allow-run-as-root")
        if keep_survivors:
            line.append("--enable-recovery")
    elif keep_survivors:
        line.append("-disable-auto-cleanup")
    for i, (ranks, env, argv) in enumerate(parts):
        if i:
            line.append(":")
        line += ["-n", str(ranks)]
        for key, value in (env or {}).items():
            line += ["-x", f"{key}={value}"] if which == "openmpi" else ["-env", key, str(value)]
        line += [str(a) for a in argv]
    return line


def run(parts, keep_survivors=False, timeout=120, env=None):
    """Run the job (``parts`` as for :func:`command`) in :func:`environment` plus
    ``env``; returns the ``subprocess.CompletedProcess`` (text output captured)."""
    return subprocess.run(command(parts, keep_survivors), capture_output=True, text=True, timeout=timeout,
                          env=environment(env))
