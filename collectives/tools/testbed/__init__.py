"""A multi-host testbed on one Linux machine: network namespaces as hosts, joined by
rate-limited links, and MPI jobs launched across them over TCP.

::

     cctb-h0              cctb-h1                    cctb-h(N-1)      one namespace per "host"
    10.251.16.10         10.251.16.11               10.251.16.(10+N-1)
    [cctb0] tbf         [cctb0] tbf         ...    [cctb0] tbf       the host's end of its link
       |  veth             |  veth                     |  veth
    [cctbp0] tbf        [cctbp1] tbf        ...    [cctbp(N-1)] tbf  the bridge's end, shaped too
       \\____________________|_____________________________/
                      cctbbr (bridge, in namespace cctb-br)

Each host reaches the others only through its link, shaped with tbf (1 Gbit/s unless
told otherwise) in both directions; ranks on one host share memory as on a real node.
The subnet exists only inside the namespaces (no default route, no forwarding, a
blackhole route for it in the root namespace). All hosts share the machine's CPUs,
so the testbed measures what the network changes, not a cluster's speed.

    python -m collectives.tools.testbed up --hosts 4 --rate 1gbit [--host-rate 3=100mbit]
    python -m collectives.tools.testbed run --layout 2x2 [--timeout 300] -- python prog.py args
    python -m collectives.tools.testbed down

or from Python (the tests do)::

    from collectives.tools.testbed import Testbed
    with Testbed(hosts=2, rate="1gbit") as tb:      # up; down on leaving, whatever happens
        result = tb.run("2x2", ["python", "prog.py"], timeout=120)
        assert result.ok, result.summary()

:func:`set_rate`, :func:`set_link` and :func:`link_bytes` change or read a link while
a job runs (fault tests). It needs root and iproute2; :func:`missing` says what
lacks. The core library never imports this package.

Modules: :mod:`.names` (names and addresses), :mod:`.net` (the network),
:mod:`.job` (launching, link checks, ending processes), :mod:`.ssh` (hydra's
stand-in for ssh), ``__main__`` (the command line).
"""

from .job import DEFAULT_MIN_LINK_BYTES, Job, LinkUnusedError, Result, parse_layout, run, start
from .net import DEFAULT_RATE, TestbedError, down, link_bytes, missing, set_link, set_rate, up

__all__ = ["DEFAULT_MIN_LINK_BYTES", "DEFAULT_RATE", "Job", "LinkUnusedError", "Result", "Testbed", "TestbedError",
           "down", "link_bytes", "missing", "parse_layout", "run", "set_link", "set_rate", "start", "up"]


class Testbed:
    """A testbed of ``hosts`` hosts with links at ``rate`` (``host_rates``: {host:
    rate} where one differs). As a context manager it is built on entry and always
    removed on exit (``keep=True``: left up, e.g. for a make target that tears down
    itself)."""

    def __init__(self, hosts=2, rate=DEFAULT_RATE, host_rates=None, keep=False):
        from .net import rates_for
        rates_for(hosts, rate, host_rates)  # check the arguments now, naming the bad one
        self.hosts, self.rate, self.host_rates, self.keep = hosts, rate, dict(host_rates or {}), keep

    def up(self):
        """Build it (idempotent); returns self."""
        up(self.hosts, self.rate, self.host_rates)
        return self

    def down(self):
        """Remove it (idempotent)."""
        down()

    def __enter__(self):
        try:
            return self.up()
        except BaseException:
            down()
            raise

    def __exit__(self, *exc):
        if not self.keep:
            down()
        return False

    def run(self, layout, argv, timeout=None, min_link_bytes=DEFAULT_MIN_LINK_BYTES, env=None):
        """Run a job to its end: see :func:`collectives.tools.testbed.job.run`."""
        return run(layout, argv, timeout, min_link_bytes, env)

    def start(self, layout, argv, env=None, stdout=None, stderr=None):
        """Launch a job and return at once: see :func:`collectives.tools.testbed.job.start`."""
        return start(layout, argv, env, stdout, stderr)

    set_rate = staticmethod(set_rate)
    set_link = staticmethod(set_link)
    link_bytes = staticmethod(link_bytes)
