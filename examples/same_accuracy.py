"""Exit 1 unless two runs of a training example (their --json files) reach the same
final test accuracy within --tolerance: e.g. a serial run and an mpiexec -n 4 run.

    python examples/same_accuracy.py serial.json n4.json
"""

import argparse
import json
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reference", help="--json of the reference run (e.g. one process)")
    p.add_argument("other", help="--json of the run to compare (e.g. mpiexec -n 4)")
    p.add_argument("--tolerance", type=float, default=0.005, help="largest accuracy difference accepted")
    args = p.parse_args()
    runs = []
    for path in (args.reference, args.other):
        with open(path) as f:
            runs.append(json.load(f))
    (a, b) = (run["final_test_accuracy"] for run in runs)
    ok = abs(a - b) <= args.tolerance
    print(f"{runs[0]['script']}: {a:.2%} on {runs[0]['world_size']} rank(s), {b:.2%} on {runs[1]['world_size']}: "
          + ("the same" if ok else f"DIFFERENT (tolerance {args.tolerance:.2%})"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
