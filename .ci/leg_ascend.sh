#!/usr/bin/env bash
# CI leg "ascend": lower every Triton kernel through triton-ascend's compiler front end and adapter
# (tests/kernels/test_kernels_ascend_lowering.py) on this CPU, then execute every variant under triton-ascend's
# interpreter with the NPU launch settings against float64 (tests/kernels/test_kernels_ascend_interpreter.py).
# triton-ascend ships its own `triton` package, so it gets a venv of its own, apart from the CUDA
# `triton` of leg 1. Its interpreter needs numpy<2 (numpy 2: "only 0-dimensional arrays can be
# converted to Python scalars").
#
#   bash .ci/leg_ascend.sh              # venv in .venv_ascend/ (git-ignored), re-used if present
#   bash .ci/leg_ascend.sh --prepare    # only the venv and its pins (.ci/run: in the background during leg 1)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

VENV="${VENV:-.venv_ascend}"
TORCH_VERSION=2.13.0
TRITON_ASCEND_VERSION=3.2.0

start=$SECONDS
stamp() { echo "== leg ascend [$((SECONDS - start))s] $*"; }

stamp "venv $VENV"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
stamp "install torch==$TORCH_VERSION, then triton-ascend==$TRITON_ASCEND_VERSION (its triton last), the package"
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" "numpy<2" pytest
"$VENV/bin/python" -m pip install -q "triton-ascend==$TRITON_ASCEND_VERSION" pybind11
[ "${1:-}" = --prepare ] && { stamp "prepared"; exit 0; }
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" - <<PY
import triton, triton.backends.ascend  # noqa: F401
from importlib.metadata import version
assert version("triton-ascend") == "$TRITON_ASCEND_VERSION", version("triton-ascend")
print("triton", triton.__version__, "| triton-ascend", version("triton-ascend"))
PY
stamp "pytest tests/kernels/test_kernels_ascend_lowering.py"
"$VENV/bin/python" -m pytest -q -rs tests/kernels/test_kernels_ascend_lowering.py
stamp "pytest tests/kernels/test_kernels_ascend_interpreter.py (TRITON_INTERPRET=1, NPU launch settings)"
TRITON_INTERPRET=1 "$VENV/bin/python" -m pytest -q -rs -p no:warnings tests/kernels/test_kernels_ascend_interpreter.py
stamp "done"
