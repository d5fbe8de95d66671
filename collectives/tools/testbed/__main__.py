"""The command line: ``python -m collectives.tools.testbed up|run|down|status|set-rate|set-link``
(see :mod:`collectives.tools.testbed`). Exit status: 0 on success; ``run`` returns the job's
(124 on timeout; 3 when a host's link stayed idle); 2 when the machine lacks root or
iproute2, or an argument is wrong, with a one-line message naming it."""

import argparse
import json
import signal
import sys

from . import job, names, net


def parse_host_rate(text):
    host, sep, rate = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--host-rate must be HOST=RATE, e.g. 1=100mbit; got {text!r}")
    try:
        names.host_index(host)
        net.parse_rate(rate)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--host-rate {text}: {exc}") from None
    return host, rate


def parser():
    p = argparse.ArgumentParser(prog="python -m collectives.tools.testbed",
                                description="A multi-host MPI testbed on one machine (network namespaces).")
    sub = p.add_subparsers(dest="command", required=True)
    u = sub.add_parser("up", help="build N hosts joined by shaped links (idempotent)")
    u.add_argument("--hosts", type=int, required=True, help="number of hosts")
    u.add_argument("--rate", default=net.DEFAULT_RATE, help="every link's rate (default 1gbit)")
    u.add_argument("--host-rate", type=parse_host_rate, action="append", default=[], metavar="HOST=RATE",
                   help="one host's link rate (repeatable), e.g. 1=100mbit")
    sub.add_parser("down", help="remove the testbed (idempotent)")
    sub.add_parser("status", help="print the hosts, rates and link counters")
    r = sub.add_parser("run", help="run an MPI job across the hosts: run --layout 2x2 -- python prog.py")
    r.add_argument("--layout", required=True, help="HOSTSxRANKS, e.g. 2x4 (ranks host-major)")
    r.add_argument("--timeout", type=float, help="seconds before the job is killed (exit 124)")
    r.add_argument("--min-link-bytes", type=int, default=job.DEFAULT_MIN_LINK_BYTES,
                   help="fail if a host sends fewer bytes over its link "
                        f"(default {job.DEFAULT_MIN_LINK_BYTES}; 0: off)")
    r.add_argument("--counters", help="write the per-host link bytes and the outcome to this JSON file")
    r.add_argument("argv", nargs=argparse.REMAINDER, help="-- program and arguments")
    s = sub.add_parser("set-rate", help="shape one host's link now: set-rate HOST RATE")
    s.add_argument("host")
    s.add_argument("rate")
    s = sub.add_parser("set-link", help="set one host's link up or down now: set-link HOST up|down")
    s.add_argument("host")
    s.add_argument("state", choices=("up", "down"))
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    why = net.missing()
    if why:
        print(why, file=sys.stderr)
        return 2
    try:
        if args.command == "up":
            state = net.up(args.hosts, args.rate, dict(args.host_rate))
            rates = ", ".join(f"h{i} {b / 1e6:g} Mbit/s" for i, b in enumerate(state["rates"]))
            print(f"testbed up: {state['hosts']} hosts ({rates}), addresses {state['addresses'][0]}..")
        elif args.command == "down":
            net.down()
            print("testbed down")
        elif args.command == "status":
            hosts = net.hosts_present()
            state = net.read_state()
            print(json.dumps({"hosts": hosts, "rates": state.get("rates"),
                              "link_bytes": {f"h{h}": net.link_bytes(h) for h in hosts}}, indent=1))
        elif args.command == "set-rate":
            net.set_rate(args.host, args.rate)
        elif args.command == "set-link":
            net.set_link(args.host, args.state == "up")
        else:
            return run(args)
    except (ValueError, TypeError, net.TestbedError) as exc:
        print(f"collectives.tools.testbed {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


def _interrupted(signum, frame):
    raise SystemExit(128 + signum)


def run(args):
    # A SIGTERM (timeout, a cancelled CI job) or SIGHUP must unwind through job.run's
    # cleanup like Ctrl-C does, or the job (in a session of its own) would outlive us.
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGHUP, _interrupted)
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ValueError("no program: run --layout 2x2 -- python prog.py")
    result = job.run(args.layout, argv, args.timeout, args.min_link_bytes)
    print(result.summary(), file=sys.stderr)
    if args.counters:
        with open(args.counters, "w") as f:
            json.dump(dict(result.as_dict(), layout=args.layout, argv=argv), f, indent=1)
    if result.timed_out:
        print(f"testbed: the job ran past --timeout {args.timeout:g} s and was killed", file=sys.stderr)
    if result.link_error:
        print(f"testbed: FAILED: {result.link_error}", file=sys.stderr)
        return result.returncode or 3
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
