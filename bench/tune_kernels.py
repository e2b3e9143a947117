"""Time this package's two kernels alone over a few launch configurations (tuning aid).

    python bench/tune_kernels.py [--shapes 8192x151936,...]

Prints, per shape and configuration, the median forward (partials kernel) and backward (grad
kernel, in place) times and their ratio to the bandwidth floor measured in the same run.
"""

import argparse
import itertools

import torch
import triton.testing

from mindspeed_cez.kernels import device_cores
from mindspeed_cez.kernels import triton_cross_entropy as tce


def copy_bandwidth():
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8192x151936,16384x16160,4096x262144")
    parser.add_argument("--blocks", default="2048,4096,8192")
    parser.add_argument("--warps", default="8,16")
    parser.add_argument("--per-core", default="8,16")
    parser.add_argument("--evict", default="evict_first,none")
    args = parser.parse_args()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| shape | BLOCK_V | warps | programs/SM | eviction | fwd ms | fwd/1 pass | bwd ms | bwd/2 passes | fwd+bwd / 3 passes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, v = map(int, shape.split("x"))
        x = (torch.randn(n, v, device="cuda") * 4).to(torch.bfloat16)
        target = torch.randint(0, v, (n,), device="cuda")
        lse = torch.randn(n, device="cuda") + 12
        g = torch.randn(n, device="cuda")
        pass_ms = x.numel() * x.element_size() / bw * 1e3
        for block, warps, per_core, evict in itertools.product(
            map(int, args.blocks.split(",")),
            map(int, args.warps.split(",")),
            map(int, args.per_core.split(",")),
            args.evict.split(","),
        ):
            tce.LAUNCH_CONFIG["cuda"] = {"max_block_v": block, "num_warps": warps}
            tce.EVICTION["cuda"] = "" if evict == "none" else evict
            device_cores.PROGRAMS_PER_CORE["cuda"] = per_core
            fwd = triton.testing.do_bench(
                lambda: tce.shard_partials(x, target, 0, v, -100, False), warmup=25, rep=100, return_mode="median"
            )
            bwd = triton.testing.do_bench(
                lambda: tce.write_grad(x, x, target, lse, g, 0, 1e-4, 0.0, v), warmup=25, rep=100, return_mode="median"
            )
            x.copy_((torch.randn(n, v, device="cuda") * 4).to(torch.bfloat16))
            print(
                f"| {shape} | {block} | {warps} | {per_core} | {evict} | {fwd:.3f} | {fwd / pass_ms:.2f} | {bwd:.3f} | "
                f"{bwd / (2 * pass_ms):.2f} | {(fwd + bwd) / (3 * pass_ms):.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
