"""Compile the Triton kernels ahead of time for a CUDA target, on any machine (no GPU needed),
and report what ptxas allotted: registers and spills per thread, shared memory, and the
CTAs per SM those allow (tuning aid; tests/kernels/test_kernels_compile.py runs it as a check).

    python tests/support/kernel_resources.py                       # the CUDA launch settings, sm_90, V=151936
    python tests/support/kernel_resources.py --settings npu --arch 90
    python tests/support/kernel_resources.py --sass out/sass       # also write each kernel's SASS

Must run without TRITON_INTERPRET (the interpreter has no compiler).
"""

import argparse
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mindspeed_cez.kernels import triton_cross_entropy as tce
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the support package
from support.kernel_variants import linear_variants, variants  # noqa: E402

REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
MAX_CTAS_PER_SM = 32


def _compile(variant, arch):
    fn = variant.fn
    divisible = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in variant.divisible_args()}
    # every parameter in the kernel's order (Triton 3.3 reads the signature by position)
    signature = {k: variant.signature.get(k, "constexpr") for k in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in variant.constexprs.items()}, attrs=divisible)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": variant.num_warps, **variant.options})


def _shared_per_sm(arch):
    return 228 * 1024 if arch >= 90 else 164 * 1024


def _resources(kernel, tmpdir):
    """(registers, spill stores bytes, stack bytes) from the cubin, through cuobjdump."""
    path = os.path.join(tmpdir, f"{kernel.name}.cubin")
    with open(path, "wb") as fh:
        fh.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    text = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", text).group(1))
    stack = int(re.search(r"STACK:(\d+)", text).group(1))
    return regs, stack, path


def report(settings_name, arch=90, dtype="bf16", n_cols=151936, sass_dir=None, tmpdir="/tmp"):
    if isinstance(settings_name, str):
        settings = tce.launch_settings(settings_name, n_cols)
    else:
        settings = settings_name
    rows = []
    linear = linear_variants(settings_name, dtype) if isinstance(settings_name, str) else []
    for variant in variants(settings, dtype, n_cols) + linear:
        name, warps = variant.name, variant.num_warps
        kernel = _compile(variant, arch)
        regs, stack, cubin = _resources(kernel, tmpdir)
        by_regs = REGISTERS_PER_SM // (regs * 32 * warps)
        by_shared = _shared_per_sm(arch) // max(kernel.metadata.shared, 1)
        ctas = max(0, min(by_regs, by_shared, MAX_WARPS_PER_SM // warps, MAX_CTAS_PER_SM))
        rows.append((name, warps, regs, stack, kernel.metadata.shared, ctas))
        if sass_dir:
            os.makedirs(sass_dir, exist_ok=True)
            tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
            sass = subprocess.run([tool, "--dump-sass", cubin], capture_output=True, text=True).stdout
            with open(os.path.join(sass_dir, re.sub(r"\W+", "_", name) + ".sass"), "w") as fh:
                fh.write(sass)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="cuda", help="a LAUNCH_CONFIG key (cuda / npu / cpu)")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--n-cols", type=int, default=151936)
    parser.add_argument("--sass", default=None, help="write SASS listings into this folder")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter does not compile")
    print(f"settings {args.settings}: {tce.launch_settings(args.settings, args.n_cols)}; sm_{args.arch}, {args.dtype}, "
          f"{args.n_cols} columns; triton {triton.__version__}")
    print("| kernel | warps | registers / thread | stack bytes | shared bytes | CTAs / SM (registers, shared, warps) |")
    print("|---|---|---|---|---|---|")
    for row in report(args.settings, args.arch, args.dtype, args.n_cols, args.sass):
        print("| " + " | ".join(str(v) for v in row) + " |", flush=True)


if __name__ == "__main__":
    main()
