#!/usr/bin/env bash
# CI leg "users": MindSpeed-LLM 26.x's stack, with the package installed from its built wheel.
# Python 3.10, torch 2.7.1 (its PyPI build, run on the CPU), triton 3.3.1 (torch's pin: the Triton
# kernels under the interpreter), megatron-core 0.12.1. Steps: build the wheel; install it (not
# editable) into a fresh venv; from a folder outside the checkout import every public module, call
# the op and import the adaptor; then, the same venv's package reinstalled editable (the suite's
# subprocesses run from the checkout root, where the source folder comes first on sys.path and only an
# editable install maps kernels/ and patches/ into it), the README's test suite and the main job's quick
# mode; then
# MindSpeed-LLM's real sources (../shared/third_party, CEZ_THIRD_PARTY to override): the suite ran
# tests/mindspeed_stack/test_mindspeed_llm_source.py on the v26.0.0 triple (its default), and it runs again on the
# master and v2.2.0 triples. Missing archives fail this leg (CI=true). Measured 2026-11-27 on this
# 2-core machine under other load (wall, CPU): v26.0.0 258 s / 166 s, master 159 s, v2.2.0 92 s / 131 s;
# the stand-in file it no longer runs here (nor on leg 1's 0.13-0.15 lines) 287 s / 152 s.
#
#   bash .ci/leg_users.sh               # venv in .venv310/ (git-ignored), made anew
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

stamp "fresh venv $VENV from $PY310"
rm -rf "$VENV" dist
"$PY310" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip

stamp "build the wheel"
"$VENV/bin/python" -m pip wheel -q --no-deps -w dist .
wheel=$(ls dist/mindspeed_cez-*.whl)
"$VENV/bin/python" -c "import sys, zipfile; names = zipfile.ZipFile(sys.argv[1]).namelist()
assert 'mindspeed_cez/kernels/triton_cross_entropy.py' in names and 'mindspeed_cez/patches/patch_points.py' in names, names
assert not any(n.startswith('mindspeed_cez/kernels/variants') for n in names), names  # test-only code stays out" "$wheel"

stamp "install $wheel[test,examples] with torch==$TORCH_VERSION triton==$TRITON_VERSION megatron-core==$MEGATRON_CORE_VERSION"
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" "triton==$TRITON_VERSION" \
    "megatron-core==$MEGATRON_CORE_VERSION" "$PWD/$wheel[test,examples]"

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
stamp "pytest -q tests (the README's test command; MindSpeed-LLM v26.0.0's real sources among them)"
# the stand-in of MindSpeed / MindSpeed-LLM is for the other megatron-core lines: here the real sources run
"$VENV/bin/pytest" -q tests --ignore=tests/mindspeed_stack/test_mindspeed_llm_stand_in.py

for triple in master v2.2.0; do
    stamp "MindSpeed-LLM $triple's real sources: tests/mindspeed_stack/test_mindspeed_llm_source.py"
    CEZ_MINDSPEED_LLM_TRIPLE=$triple "$VENV/bin/pytest" -q -rs tests/mindspeed_stack/test_mindspeed_llm_source.py
done

stamp "the main job, quick mode"
"$VENV/bin/python" -m mindspeed_cez.launch examples/train_tiny_moe.py --lm-z-loss-coeff 1e-2 --quick
stamp "done"
