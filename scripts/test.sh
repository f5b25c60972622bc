#!/usr/bin/env bash
# Sets up (see setup.sh) and runs every test: the Rust crates, then the Python suite once per
# eager mode (Strict, Debug, DeferAndFuse; TORCH_PJRT_TEST_MODES="strict" runs one). The
# OpInfo dtype sweeps (marker `slow`) run in Strict only (TORCH_PJRT_TEST_SWEEPS=0: not at
# all), and Debug/DeferAndFuse take the first 3 samples of each OpInfo instead of 8: they
# test lowerings, which all modes share, and each DeferAndFuse sample compiles its own fused
# program. TORCH_PJRT_TEST_FILES="tests/test_a.py ..." runs those files (with the OpInfo
# runs) instead of every tests/test_*.py. Extra arguments go to pytest.
#
# CI's time (the aim is 40 min on 2 cores) takes a fixed sample of the longest parts:
# the OpInfo dtype sweeps take 3 samples of each OpInfo (float32 keeps 8), Debug skips the
# files whose programs and waits are Strict's (DEBUG_SAME below: multi-process, disk cache,
# torch.compile, custom kernels, fork, bucketed OpInfo), and the model zoo runs its whole
# CI sample in Strict and a third of it in DeferAndFuse and compiled.
# TORCH_PJRT_TEST_FULL=1 runs all of it (~75 min on 2 cores).
#
# Each test file (and each OpInfo dtype group) runs in its own process, so one file's compiled
# programs do not accumulate into the next (XLA:CPU fails after several thousand programs in
# one process, see ARCHITECTURE.md); TORCH_PJRT_TEST_JOBS processes (default: the number of
# cores) run at once, each logging to its own file, printed in order at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}
cargo test -q -p pjrt -p stablehlo -p lowering -p runtime

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# Inductor (the CPU comparisons) gets a cache of its own per run: its FX graph cache key
# ignores ATEN_CPU_CAPABILITY, so a run with vectorization off would reload C++ written for
# AVX2 by an earlier run and fail to build it.
export TORCHINDUCTOR_CACHE_DIR="$logs/inductor"
names=()
n=0
par=${TORCH_PJRT_TEST_JOBS:-$(nproc)}
full=${TORCH_PJRT_TEST_FULL:-0}
export TORCH_PJRT_TEST_FULL=$full
sweep_env=()
[[ $full == 1 ]] || sweep_env=(TORCH_PJRT_OPINFO_SAMPLES=3)
DEBUG_SAME=(tests/test_distributed.py tests/test_cache.py tests/test_compile.py
            tests/test_pallas.py tests/test_fork.py tests/test_dynamic_opinfo.py)

# job NAME ENV... -- PYTEST-ARGS...: runs in the background once a slot is free.
job() {
  local name=$1; shift
  local env=()
  while [[ $1 != -- ]]; do env+=("$1"); shift; done
  shift
  while (( $(jobs -rp | wc -l) >= par )); do wait -n || true; done
  names[n]=$name
  (start=$SECONDS
   env "${env[@]}" python -m pytest -q -p no:cacheprovider "$@" > "$logs/$n.log" 2>&1
   echo $? > "$logs/$n.rc"; echo $((SECONDS - start)) > "$logs/$n.s") &
  n=$((n + 1))
}

for mode in ${TORCH_PJRT_TEST_MODES:-strict debug defer_and_fuse}; do
  case $mode in
    strict) env=(TORCH_TPU_LAUNCH_BLOCKING=0 TORCH_TPU_DEFER_AND_FUSE=0); sel=() ;;
    debug) env=(TORCH_TPU_LAUNCH_BLOCKING=1 TORCH_TPU_DEFER_AND_FUSE=0
                TORCH_PJRT_OPINFO_SAMPLES=3); sel=(-m "not slow") ;;
    defer_and_fuse) env=(TORCH_TPU_LAUNCH_BLOCKING=0 TORCH_TPU_DEFER_AND_FUSE=1
                         TORCH_PJRT_OPINFO_SAMPLES=3); sel=(-m "not slow") ;;
    *) echo "unknown mode $mode"; exit 2 ;;
  esac
  # The OpInfo runs first: they are the longest.
  if (( ${#sel[@]} == 0 )); then
    job "[$mode] tests/test_opinfo.py float32" "${env[@]}" -- -m "not slow" tests/test_opinfo.py "$@"
    if [[ ${TORCH_PJRT_TEST_SWEEPS:-1} != 0 ]]; then
      job "[$mode] tests/test_opinfo.py int64/int32/bool" "${env[@]}" "${sweep_env[@]}" -- \
        -m slow -k "not (bfloat16 or float16 or complex64)" tests/test_opinfo.py "$@"
      job "[$mode] tests/test_opinfo.py complex64" "${env[@]}" "${sweep_env[@]}" -- \
        -m slow -k "complex64" tests/test_opinfo.py "$@"
      job "[$mode] tests/test_opinfo.py bfloat16/float16" "${env[@]}" "${sweep_env[@]}" -- \
        -m slow -k "bfloat16 or float16" tests/test_opinfo.py "$@"
    fi
  else
    job "[$mode] tests/test_opinfo.py" "${env[@]}" -- "${sel[@]}" tests/test_opinfo.py "$@"
  fi
  for f in ${TORCH_PJRT_TEST_FILES:-tests/test_*.py}; do
    [[ $f == tests/test_opinfo.py ]] && continue
    if [[ $mode == debug && $full != 1 && " ${DEBUG_SAME[*]} " == *" $f "* ]]; then
      continue
    fi
    job "[$mode] $f" "${env[@]}" -- "${sel[@]}" "$f" "$@"
  done
done
wait

status=0
for ((i = 0; i < n; i++)); do
  echo "== ${names[i]} ($(cat "$logs/$i.s" 2>/dev/null || echo ?) s)"
  cat "$logs/$i.log"
  rc=$(cat "$logs/$i.rc" 2>/dev/null || echo 1)
  if [[ $rc != 0 ]]; then
    echo "!! ${names[i]}: exit status $rc"
    status=1
  fi
done
exit $status
