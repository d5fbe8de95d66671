"""The network: builds and removes the hosts, their links and the bridge; sets a
link's rate or state; reads its byte counters. Standard library only; every change
goes through iproute2 (``ip``, ``tc``), so it needs root.

What it promises:

- :func:`up` leaves exactly ``hosts`` hosts, each link shaped with tbf at its rate on
  both ends (so both directions are shaped). On a testbed of the same shape and rates
  it changes nothing; otherwise it removes the old one first.
- :func:`down` removes every namespace, link and route the testbed made, and nothing
  else (only names starting with ``cctb``); it succeeds when there is nothing to remove.
- Addresses exist only inside the namespaces: no default route, no forwarding, and a
  blackhole route for the subnet in the root namespace, so a program started outside
  the namespaces by mistake cannot reach (or leak to) the testbed's addresses.
- Every failure raises :class:`TestbedError` with the command and what it printed.
"""

import json
import os
import re
import shutil
import subprocess

from . import names

DEFAULT_RATE = "1gbit"
LATENCY = "50ms"  # how long tbf may queue a packet before dropping it


class TestbedError(RuntimeError):
    """The testbed could not do what was asked (the message says what and why)."""


def missing():
    """What the testbed lacks on this machine (a one-line message), or None."""
    lacking = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if lacking:
        return f"collectives.tools.testbed needs iproute2: {' and '.join(lacking)} not found on PATH"
    if os.geteuid() != 0:
        return "collectives.tools.testbed needs root (it creates network namespaces); run it as root"
    return None


def require():
    """Raise :class:`TestbedError` with :func:`missing`'s message if anything is missing."""
    why = missing()
    if why:
        raise TestbedError(why)


def sh(*args, check=True):
    """Run one command; its stdout. Raises TestbedError naming it if it fails."""
    done = subprocess.run(args, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise TestbedError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


# -- rates ------------------------------------------------------------------------------
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_rate(rate):
    """Bits per second from ``"1gbit"``, ``"10mbit"``, ``"500kbit"``, ``"2.5gbit"`` or a
    number of bit/s. ``ValueError`` naming the rate otherwise."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        bits = float(rate)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:bit)?\s*", str(rate).lower())
        if not match:
            raise ValueError(f"rate must look like 1gbit, 100mbit or 500kbit; got {rate!r}")
        bits = float(match.group(1)) * _UNITS[match.group(2)]
    if not 8000 <= bits <= 10**12:
        raise ValueError(f"rate must be between 8kbit and 1000gbit; got {rate!r}")
    return int(bits)


def tbf_args(rate):
    """tc's arguments for a tbf shaper at ``rate``: a burst of 1 ms of traffic (125000 B
    at 1 Gbit/s) but never less than a few full-size frames (tbf drops a packet bigger
    than its burst)."""
    bits = parse_rate(rate)
    burst = max(bits // 8000, 4 * 1514)
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", LATENCY]


# -- what exists -------------------------------------------------------------------------
def namespaces():
    """The testbed's namespaces that exist now."""
    out = sh("ip", "netns", "list")
    found = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in found if n.startswith(names.PREFIX + "-"))


def hosts_present():
    """Indices of the host namespaces that exist now."""
    return sorted(int(n[len(names.PREFIX) + 2:]) for n in namespaces()
                  if re.fullmatch(rf"{names.PREFIX}-h\d+", n))


def read_state():
    """The state file's contents ({} if there is none or it is unreadable). The
    namespaces are the truth; the file only remembers the rates asked for."""
    try:
        with open(names.STATE_FILE) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_state(state):
    with open(names.STATE_FILE, "w") as f:
        json.dump(state, f, indent=1)


# -- up and down -------------------------------------------------------------------------
def rates_for(hosts, rate=DEFAULT_RATE, host_rates=None):
    """Every host's rate as a list of bit/s: ``rate`` unless ``host_rates`` ({host: rate})
    says otherwise. Checks every value, naming the bad one."""
    hosts = _check_hosts(hosts)
    rates = [parse_rate(rate)] * hosts
    for host, value in (host_rates or {}).items():
        index = names.host_index(host)
        if index >= hosts:
            raise ValueError(f"a host rate names host {host!r}, but the testbed has hosts 0..{hosts - 1}")
        rates[index] = parse_rate(value)
    return rates


