"""Project allreduce time and bus bandwidth to many ranks with the simulator.

    python -m collectives.tools.sim                                   # α, β, γ of a typical cluster
    python -m collectives.tools.sim --alpha 2e-6 --beta 8e-11 --gamma 1e-10
    python -m collectives.tools.sim --fit bench/results/HOST/n2.json bench/results/HOST/n4.json
    python -m collectives.tools.sim --fit run1-2x2.json run1-2x4.json --compare run2-2x2.json run2-2x4.json

Prints, and plots (``--plot``, PNG), the predicted time and busbw of every allreduce
algorithm and of a parameter server (S server ranks besides the p workers) against
the world size p (2 … 4096) at one message size, and against the message size at one
world size. With ``--fit``, α, β and γ are fitted to benchmark results
(``collectives-bench --json``) first, and the predictions for the benchmark's own runs
are printed against what it measured (``--compare``: runs not used in the fit). Rows
measured across several nodes (their ``layout``, e.g. ``2x4``) make it a two-level fit:
the network's α′ and β′ too.
"""

import argparse
import json
import sys

from ..sim import calibrate, project
from .bench.cli import parse_bytes, sizes

DEFAULTS = dict(alpha=2e-6, beta=1 / 12.5e9, gamma=1 / 10e9)  # 100 Gb/s links, 10 GB/s reductions


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m collectives.tools.sim", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    model = p.add_argument_group("the model (seconds; seconds per byte)")
    model.add_argument("--alpha", type=float, help=f"latency per message (default {DEFAULTS['alpha']:g})")
    model.add_argument("--beta", type=float, help=f"time per byte on a link (default {DEFAULTS['beta']:g})")
    model.add_argument("--gamma", type=float, help=f"time per byte reduced (default {DEFAULTS['gamma']:g})")
    model.add_argument("--fit", nargs="+", metavar="JSON", help="fit alpha, beta, gamma to these benchmark results")
    model.add_argument("--fit-from", type=parse_bytes, default=0, metavar="BYTES",
                       help="fit to rows of at least this size (default: all)")
    model.add_argument("--compare", nargs="+", metavar="JSON",
                       help="with --fit: print predicted against measured for these runs, not used in the fit "
                            "(default: the fitted runs)")
    model.add_argument("--compare-from", type=parse_bytes, default=1 << 20, metavar="BYTES",
                       help="print predicted against measured from this size (default 1M)")
    model.add_argument("--ranks-per-node", type=int, help="two levels: ranks per node")
    model.add_argument("--inter-alpha", type=float, help="latency per message between nodes")
    model.add_argument("--inter-beta", type=float, help="time per byte on a node's network link")
    sweep = p.add_argument_group("the projection")
    sweep.add_argument("--size", type=parse_bytes, default=64 << 20, help="message size for the sweep over p (64M)")
    sweep.add_argument("--world-size", type=int, default=64, help="world size for the sweep over sizes (64)")
    sweep.add_argument("--max-world-size", type=int, default=4096, help="largest p, in powers of two (4096)")
    sweep.add_argument("--min-bytes", type=parse_bytes, default=4 << 10, help="smallest size (4K)")
    sweep.add_argument("--max-bytes", type=parse_bytes, default=256 << 20, help="largest size (256M)")
    sweep.add_argument("--servers", type=int, nargs="*", default=[1, 8],
                       help="parameter-server baselines with these server counts (default 1 8)")
    sweep.add_argument("--max-ops", type=int, default=project.DEFAULT_MAX_OPS,
                       help="simulate points up to this many operations, else the closed form")
    out = p.add_argument_group("output")
    out.add_argument("--plot", default="sim-projection.png", help="PNG to write (default sim-projection.png)")
    out.add_argument("--json", help="write every projected row here")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    given = [args.alpha is not None, args.beta is not None, args.gamma is not None]
    if args.fit and any(given):
        p.error("give either --fit or --alpha/--beta/--gamma, not both")
    if args.compare and not args.fit:
        p.error("--compare needs --fit")
    for name in ("alpha", "beta", "gamma", "inter_alpha", "inter_beta"):
        value = getattr(args, name)
        if value is not None and value < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0; got {value}")
    if (args.inter_alpha is not None or args.inter_beta is not None) and args.ranks_per_node is None:
        p.error("--inter-alpha/--inter-beta need --ranks-per-node")
    for name in ("world_size", "max_world_size", "ranks_per_node", "max_ops"):
        value = getattr(args, name)
        if value is not None and value < (2 if "world" in name else 1):
            p.error(f"--{name.replace('_', '-')} must be at least {2 if 'world' in name else 1}; got {value}")
    if any(s < 1 for s in args.servers):
        p.error("--servers must be positive")
    if args.size < 4 or args.size % 4:
        p.error(f"--size must be a positive multiple of 4 bytes (float32 elements); got {args.size}")
    if args.min_bytes < 4 or args.min_bytes > args.max_bytes:
        p.error("need 4 <= --min-bytes <= --max-bytes")
    if not args.plot.lower().endswith(".png"):
        p.error(f"--plot must name a .png file; got {args.plot!r}")
    return args


