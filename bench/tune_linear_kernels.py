"""Tile settings of the fused output projection's Triton kernels (kernels/triton_linear_cross_entropy.py)
on one GPU, beside cuBLAS's ``[N, h] @ [h, V]`` in the same run.

Per setting: the forward (``linear_partials``: tiles + online softmax, no logits) and the backward's
gradient kernel over every vocab chunk (``linear_grad``: tiles recomputed into the bf16 gradient),
each as a multiple of one cuBLAS GEMM of the same size; median of CUDA-event timings.

    python bench/tune_linear_kernels.py --out out/tune_linear.md
"""

import argparse
import itertools
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from report import write_report  # noqa: E402
from harness import timed  # noqa: E402

WARMUP, ITERS = 2, 7


def settings(args):
    for bm, bn, bk, warps, stages, group_n, swizzle, per_core in itertools.product(
            args.block_m, args.block_n, args.block_k, args.warps, args.stages, args.group_n, args.swizzle_m,
            args.per_core):
        yield {"block_m": bm, "block_n": bn, "block_k": bk, "group_n": group_n, "swizzle_m": swizzle,
               "warps": warps, "stages": stages, "per_core": per_core}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["8192x4096x151936", "8192x4096x37984"])
    parser.add_argument("--block-m", nargs="+", type=int, default=[128])
    parser.add_argument("--block-n", nargs="+", type=int, default=[128, 256])
    parser.add_argument("--block-k", nargs="+", type=int, default=[64])
    parser.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--stages", nargs="+", type=int, default=[3, 4])
    parser.add_argument("--group-n", nargs="+", type=int, default=[16])
    parser.add_argument("--swizzle-m", nargs="+", type=int, default=[8])
    parser.add_argument("--per-core", nargs="+", type=int, default=[1])
    parser.add_argument("--budget-s", type=float, default=400)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from mindspeed_cez.kernels import chunked_linear
    from mindspeed_cez.kernels import triton_linear_cross_entropy as tlce

    start = time.time()
    default = dict(tlce.LAUNCH_CONFIG["cuda"])
    lines = [f"Fused output projection kernels, bf16, {torch.cuda.get_device_name()}, triton "
             f"{__import__('triton').__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"default {default}", "",
             "| N x h x V | BM BN BK warps stages group_n swizzle per_core | fwd ms | / GEMM | grad ms | / GEMM |",
             "|---|---|---|---|---|---|"]
    for shape in args.shapes:
        n, h, v = (int(x) for x in shape.split("x"))
        x = torch.randn(n, h, device="cuda").bfloat16()
        w = (torch.randn(v, h, device="cuda") * 4 / h**0.5).bfloat16()
        target = torch.randint(0, v, (n,), device="cuda")
        lse = torch.full((n,), 12.0, device="cuda")
        g = torch.full((n,), 1.0 / n, device="cuda")
        gemm = timed(lambda: x @ w.t(), WARMUP, ITERS)
        lines.append(f"| {shape} | cuBLAS x @ w.T | {gemm:.3f} | 1.00 | | |")
        print(lines[-1], flush=True)
        step = chunked_linear.default_chunk_cols(n, v)
        chunk = x.new_empty((n, step))

        def grad_all():
            for c in range(0, v, step):
                wc = w[c:c + step]
                tlce.linear_grad(x, wc, chunk[:, :wc.shape[0]], target, lse, g, -100, c, 1e-4, 0.0, v)

        for s in settings(args):
            if time.time() - start > args.budget_s:
                lines.append("| (budget spent) | | | | | |")
                break
            tlce.LAUNCH_CONFIG["cuda"] = s
            tlce.launch_plans_changed()
            label = " ".join(str(s[k]) for k in ("block_m", "block_n", "block_k", "warps", "stages", "group_n",
                                                  "swizzle_m", "per_core"))
            try:
                fwd = timed(lambda: tlce.linear_partials(x, w, target, 0, v, -100), WARMUP, ITERS)
                bwd = timed(grad_all, WARMUP, ITERS)
                lines.append(f"| {shape} | {label} | {fwd:.3f} | {fwd / gemm:.2f} | {bwd:.3f} | {bwd / gemm:.2f} |")
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                lines.append(f"| {shape} | {label} | failed: {type(exc).__name__}: {str(exc)[:60]} | | | |")
            print(lines[-1], flush=True)
        tlce.LAUNCH_CONFIG["cuda"] = default
        tlce.launch_plans_changed()
        del x, w
        torch.cuda.empty_cache()
    print(write_report(args.out, lines))


if __name__ == "__main__":
    main()
