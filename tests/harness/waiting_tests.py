"""The tests whose outcome could depend on the machine's speed, and a loop that runs them.

A test is listed when it waits on a timeout or starts processes of its own: its source
names a timeout (``timeout``, ``Timeout``, ``time_out``), a launched job (``launch.``)
or a subprocess (``subprocess.``), or it is in a file about exactly that
(:data:`WHOLE_FILES`). The testbed's tests are left out: they run in
``make test-multihost``, as root, inside a testbed.

    python tests/harness/waiting_tests.py            # the list, one node id a line
    python tests/harness/waiting_tests.py --loop 20  # each run: the serial ones, then 2 ranks

``--loop N`` runs them N times as ``make test`` runs them: those marked ``serial`` on
every core (pytest-xdist), all the others under ``mpiexec -n 2``, where ``make test``
runs every test (``--sizes 2,3,4``: also at 3 and 4 ranks, those not marked
``any_size``); never the ``long`` ones. It ends with how many of the N runs passed at
each, and exits non-zero if any failed. Start the load yourself (for instance
``yes > /dev/null &``).
"""

import argparse
import ast
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMES = re.compile(r"timeout|Timeout|time_out|launch\.|subprocess\.")
WHOLE_FILES = ("tests/mpi/test_dead_rank.py", "tests/mpi/test_reliability.py", "tests/mpi/test_sizes.py",
               "tests/tools/test_run.py")
LEFT_OUT = ("tests/tools/test_multihost.py", "tests/tools/test_testbed.py")


def waiting_tests():
    """The listed tests' node ids (``file::function``), in file order."""
    ids = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name in LEFT_OUT:
            continue
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                if name in WHOLE_FILES or NAMES.search(ast.get_source_segment(source, node)):
                    ids.append(f"{name}::{node.name}")
    return ids


def runs(ids, python, mpiexec, sizes):
    """(label, command) of one pass, as make test runs the tests."""
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no", "--with-mpi"]
    yield "serial", [*pytest, "-n", "auto", "--dist", "loadscope", "-m", "serial and not long", *ids]
    for n in sizes:
        only = "not serial and not long" + ("" if n == 2 else " and not any_size")
        yield f"{n} ranks", [mpiexec, "-n", str(n), *pytest, "-m", only, *ids]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loop", type=int, default=0, metavar="N", help="run them N times")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--mpiexec", default=os.environ.get("MPIEXEC",
                                                            str(pathlib.Path(sys.executable).with_name("mpiexec"))))
    parser.add_argument("--sizes", default="2", help="world sizes of the MPI runs, comma-separated")
    parser.add_argument("--logs", default="waiting-tests-logs", help="a failed run's output goes here")
    args = parser.parse_args()
    ids = waiting_tests()
    if not args.loop:
        print("\n".join(ids))
        return 0
    passed = {}
    os.makedirs(args.logs, exist_ok=True)
    for i in range(1, args.loop + 1):
        for label, command in runs(ids, args.python, args.mpiexec, [int(n) for n in args.sizes.split(",")]):
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            tail = (done.stdout.strip().splitlines() or [""])[-1]
            ok = done.returncode in (0, 5)  # 5: nothing selected at this size
            passed[label] = passed.get(label, 0) + ok
            print(f"run {i}, {label}: {'passed' if ok else 'FAILED'} ({tail})", flush=True)
            if not ok:
                log = pathlib.Path(args.logs) / f"run{i}-{label.replace(' ', '-')}.log"
                log.write_text(done.stdout + done.stderr)
    print(f"{len(ids)} tests; passed runs of {args.loop}: "
          + ", ".join(f"{label} {count}" for label, count in passed.items()))
    return 0 if all(count == args.loop for count in passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
