"""Host time per call of the LM loss: a small shape, wall clock over many calls, peers beside it.

At 64 x 4096 the GPU work of a call is a few microseconds, so a loop of calls runs at the host's
pace: wall time / calls is the host time of one call (fwd: the call that returns the per-token
loss; fwd+bwd: that plus ``backward``). The row "harness" is the loop around a call (the input's
clone, ``sum``, autograd's ``backward``) with a column select in place of a loss: what every row
pays before its own work. The op runs twice: with its launcher (compiled kernels
reused) and with Triton's own launch path on every call. ``--profile`` adds the top functions of this package's
fwd+bwd under cProfile (where the host time goes).

    python bench/host_time.py --out out/host_time.md [--profile]
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

from report import write_report
from mindspeed_cez import vocab_parallel_cross_entropy_zloss
from mindspeed_cez.kernels import triton_cross_entropy

N, V, C = 64, 4096, 1e-4
TRITON_PATH = "mindspeed_cez, Triton's own launch path"  # the same op, kernel[grid](...) on every call
HARNESS = "harness: clone, sum, backward around a column select (no loss)"


def _with_one_rank_group():
    """The op with ``tp_group`` a process group of one rank (TP=1 under Megatron): no collective may run."""
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
    group = dist.new_group([0])
    return lambda x, t: vocab_parallel_cross_entropy_zloss(x, t, z_loss_coeff=C, tp_group=group)[0]


def implementations():
    ours = lambda x, t: vocab_parallel_cross_entropy_zloss(x, t, z_loss_coeff=C)[0]  # noqa: E731
    impls = {
        "mindspeed_cez": ours,
        TRITON_PATH: ours,
        "mindspeed_cez, one-rank TP group": _with_one_rank_group(),
        HARNESS: lambda x, t: x[:, 0].float(),
        "torch F.cross_entropy (no z)": lambda x, t: F.cross_entropy(x.float(), t, reduction="none"),
    }
    try:
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        impls["megatron fused CE (no z)"] = lambda x, t: fused_vocab_parallel_cross_entropy(x.unsqueeze(1), t.unsqueeze(1), None).squeeze(1)
    except Exception:  # noqa: BLE001 - not installed, or needs model-parallel state
        pass
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        impls["liger CE(z)"] = lambda x, t: liger_cross_entropy(x, t, reduction="none", lse_square_scale=C)
    except Exception:  # noqa: BLE001
        pass
    return impls


def per_call_us(fn, x, t, backward, calls):
    def once():
        y = x.clone().requires_grad_() if backward else x
        loss = fn(y, t)
        if backward:
            loss.sum().backward()

    for _ in range(20):
        once()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        once()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / calls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5, help="median of this many loops")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, V, device="cuda", generator=g).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    lines = [f"host time per call, {N} x {V} bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d')}; median of {args.repeats} loops of {args.calls} calls, rows alternated",
             "", "| implementation | fwd (us) | fwd+bwd (us) | fwd / fwd+bwd beyond the harness (us) |", "|---|---|---|---|"]
    # loops alternate over the rows (a shared host drifts), the median of each row's loops is kept
    impls, samples, measured = implementations(), {}, {}
    for _ in range(args.repeats):
        for name, fn in impls.items():
            if name in measured:
                continue
            for launcher in triton_cross_entropy.LAUNCHERS:
                launcher.direct = name != TRITON_PATH
            try:
                samples.setdefault(name, []).append([per_call_us(fn, x, t, bwd, args.calls) for bwd in (False, True)])
            except Exception as exc:  # noqa: BLE001 - a peer that does not run here is reported, not fatal
                measured[name] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
    for launcher in triton_cross_entropy.LAUNCHERS:
        launcher.direct = True
    for name, loops in samples.items():
        if name not in measured:
            measured[name] = [statistics.median(loop[i] for loop in loops) for i in (0, 1)]
    measured = {name: measured[name] for name in impls}
    base = measured.get(HARNESS)
    for name, value in measured.items():
        if isinstance(value, str):
            lines.append(f"| {name} | {value} | | |")
            continue
        beyond = f"{value[0] - base[0]:.1f} / {value[1] - base[1]:.1f}" if isinstance(base, list) and name != HARNESS else ""
        lines.append(f"| {name} | {value[0]:.1f} | {value[1]:.1f} | {beyond} |")
    text = "\n".join(lines)
    if args.profile:
        fn = implementations()["mindspeed_cez"]
        prof = cProfile.Profile()
        prof.enable()
        per_call_us(fn, x, t, True, args.calls)
        prof.disable()
        stream = io.StringIO()
        pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(25)
        text += "\n\ncProfile of mindspeed_cez fwd+bwd (tottime):\n```\n" + stream.getvalue() + "```\n"
    print(write_report(args.out, [text]), end="")


if __name__ == "__main__":
    main()
