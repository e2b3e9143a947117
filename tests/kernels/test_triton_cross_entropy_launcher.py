"""``kernels.triton_cross_entropy.Launcher`` reuses a compiled kernel only where Triton would compile the same one.

The launcher keys compiled kernels by its own cheap tuple instead of Triton's per-call
specialization. For every kernel of the package and many random argument sets (tensors at
aligned and unaligned addresses and of several dtypes, integers at 1, multiples of 16, past
int32, negative; floats, constexprs), arguments with equal launcher keys must get equal
specializations from Triton's own binder: otherwise a kernel compiled for aligned pointers could
run on unaligned ones. Runs in a subprocess without ``TRITON_INTERPRET`` (the kernels must be
real ``JITFunction`` objects); the direct launch itself runs in the GPU suite.
"""

import json
import os
import subprocess
import sys

import pytest

from mindspeed_cez import kernels

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="needs Triton")

SCRIPT = r"""
import json, random, sys
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import create_function_from_signature
from mindspeed_cez.kernels import triton_cross_entropy as tce

INTS = [0, 1, 2, 15, 16, 17, 48, 4096, 151936, 37984, 2**31 - 1, 2**31, 2**31 + 16, 2**40, -1, -16, -100, 2**63]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.int32]
base = torch.zeros(4096, dtype=torch.float32)
rng = random.Random(int(sys.argv[1]))


def tensor():
    dtype = rng.choice(DTYPES)
    size = torch.empty((), dtype=dtype).element_size()
    offset = rng.choice([0, 0, 1, 2, 4, 8, 16]) * size  # bytes: 16-byte aligned or not
    return base.view(torch.uint8)[offset:offset + 64].view(dtype)


def argument(param):
    if param.is_constexpr:
        return rng.choice([1, 2, 16, True, False, "evict_first", ""])
    name = param.name
    if name.endswith("_ptr"):
        return tensor()
    if name in ("z_loss_coeff", "target_weight", "smoothing_per_col", "width_hi", "width_lo"):
        return rng.choice([0.0, 1.0, 1e-4])
    return rng.choice(INTS)


result = {}
device = torch.device("cuda", 0)
for launcher in tce.LAUNCHERS:
    kernel = launcher.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    seen = {}
    for _ in range(3000):
        args = [argument(p) for p in kernel.params]
        options = rng.choice([(("num_warps", 4),), (("num_warps", 8),)])
        ours = launcher.key(device, args, options)
        _, specialization, _ = binder(*args, **dict(options))
        triton_key = repr((specialization, options))
        seen.setdefault(repr(ours), set()).add(triton_key)
    clashes = [k for k, v in seen.items() if len(v) > 1]
    specs = set().union(*seen.values())
    result[kernel.fn.__name__] = {"keys": len(seen), "triton_specs": len(specs), "clashes": clashes[:3]}
print(json.dumps(result))
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_equal_launcher_keys_mean_equal_triton_specializations(seed, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Outside the checkout: the installed package, not the source folder of the same name.
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(seed)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"_forward_kernel", "_grad_kernel", "_loss_from_partials_kernel"}
    for name, row in result.items():
        assert not row["clashes"], f"{name}: one launcher key for several Triton specializations: {row['clashes']}"
        assert row["triton_specs"] > 100, (name, row)  # the random arguments do reach many specializations


def test_bind_orders_arguments_by_parameter_name():
    from mindspeed_cez.kernels import triton_cross_entropy as tce
    from mindspeed_cez.kernels.triton_cross_entropy import Launcher

    launcher = Launcher(tce._grad_kernel)
    shared = {p: f"shared {p}" for p in launcher.params} | {"not_a_parameter": 0}
    args = launcher.bind(shared, BLOCK_V=1024, lse_ptr="named")
    assert len(args) == len(launcher.params)
    assert args[launcher.params.index("BLOCK_V")] == 1024 and args[launcher.params.index("lse_ptr")] == "named"
    assert args[0] == "shared logits_ptr"
    with pytest.raises(TypeError, match="no parameter .*blockv"):
        launcher.bind(shared, blockv=1)
    with pytest.raises(TypeError, match="no value for parameter 'logits_ptr'"):
        launcher.bind({"BLOCK_V": 1})
