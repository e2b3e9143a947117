"""Lower the Triton kernels through triton-ascend's compiler on the CPU (no NPU, no CANN).

triton-ascend's NPU pipeline is ``ttir`` (Triton's front end and its IR passes), ``ttadapter``
(the wheel's ``triton-adapter-opt``: Triton IR -> HIVM / HFusion / Linalg) and ``npubin``
(CANN's ``bishengir-compile``). The first two run on any x86 machine; this lowers every kernel
variant the Ascend launch setting compiles (``tests/support/kernel_variants.py``, the fused output
projection's ``tl.dot`` kernels included) through them, for
Ascend910B3, and prints a JSON report. Run it in a venv of its own with ``triton-ascend``
(which brings its own ``triton``), without ``TRITON_INTERPRET``:

    python tests/support/ascend_lowering.py             # every variant: [{"name", "dtype", ...}, ...]
    python tests/support/ascend_lowering.py --negative  # a kernel the adapter rejects (the harness's own check)
"""

import argparse
import json
import os
import sys

import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource, make_backend

from mindspeed_cez.kernels import triton_cross_entropy as tce
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the support package
from support.kernel_variants import linear_variants, variants  # noqa: E402

TARGET = GPUTarget("npu", "Ascend910B3", 0)
STAGES = ("ttir", "ttadapter")
DTYPES = ("bf16", "fp16", "fp32")
# The Ascend setting caps tiles at next_power_of_2(width): a wide slice and a narrow one.
WIDTHS = (151936, 2000)


def lower(fn, signature, constexprs, num_warps, target=TARGET):
    """Run ``STAGES`` of triton-ascend's pipeline; returns {stage: IR text}. Raises on failure."""
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constants=dict(constexprs))
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": num_warps})
    metadata = {"hash": src.hash(), "target": target, **options.__dict__}
    stages = {}
    backend.add_stages(stages, options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(options, backend.get_codegen_implementation(), backend.get_module_map(), context)
    out = {}
    for stage in STAGES:
        module = stages[stage](module, metadata)
        out[stage] = str(module)
    return out


def _error(exc):
    stderr = getattr(exc, "stderr", None)
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    return f"{type(exc).__name__}: {(stderr or str(exc)).strip()[-4000:]}"


def report():
    """One row per (variant, dtype, width) of the Ascend launch setting."""
    rows = []
    for n_cols in WIDTHS:
        settings = tce.launch_settings("npu", n_cols)
        for dtype in DTYPES:
            for v in variants(settings, dtype, n_cols):
                if v.cuda_only:  # the forward's CUDA target assert: never launched on Ascend
                    continue
                row = {"name": v.name, "dtype": dtype, "n_cols": n_cols, "constexprs": v.constexprs,
                       "num_warps": v.num_warps, "cuda_only": v.cuda_only}
                try:
                    out = lower(v.fn, v.signature, v.constexprs, v.num_warps)
                    row.update(ok=True, sizes={k: len(t) for k, t in out.items()})
                except Exception as exc:  # noqa: BLE001 - reported with the compiler's message
                    row.update(ok=False, error=_error(exc))
                rows.append(row)
    for dtype in DTYPES:  # the fused output projection's tl.dot kernels (tiles do not depend on the width)
        for v in linear_variants("npu", dtype):
            row = {"name": v.name, "dtype": dtype, "n_cols": None, "constexprs": v.constexprs,
                   "num_warps": v.num_warps, "cuda_only": v.cuda_only}
            try:
                out = lower(v.fn, v.signature, v.constexprs, v.num_warps)
                row.update(ok=True, sizes={k: len(t) for k, t in out.items()})
            except Exception as exc:  # noqa: BLE001
                row.update(ok=False, error=_error(exc))
            rows.append(row)
    return rows


@triton.jit
def _reads_the_clock(out_ptr, BLOCK: tl.constexpr):
    """Not lowerable by triton-ascend 3.2's adapter: an inline-PTX clock read with no operands."""
    offs = tl.arange(0, BLOCK)
    t = tl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(out_ptr + offs, t)


def negative():
    try:
        lower(_reads_the_clock, {"out_ptr": "*i32"}, {"BLOCK": 16}, 4)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": _error(exc)}
    return {"ok": True}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--negative", action="store_true")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter does not compile")
    result = negative() if args.negative else report()
    print(json.dumps({"triton": triton.__version__, "target": str(TARGET), "result": result}))


if __name__ == "__main__":
    main()
