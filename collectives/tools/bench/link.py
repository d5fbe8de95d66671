"""The network between nodes, measured, and collectives-bench results set against it.

    mpiexec ... python -m collectives.tools.bench.link --json link-2x4.json        # under MPI, across nodes
    python -m collectives.tools.bench.link --summary link-2x4.json bench-2x4.json  # no MPI: the table

Under MPI it measures what one node can push to another with MPI point-to-point messages
(the same path the library's messages take), with every link busy as a ring collective
keeps it: every node sends to the next one round a ring of the nodes, and receives from
the previous one, at once. Each rank sends ``--bytes`` to the rank of the same local rank
on the next node, ``--repeats`` times, and the rate is a node's bytes over the slowest
rank's time (the median over repeats). With one rank per node that is one stream each
way; with k, the node's link shared by k streams, as a two-level collective shares it.
Needs two nodes or more (``comm.topology``).

``--summary`` reads link files and ``collectives-bench --json`` files (matched by their
``layout``) and prints, per layout and size, each allreduce contender's bus bandwidth,
its ratio to the link's measured rate, ``hierarchical`` over the flat ring and the best
of the library over ``native``, each from one run.
"""

import argparse
import json
import sys

MIB = 1 << 20


def measure(comm, nbytes, repeats):
    """The node-to-node rate in bytes per second over ``comm`` (a Communicator; call
    on every rank), or None on one node: :func:`collectives.topology.measure_link` on
    the library's own duplicate, where no user traffic can match its messages."""
    from ...topology import measure_link

    return measure_link(comm.mpi_comm, comm.topology, nbytes, repeats)


def run(argv):
    import collectives as cc

    args = parse_args(argv)
    comm = cc.Communicator()
    rate = measure(comm, args.bytes, args.repeats)
    if comm.rank == 0:
        if rate is None:
            sys.exit("collectives.tools.bench.link: needs two nodes or more; MPI sees one (comm.topology)")
        row = {"layout": comm.topology.key(), "world_size": comm.size, "bytes": args.bytes,
               "streams": min(len(n) for n in comm.topology.nodes[:2]), "link_Bps": rate}
        print(f"# each node -> the next ({comm.topology.node_count} nodes in a ring), {row['streams']} stream(s) "
              f"of {args.bytes / MIB:g} MiB each way: {rate / 1e6:.1f} MB/s per node")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(row, f, indent=1)
    return 0


def summary(paths, threshold=16 * MIB):
    """The table for the link files and benchmark files in ``paths``."""
    links, rows = {}, []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and "link_Bps" in data:
            links[data["layout"]] = data["link_Bps"]
        elif isinstance(data, list):
            rows += [r for r in data if r.get("collective") == "allreduce"]
        else:
            raise ValueError(f"{path}: neither a link measurement nor collectives-bench --json rows")
    lines = []
    for layout in sorted({r.get("layout") for r in rows}, key=str):
        link = links.get(layout)
        mine = [r for r in rows if r.get("layout") == layout]
        names = list(dict.fromkeys(r["algorithm"] for r in mine))
        lines.append(f"## {layout}: link {link / 1e6:.1f} MB/s" if link else f"## {layout}: no link measurement")
        lines.append("bytes      " + "".join(f"{n:>20}" for n in names) + "  hier/ring  best/native")
        for nbytes in sorted({r["bytes"] for r in mine}):
            at = {r["algorithm"]: r for r in mine if r["bytes"] == nbytes}
            cells = []
            for n in names:
                r = at.get(n)
                if r is None:
                    cells.append(f"{'-':>20}")
                    continue
                share = f" ({r['busbw_GBps'] * 1e9 / link:.0%})" if link else ""
                cells.append(f"{r['busbw_GBps'] * 1e3:>13.1f}{share:>7}")
            ours = {n: r["time_us"] for n, r in at.items() if n not in ("native", "auto", "gloo")}
            ring, hier = at.get("ring"), at.get("hierarchical")
            ratio = f"{ring['time_us'] / hier['time_us']:>10.2f}x" if ring and hier else f"{'-':>11}"
            best = min(ours, key=ours.get) if ours else None
            vs = (f"{at['native']['time_us'] / ours[best]:>6.2f}x {best}" if best and "native" in at else "-")
            lines.append(f"{_size(nbytes):<11}" + "".join(cells) + f" {ratio}  {vs}")
        lines.append("busbw in MB/s (share of the link's measured rate); ratios are time over time, same run")
        lines.append("")
    return "\n".join(lines)


def _size(n):
    for unit, factor in (("MiB", MIB), ("KiB", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m collectives.tools.bench.link", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--bytes", type=int, default=16 * MIB, help="bytes per stream per repeat (default 16 MiB)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (default 5)")
    p.add_argument("--json", help="write the measurement here (rank 0)")
    p.add_argument("--summary", nargs="+", metavar="JSON",
                   help="no measurement: print the table for these link and collectives-bench files")
    args = p.parse_args(argv)
    if args.bytes < 1 or args.repeats < 1:
        p.error("--bytes and --repeats must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.summary:
        print(summary(args.summary))
        return 0
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
