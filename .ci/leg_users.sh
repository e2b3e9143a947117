#!/usr/bin/env bash
# CI leg "users": MindSpeed-LLM 26.x's stack, with the package installed from its built wheel.
# Python 3.10, torch 2.7.1 (its PyPI build, run on the CPU), triton 3.3.1 (torch's pin: its compiler on the
# kernels), megatron-core 0.12.1. It runs what depends on that stack, and not leg 1's
# stack-free tests (tests/package/, tests/bench/, tests/examples/, tests/environments/gpu/: see .ci/run's table).
# Steps: build the wheel; install it (not editable) into a fresh venv; from a folder outside the checkout
# import every public module, call the op and import the adaptor; from the checkout root the source folder
# shadows it in one line; then, the same venv's package reinstalled editable (the tests' subprocesses run
# from the checkout root, where the source folder comes first on sys.path and only an editable install maps
# kernels/ and patches/ into it): the files of tests/ops and tests/kernels whose outcome depends on torch 2.7.1
# or triton 3.3.1, the adaptor, its patch points and Megatron's schedule on megatron-core 0.12.1, MindSpeed's
# real source, MindSpeed-LLM's real sources on the v26.0.0, master and v2.2.0 triples (../shared/third_party,
# CEZ_THIRD_PARTY to override; missing archives fail this leg, CI=true), and the main job's quick mode.
# Measured 2026-11-27 on this 2-core machine under other load (wall, CPU): MindSpeed-LLM v26.0.0 258 s / 166 s,
# master 159 s, v2.2.0 92 s / 131 s. CI 2026-12-07: 15m57s, the first pytest 11m35s with all of tests/kernels
# and tests/ops; the files left to leg 1 took 6.5 min of it (their share measured here the same day), so about
# 9.5 min now.
#
#   bash .ci/leg_users.sh               # venv in .venv310/ (git-ignored), made anew
#   bash .ci/leg_users.sh --prepare     # only the fresh venv with the stack (.ci/run: in the background
#                                       # during leg 1); the next plain run in this checkout uses it once
#   PY310=/path/to/python3.10 bash .ci/leg_users.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

PY310="${PY310:-$HOME/.pyenv/versions/3.10.13/bin/python}"
VENV="${VENV:-.venv310}"
TORCH_VERSION=2.7.1
TRITON_VERSION=3.3.1
MEGATRON_CORE_VERSION=0.12.1

start=$SECONDS
stamp() { echo "== leg users [$((SECONDS - start))s] $*"; }

STACK=("torch==$TORCH_VERSION" "triton==$TRITON_VERSION" "megatron-core==$MEGATRON_CORE_VERSION")
PREPARED="$VENV/.ci-prepared"  # made by --prepare, used (and removed) by the next run
if [ "${1:-}" = --prepare ] || [ "$(cat "$PREPARED" 2>/dev/null)" != "${STACK[*]}" ]; then
    stamp "fresh venv $VENV from $PY310, with ${STACK[*]}"
    rm -rf "$VENV"
    "$PY310" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # with the wheel's [test,examples] needs beside the stack: installing the wheel later fetches nothing more
    "$VENV/bin/python" -m pip install -q "${STACK[@]}" "pytest>=7" "hypothesis>=6" matplotlib
    [ "${1:-}" = --prepare ] && { echo "${STACK[*]}" > "$PREPARED"; stamp "prepared"; exit 0; }
else
    stamp "the venv $VENV prepared fresh by --prepare, with ${STACK[*]}"
fi
rm -f "$PREPARED"
rm -rf dist

stamp "build the wheel"
"$VENV/bin/python" -m pip wheel -q --no-deps -w dist .
wheel=$(ls dist/mindspeed_cez-*.whl)
"$VENV/bin/python" -c "import sys, zipfile; names = zipfile.ZipFile(sys.argv[1]).namelist()
assert 'mindspeed_cez/kernels/triton_cross_entropy.py' in names and 'mindspeed_cez/patches/patch_points.py' in names, names
assert not any(n.startswith('mindspeed_cez/kernels/variants') for n in names), names  # test-only code stays out" "$wheel"

stamp "install $wheel[test,examples] with ${STACK[*]}"
"$VENV/bin/python" -m pip install -q "${STACK[@]}" "$PWD/$wheel[test,examples]"

stamp "the installed wheel, from outside the checkout"
(cd "$(mktemp -d)" && "$OLDPWD/$VENV/bin/python" "$OLDPWD/.ci/wheel_check.py" --installed)

stamp "the installed wheel, from the checkout root: the source folder shadows it, and says so in one line"
if out=$("$VENV/bin/python" -c "import mindspeed_cez" 2>&1); then
    echo "leg users: from the checkout root the source tree imported without an install's mapping" >&2; exit 1
fi
grep -q "you are importing the source tree at $PWD.*pip install -e \." <<<"$out" || { echo "$out" >&2; exit 1; }

stamp "the package reinstalled editable, for the suite run from the checkout root"
"$VENV/bin/python" -m pip install -q --no-deps -e .

export CI="${CI:-true}"  # real-source archives missing: an error here, not a skip
# What depends on this stack, each for a reason. The rest of tests/kernels and tests/ops runs in leg 1 only: under
# Triton's interpreter (which no user runs) they check the kernels' arithmetic, not this Triton's compiler.
tests=(
    tests/patches  # the adaptor on megatron-core 0.12.1: patch points, GPTModel, optimizer, groups, parser, torchrun
    --ignore=tests/patches/test_arguments_megatron_main_knobs.py  # Megatron main's knobs: none on 0.12.1
    tests/environments/megatron_loop/test_output_layer_in_megatron_schedule.py  # 0.12.1's DDP and schedule
    tests/environments/mindspeed_stack/test_mindspeed_source.py      # MindSpeed's real source
    tests/environments/mindspeed_stack/test_mindspeed_llm_source.py  # MindSpeed-LLM v26.0.0's
    tests/ops/test_torch_compat.py                       # what differs on torch 2.7.1: addmm without out_dtype, int32
    tests/ops/test_linear_forward_grads_accumulation.py  # the fp32 accumulation torch < 2.8 takes
    tests/ops/test_first_order.py                 # autograd's double backward and create_graph on torch 2.7.1
    tests/kernels/test_kernels_compile.py         # triton 3.3.1's compiler front end, not the interpreter
    tests/kernels/test_kernels_variants.py        # the kernels' parameters as triton 3.3.1 reads them
    tests/kernels/test_triton_cross_entropy_launcher.py  # the launcher's keys against triton 3.3.1's specialization
    tests/kernels/test_cann_backend.py            # backend="cann" on torch_npu's torch (2.7.1)
)
stamp "pytest ${tests[*]} (MindSpeed-LLM v26.0.0's real sources among them)"
"$VENV/bin/pytest" -q "${tests[@]}"

for triple in master v2.2.0; do
    stamp "MindSpeed-LLM $triple's real sources: tests/environments/mindspeed_stack/test_mindspeed_llm_source.py"
    CEZ_MINDSPEED_LLM_TRIPLE=$triple "$VENV/bin/pytest" -q -rs tests/environments/mindspeed_stack/test_mindspeed_llm_source.py
done

stamp "the main job, quick mode"
"$VENV/bin/python" -m mindspeed_cez.launch examples/train_tiny_moe.py --lm-z-loss-coeff 1e-2 --quick
stamp "done"