def _check_hosts(hosts):
    if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= names.MAX_HOSTS:
        raise ValueError(f"hosts must be an integer 1..{names.MAX_HOSTS}; got {hosts!r}")
    return hosts


def up(hosts, rate=DEFAULT_RATE, host_rates=None):
    """Build a testbed of ``hosts`` hosts (see the module's promises). Returns the state
    (hosts, rates in bit/s, addresses)."""
    rates = rates_for(hosts, rate, host_rates)
    require()
    state = {"hosts": hosts, "rates": rates, "addresses": [names.address(i) for i in range(hosts)]}
    if read_state() == state and hosts_present() == list(range(hosts)) and names.BRIDGE_NS in namespaces():
        return state  # the same testbed is up: nothing to do
    down()
    try:
        _build(hosts, rates)
        _write_state(state)
    except BaseException:
        down()  # never leave half a testbed behind
        raise
    return state


def _build(hosts, rates):
    br = names.BRIDGE_NS
    sh("ip", "netns", "add", br)
    sh("ip", "-n", br, "link", "add", names.BRIDGE, "type", "bridge")
    sh("ip", "-n", br, "link", "set", names.BRIDGE, "up")
    sh("ip", "-n", br, "link", "set", "lo", "up")
    prefix = names.SUBNET.prefixlen
    for i in range(hosts):
        ns, port = names.host_ns(i), names.bridge_port(i)
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", names.HOST_DEV, "netns", ns, "type", "veth", "peer", "name", port, "netns", br)
        sh("ip", "-n", br, "link", "set", port, "master", names.BRIDGE)
        sh("ip", "-n", br, "link", "set", port, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "addr", "add", f"{names.address(i)}/{prefix}", "dev", names.HOST_DEV)
        sh("ip", "-n", ns, "link", "set", names.HOST_DEV, "up")
        _shape(i, rates[i], "add")
    # Nothing in the root namespace may send to the subnet (it would go out the default route).
    sh("ip", "route", "replace", "blackhole", str(names.SUBNET))


def _shape(host, bits, how="replace"):
    args = tbf_args(bits)
    sh("ip", "netns", "exec", names.host_ns(host), "tc", "qdisc", how, "dev", names.HOST_DEV, "root", *args)
    sh("ip", "netns", "exec", names.BRIDGE_NS, "tc", "qdisc", how, "dev", names.bridge_port(host), "root", *args)


def down():
    """Remove the testbed: every ``cctb`` namespace (their links go with them) and the
    blackhole route. Idempotent."""
    require()
    for ns in namespaces():
        sh("ip", "netns", "delete", ns)
    routes = sh("ip", "route", "show", "type", "blackhole", str(names.SUBNET), check=False)
    if routes.strip():
        sh("ip", "route", "delete", "blackhole", str(names.SUBNET))
    try:
        os.unlink(names.STATE_FILE)
    except FileNotFoundError:
        pass


# -- during a run ------------------------------------------------------------------------
def _existing(host):
    index = names.host_index(host)
    if index not in hosts_present():
        raise TestbedError(f"host {host!r} does not exist (the testbed has hosts {hosts_present()}; "
                           "python -m collectives.tools.testbed up --hosts N)")
    return index


def set_rate(host, rate):
    """Shape ``host``'s link, both directions, to ``rate`` (e.g. ``"10mbit"``) now,
    while a job runs. Works from inside a host's namespace too (as root)."""
    bits = parse_rate(rate)
    index = _existing(host)
    _shape(index, bits)
    state = read_state()
    if state.get("rates") and index < len(state["rates"]):
        state["rates"][index] = bits
        _write_state(state)


def set_link(host, up):
    """Set ``host``'s link up (True) or down (False): down cuts the host off, as a
    pulled cable would; TCP connections through it stall, they are not reset."""
    if not isinstance(up, bool):
        raise TypeError(f"up must be True or False; got {up!r}")
    index = _existing(host)
    sh("ip", "-n", names.host_ns(index), "link", "set", names.HOST_DEV, "up" if up else "down")


def link_bytes(host):
    """``{"tx": bytes, "rx": bytes}`` sent and received so far by ``host`` over its link
    (the host end's counters; loopback and shared memory are not counted)."""
    index = _existing(host)
    out = sh("ip", "-n", names.host_ns(index), "-s", "-j", "link", "show", "dev", names.HOST_DEV)
    stats = json.loads(out)[0]["stats64"]
    return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}
