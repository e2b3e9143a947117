#!/usr/bin/env bash
# CI leg 2: Python 3.12 + megatron-core 0.19.2, which brings megatron.training (arguments,
# initialize, pretrain, training_log). From scratch on a fresh machine with only pip:
# a venv, pinned torch, megatron-core, this package (editable) and pytest, then the tests that
# need megatron.training, among them the end-to-end run of Megatron's own training loop
# (tests/environments/megatron_loop/test_e2e_megatron_training.py: torchrun, 2 ranks, TP=2, gloo, mock data) and its parallel
# layouts (tests/environments/megatron_loop/test_e2e_layouts.py: PP, VPP, EP, DP, MTP, checkpoint resume).
#
#   bash .ci/leg_py312.sh              # venv in .venv312/ (git-ignored), re-used if present
#   bash .ci/leg_py312.sh --prepare    # only the venv and its pins (.ci/run: in the background during leg 1)
#   PY312=/path/to/python3.12 VENV=/tmp/v bash .ci/leg_py312.sh
#
# CI 2026-12-07: 9m48s (169 passed in 9m19s; the venv made in the background during leg 1). The parallel
# layouts run here only: leg "megatron main" does not repeat them.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# 2 ranks on 2 cores: one thread per rank; Megatron requires this with TP > 1.
export OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1

PY312="${PY312:-$HOME/.pyenv/versions/3.12.1/bin/python}"
VENV="${VENV:-.venv312}"
TORCH_VERSION=2.13.0
MEGATRON_CORE_VERSION=0.19.2

start=$SECONDS
stamp() { echo "== leg py312 [$((SECONDS - start))s] $*"; }

stamp "venv $VENV from $PY312"
[ -x "$VENV/bin/python" ] || "$PY312" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip

stamp "install torch==$TORCH_VERSION megatron-core==$MEGATRON_CORE_VERSION, the package, pytest"
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
# psutil: Megatron's torch_dist checkpoint save starts a worker that needs it
# tokenizers, tensorboard, matplotlib: the z-loss sweep's CPU smoke run (tests/examples/test_zloss_lr_sweep.py, about 2 min)
# einops: Megatron-FSDP imports it (tests/environments/megatron_loop/test_megatron_features_cpu.py's Megatron-FSDP gradient against float64)
"$VENV/bin/python" -m pip install -q "megatron-core==$MEGATRON_CORE_VERSION" pytest psutil tokenizers tensorboard matplotlib \
    einops
[ "${1:-}" = --prepare ] && { stamp "prepared"; exit 0; }
# --no-deps: the pins above stay as they are (the extras would re-resolve megatron-core)
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" - <<EOF
import torch, megatron.core, megatron.training, mindspeed_cez
from importlib.metadata import version
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
assert version("megatron-core") == "$MEGATRON_CORE_VERSION", version("megatron-core")
print("python", __import__("sys").version.split()[0], "| torch", torch.__version__,
      "| megatron-core", version("megatron-core"), "| cuda", torch.cuda.is_available())
EOF

# The tests that need megatron.training (they skip cleanly on leg 1's megatron-core 0.16.1), and
# the megatron-core GPT tests once more on this line (its MoE schedule-plan node among them). Not the files
# that only name it: tests/package/ (the whole-package checks, stack-free: leg 1's) and
# tests/environments/mindspeed_stack/ (MindSpeed-LLM's Python 3.10: they skip here; the users' leg runs them).
tests=(tests/environments/megatron_loop/test_e2e_megatron_training.py tests/environments/megatron_loop/test_e2e_layouts.py
       tests/patches/test_loss_wrappers_gpt.py)
for f in $(grep -rl --include="test_*.py" "megatron\.training" tests | grep -v -e "^tests/package/" \
           -e "^tests/environments/mindspeed_stack/" | sort); do
    [[ " ${tests[*]} " == *" $f "* ]] || tests+=("$f")
done
stamp "pytest ${tests[*]}"
"$VENV/bin/python" -m pytest -q -rs "${tests[@]}"
stamp "the main job, quick mode (README command 1 on Python 3.12)"
"$VENV/bin/python" -m mindspeed_cez.launch examples/train_tiny_moe.py --lm-z-loss-coeff 1e-2 --quick
stamp "done"
