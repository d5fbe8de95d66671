"""MPI jobs across the testbed's hosts: launch with MPICH's hydra, check that the
inter-host bytes crossed the links, and end every process the job started.

What it promises:

- Layout ``HxR``: H hosts, R ranks each, host-major (ranks 0..R-1 on host 0, R..2R-1
  on host 1, ...). ``mpiexec`` runs inside host 0's namespace and reaches the others
  through a launcher that stands in for ssh (:mod:`collectives.tools.testbed.ssh`).
- Between hosts MPI uses TCP over the links: MPICH's default netmod would silently
  carry "inter-host" messages over shared memory, since every host is this kernel
  (``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp``). Within a host, shared memory.
- The ranks get this Python and this environment, plus ``COLLECTIVES_TESTBED=1``,
  ``COLLECTIVES_TESTBED_LAYOUT=HxR`` (how tests know where they run) and the MPI
  settings above. ``python``/``python3`` as the program means ``sys.executable``.
- The links' byte counters are read before and after. With H > 1, a job in which some
  host sent fewer than ``min_link_bytes`` fails (:class:`LinkUnusedError` or the CLI's
  non-zero exit), naming the host and its counters.
- The job runs in a session of its own. :meth:`Job.kill` (and every way a run ends:
  success, failure, timeout, an exception in the caller) ends the processes of that
  session and their descendants, by PID, and nothing else; none is left behind.
"""

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

from . import names, net

# Settings the job's environment gets; see the module docstring (the trap).
MPI_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": names.HOST_DEV}
# A launcher's own variables must not reach a nested mpiexec (e.g. run from inside a job).
_DROP = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "FI_", "UCX_", "OMPI_")
# The launcher alone (hydra's proxies, PMI, the TCP netmod's address exchange) sends
# 6-22 KB per host over the links even when the ranks exchange nothing (measured at
# 2x2, 4x1 and 2x4): the minimum must sit well above that to mean anything.
DEFAULT_MIN_LINK_BYTES = 64 * 1024


class LinkUnusedError(net.TestbedError):
    """A multi-host job in which a host sent (almost) nothing over its link: its
    "inter-host" messages went some other way, so it tested nothing about the network."""


def parse_layout(layout):
    """``(hosts, ranks_per_host)`` from ``"2x4"`` (or a pair). ``ValueError`` naming it."""
    if isinstance(layout, str):
        match = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", layout)
        if not match:
            raise ValueError(f"layout must be HOSTSxRANKS, e.g. 2x4; got {layout!r}")
        hosts, ranks = int(match.group(1)), int(match.group(2))
    else:
        try:
            hosts, ranks = layout
        except (TypeError, ValueError):
            raise ValueError(f"layout must be 'HxR' or (hosts, ranks); got {layout!r}") from None
    if not (isinstance(hosts, int) and isinstance(ranks, int) and hosts >= 1 and ranks >= 1):
        raise ValueError(f"layout needs at least 1 host and 1 rank per host; got {layout!r}")
    return hosts, ranks


def mpiexec_path():
    """``$MPIEXEC``, else the ``mpiexec`` beside this Python (the venv's), else PATH's."""
    path = os.environ.get("MPIEXEC") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.sep not in path or not os.access(path, os.X_OK):
        import shutil
        found = shutil.which(os.path.basename(path)) or shutil.which("mpiexec")
        if not found:
            raise net.TestbedError("no mpiexec: set MPIEXEC, or install MPICH (pip install mpich)")
        path = found
    return path


def _session_and_descendants(leader):
    """PIDs (other than ours) in ``leader``'s session, and their descendants: what the
    job started, whether or not it is still attached to its parent."""
    parents, members = {}, set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        pid, ppid, sid = int(entry), int(fields[1]), int(fields[3])
        parents[pid] = ppid
        if sid == leader:
            members.add(pid)
    found, grew = set(members) | ({leader} if leader in parents else set()), True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    found.discard(os.getpid())
    return found


