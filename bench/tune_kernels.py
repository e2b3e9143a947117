"""Time this package's forward and backward kernels alone over launch configurations (tuning aid).

    python bench/tune_kernels.py [--shapes 8192x151936,...] [--fwd-blocks 4096,8192] ...

Forward: ``fused_loss`` (one rank: statistics and loss in one kernel). Backward: ``write_grad``
in place. Each over a grid of settings, median of ``triton.testing.do_bench`` (which flushes
L2 between runs), as a ratio to the bandwidth floor measured in the same run (forward: one
pass over the logits; backward: two). Prints one row per setting, then per kernel the setting
whose worst ratio over the shapes is lowest.
"""

import argparse
import itertools

import torch
import triton.testing

from mindspeed_cez.kernels import triton_cross_entropy as tce


def copy_bandwidth():
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def _ints(text):
    return [None if t == "none" else int(t) for t in text.split(",")]


def _sweep(name, keys, grid, shapes, time_one, passes, pass_ms):
    """Rows of (setting, ratio per shape); prints them and the best setting."""
    results = {}
    for values in itertools.product(*grid):
        setting = dict(zip(keys, values))
        for _, settings in tce.LAUNCH_CONFIG["cuda"]:  # the same setting for every vocab width
            settings.update(setting)
        tce.launch_plans_changed()
        ratios = []
        for shape in shapes:
            ms = time_one(shape)
            ratio = ms / (passes * pass_ms[shape])
            ratios.append(ratio)
            print(f"| {name} | {shape} | {setting} | {ms:.3f} | {ratio:.3f} |", flush=True)
        results[tuple(values)] = ratios
    best = min(results, key=lambda v: max(results[v]))
    print(f"best {name}: {dict(zip(keys, best))} worst {max(results[best]):.3f} "
          f"per shape {[f'{r:.3f}' for r in results[best]]}", flush=True)
    return dict(zip(keys, best))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8192x151936,8192x37984,16384x16160,4096x262144")
    parser.add_argument("--fwd-blocks", default="4096,8192")
    parser.add_argument("--slot-widths", default="8,16")
    parser.add_argument("--fwd-warps", default="4,8")
    parser.add_argument("--fwd-per-core", default="4,8,16")
    parser.add_argument("--bwd-blocks", default="4096,8192")
    parser.add_argument("--bwd-warps", default="4,8")
    parser.add_argument("--bwd-per-core", default="4,8,16")
    parser.add_argument("--skip-fwd", action="store_true")
    parser.add_argument("--skip-bwd", action="store_true")
    args = parser.parse_args()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    print(f"defaults {tce.LAUNCH_CONFIG['cuda']}", flush=True)  # (narrowest width, settings) pairs
    print("| kernel | shape | setting | ms | / floor |\n|---|---|---|---|---|", flush=True)

    inputs, pass_ms = {}, {}
    shapes = args.shapes.split(",")
    for shape in shapes:
        n, v = map(int, shape.split("x"))
        x = torch.empty(n, v, dtype=torch.bfloat16, device="cuda")
        for start in range(0, n, 1024):
            x[start : start + 1024] = torch.randn(min(1024, n - start), v, device="cuda") * 3
        target = torch.randint(0, v, (n,), device="cuda")
        lse = torch.logsumexp(x[:, :1].float(), -1) + 12  # any finite value: times only
        g = torch.rand(n, device="cuda")
        inputs[shape] = (x, target, lse, g, v)
        pass_ms[shape] = x.numel() * x.element_size() / bw * 1e3

    def time_fwd(shape):
        x, target, _, _, _ = inputs[shape]
        return triton.testing.do_bench(lambda: tce.fused_loss(x, target, -100, 1e-4, 0.0), warmup=10, rep=40,
                                       return_mode="median")

    def time_bwd(shape):
        x, target, lse, g, v = inputs[shape]
        return triton.testing.do_bench(lambda: tce.write_grad(x, x, target, lse, g, -100, 0, 1e-4, 0.0, v),
                                       warmup=10, rep=40, return_mode="median")

    if not args.skip_fwd:
        _sweep("fwd", ["fwd_block_v", "slot_width", "fwd_warps", "fwd_per_core"],
               [_ints(args.fwd_blocks), _ints(args.slot_widths), _ints(args.fwd_warps), _ints(args.fwd_per_core)],
               shapes, time_fwd, 1, pass_ms)
    if not args.skip_bwd:
        _sweep("bwd", ["bwd_block_v", "bwd_warps", "bwd_per_core"],
               [_ints(args.bwd_blocks), _ints(args.bwd_warps), _ints(args.bwd_per_core)],
               shapes, time_bwd, 2, pass_ms)


if __name__ == "__main__":
    main()
