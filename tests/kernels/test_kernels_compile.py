"""The Triton kernels compile for a real GPU target, on this CPU-only machine.

The interpreter that runs the kernels in CI checks what they compute, not whether Triton's
compiler accepts them (it skips the compiler's checks, e.g. on non-constexpr globals). This
compiles every kernel ahead of time for sm_90 under both launch settings (CUDA's and Ascend's
shape), for a wide and a narrow vocab slice (CUDA picks its settings by width), the fused output
projection's tl.dot kernels included, each also with the logit scale and the soft cap compiled in.
"""

import json
import os
import subprocess
import sys

import pytest

from mindspeed_cez import kernels

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="needs Triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import json, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, "tests")
from support.kernel_resources import report
print(json.dumps(report(sys.argv[1], arch=90, n_cols=int(sys.argv[2]))))
"""


@pytest.mark.parametrize("settings", ["cuda", "npu"])
@pytest.mark.parametrize("n_cols", [151936, 16160])
def test_kernels_compile_for_sm90(settings, n_cols):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, settings, str(n_cols)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    names = [row[0] for row in rows]
    assert "grad" in names and "forward finish=True logit_sum=False check_targets" in names
    assert {"linear partials logit_sum=False", "linear grad", "linear merge", "fp32 accumulation even_k=True",
            "fp32 accumulation even_k=False"} <= set(names) and len(rows) == 25
    assert {"forward finish=True logit_sum=True check_targets transform=softcap", "grad transform=softcap",
            "linear partials logit_sum=True transform=softcap", "linear grad transform=softcap"} <= set(names)
    for name, warps, registers, stack, shared, ctas in rows:
        assert 0 < registers <= 255 and stack < 1024, name
        if settings == "cuda":
            assert ctas >= 1, name
