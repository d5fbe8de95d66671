"""The testbed's names and addresses, in one place (standard library only: the
launcher script :mod:`collectives.tools.testbed.ssh` imports this module as a plain script,
without the ``collectives`` package, which would start MPI).

Everything the testbed creates starts with ``cctb``, so it cannot be mistaken for, or
collide with, anything else on the machine; ``down`` removes exactly these names.
"""

import ipaddress
import re

PREFIX = "cctb"
BRIDGE_NS = f"{PREFIX}-br"        # the namespace that holds the bridge (the "switch")
BRIDGE = f"{PREFIX}br"            # the bridge device inside BRIDGE_NS
HOST_DEV = f"{PREFIX}0"           # each host's end of its link, inside the host's namespace
SUBNET = ipaddress.ip_network("10.251.16.0/24")  # exists only inside the namespaces
FIRST = 10                        # host i has address SUBNET[FIRST + i]
MAX_HOSTS = 200
STATE_FILE = "/run/collectives-testbed.json"


def host_ns(i):
    """The namespace of host ``i``."""
    return f"{PREFIX}-h{i}"


def bridge_port(i):
    """Host ``i``'s link end on the bridge (inside BRIDGE_NS)."""
    return f"{PREFIX}p{i}"


def address(i):
    """Host ``i``'s address (a string, no prefix length)."""
    return str(SUBNET[FIRST + i])


def host_index(host):
    """The index of ``host``: an int, ``"3"``, ``"h3"``, ``"cctb-h3"`` or the host's
    address. ``ValueError`` (naming it) for anything else."""
    if isinstance(host, int) and not isinstance(host, bool):
        index = host
    else:
        text = str(host)
        match = re.fullmatch(rf"(?:{PREFIX}-)?h?(\d+)", text)
        if match:
            index = int(match.group(1))
        else:
            try:
                ip = ipaddress.ip_address(text)
            except ValueError:
                raise ValueError(f"host must be an index, h<i>, {PREFIX}-h<i> or a testbed address; "
                                 f"got {host!r}") from None
            if ip not in SUBNET:
                raise ValueError(f"host {host!r} is not a testbed address (subnet {SUBNET})")
            index = int(ip) - int(SUBNET.network_address) - FIRST
    if not 0 <= index < MAX_HOSTS:
        raise ValueError(f"host index must be 0..{MAX_HOSTS - 1}; got {host!r}")
    return index
