"""Every Triton kernel lowers through triton-ascend's front end and adapter (CPU, no NPU).

Runs where ``triton`` is triton-ascend's (CI: ``.ci/leg_ascend.sh``, a venv of its own with
triton-ascend 3.2.0); skipped elsewhere. ``tests/support/ascend_lowering.py`` runs in a subprocess
without ``TRITON_INTERPRET`` (which the CPU test configuration sets) and lowers each variant of
the Ascend launch setting through the ``ttir`` and ``ttadapter`` stages for Ascend910B3:
forward (one rank: FINISH; several: partials; with and without the smoothing sum), the TP
path's loss-from-partials kernel, the gradient kernel; bf16, fp16, fp32 logits; a
wide and a narrow vocab slice; and the fused output projection's ``tl.dot`` kernels (partials,
merge, gradient tiles) for the three input dtypes, and the fp32 weight-gradient accumulation kernel
(bf16, fp16; with and without a k tail); the streaming and ``tl.dot`` kernels also with
the logit scale and the soft cap (``TRANSFORM``: the exp2-based tanh) compiled in. A failure names the variant and carries the compiler's message.
The forward's target assert (``CHECK_TARGETS``) is compiled on CUDA only and not lowered here.
``npubin`` needs CANN and is not run.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.ascend", reason="needs triton-ascend (CI: .ci/leg_ascend.sh)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "support", "ascend_lowering.py")


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_variant_lowers_for_ascend():
    out = _run()
    rows = out["result"]
    failed = [f"{r['name']} {r['dtype']} n_cols={r['n_cols']}:\n{r['error']}" for r in rows if not r["ok"]]
    assert not failed, "did not lower for Ascend:\n\n" + "\n\n".join(failed)
    names = {r["name"] for r in rows}
    linear = {"linear partials logit_sum=False", "linear partials logit_sum=True", "linear grad", "linear merge",
              "linear partials logit_sum=True transform=scale", "linear partials logit_sum=True transform=softcap",
              "linear grad transform=scale", "linear grad transform=softcap",
              "fp32 accumulation even_k=True", "fp32 accumulation even_k=False"}
    assert names == {
        "forward finish=True logit_sum=False", "forward finish=True logit_sum=True",
        "forward finish=False logit_sum=False", "forward finish=False logit_sum=True",
        "forward finish=True logit_sum=True transform=scale", "forward finish=True logit_sum=True transform=softcap",
        "forward finish=False logit_sum=True transform=softcap",
        "grad", "grad transform=scale", "grad transform=softcap", "loss from partials", *linear,
    }, names
    assert {r["dtype"] for r in rows} == {"bf16", "fp16", "fp32"} and len(rows) == 11 * 3 * 2 + 8 * 3 + 2 * 2
    assert not any(r["cuda_only"] for r in rows)
    assert all(r["constexprs"]["CHECK_TARGETS"] is False for r in rows if r["name"].startswith("forward"))
    forward = next(r for r in rows if r["name"].startswith("forward") and r["n_cols"] == 151936)
    assert forward["constexprs"]["SLOTS"] == 1 and forward["constexprs"]["SLOT_WIDTH"] == 4096  # Ascend's tiles
    assert all(r["sizes"]["ttadapter"] > 0 for r in rows)
    partials = next(r for r in rows if r["name"] == "linear partials logit_sum=False" and r["dtype"] == "bf16")
    assert partials["constexprs"]["BLOCK_M"] == 64  # the Ascend tiles


def test_a_kernel_that_does_not_lower_fails_with_the_compilers_message():
    out = _run("--negative")["result"]
    assert not out["ok"]
    assert "triton-adapter-opt" in out["error"], out["error"][:2000]
