"""The launcher MPICH's hydra calls instead of ssh: ``ssh.py [ssh options] HOST
command...`` runs ``command`` in HOST's network namespace
(``ip netns exec cctb-hI sh -c "command..."``), the way ssh would run it on HOST.

hydra is given a small shell wrapper around this file as ``-launcher-exec`` (see
:mod:`collectives.tools.testbed.job`); it also works as ``python -m
collectives.tools.testbed.ssh``. Options (``-x``, ``-o VALUE`` ...) are accepted and
ignored: there is no remote login. The process replaces itself (exec) with ``ip``,
then ``sh``, so that the job's process tree holds only what hydra started. The
environment passes through unchanged: every "host" is this machine, so the ranks get
the caller's Python, PYTHONPATH and the testbed's MPI settings.
"""

import os
import sys

try:
    from . import names
except ImportError:  # run as a script (the wrapper does): no package, no MPI
    import names  # type: ignore[no-redef]

# ssh options that take a value; every other option is a flag.
_WITH_VALUE = set("bcDEeFIiJLlmOoPpQRSWw")


def parse(argv):
    """``(host, command)`` from ssh-style arguments; ``ValueError`` if there is no host
    or no command."""
    args = list(argv)
    while args and args[0].startswith("-") and len(args[0]) > 1:
        option = args.pop(0)
        if option == "--":
            break
        if len(option) == 2 and option[1] in _WITH_VALUE:
            if not args:
                raise ValueError(f"ssh option {option} needs a value")
            args.pop(0)
    if len(args) < 2:
        raise ValueError(f"expected [options] HOST command...; got {' '.join(argv)!r}")
    return args[0], " ".join(args[1:])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        host, command = parse(argv)
        namespace = names.host_ns(names.host_index(host))
    except ValueError as exc:
        print(f"collectives.tools.testbed.ssh: {exc}", file=sys.stderr)
        return 255  # what ssh returns when it cannot connect
    os.execvp("ip", ["ip", "netns", "exec", namespace, "sh", "-c", command])


if __name__ == "__main__":
    sys.exit(main())
