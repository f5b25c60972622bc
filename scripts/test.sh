#!/usr/bin/env bash
# Sets up (see setup.sh) and runs every test: the Rust crates, then the Python suite.
# Each test file runs in its own process, so one file's compiled programs and caches do not
# accumulate into the next.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}
cargo test -q -p pjrt -p stablehlo -p lowering -p runtime
status=0
for f in tests/test_*.py; do
  echo "== $f"
  python -m pytest -q -p no:cacheprovider "$f" "$@" || status=1
done
exit $status
