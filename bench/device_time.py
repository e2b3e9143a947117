"""Device time of the op by CUDA-graph replay, beside event timing, and its memory per token.

For each N x V shape (bf16 logits, c = 1e-4, TP=1) the op's forward and forward+backward are
captured in a CUDA graph and replayed, L2 flushed and the logits restored before each replay
(untimed): the replay's event time is device time alone, no Python or launch cost. Beside it:
the same call eager between CUDA events, after a 2 ms GPU busy-wait that lets the host queue
the region whole (device time unless the host is slower than the GPU), and eager without that
head start (what a host-bound caller sees). Floors: 1 pass (fwd) and 3 passes (fwd+bwd) over
the logits at the device-to-device copy bandwidth measured in the same run. The logits are a
non-leaf alias of a buffer (as the output layer's result is in training), so the gradient is
written in place as in training.

Memory: bytes per token held after forward and at the peak of forward+backward beyond the
inputs, and each allocation the op makes (size and where), from the allocator's history.

    python bench/device_time.py [--shapes 8192x151936 ...] [--out out/device_time.md]
    python bench/device_time.py --logit-softcap 30 [--logit-scale S]   # the op on transformed logits
"""

import argparse
import time

import torch

from bench_cross_entropy import GPU_SHAPES, Z_LOSS_COEFF
from harness import LOGIT_SCALE, Timer, copy_bandwidth
from report import write_report
from support import capture_cuda_graph  # tests/support.py, on the path by harness
from mindspeed_cez import vocab_parallel_cross_entropy_zloss


class _Alias(torch.autograd.Function):
    """The buffer itself as a non-leaf tensor: the op writes its gradient into it, in place."""

    @staticmethod
    def forward(ctx, base):
        return base.detach()

    @staticmethod
    def backward(ctx, grad):
        return None


def _step(base, target, upstream, backward, transform):
    logits = _Alias.apply(base)
    loss, _ = vocab_parallel_cross_entropy_zloss(logits, target, z_loss_coeff=Z_LOSS_COEFF, **transform)
    if backward:
        torch.autograd.grad(loss, logits, upstream)


def _median_ms(run, restore, timer, iters, head_start=True):
    for _ in range(iters):
        restore()
        if head_start:
            timer.prepare()
        else:
            timer.flush.zero_()
            torch.cuda.synchronize()
        started = timer.start()
        run()
        timer.stop(started)
        torch.cuda.synchronize()
    return timer.median_ms()


def _allocations(base, target, upstream, transform):
    """(bytes held after forward, peak bytes of fwd+bwd, [(bytes, where)] of each allocation)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=10000)
    logits = _Alias.apply(base)
    loss, z = vocab_parallel_cross_entropy_zloss(logits, target, z_loss_coeff=Z_LOSS_COEFF, **transform)
    held = torch.cuda.memory_allocated() - before
    torch.autograd.grad(loss, logits, upstream)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    allocs = []
    for trace in snapshot.get("device_traces", []):
        for event in trace:
            if event.get("action") != "alloc":
                continue
            frames = [f for f in event.get("frames", []) if f.get("filename", "").endswith(".py")]
            where = " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames[:3])
            allocs.append((event["size"], where))
    del loss, z, logits
    return held, peak, allocs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=None, help="N x V, e.g. 8192x151936")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--logit-scale", type=float, default=1.0)
    parser.add_argument("--logit-softcap", type=float, default=0.0, help="0: no cap")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    transform = {"logit_scale": args.logit_scale, "logit_softcap": args.logit_softcap}
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else GPU_SHAPES
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    timer = Timer(device)
    lines = [
        f"device time of mindspeed_cez (TP=1, bf16, c={Z_LOSS_COEFF}, logit_scale={args.logit_scale}, "
        f"logit_softcap={args.logit_softcap}), {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; median of {args.iters}; "
        f"copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)",
        "",
        "| N x V | mode | floor ms | graph replay ms (/ floor) | events, head start ms (/ floor) "
        "| events, no head start ms (/ floor) |",
        "|---|---|---|---|---|---|",
    ]
    memory_lines = ["", "| N x V | held after fwd B/token | peak fwd+bwd B/token | allocations (bytes: where) |",
                    "|---|---|---|---|"]
    for n, v in shapes:
        g = torch.Generator(device=device).manual_seed(n + v)
        pristine = (torch.randn(n, v, device=device, generator=g) * LOGIT_SCALE).to(torch.bfloat16)
        base = pristine.clone().requires_grad_()
        target = torch.randint(0, v, (n,), device=device, generator=g)
        upstream = torch.rand(n, device=device, generator=g)

        def restore():
            with torch.no_grad():
                base.copy_(pristine)

        one_pass = n * v * 2 * 2 / bandwidth * 1e3  # read + write of the logits' bytes = 2 passes' traffic
        floors = {"fwd": one_pass / 2, "fwd+bwd": 3 * one_pass / 2}
        for mode, backward in (("fwd", False), ("fwd+bwd", True)):
            def eager():
                _step(base, target, upstream, backward, transform)

            restore()
            graph, _ = capture_cuda_graph(eager, warmup=3)
            graphed = _median_ms(graph.replay, restore, timer, args.iters)
            head = _median_ms(eager, restore, timer, args.iters)
            bare = _median_ms(eager, restore, timer, args.iters, head_start=False)
            f = floors[mode]
            lines.append(f"| {n} x {v} | {mode} | {f:.3f} | {graphed:.3f} ({graphed / f:.3f}) | {head:.3f} "
                         f"({head / f:.3f}) | {bare:.3f} ({bare / f:.3f}) |")
            print(lines[-1], flush=True)
            del graph
        restore()
        held, peak, allocs = _allocations(base, target, upstream, transform)
        listed = "; ".join(f"{size}: {where}" for size, where in allocs) or "none"
        memory_lines.append(f"| {n} x {v} | {held / n:.1f} | {peak / n:.1f} | {listed} |")
        print(memory_lines[-1], flush=True)
        del pristine, base, target, upstream
        torch.cuda.empty_cache()
    print(write_report(args.out, lines + memory_lines), end="")


if __name__ == "__main__":
    main()
