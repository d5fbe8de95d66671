"""torch's own torch.distributed test base, ``DistributedTest._DistTestBase``, run against
the backend "collectives" under mpiexec (``make test-torch-suite``):

    mpiexec -n 3 python tests/harness/torch_suite.py [-k PATTERN] [--list-skips]

The tests are torch's, from the installed wheel
(``torch/testing/_internal/distributed/distributed_test.py``), unchanged. torch runs
them for gloo and NCCL by spawning one process per rank (``TestDistBackend``); here
mpiexec starts the ranks and every rank runs every test in the same order, as torch
once ran them for its MPI backend. What ``TestDistBackend`` does around each test is
done here too: a fresh default group per test (``init_process_group`` on a file store
of its own, the test's timeout from ``CUSTOM_PG_TIMEOUT``), torch's file barrier before
and after, ``destroy_process_group`` at the end; its skip exits
(``sys.exit(TEST_SKIPS[...].exit_code)``, which a spawned process reports to its
parent) become skips with TEST_SKIPS' message.

The backend's features are declared through the test file's own hooks, never by
editing a test: ``BACKEND`` (the environment variable the file reads at import) and
``DistTestCases.backend_feature``: "plugin" (a third-party backend, so
``require_backend_is_available`` accepts it), "ddp", "subgroup", and "gpu" and "cuda"
(the backend registers for CUDA tensors; on a machine without GPUs the tests that need
one skip themselves). No entry of ``DistTestCases.skip_collective`` names it: it has
allgather_coalesced, reduce, receive from any source and barrier on the CPU. Tests the
file keeps for a backend by its name (``BACKEND == "gloo"``, ``{"gloo"}``, "mpi",
"nccl") skip, with their reasons in the summary.

Each rank runs quietly; rank 0 gathers every rank's outcomes and prints one line per
test that did not pass everywhere (with each rank's error), the skip reasons with their
counts (``--list-skips``: every skipped test), and the totals. The exit status is 1
if a test failed or errored on any rank, or if the ranks disagree on what ran.
"""

import argparse
import collections
import io
import os
import shutil
import sys
import tempfile
import time
import traceback
import unittest
from datetime import timedelta

from mpi4py import MPI

BACKEND = "collectives"
os.environ["BACKEND"] = BACKEND  # read by distributed_test.py at import
os.environ.setdefault("INIT_METHOD", "env://")
os.environ.setdefault("COLLECTIVES_QUIET", "1")  # the untuned-table hint, once per group

import collectives.torch  # noqa: E402,F401 - registers the backend; MASTER_ADDR, RANK, WORLD_SIZE from MPI
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.common_distributed import TEST_SKIPS, DistTestCases  # noqa: E402

# The backend's features, declared where the test file looks them up (before its import:
# some of its skip decorators read them at class definition).
for _feature in ("plugin", "ddp", "subgroup", "gpu", "cuda"):
    DistTestCases.backend_feature[_feature].add(BACKEND)

from torch.testing._internal.common_utils import TestCase  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import Barrier, DistributedTest  # noqa: E402

WORLD = MPI.COMM_WORLD
_SKIP_MESSAGES = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}


def _shared_temp_dir():
    """One directory for every rank (rank 0 makes it), as torch's TEMP_DIR: its file
    barrier, its test_dir, and the file stores of the tests' groups."""
    path = tempfile.mkdtemp(prefix="torch-suite-") if WORLD.Get_rank() == 0 else None
    path = WORLD.bcast(path, root=0)
    if WORLD.Get_rank() == 0:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.mkdir(os.path.join(path, sub))
    WORLD.Barrier()
    os.environ["TEMP_DIR"] = path
    return path


class TestCollectivesBackend(TestCase, DistributedTest._DistTestBase):
    """torch's test base on the backend "collectives": what ``TestDistBackend`` does for
    a spawned rank, done for an mpiexec rank."""

    _test_number = 0  # the same on every rank: every rank runs the same tests in the same order

    @property
    def rank(self):
        return WORLD.Get_rank()

    @property
    def world_size(self):  # a string, as TestDistBackend's
        return os.environ["WORLD_SIZE"]

    @property
    def init_method(self):
        return f"file://{self.file_name}"

    def setUp(self):
        super().setUp()
        type(self)._test_number += 1
        self.file_name = os.path.join(os.environ["TEMP_DIR"], "init_dir", f"store-{self._test_number}")
        seconds = distributed_test.CUSTOM_PG_TIMEOUT.get(self._testMethodName, distributed_test.default_pg_timeout)
        dist.init_process_group(init_method=self.init_method, backend=BACKEND, world_size=int(self.world_size),
                                rank=self.rank, timeout=timedelta(seconds=seconds))
        self._barrier()

    def tearDown(self):
        try:
            self._barrier()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            super().tearDown()

    def _callTestMethod(self, method):
        # TestDistBackend's spawned ranks skip by exiting with a TEST_SKIPS code
        try:
            return super()._callTestMethod(method)
        except SystemExit as exc:
            if exc.code in _SKIP_MESSAGES:
                raise unittest.SkipTest(_SKIP_MESSAGES[exc.code]) from None
            raise


