"""collectives.tools.testbed's parts that need neither root nor a network: parsing rates,
layouts, host names and ssh-style arguments, and the one-line messages for a machine
that lacks root or iproute2. (The testbed itself: tests/tools/test_multihost.py under
`make test-multihost`.)"""

import os
import subprocess
import sys

import pytest

from collectives.tools.testbed import job, names, net, ssh

pytestmark = pytest.mark.serial


@pytest.mark.parametrize("rate,bits", [("1gbit", 10**9), ("10mbit", 10**7), ("2.5Gbit", 25 * 10**8),
                                       ("500kbit", 5 * 10**5), (10**8, 10**8)])
def test_rates(rate, bits):
    assert net.parse_rate(rate) == bits


@pytest.mark.parametrize("rate", ["fast", "1gb/s", "", "0mbit", "5000gbit", True])
def test_bad_rates_name_the_rate(rate):
    with pytest.raises(ValueError, match="rate"):
        net.parse_rate(rate)


def test_burst_is_a_millisecond_of_traffic_but_holds_a_few_frames():
    assert net.tbf_args("1gbit") == ["tbf", "rate", "1000000000bit", "burst", "125000", "latency", net.LATENCY]
    assert int(net.tbf_args("10mbit")[4]) == 4 * 1514  # 1 ms would be 1250 B: tbf would drop every full frame


def test_layouts():
    assert job.parse_layout("2x4") == (2, 4)
    assert job.parse_layout((4, 1)) == (4, 1)
    for bad in ["2", "0x2", "2x0", "axb", (1,), None]:
        with pytest.raises(ValueError, match="layout"):
            job.parse_layout(bad)


def test_host_names_and_addresses_agree():
    for i in (0, 1, 7):
        assert names.host_index(i) == names.host_index(f"h{i}") == names.host_index(names.host_ns(i)) \
            == names.host_index(names.address(i)) == i
    for bad in ["10.0.0.1", "nodeA", -1, names.MAX_HOSTS]:
        with pytest.raises(ValueError, match="host"):
            names.host_index(bad)


def test_host_rates_must_name_a_host_of_the_testbed():
    assert net.rates_for(3, "1gbit", {"h2": "10mbit"}) == [10**9, 10**9, 10**7]
    with pytest.raises(ValueError, match="a host rate names host 'h3'"):
        net.rates_for(3, "1gbit", {"h3": "10mbit"})
    with pytest.raises(ValueError, match="hosts must be"):
        net.rates_for(0)


def test_the_ssh_stand_in_ignores_options_and_keeps_the_command():
    assert ssh.parse(["-x", "10.251.16.11", "/usr/bin/proxy", "--a", "1"]) == ("10.251.16.11", "/usr/bin/proxy --a 1")
    assert ssh.parse(["-o", "BatchMode=yes", "-x", "h1", "echo"]) == ("h1", "echo")
    with pytest.raises(ValueError, match="HOST command"):
        ssh.parse(["-x", "h1"])


def test_the_ssh_stand_in_refuses_a_host_outside_the_testbed():
    done = subprocess.run([sys.executable, ssh.__file__, "-x", "example.org", "true"], capture_output=True, text=True)
    assert done.returncode == 255 and "host must be an index" in done.stderr, done.stderr


def test_without_root_or_iproute2_one_line_says_what_is_missing(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no ip, no tc
    done = subprocess.run([sys.executable, "-m", "collectives.tools.testbed", "down"], capture_output=True, text=True,
                          env=env)
    assert done.returncode == 2
    assert done.stderr.strip() == "collectives.tools.testbed needs iproute2: ip and tc not found on PATH"


def test_without_root_it_says_so(monkeypatch):
    monkeypatch.setattr(net.os, "geteuid", lambda: 1000)
    assert net.missing() == "collectives.tools.testbed needs root (it creates network namespaces); run it as root"
    with pytest.raises(net.TestbedError, match="needs root"):
        net.up(2)


def test_the_core_does_not_import_the_testbed():
    code = "import sys, collectives; sys.exit('collectives.tools.testbed' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
