#!/usr/bin/env bash
# Sets up (see setup.sh) and runs every test: the Rust crates, then the Python suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}
cargo test -q -p pjrt -p stablehlo -p lowering -p runtime
python -m pytest -q tests "$@"