class _Outcomes(unittest.TestResult):
    """Every test's outcome on this rank: (name, "passed" | "failed" | "skipped", detail)."""

    def __init__(self, verbose=False):
        super().__init__()
        self.rows = []
        self._started = {}
        self._verbose = verbose

    def startTest(self, test):
        super().startTest(test)
        self._started[test.id()] = time.monotonic()

    def _row(self, test, outcome, detail=""):
        seconds = time.monotonic() - self._started.get(test.id(), time.monotonic())
        name = test.id().rsplit(".", 1)[-1]
        self.rows.append((name, outcome, detail, seconds))
        if self._verbose:
            print(f"rank {WORLD.Get_rank()}: {name} {outcome} ({seconds:.1f} s) {detail[-300:]}", file=sys.stderr,
                  flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._row(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._row(test, "failed", "".join(traceback.format_exception(*err))[-3000:])

    def addError(self, test, err):
        super().addError(test, err)
        self._row(test, "failed", "".join(traceback.format_exception(*err))[-3000:])

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._row(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._row(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._row(test, "failed", "unexpected success")


def _report(everyone, list_skips):
    """Rank 0's summary of every rank's rows; whether the suite passed."""
    names = [row[0] for row in everyone[0]]
    if any([row[0] for row in rows] != names for rows in everyone):
        print("the ranks ran different tests:", [len(rows) for rows in everyone])
        return False
    counts = collections.Counter()
    skips = collections.defaultdict(list)
    ok = True
    slowest = []
    for i, name in enumerate(names):
        outcomes = [rows[i][1] for rows in everyone]
        seconds = max(rows[i][3] for rows in everyone)
        slowest.append((seconds, name))
        if all(o == "passed" for o in outcomes):
            counts["passed"] += 1
        elif all(o == "skipped" for o in outcomes):
            counts["skipped"] += 1
            skips[everyone[0][i][2]].append(name)
        else:
            ok = False
            counts["failed"] += 1
            print(f"FAILED {name}: " + ", ".join(f"rank {r} {o}" for r, o in enumerate(outcomes)))
            for r, rows in enumerate(everyone):
                if rows[i][1] == "failed":
                    print(f"--- rank {r}:\n{rows[i][2]}")
    print(f"\nskip reasons ({counts['skipped']} tests):")
    for reason, tests in sorted(skips.items(), key=lambda item: -len(item[1])):
        print(f"  {len(tests):4d}  {reason}")
        if list_skips:
            for name in tests:
                print(f"          {name}")
    print("\nslowest: " + ", ".join(f"{name} {seconds:.1f} s" for seconds, name in sorted(slowest)[-5:][::-1]))
    print(f"\n{len(names)} tests at {len(everyone)} ranks: {counts['passed']} passed, {counts['skipped']} skipped, "
          f"{counts['failed']} failed")
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="pattern", action="append", help="run only tests whose name contains this "
                        "(repeatable)")
    parser.add_argument("--list-skips", action="store_true", help="name every skipped test under its reason")
    parser.add_argument("-v", "--verbose", action="store_true", help="every rank prints each test as it runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # several ranks share the cores
    temp = _shared_temp_dir()
    Barrier.init() if WORLD.Get_rank() == 0 else None
    WORLD.Barrier()
    loader = unittest.TestLoader()
    if args.pattern:
        loader.testNamePatterns = [f"*{p}*" for p in args.pattern]
    suite = loader.loadTestsFromTestCase(TestCollectivesBackend)
    result = _Outcomes(args.verbose)
    started = time.monotonic()
    stdout, sys.stdout = sys.stdout, io.StringIO()  # what the tests print; their outcomes are in result
    try:
        suite.run(result)
    finally:
        sys.stdout = stdout
    everyone = WORLD.gather(result.rows, root=0)
    ok = True
    if WORLD.Get_rank() == 0:
        ok = _report(everyone, args.list_skips)
        print(f"{time.monotonic() - started:.0f} s")
        shutil.rmtree(temp, ignore_errors=True)
    return 0 if WORLD.bcast(ok, root=0) else 1


if __name__ == "__main__":
    sys.exit(main())
