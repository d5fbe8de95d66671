#!/usr/bin/env bash
# One GPU session's runs (`make gpu-session`), on a lent GPU machine whose image has CuPy,
# PyTorch and mpi4py but no MPI runtime, no pytest-mpi and no network.
#
#   here:   make gpu-wheels                      # .whl/: the mpich and pytest-mpi wheels
#   there:  tests/harness/gpu_session.sh bench probe test   # carrying .whl, timeout_s 595
#           tests/harness/gpu_session.sh auto               # then, within 30 s: timeout_s 200
#
# The default limits (150 + 120 + 300 s, and the install) fit the device tool's 600 s a
# call, so that one call, one machine start, does all three: on the H200 bench-gpu took
# 63 s. A second call must come within the machine's 30 s of idle or it starts anew.
# The `auto` step uses no GPU: the check of `auto` with no tuning table (make
# bench-auto) on the lent machine's own cores, where every rank has one (this project's
# own machine has 2), into OUT/auto.
#
# Installs the wheels and this package (not editable: the kernels ship inside it) under
# /tmp/gpu-env, then runs each step named (bench: make bench-gpu; test: make test-gpu;
# probe: make probe-gpu, where a call's time goes on a GPU the ranks share; auto: make
# bench-auto), each within its limit (BENCH_LIMIT, TEST_LIMIT, PROBE_LIMIT, AUTO_LIMIT
# seconds), and leaves under OUT
# (the device tool's folder; bench/results/gpu-session here) each step's log, the
# results folder and the test ranks' logs as one tarball each, and summary.txt with
# every step's exit status. A step that fails does not stop the next; the script fails
# if any did.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu-session}
PY=${PYTHON:-python3}
ENV_DIR=/tmp/gpu-env
mkdir -p "$OUT"
summary="$OUT/summary.txt"
: > "$summary"

if [ ! -f "$ENV_DIR/.installed" ]; then
  ls .whl/*.whl > /dev/null 2>&1 || { echo "no .whl/: run 'make gpu-wheels' here and carry .whl" | tee -a "$summary"; exit 1; }
  "$PY" -m pip install -q --ignore-installed --no-index --no-deps --no-compile --no-cache-dir \
    --prefix "$ENV_DIR" .whl/*.whl || { echo "wheels: install failed" | tee -a "$summary"; exit 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --prefix "$ENV_DIR" . \
    || { echo "collectives: install failed" | tee -a "$summary"; exit 1; }
fi
# Installed (written only past both installs: one cut short runs again), and make's
# install step done (bench-auto asks for it): newer than this copy's setup.py.
touch "$ENV_DIR/.installed"
site=$(echo "$ENV_DIR"/lib/python3*/site-packages)
# PYTHONSAFEPATH: the installed package, not the checkout's folder (whose kernels/ lies
# beside it, not inside), even under `python -m` from the checkout's root.
export PATH="$ENV_DIR/bin:$PATH" LD_LIBRARY_PATH="$ENV_DIR/lib:${LD_LIBRARY_PATH:-}" \
       PYTHONPATH="$site:${PYTHONPATH:-}" PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
# bench-gpu's own step limits inside BENCH_LIMIT (a step that hangs leaves the others theirs)
make_vars=(VENV="$ENV_DIR" PYTHON="$PY" MPIEXEC="$ENV_DIR/bin/mpiexec" MPIEXEC_FLAGS= GPU_LOGS=/tmp/gpu-logs
           GPU_STEP_LIMITS="${GPU_STEP_LIMITS:-60 60 25}" AUTO_RESULTS="$OUT/auto")
"$PY" -c "import collectives, cupy; from mpi4py import MPI; print(collectives.__file__, MPI.Get_library_version().splitlines()[0], cupy.cuda.runtime.getDeviceProperties(0)['name'].decode())" \
  2>&1 | tee -a "$summary"
gpu=$("$PY" -c "import cupy; print(cupy.cuda.runtime.getDeviceProperties(0)['name'].decode().replace(' ', '-'))")
results=bench/results/$gpu  # make's GPU_RESULTS

status=0
for step in "$@"; do
  case $step in
    bench) target=bench-gpu; limit=${BENCH_LIMIT:-150} ;;
    test)  target=test-gpu;  limit=${TEST_LIMIT:-300} ;;
    probe) target=probe-gpu; limit=${PROBE_LIMIT:-120} ;;
    auto)  target=bench-auto; limit=${AUTO_LIMIT:-180} ;;
    *) echo "unknown step $step (bench, test, probe, auto)" | tee -a "$summary"; exit 2 ;;
  esac
  start=$(date +%s)
  timeout "$limit" make --no-print-directory "${make_vars[@]}" "$target" > "$OUT/$target.log" 2>&1
  rc=$?
  echo "$target: exit $rc after $(( $(date +%s) - start )) s (limit $limit s)" | tee -a "$summary"
  [ "$rc" = 0 ] || status=1
done
if [ -n "$gpu" ] && [ -d "$results" ]; then
  tar czf "$OUT/results.tar.gz" "$results" && echo "results: $results -> $OUT/results.tar.gz" | tee -a "$summary"
fi
if [ -d /tmp/gpu-logs ]; then
  tar czf "$OUT/gpu-logs.tar.gz" -C /tmp gpu-logs && echo "test logs: $OUT/gpu-logs.tar.gz" | tee -a "$summary"
fi
exit $status
