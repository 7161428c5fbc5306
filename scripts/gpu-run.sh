#!/usr/bin/env bash
# Runs the GPU tests and benchmarks on a machine with a CUDA GPU, from the repository
# root (see docs/development.md):
#   bash scripts/gpu-run.sh [tests|bench|all]
# It installs the wheels of .whl/ (made by scripts/gpu-wheels.sh, for a machine without
# network access) into /tmp/site, then runs the whole suite with
# XARRAY_GDS_REQUIRE_GPU=1 and the demo on the GPU, and/or `xarray-gds bench`, writing
# logs and results under $OUT (default /tmp/xarray-gds-out). BENCH_CASES (names
# separated by spaces) limits the benchmark to those cases (BENCH_SIZE, BENCH_REPEAT,
# BENCH_TIMEOUT: its --size-gb, --repeat and time limit); TESTS names the test paths,
# TESTS_TIMEOUT the suite's time limit, EXTRA_SITE a second site directory (see below),
# GPU_WORKERS the pytest-xdist processes; BENCH_PROFILE=1 adds a cProfile of one more
# run per contender under $OUT/profiles.
set -uo pipefail
what=${1:-all}
out=${OUT:-/tmp/xarray-gds-out}
mkdir -p "$out"
# without the project's wheel the engine is not registered and every test fails: stop
# before running anything
if ! ls .whl/xarray_gds-*.whl > /dev/null 2>&1; then
  echo "no xarray_gds wheel in .whl: run bash scripts/gpu-wheels.sh first" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
# EXTRA_SITE: a directory that more wheels were installed into beforehand (e.g. the
# remote tests' moto stack, kept apart from .whl: see docs/development.md)
export PYTHONPATH=/tmp/site${EXTRA_SITE:+:$EXTRA_SITE} PYTHONUNBUFFERED=1
# nginx bundled by scripts/gpu-nginx.sh, for the remote cases and tests on a machine
# without it
if [ -x .nginx/nginx ]; then
  PATH=$PWD/.nginx:$PATH
  export PATH
fi
# the commit the wheels were made at (gpu-wheels.sh), for the benchmark's results
if [ -s .whl/COMMIT ] && [ -z "${XARRAY_GDS_BENCH_COMMIT:-}" ]; then
  XARRAY_GDS_BENCH_COMMIT=$(cat .whl/COMMIT)
  export XARRAY_GDS_BENCH_COMMIT
fi
if [ -n "${EXTRA_SITE:-}" ] && [ ! -d "$EXTRA_SITE" ]; then
  echo "EXTRA_SITE=$EXTRA_SITE does not exist: the tests of its packages skip" >&2
fi
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  # the suite takes over 9 minutes in one process: spread it over GPU_WORKERS processes
  # (pytest-xdist, one of the wheels) that share the one GPU
  # every worker's CuPy pool is capped (CUPY_GPU_MEMORY_LIMIT, CuPy's own setting) so
  # that the pools together hold at most 64% of the card: nvCOMP's own allocations,
  # CUDA contexts and the dask-cuda workers some tests start need the rest. Uncapped,
  # 14 workers filled an 80 GB H100; 8 workers at 8% ran clean, 10 at 8% (80%) ran
  # out of memory in nvCOMP encodes and in dask-cuda workers (December 2026)
  workers=${GPU_WORKERS:-8}
  CUPY_GPU_MEMORY_LIMIT=${CUPY_GPU_MEMORY_LIMIT:-$((64 / workers))%} \
  XARRAY_GDS_REQUIRE_GPU=1 timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q \
    -p no:cacheprovider -n "$workers" --timeout 300 --tb=short -ra \
    ${TESTS:-tests} > "$out/gpu-tests.log" 2>&1 || rc=1
  # -ra (not -rf): the log lists every skip with its reason, so a GPU run that skips
  # shows why
  grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$out/gpu-tests.log" | tail -30
  timeout 60 python3 -m xarray_gds.tools.cli demo --device cuda > "$out/demo.txt" 2>&1 || rc=1
  tail -5 "$out/demo.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  # one process a case, under one deadline, each writing its own JSON, merged at the
  # end into bench.json: a case that hangs or crashes costs only itself, and the
  # results of the cases before it come back even if the call runs out of time
  deadline=$((SECONDS + ${BENCH_TIMEOUT:-400}))
  mkdir -p /tmp/bench-json
  rm -f /tmp/bench-json/*.json
  for c in ${BENCH_CASES:-all}; do
    left=$((deadline - SECONDS))
    if [ "$left" -lt 20 ]; then
      echo "bench: $c not run, out of time" | tee -a "$out/bench.txt"; rc=1; continue
    fi
    args=(--size-gb "${BENCH_SIZE:-2}" --repeat "${BENCH_REPEAT:-3}")
    [ "$c" != all ] && args+=(--case "$c")
    if [ -n "${BENCH_PROFILE:-}" ]; then args+=(--profile "$out/profiles"); fi
    timeout "$left" python3 -m xarray_gds.tools.cli bench "${args[@]}" \
      --json "/tmp/bench-json/$c.json" 2>&1 | grep -v -i warn | tee -a "$out/bench.txt" || rc=1
  done
  python3 - "$out/bench.json" /tmp/bench-json/*.json <<'PY' || rc=1
import json, sys
merged = {"env": None, "results": []}
for name in sys.argv[2:]:
    part = json.load(open(name))
    merged["env"] = merged["env"] or part["env"]
    merged["results"] += part["results"]
json.dump(merged, open(sys.argv[1], "w"), indent=2)
PY
fi
exit $rc
