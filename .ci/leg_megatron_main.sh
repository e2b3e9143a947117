#!/usr/bin/env bash
# CI leg "megatron main": Megatron-LM's git main (d98e8a64, 0.20.0 dev), as its users run it: a
# source checkout on PYTHONPATH, no pip install (../shared/third_party/megatron-lm-main-d98e8a64.tar.gz,
# CEZ_THIRD_PARTY to override). Re-uses leg 2's venv (.venv312: Python 3.12, torch, megatron-core 0.19.2,
# the package editable); only the path differs: the checkout's megatron.core / megatron.training come
# first (megatron is a namespace package in both). Steps: the Megatron-LM launch with the flag
# (examples/run_megatron_lm_moe.sh: main's own training loop, TP=2 MoE, lm_z_loss on its log line), then what
# the other megatron-core lines run (.ci/run's LINE_TESTS: the patch points, apply/remove, the parser, the
# GPTModel cases) and Megatron main's new knobs, feature-detected (only main has them). Not the parallel
# layouts (tests/environments/megatron_loop/test_e2e_layouts.py): leg 2 runs them on 0.19.2, 3m50s here.
#
#   bash .ci/leg_megatron_main.sh      # after .ci/leg_py312.sh (its venv)
#   CEZ_EXTRA_TESTS="tests/environments/megatron_loop/test_e2e_layouts.py" bash .ci/leg_megatron_main.sh
#                                      # more test files on main, e.g. the layouts (mtp-dp2 skips, naming Megatron
#                                      # main's own MTP bug without Transformer Engine: test_e2e_layouts.megatron_mtp_bug)
#
# CI 2026-12-07: 5m28s (launch 20 s, 81 tests in 4m59s, the layouts among them); without the layouts about
# 1m45s.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
VENV="${VENV:-.venv312}"
# shared/third_party beside the checkout, or, for a clone of a local checkout made elsewhere, beside the
# checkout it was cloned from (as tests/support/mindspeed_llm_source.py finds it)
origin=$(git config --get remote.origin.url 2>/dev/null || true); origin=${origin#file://}
THIRD_PARTY=../shared/third_party
[ -d "$THIRD_PARTY" ] || [ -z "$origin" ] || [ ! -d "$origin" ] || THIRD_PARTY="$(dirname "$(cd "$origin" && pwd)")/shared/third_party"
THIRD_PARTY="${CEZ_THIRD_PARTY:-$THIRD_PARTY}"
ARCHIVE="$THIRD_PARTY/megatron-lm-main-d98e8a64.tar.gz"
SRC="${MEGATRON_MAIN_SRC:-$PWD/.megatron-main}"

start=$SECONDS
stamp() { echo "== leg megatron main [$((SECONDS - start))s] $*"; }

# Megatron's initialize compiles its dataset helpers (megatron/core/datasets/Makefile: g++, `python3 -m pybind11`,
# `python3-config`) on rank 0 even with mock data: the venv's python3 first on PATH, with pybind11
"$VENV/bin/python" -m pip install -q pybind11
# (and python3-config, which a venv lacks, from its base Python: the helpers' suffix is that Python's)
export PATH="$(cd "$VENV/bin" && pwd):$("$VENV/bin/python" -c 'import os, sys; print(os.path.join(sys.base_prefix, "bin"))'):$PATH"

[ -f "$ARCHIVE" ] || { echo "leg megatron main: $ARCHIVE is missing (shared/ beside the clone)" >&2; exit 1; }
[ -d "$SRC/megatron/core" ] || { mkdir -p "$SRC" && tar xzf "$ARCHIVE" -C "$SRC"; }
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"
"$VENV/bin/python" - "$SRC" <<'PY'
import os, sys, megatron.core as mc, megatron.training as mt
src = sys.argv[1]
assert mc.__file__.startswith(src) and mt.__file__.startswith(src), (mc.__file__, mt.__file__)
print("megatron-core", mc.__version__, "from", os.path.dirname(mc.__file__))
PY

stamp "the Megatron-LM launch with the flag: examples/run_megatron_lm_moe.sh"
log=$(mktemp)
if ! PYTHON="$VENV/bin/python" bash examples/run_megatron_lm_moe.sh >"$log" 2>&1; then
    tail -40 "$log" >&2; echo "leg megatron main: the launch failed" >&2; exit 1
fi
grep -E "iteration +20/" "$log"
grep -qE "iteration +20/.*lm_z_loss: [0-9.E+-]+" "$log" || { echo "leg megatron main: no lm_z_loss on the last log line" >&2; exit 1; }

# shellcheck disable=SC2206  # CEZ_EXTRA_TESTS: paths split on spaces
main_tests=(tests/patches/test_loss_wrappers_gpt.py tests/patches/test_model_context_output_layer.py
            tests/patches/test_patches_apply.py tests/patches/test_arguments.py tests/patches/test_patch_points.py
            tests/patches/test_arguments_megatron_main_knobs.py ${CEZ_EXTRA_TESTS:-})
stamp "pytest ${main_tests[*]}"
"$VENV/bin/python" -m pytest -q -rs "${main_tests[@]}"
stamp "done"
