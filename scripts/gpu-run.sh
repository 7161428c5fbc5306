#!/usr/bin/env bash
# Runs on the lent GPU machine (see docs/development.md), from the repository root,
# after `PATH=$PWD/.venv/bin:$PATH ../shared/gpu/prepare cftime==1.6.6.1 pytest-xdist==3.8.0
# execnet==2.1.1 pytest-timeout==2.4.0` here:
#   run(command="bash scripts/gpu-run.sh [tests|bench|all]", carry=[".whl"])
# Installs the carried wheels, then runs the whole suite with XARRAY_GDS_REQUIRE_GPU=1
# and/or `xarray-gds bench`, writing logs and results under $OUT. BENCH_CASES (names
# separated by spaces) limits the benchmark to those cases (BENCH_SIZE, BENCH_REPEAT,
# BENCH_TIMEOUT: its --size-gb, --repeat and time limit); TESTS names the test paths,
# EXTRA_SITE a second site directory (see below),
# GPU_WORKERS the pytest-xdist processes; BENCH_PROFILE=1 adds a
# cProfile of one more run per contender under $OUT/profiles.
set -uo pipefail
what=${1:-all}
out=${OUT:-/tmp/xarray-gds-out}
mkdir -p "$out"
# prepare builds the project's wheel only with the project's venv on PATH: without it the
# engine is not registered and every test fails, so stop before spending device time
if ! ls .whl/xarray_gds-*.whl > /dev/null 2>&1; then
  echo "no xarray_gds wheel in .whl: run PATH=\$PWD/.venv/bin:\$PATH ../shared/gpu/prepare" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
# EXTRA_SITE: a directory an earlier call on the same (warm) machine installed more
# wheels into (e.g. the remote tests' moto stack, too large to carry with the rest)
export PYTHONPATH=/tmp/site${EXTRA_SITE:+:$EXTRA_SITE} PYTHONUNBUFFERED=1
if [ -n "${EXTRA_SITE:-}" ] && [ ! -d "$EXTRA_SITE" ]; then
  echo "EXTRA_SITE=$EXTRA_SITE is not on this machine (a fresh one): its tests skip" >&2
fi
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  # the suite takes over 9 minutes in one process: spread it over GPU_WORKERS processes
  # (pytest-xdist, carried as a wheel) that share the one GPU
  XARRAY_GDS_REQUIRE_GPU=1 timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q \
    -p no:cacheprovider -n "${GPU_WORKERS:-8}" --timeout 300 --tb=short -ra \
    ${TESTS:-tests} > "$out/gpu-tests.log" 2>&1 || rc=1
  # -ra (not -rf): the log lists every skip with its reason, so a GPU run that skips
  # shows why
  grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$out/gpu-tests.log" | tail -30
  timeout 60 python3 -m xarray_gds.tools.cli demo --device cuda > "$out/demo.txt" 2>&1 || rc=1
  tail -5 "$out/demo.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  cases=()
  for c in ${BENCH_CASES:-}; do cases+=(--case "$c"); done
  if [ -n "${BENCH_PROFILE:-}" ]; then cases+=(--profile "$out/profiles"); fi
  timeout "${BENCH_TIMEOUT:-400}" python3 -m xarray_gds.tools.cli bench \
    --size-gb "${BENCH_SIZE:-2}" --repeat "${BENCH_REPEAT:-3}" "${cases[@]}" \
    --json "$out/bench.json" 2>&1 | grep -v -i warn | tee "$out/bench.txt" || rc=1
fi
exit $rc
