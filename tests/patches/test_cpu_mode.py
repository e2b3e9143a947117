"""``mindspeed_cez.patches.cpu_mode`` (Megatron on a CPU, for the demo and the tests) changes nothing until called:
its import (and ``local_gpt``'s) imports nothing of Megatron and leaves torch alone, ``apply()`` is a no-op where
CUDA is available, and applying again, or the training loop's part after the models' part, ends in the same
state. Each case runs in a fresh interpreter: the CPU mode changes torch for the whole process."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")


def _run(script):
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_importing_changes_nothing():
    seen = _run("""
import json, sys, torch
before = (torch.cuda.current_device, torch.zeros, torch.Tensor.to, torch.Tensor.cuda)
from mindspeed_cez.patches import cpu_mode, local_gpt
after = (torch.cuda.current_device, torch.zeros, torch.Tensor.to, torch.Tensor.cuda)
print(json.dumps({"megatron": [m for m in sys.modules if m.split(".")[0] == "megatron"], "same": before == after}))
""")
    assert seen == {"megatron": [], "same": True}


def test_a_machine_with_cuda_never_gets_it():
    seen = _run("""
import json, sys, torch
torch.cuda.is_available = lambda: True  # as on a GPU machine
before = (torch.cuda.current_device, torch.zeros, torch.Tensor.to, torch.Tensor.cuda, torch.cuda.device_count)
from mindspeed_cez.patches import cpu_mode
on = [cpu_mode.apply(), cpu_mode.apply(training_loop=True)]
after = (torch.cuda.current_device, torch.zeros, torch.Tensor.to, torch.Tensor.cuda, torch.cuda.device_count)
print(json.dumps({"on": on, "same": before == after, "megatron": [m for m in sys.modules if m.startswith("megatron")]}))
""")
    assert seen == {"on": [False, False], "same": True, "megatron": []}


def test_applying_again_or_in_either_order_ends_the_same():
    seen = _run("""
import json, torch
from mindspeed_cez.patches import cpu_mode
from megatron.core.tensor_parallel import random as mp_random
out = {"on": cpu_mode.apply(), "device": torch.cuda.current_device()}
fork, zeros = mp_random.CudaRNGStatesTracker.fork, torch.zeros
out["again"] = [cpu_mode.apply(), mp_random.CudaRNGStatesTracker.fork is fork, torch.zeros is zeros]
cpu_mode.apply(training_loop=True)  # the loop's part after the models' part
to, zeros = torch.Tensor.to, torch.zeros
cpu_mode.apply(training_loop=True)
cpu_mode.apply()
out["loop"] = [torch.cuda.current_device(), torch.Tensor.to is to, torch.zeros is zeros, torch.cuda.device_count(),
               str(torch.zeros(2, device="cuda").device), str(torch.ones(1).to("cuda:0").device),
               str(torch.ones(1).cuda().device)]
print(json.dumps(out))
""")
    assert seen == {"on": True, "device": "cpu", "again": [True, True, True],
                    "loop": [0, True, True, 1, "cpu", "cpu", "cpu"]}