class Job:
    """One MPI job on the testbed (made by :func:`start`)."""

    def __init__(self, process, hosts, ranks, before, tmpdir, argv):
        self.process, self.hosts, self.ranks = process, hosts, ranks
        self.pid = process.pid
        self.before = before  # {host: {"tx", "rx"}} when it started
        self.started = time.monotonic()
        self.seconds = None
        self.argv = argv
        self._tmpdir = tmpdir

    def _exited(self):
        """Whether mpiexec has exited, without reaping it: until it is reaped its PID
        (the job's session id) cannot be reused, so the sweep cannot hit a stranger."""
        if self.process.returncode is not None:
            return True
        return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def poll(self):
        """The exit status if the job has ended (stragglers then ended too), else None."""
        return self._finish() if self._exited() else None

    def wait(self, timeout=None):
        """The job's exit status, or None if it is still running after ``timeout`` s.
        When mpiexec has exited, any process it left behind is ended first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._exited():
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
        return self._finish()

    def _finish(self):
        if self.process.returncode is None:
            self._end_all()
            self.process.wait()
        if self.seconds is None:
            self.seconds = time.monotonic() - self.started
        self._cleanup()
        return self.process.returncode

    def kill(self):
        """End every process the job started (SIGTERM, then SIGKILL), by PID, and reap
        mpiexec. Returns its exit status. Safe to call more than once."""
        return self._finish()

    def _end_all(self, grace=2.0):
        for sig, pause in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            pids = {p for p in _session_and_descendants(self.pid) if _alive(p)}
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + pause
            while time.monotonic() < deadline:
                if not any(_alive(p) for p in _session_and_descendants(self.pid)):
                    return
                time.sleep(0.05)
        left = sorted(p for p in _session_and_descendants(self.pid) if _alive(p))
        if left:
            raise net.TestbedError(f"processes {left} of the job survived SIGKILL")

    def _cleanup(self):
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def link_bytes_moved(self):
        """``{host: {"tx", "rx"}}``: bytes each of the job's hosts moved over its link
        since the job started (everything on the link, the launcher's traffic included)."""
        moved = {}
        for host, start in self.before.items():
            now = net.link_bytes(host)
            moved[host] = {k: now[k] - start[k] for k in ("tx", "rx")}
        return moved

    def check_links(self, moved, min_link_bytes=DEFAULT_MIN_LINK_BYTES):
        """Raise :class:`LinkUnusedError` if a multi-host job left a host's link (nearly)
        idle: fewer than ``min_link_bytes`` sent. 0 disables the check."""
        if self.hosts < 2 or not min_link_bytes:
            return
        idle = [h for h, m in moved.items() if m["tx"] < min_link_bytes]
        if idle:
            detail = ", ".join(f"host {h} ({names.host_ns(h)}) sent {moved[h]['tx']} B, received "
                               f"{moved[h]['rx']} B" for h in idle)
            raise LinkUnusedError(f"the job ran on {self.hosts} hosts but {detail} over its link "
                                  f"(fewer than --min-link-bytes {min_link_bytes}): its inter-host "
                                  "messages did not cross the links (MPI used shared memory?)")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start(layout, argv, env=None, stdout=None, stderr=None):
    """Launch ``argv`` on the testbed at ``layout`` (see the module's promises); returns
    a :class:`Job` at once. ``env``: extra variables for the ranks."""
    hosts, ranks = parse_layout(layout)
    argv = [str(a) for a in argv]
    if not argv:
        raise ValueError("argv is empty: give the program to run, e.g. ['python', 'prog.py']")
    net.require()
    present = net.hosts_present()
    if not set(range(hosts)) <= set(present) or names.BRIDGE_NS not in net.namespaces():
        raise net.TestbedError(f"layout {hosts}x{ranks} needs hosts 0..{hosts - 1} but the testbed has "
                               f"{len(present)}: run `python -m collectives.tools.testbed up --hosts {hosts}` first")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    tmpdir = tempfile.TemporaryDirectory(prefix="cctb-")
    launcher = os.path.join(tmpdir.name, "ssh")
    ssh_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ssh.py")
    with open(launcher, "w") as f:
        f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(ssh_py)} \"$@\"\n")
    os.chmod(launcher, 0o755)
    job_env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
    job_env.update(MPI_ENV)
    job_env.update(COLLECTIVES_TESTBED="1", COLLECTIVES_TESTBED_LAYOUT=f"{hosts}x{ranks}")
    job_env.update(env or {})
    host_list = ",".join(f"{names.address(h)}:{ranks}" for h in range(hosts))
    command = ["ip", "netns", "exec", names.host_ns(0), mpiexec_path(),
               "-launcher", "ssh", "-launcher-exec", launcher, "-localhost", names.address(0),
               "-hosts", host_list, "-n", str(hosts * ranks), *argv]
    before = {h: net.link_bytes(h) for h in range(hosts)}
    try:
        process = subprocess.Popen(command, env=job_env, start_new_session=True, stdout=stdout, stderr=stderr)
    except BaseException:
        tmpdir.cleanup()
        raise
    return Job(process, hosts, ranks, before, tmpdir, argv)


class Result:
    """How a run ended: ``returncode`` (124 on timeout), ``seconds``, ``link_bytes``
    ({host: {"tx", "rx"}} moved during the job), ``timed_out``, ``link_error`` (the
    :class:`LinkUnusedError` message, or None)."""

    def __init__(self, returncode, seconds, link_bytes, timed_out, link_error):
        self.returncode, self.seconds, self.link_bytes = returncode, seconds, link_bytes
        self.timed_out, self.link_error = timed_out, link_error

    @property
    def ok(self):
        return self.returncode == 0 and self.link_error is None

    def as_dict(self):
        return {"returncode": self.returncode, "seconds": round(self.seconds, 3), "timed_out": self.timed_out,
                "link_error": self.link_error, "link_bytes": {str(h): m for h, m in self.link_bytes.items()}}

    def summary(self):
        links = "; ".join(f"h{h} tx {m['tx'] / 1e6:.2f} MB rx {m['rx'] / 1e6:.2f} MB"
                          for h, m in self.link_bytes.items())
        how = "timed out" if self.timed_out else f"exited {self.returncode}"
        return f"testbed: job {how} after {self.seconds:.1f} s; link bytes: {links}"


def run(layout, argv, timeout=None, min_link_bytes=DEFAULT_MIN_LINK_BYTES, env=None):
    """Run ``argv`` at ``layout`` to the end (or ``timeout`` seconds, then kill it: exit
    status 124) and check the links. Returns a :class:`Result`; the job's output goes
    to this process's stdout and stderr."""
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
    job = start(layout, argv, env)
    timed_out = False
    try:
        code = job.wait(timeout)
        if code is None:
            timed_out, code = True, 124
    finally:
        job.kill()  # all of a timed-out or interrupted job (wait ended a finished one's stragglers)
    moved = job.link_bytes_moved()
    try:
        job.check_links(moved, min_link_bytes)
        link_error = None
    except LinkUnusedError as exc:
        link_error = str(exc)
    return Result(code, job.seconds, moved, timed_out, link_error)
