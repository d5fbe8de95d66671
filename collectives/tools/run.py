"""``collectives-run``: start a job the way ``horovodrun`` does, on whichever MPI is
installed.

    collectives-run -np 4 python train.py
    collectives-run -np 4 -H a:2,b:2 python train.py
    collectives-run --hostfile hosts.txt -x NCCL_DEBUG --check --timeout 60 python train.py
    collectives-run -np 4 -H a:2,b:2 --dry-run python train.py     # print the mpiexec line

It builds the ``mpiexec`` line for the MPI family of the ``mpiexec`` it finds (the one
beside this Python, or ``--mpiexec``; ``--family`` names one instead, for a dry run),
prints it with ``--dry-run``, and otherwise runs it and exits with its status. What
each family is given (each form tried here with the family's wheel from PyPI, on one
host):

- MPICH: ``-hosts a:2,b:2``, and ``-genv K V`` for a variable;
- Intel MPI: a section per host, ``-host a -n 2 CMD : -host b -n 2 CMD``, and ``-genv K V``;
- Open MPI: ``-H a:2,b:2``, and ``-x K=V``.

Intel MPI's ``-hosts`` takes no counts, so each host gets a section of its own. Open MPI
gets ``--oversubscribe`` where no host is named and the ranks outnumber this machine's
cores, and ``--allow-run-as-root`` as root (a container). ``--check`` and ``--timeout``
set ``COLLECTIVES_CHECK`` and ``COLLECTIVES_TIMEOUT`` for every rank. ``-np`` defaults
to the hosts' slots; ranks fill the hosts in order, each up to its slots. A hostfile
holds a host per line, as ``host``, ``host:N`` or ``host slots=N`` (``#`` starts a
comment).
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

FAMILIES = ("mpich", "impi", "openmpi")
_HOST = re.compile(r"^([A-Za-z0-9_.\-]+)(?::(\d+))?$")
_HOSTFILE_LINE = re.compile(r"^(\S+?)(?::(\d+)|\s+slots\s*=\s*(\d+))?\s*$")


@dataclass(frozen=True)
class Job:
    """What to start: ``ranks`` processes of ``command``, placed on ``hosts``
    (``(name, ranks)`` pairs; empty: this machine), with ``env`` set for every rank."""

    ranks: int
    command: tuple
    hosts: tuple = ()
    env: tuple = ()  # (name, value) pairs


def family_of(mpiexec, env=None):
    """``"mpich"``, ``"impi"`` or ``"openmpi"``, from what ``mpiexec --version``
    prints (run in ``env``: this process's environment by default); ValueError naming
    the launcher otherwise."""
    try:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60, env=env).stdout
    except OSError as exc:
        raise ValueError(f"cannot run {mpiexec} --version: {exc}") from None
    if "Intel(R) MPI" in version:
        return "impi"
    if "HYDRA" in version:
        return "mpich"
    if "Open MPI" in version or "OpenRTE" in version:
        return "openmpi"
    raise ValueError(f"{mpiexec}: not a launcher collectives-run knows (MPICH's hydra, Intel MPI, Open MPI); "
                     f"--version says {version[:200]!r}")


def parse_hosts(text):
    """``"a:2,b:2"`` (``-H``) as ``(("a", 2), ("b", 2))``; a host without a count has 1."""
    hosts = []
    for item in text.split(","):
        match = _HOST.match(item.strip())
        if not match or (match.group(2) is not None and int(match.group(2)) < 1):
            raise ValueError(f"-H: {item!r} is not host or host:slots (slots at least 1)")
        hosts.append((match.group(1), int(match.group(2) or 1)))
    return tuple(hosts)


def read_hostfile(path):
    """A hostfile's hosts: a line each, ``host``, ``host:N`` or ``host slots=N``."""
    hosts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            match = _HOSTFILE_LINE.match(line)
            slots = match and int(match.group(2) or match.group(3) or 1)
            if not match or slots < 1:
                raise ValueError(f"--hostfile {path}, line {number}: {line!r} is not host, host:N or host slots=N")
            hosts.append((match.group(1), slots))
    if not hosts:
        raise ValueError(f"--hostfile {path} names no host")
    return tuple(hosts)


def place(ranks, hosts):
    """``ranks`` spread over ``hosts`` in order, each up to its slots:
    ``(name, ranks there)`` for every host that gets one."""
    slots = sum(n for _, n in hosts)
    if ranks > slots:
        raise ValueError(f"-np {ranks} is more than the hosts' {slots} slots ({format_hosts(hosts)})")
    placed, left = [], ranks
    for name, n in hosts:
        if left == 0:
            break
        placed.append((name, min(n, left)))
        left -= placed[-1][1]
    return tuple(placed)


def format_hosts(hosts):
    return ",".join(f"{name}:{n}" for name, n in hosts)


def command_line(job, family, mpiexec="mpiexec", launcher_args=(), cores=None, root=None):
    """The launcher's command line for ``job`` on ``family`` (see the module's table).
    ``cores`` (this machine's, by default) and ``root`` (whether this process runs as
    root, by default) decide Open MPI's two extra flags."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}; got {family!r}")
    cores = (os.cpu_count() or 1) if cores is None else cores
    root = (hasattr(os, "geteuid") and os.geteuid() == 0) if root is None else root
    line = [mpiexec, *launcher_args]
    if family == "openmpi":
        if root:
            line.append("--allow-run-as-root")
        if not job.hosts and job.ranks > cores:
            line.append("--oversubscribe")
        line += ["-n", str(job.ranks)]
        if job.hosts:
            line += ["-H", format_hosts(job.hosts)]
        for name, value in job.env:
            line += ["-x", f"{name}={value}"]
        return line + list(job.command)
    for name, value in job.env:
        line += ["-genv", name, value]
    if family == "mpich" or not job.hosts:
        if job.hosts:
            line += ["-hosts", format_hosts(job.hosts)]
        return line + ["-n", str(job.ranks), *job.command]
    for i, (name, ranks) in enumerate(job.hosts):  # Intel MPI: a section per host
        line += ([":"] if i else []) + ["-host", name, "-n", str(ranks), *job.command]
    return line


def parser():
    p = argparse.ArgumentParser(
        prog="collectives-run", description="Start a job as horovodrun does, on the MPI installed here.",
        epilog="Everything from the command on goes to every rank unchanged.")
    p.add_argument("-np", "--num-proc", dest="ranks", type=int, help="ranks (default: the hosts' slots)")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="hosts and their slots: a:2,b:2 (default: this machine)")
    hosts.add_argument("--hostfile", help="a file of hosts: host, host:N or host slots=N on each line")
    p.add_argument("-x", "--env", action="append", default=[], metavar="VAR[=VALUE]",
                   help="a variable for every rank: its value here, or VALUE (repeat for more)")
    p.add_argument("--check", action="store_true", help="check mode on every rank (COLLECTIVES_CHECK=1)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="the library's timeout on every rank (COLLECTIVES_TIMEOUT)")
    p.add_argument("--mpiexec", help="the launcher (default: the mpiexec beside this Python, else on PATH)")
    p.add_argument("--family", choices=FAMILIES, help="the launcher's MPI family (default: ask it)")
    p.add_argument("--launcher-args", default="", metavar="ARGS", help="more options for mpiexec, as one string")
    p.add_argument("--dry-run", action="store_true", help="print the command line and run nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def job_from(args, environ):
    """The :class:`Job` that parsed ``args`` ask for; ValueError naming the argument
    that makes no sense."""
    if not args.command:
        raise ValueError("give the command to run, e.g. collectives-run -np 4 python train.py")
    hosts = parse_hosts(args.hosts) if args.hosts else read_hostfile(args.hostfile) if args.hostfile else ()
    if args.ranks is None and not hosts:
        raise ValueError("-np: give the number of ranks, or hosts with -H or --hostfile")
    ranks = sum(n for _, n in hosts) if args.ranks is None else args.ranks
    if ranks < 1:
        raise ValueError(f"-np must be at least 1; got {ranks}")
    env = []
    for item in args.env:
        name, has_value, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"-x {item!r}: not a variable name")
        if not has_value:
            if name not in environ:
                raise ValueError(f"-x {name}: not set here (give -x {name}=VALUE)")
            value = environ[name]
        env.append((name, value))
    if args.check:
        env.append(("COLLECTIVES_CHECK", "1"))
    if args.timeout is not None:
        if not args.timeout > 0:
            raise ValueError(f"--timeout must be a positive number of seconds; got {args.timeout}")
        env.append(("COLLECTIVES_TIMEOUT", repr(args.timeout)))
    return Job(ranks, tuple(args.command), place(ranks, hosts) if hosts else (), tuple(env))


def default_mpiexec():
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else "mpiexec"


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    try:
        job = job_from(args, os.environ)
        mpiexec = args.mpiexec or default_mpiexec()
        family = args.family or family_of(mpiexec)
        line = command_line(job, family, mpiexec, shlex.split(args.launcher_args))
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    if args.dry_run:
        print(shlex.join(line))
        return 0
    return subprocess.run(line).returncode


if __name__ == "__main__":
    sys.exit(main())