def main(argv=None):
    args = parse_args(argv)
    params = dict(DEFAULTS)
    source = "defaults (a typical cluster: 100 Gb/s links)"
    if args.fit:
        try:
            rows = calibrate.load_rows(args.fit)
            fitted = calibrate.fit(rows, args.fit_from)
            held_out = calibrate.load_rows(args.compare) if args.compare else rows
        except (OSError, ValueError, TypeError) as e:
            sys.exit(f"python -m collectives.tools.sim: --fit: {e}")
        params = dict(zip(calibrate.NAMES, fitted))
        source = f"fitted to {', '.join(args.fit)}"
        print("# fitted: " + ", ".join(_describe(name, value) for name, value in params.items()))
        compared = ", ".join(args.compare) if args.compare else "the fitted runs"
        print(f"# predicted against measured ({compared}), rows of {args.compare_from} bytes and more:")
        comparison = calibrate.compare(held_out, fitted, args.compare_from)
        print(calibrate.report(comparison))
        print("\n".join(calibrate.summary(comparison, by=lambda row: f"{row['collective']} {row['algorithm']}")))
        params = {k: v for k, v in params.items() if not k.startswith("inter")}
        if len(fitted) == 5:  # project with the network too, at the fitted runs' ranks per node unless given
            args.inter_alpha, args.inter_beta = fitted[3], fitted[4]
            if args.ranks_per_node is None:
                # (uneven nodes, one label per rank: their largest node's size)
                args.ranks_per_node = max(max(map(per_node.count, set(per_node))) if isinstance(per_node, list)
                                          else per_node for nodes, per_node in map(calibrate.nodes_of, rows)
                                          if nodes > 1)
    for name in ("alpha", "beta", "gamma"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
            source = "given"
    model = dict(params, ranks_per_node=args.ranks_per_node, inter_alpha=args.inter_alpha, inter_beta=args.inter_beta)

    world_sizes = sizes(2, args.max_world_size, 2)
    byte_sizes = sizes(args.min_bytes, args.max_bytes, 4)
    variants = len(project.ALLREDUCE) + len(args.servers)
    bar = _progress((len(world_sizes) + len(byte_sizes)) * variants, args.no_progress)
    step = bar.update if bar else None
    by_p = project.sweep(world_sizes, [args.size], model, args.servers, args.max_ops, step)
    by_size = project.sweep([args.world_size], byte_sizes, model, args.servers, args.max_ops, step)
    if bar:
        bar.close()
    title = (f"alpha {params['alpha'] * 1e6:.3g} us, beta {params['beta'] * 1e9:.3g} ns/B, "
             f"gamma {params['gamma'] * 1e9:.3g} ns/B ({source})")
    if args.ranks_per_node:
        title += f"; {args.ranks_per_node} ranks per node"
    print(f"# model: {title}")
    print(f"\n# allreduce of {project._size(args.size)} float32 against p (parameter server: p workers + S servers)")
    print(project.table(by_p, "world_size"))
    print(f"\n# allreduce at p = {args.world_size} against size")
    print(project.table(by_size, "bytes"))
    project.plot(by_p, by_size, args.plot, title)
    print(f"\n# plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "source": source, "by_world_size": by_p, "by_size": by_size}, f, indent=1)
        print(f"# rows: {args.json}")


def _describe(name, value):
    if "alpha" in name:
        return f"{name} {value * 1e6:.2f} us"
    rate = f" ({1 / value / 1e9:.2f} GB/s)" if value else ""
    return f"{name} {value * 1e9:.4f} ns/B{rate}"


def _progress(total, disabled):
    if disabled or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, file=sys.stderr, unit="sweep", leave=False)


if __name__ == "__main__":
    main()
