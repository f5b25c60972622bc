#!/usr/bin/env bash
# Sets up (see setup.sh) and runs every test: the Rust crates, then the Python suite once per
# eager mode (Strict, Debug, DeferAndFuse; TORCH_PJRT_TEST_MODES="strict" runs one). The
# OpInfo dtype sweeps (marker `slow`) run in Strict only, and Debug/DeferAndFuse take the
# first 3 samples of each OpInfo instead of 8: they test lowerings, which all modes share,
# and each DeferAndFuse sample compiles its own fused program. Each test file runs in its own process, so one file's compiled programs and
# caches do not accumulate into the next. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}
cargo test -q -p pjrt -p stablehlo -p lowering -p runtime
status=0
for mode in ${TORCH_PJRT_TEST_MODES:-strict debug defer_and_fuse}; do
  case $mode in
    strict) env=(TORCH_TPU_LAUNCH_BLOCKING=0 TORCH_TPU_DEFER_AND_FUSE=0); sel=() ;;
    debug) env=(TORCH_TPU_LAUNCH_BLOCKING=1 TORCH_TPU_DEFER_AND_FUSE=0
                TORCH_PJRT_OPINFO_SAMPLES=3); sel=(-m "not slow") ;;
    defer_and_fuse) env=(TORCH_TPU_LAUNCH_BLOCKING=0 TORCH_TPU_DEFER_AND_FUSE=1
                         TORCH_PJRT_OPINFO_SAMPLES=3); sel=(-m "not slow") ;;
    *) echo "unknown mode $mode"; exit 2 ;;
  esac
  for f in tests/test_*.py; do
    if [[ $f == tests/test_opinfo.py && ${#sel[@]} -eq 0 ]]; then
      # One process per dtype group: XLA:CPU fails after several thousand programs
      # compiled in one process (see ARCHITECTURE.md, known limits).
      for group in "not slow" "slow:not (bfloat16 or float16)" "slow:bfloat16 or float16"; do
        marker=${group%%:*}
        ids=(); [[ $group == *:* ]] && ids=(-k "${group#*:}")
        echo "== [$mode] $f -m '$marker' ${ids[*]}"
        env "${env[@]}" python -m pytest -q -p no:cacheprovider -m "$marker" "${ids[@]}" "$f" "$@" \
          || status=1
      done
      continue
    fi
    echo "== [$mode] $f"
    env "${env[@]}" python -m pytest -q -p no:cacheprovider "${sel[@]}" "$f" "$@" || status=1
  done
done
exit $status
