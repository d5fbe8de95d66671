# collectives: `make test` installs into .venv (first time) and runs the whole suite.
# Using your own MPI (a cluster): make test VENV=/path/to/env MPIEXEC=mpiexec
VENV     ?= .venv
PYTHON   ?= $(VENV)/bin/python
MPIEXEC  ?= $(VENV)/bin/mpiexec
# Extra mpiexec flags, e.g. MPIEXEC_FLAGS=--oversubscribe with Open MPI.
MPIEXEC_FLAGS ?=
WORLD_SIZES   ?= 2 3 4 5 6 7 8
# A hung run must fail, not stall CI: seconds per mpiexec run.
RUN_TIMEOUT   ?= 900

.PHONY: install test test-serial test-mpi demo clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -e ".[mpich,test]"
	touch $@

test: install test-serial test-mpi

# Once, serially: the in-process schedule sweep plus the MPI suite at world size 1.
test-serial: install
	$(PYTHON) -m pytest -q --with-mpi tests

# The MPI suite under every world size in WORLD_SIZES.
test-mpi: install
	@for n in $(WORLD_SIZES); do \
	  echo "== mpiexec -n $$n"; \
	  timeout $(RUN_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $$n $(PYTHON) -m pytest -q --with-mpi -m "not serial" tests || exit 1; \
	done

demo: install
	$(MPIEXEC) $(MPIEXEC_FLAGS) -n 4 $(PYTHON) -m collectives.demo

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
