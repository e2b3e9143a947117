"""Output projection + CE (+ z-loss) forward+backward on one GPU, beside cuBLAS + this package's op
and the peers (issue 21): time over the 3-GEMM floor, peak memory beyond inputs and gradients (in
multiples of the logits' size), and the error of dhidden / dweight against float64.

Per shape ``N x h x V``: bf16 hidden ``[N, h]``, weight ``[V, h]``, 10 % ignored targets, loss =
``sum(per-token loss) / N`` (the peers' mean), ``c = 1e-4`` where the implementation has a z-loss.
The floor: three GEMMs of ``N x h x V`` (logits, dX, dW) at the rate cuBLAS gives ``[N, h] @ [h, V]``
in the same run. Time: median of CUDA-event timings of forward+backward (host included).

    python bench/linear_cross_entropy.py --out out/linear_ce.md        # GPU; liger / CCE if installed
    python bench/linear_cross_entropy.py --accumulations --out out/accumulations.md
        # the default path into main_grad with each fp32 accumulation forced, and the dial's curve
    python bench/linear_cross_entropy.py --tune-accumulate --out out/tune_accumulate.md
        # the Triton accumulation kernel alone over tile settings, beside addmm(out_dtype)
    torchrun --nproc-per-node 2 bench/linear_cross_entropy.py --tp --shapes 8192x4096x151936 --out out/tp2.md
        # TP=2 + SP: the unfused layer beside the default path at each block fraction
"""

import argparse
import contextlib
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import timed  # noqa: E402
from report import write_report  # noqa: E402
from support import linear_loss_and_grads_float64, relative_error  # noqa: E402  (tests/support.py)

Z = 1e-4
# issue 31's table; the last: a DeepSeek-V3-like vocab slice (V/8)
SHAPES = ["8192x4096x151936", "8192x4096x37984", "32768x4096x151936", "16384x4096x75968", "8192x7168x16160"]


def into_main_grad(rows=None):
    """The gradients-in-forward path as Megatron runs it: the upstream gradient known in forward
    (``grad_scale``; here 1 per counted token, the benchmark's ``sum``), ``dweight`` added into an fp32
    ``weight.main_grad`` (made once, counted with the inputs' gradients, as Megatron's grad buffer)."""
    from mindspeed_cez import linear_cross_entropy_zloss

    def loss(h, w, t):
        if not hasattr(w, "main_grad"):
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        return linear_cross_entropy_zloss(h, w, t, Z, token_weights=(t != -100).float(), grad_scale=1.0,
                                          gradient_accumulation_fusion=True, grads="forward", row_block=rows)[0].sum()
    return loss


def implementations(main_grad_rows=()):
    from mindspeed_cez import linear_cross_entropy_zloss, vocab_parallel_cross_entropy_zloss

    def fused(backend):
        def loss(h, w, t):
            return linear_cross_entropy_zloss(h, w, t, Z, linear_backend=backend)[0].sum()
        return loss

    impls = {
        "unfused: cuBLAS + cez op": lambda h, w, t: vocab_parallel_cross_entropy_zloss(h @ w.t(), t, Z)[0].sum(),
        "cez fused, Triton tl.dot": fused("triton"),
        "cez fused, cuBLAS chunks": fused("gemm"),
        # the loss mask as token weights (upstream gradient mask / const, as in Megatron)
        "cez fused, grads in forward": lambda h, w, t: linear_cross_entropy_zloss(
            h, w, t, Z, token_weights=(t != -100).float(), grads="forward")[0].sum(),
        "cez fused, grads in forward into main_grad (default rows)": into_main_grad(),
    }
    for rows in main_grad_rows:
        impls[f"cez fused, grads in forward into main_grad, {rows} rows"] = into_main_grad(rows)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        impls["liger fused linear CE"] = lambda h, w, t: liger_fused_linear_cross_entropy(
            h, w, t, lse_square_scale=Z, reduction="sum")
    except ImportError as exc:
        print(f"liger-kernel not installed ({exc})")
    try:
        from cut_cross_entropy import linear_cross_entropy

        impls["CCE default (no z)"] = lambda h, w, t: linear_cross_entropy(h, w, t, reduction="sum")
    except ImportError as exc:
        print(f"cut-cross-entropy not installed ({exc})")
    return impls


def inputs(n, h, v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(n, h, device="cuda", generator=g) * 1.0).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * (4.0 / h**0.5)).bfloat16()
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    target[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
    return hidden, weight, target


def gemm_ms(n, h, v, warmup, iters):
    a = torch.randn(n, h, device="cuda").bfloat16()
    b = torch.randn(h, v, device="cuda").bfloat16()
    return timed(lambda: a @ b, warmup, iters)


def _weight_grad(w):
    return w.main_grad if hasattr(w, "main_grad") else w.grad


def run(args):
    impls = implementations(args.main_grad_rows)
    if args.impls:
        impls = {name: fn for name, fn in impls.items() if any(part in name for part in args.impls)}
    device = torch.cuda.get_device_name()
    lines = [f"Output projection + CE (+ z-loss), fwd+bwd, bf16, {device}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; median of {args.iters} (CUDA events)", ""]
    # accuracy at a small shape against float64 (z-loss as implemented: peers without z differ by it)
    hs, ws, ts = inputs(512, 512, 8192, seed=1)
    _, exp_dh, exp_dw = linear_loss_and_grads_float64(hs, ws, ts, torch.ones(len(ts), device=ts.device), z_loss_coeff=Z)
    lines += ["| implementation | dhidden rel. error | dweight rel. error (512 x 512 x 8192, vs float64 with z-loss) |",
              "|---|---|---|"]
    for name, fn in impls.items():
        h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        fn(h, w, ts).backward()
        lines.append(f"| {name} | {relative_error(h.grad, exp_dh):.2e} | {relative_error(_weight_grad(w), exp_dw):.2e} |")
    lines += ["", "Peak extra: beyond the inputs and their gradients (Megatron's fp32 main_grad where the path writes",
              "it), in multiples of the bf16 logits.", "",
              "| N x h x V | implementation | ms | / 3-GEMM floor | peak extra (x logits) |", "|---|---|---|---|---|"]
    for shape in args.shapes:
        n, hdim, v = (int(x) for x in shape.split("x"))
        floor = 3 * gemm_ms(n, hdim, v, args.warmup, args.iters)
        logits_bytes = n * v * 2
        lines.append(f"| {shape} | 3 GEMMs (cuBLAS) | {floor:.3f} | 1.00 | |")
        for name, fn in impls.items():
            hidden, weight, target = inputs(n, hdim, v)
            h, w = hidden.requires_grad_(), weight.requires_grad_()

            def step():
                h.grad = w.grad = None
                fn(h, w, target).backward()

            try:
                step()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()  # inputs and their gradients
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                extra = (torch.cuda.max_memory_allocated() - base) / logits_bytes
                ms = timed(step, args.warmup, args.iters)
                lines.append(f"| {shape} | {name} | {ms:.3f} | {ms / floor:.2f} | {extra:.2f} |")
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run a shape is reported
                lines.append(f"| {shape} | {name} | failed: {type(exc).__name__}: {str(exc)[:80]} | | |")
            print(lines[-1], flush=True)
            del h, w, hidden, weight, target
            torch.cuda.empty_cache()
    if args.profile:
        for shape in args.shapes:
            lines += profile_breakdown(impls, shape)
    return lines


def profile_breakdown(impls, shape, steps=3):
    """Device time per fwd+bwd (sum of kernel durations, torch profiler / CUPTI) of each
    implementation at ``shape``, split into GEMMs and the rest."""
    from torch.profiler import ProfilerActivity, profile

    n, hdim, v = (int(x) for x in shape.split("x"))
    lines = ["", f"Device time per fwd+bwd at {shape} (torch profiler, sum of kernel durations, {steps} steps)", "",
             "| implementation | device ms | GEMM ms | other ms | kernels |", "|---|---|---|---|---|"]
    for name, fn in impls.items():
        hidden, weight, target = inputs(n, hdim, v)
        h, w = hidden.requires_grad_(), weight.requires_grad_()
        try:
            fn(h, w, target).backward()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    h.grad = w.grad = None
                    fn(h, w, target).backward()
                torch.cuda.synchronize()
            gemm = other = count = 0.0
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
                    count += 1
                    is_gemm = any(k in e.name.lower() for k in ("gemm", "sm90", "cutlass", "xmma", "nvjet"))
                    gemm, other = (gemm + e.device_time, other) if is_gemm else (gemm, other + e.device_time)
            lines.append(f"| {name} | {(gemm + other) / 1e3 / steps:.3f} | {gemm / 1e3 / steps:.3f} | "
                         f"{other / 1e3 / steps:.3f} | {count / steps:.0f} |")
        except Exception as exc:  # noqa: BLE001
            lines.append(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:80]} | | | |")
        print(lines[-1], flush=True)
        del h, w, hidden, weight, target
        torch.cuda.empty_cache()
    return lines


def time_and_peak(step, logits_bytes, args):
    """(median ms, peak memory beyond what one step leaves allocated, in multiples of the logits)."""
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    extra = (torch.cuda.max_memory_allocated() - base) / logits_bytes
    return timed(step, args.warmup, args.iters), extra


def sweep_chunks(args):
    """This package's fused op alone at each ``--chunk-cols`` (vocab rows per chunk)."""
    from mindspeed_cez import linear_cross_entropy_zloss
    from mindspeed_cez.kernels import chunked_linear

    lines = [f"chunk sweep, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "", "| N x h x V | chunk cols | ms | / 3-GEMM floor | peak extra (x logits) |", "|---|---|---|---|---|"]
    default = chunked_linear.default_chunk_cols
    for shape in args.shapes:
        n, hdim, v = (int(x) for x in shape.split("x"))
        floor = 3 * gemm_ms(n, hdim, v, args.warmup, args.iters)
        hidden, weight, target = inputs(n, hdim, v)
        h, w = hidden.requires_grad_(), weight.requires_grad_()

        def step(cols):
            h.grad = w.grad = None
            linear_cross_entropy_zloss(h, w, target, Z, chunk_cols=cols)[0].sum().backward()

        for cols in args.chunk_cols + [0]:
            ms, extra = time_and_peak(lambda: step(cols or None), n * v * 2, args)
            label = f"default ({default(n, v)})" if cols == 0 else str(cols)
            lines.append(f"| {shape} | {label} | {ms:.3f} | {ms / floor:.2f} | {extra:.2f} |")
            print(lines[-1], flush=True)
        del h, w, hidden, weight, target
        torch.cuda.empty_cache()
    return lines


def sweep_row_blocks(args):
    """The gradients-in-forward path alone at each ``--row-blocks`` (token rows per block)."""
    from mindspeed_cez import linear_cross_entropy_zloss
    from mindspeed_cez.linear_cross_entropy import default_row_block as default

    lines = [f"row-block sweep (grads in forward), {torch.cuda.get_device_name()}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| N x h x V | rows per block | ms | / 3-GEMM floor | / unfused | peak extra (x logits) |",
             "|---|---|---|---|---|---|"]
    for shape in args.shapes:
        n, hdim, v = (int(x) for x in shape.split("x"))
        floor = 3 * gemm_ms(n, hdim, v, args.warmup, args.iters)
        hidden, weight, target = inputs(n, hdim, v)
        mask = (target != -100).float()
        h, w = hidden.requires_grad_(), weight.requires_grad_()
        h.grad = w.grad = None
        from mindspeed_cez import vocab_parallel_cross_entropy_zloss
        unfused = timed(lambda: vocab_parallel_cross_entropy_zloss(h @ w.t(), target, Z)[0].sum().backward(),
                        args.warmup, args.iters)

        def step(rows):
            h.grad = w.grad = None
            linear_cross_entropy_zloss(h, w, target, Z, token_weights=mask, grads="forward",
                                       row_block=rows)[0].sum().backward()

        for rows in args.row_blocks + [0]:
            ms, extra = time_and_peak(lambda: step(rows or None), n * v * 2, args)
            label = f"default ({default(n, v)})" if rows == 0 else str(rows)
            lines.append(f"| {shape} | {label} | {ms:.3f} | {ms / floor:.2f} | {ms / unfused:.2f} | {extra:.2f} |")
            print(lines[-1], flush=True)
        del h, w, hidden, weight, target
        torch.cuda.empty_cache()
    return lines


FRACTIONS = [0.125, 0.25, 0.5, 1.0]  # the dial: the lean setting ... one block of every token


def sweep_accumulations(args):
    """Per shape: the unfused op, Liger, the default path into main_grad (block fraction 0.5) with
    each fp32 accumulation forced (``addmm_out_dtype``: torch >= 2.8; ``triton``: what torch < 2.8
    runs; ``gemm_add``: 16-bit GEMM + fp32 add), then the dial's curve (time and peak per block
    fraction) on the accumulation this torch chooses; a float64 check of each accumulation first."""
    from mindspeed_cez import fp32_accumulation as acc
    from mindspeed_cez import linear_cross_entropy_zloss, vocab_parallel_cross_entropy_zloss
    from mindspeed_cez.linear_cross_entropy import default_row_block

    kinds = [k for k in ("addmm_out_dtype", "triton", "gemm_add") if k != "addmm_out_dtype" or acc.ADDMM_OUT_DTYPE]
    chosen = acc.kind_for(torch.device("cuda"))
    lines = [f"fp32 accumulation and the block dial, fwd+bwd into an fp32 main_grad, bf16, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; median of {args.iters} "
             f"(CUDA events); this torch chooses {chosen}", ""]
    hs, ws, ts = inputs(512, 512, 8192, seed=1)
    _, _, exp_dw = linear_loss_and_grads_float64(hs, ws, ts, torch.ones(len(ts), device=ts.device), z_loss_coeff=Z)
    lines += ["| accumulation | dweight rel. error (512 x 512 x 8192, vs float64) |", "|---|---|"]
    for kind in kinds:
        w = ws.clone().requires_grad_()
        with acc.forced(kind):
            into_main_grad()(hs.clone().requires_grad_(), w, ts).backward()
        lines.append(f"| {kind} | {relative_error(w.main_grad, exp_dw):.2e} |")
    lines += ["", "Peak extra: beyond the inputs, their gradients and main_grad, in multiples of the bf16 logits.", "",
              "| N x h x V | implementation | rows per block | ms | / unfused | / out_dtype | peak extra (x logits) |",
              "|---|---|---|---|---|---|---|"]
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        liger_fused_linear_cross_entropy = None
    for shape in args.shapes:
        n, hdim, v = (int(x) for x in shape.split("x"))
        hidden, weight, target = inputs(n, hdim, v)
        mask = (target != -100).float()
        h, w = hidden.requires_grad_(), weight.requires_grad_()
        logits_bytes = n * v * 2

        def plain(fn):
            def step():
                h.grad = w.grad = None
                fn().backward()
            return step

        rows = []
        unfused = time_and_peak(plain(lambda: vocab_parallel_cross_entropy_zloss(h @ w.t(), target, Z)[0].sum()),
                                logits_bytes, args)
        rows.append(("unfused: cuBLAS + cez op", "", unfused))
        if liger_fused_linear_cross_entropy is not None:
            rows.append(("liger fused linear CE 0.8.5", "", time_and_peak(plain(
                lambda: liger_fused_linear_cross_entropy(h, w, target, lse_square_scale=Z, reduction="sum")),
                logits_bytes, args)))
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)

        def fused(fraction, kind=None):
            def step():
                h.grad = w.grad = None
                with acc.forced(kind) if kind else contextlib.nullcontext():
                    linear_cross_entropy_zloss(h, w, target, Z, token_weights=mask, grad_scale=1.0,
                                               gradient_accumulation_fusion=True, grads="forward",
                                               block_fraction=fraction)[0].sum().backward()
            return step

        out_dtype = None
        for kind in kinds:
            result = time_and_peak(fused(None, kind), logits_bytes, args)
            out_dtype = result[0] if kind == "addmm_out_dtype" else out_dtype
            rows.append((f"default path (fraction 0.5), {kind}", default_row_block(n, v), result))
        for fraction in FRACTIONS:
            rows.append((f"dial: fraction {fraction}, {chosen}", default_row_block(n, v, fraction),
                         time_and_peak(fused(fraction), logits_bytes, args)))
        for name, block, (ms, extra) in rows:
            ratio = f"{ms / out_dtype:.3f}" if out_dtype else ""
            lines.append(f"| {shape} | {name} | {block} | {ms:.2f} | {ms / unfused[0]:.3f} | {ratio} | {extra:.2f} |")
            print(lines[-1], flush=True)
        del h, w, hidden, weight, target
        torch.cuda.empty_cache()
    return lines


TUNE_ACCUMULATE = [  # block_m, block_n, block_k, group_m, warps, stages, programs per SM, main_grad tile read first
    (128, 256, 64, 8, 8, 3, 1, False), (128, 256, 32, 8, 8, 5, 1, False), (128, 128, 64, 8, 8, 4, 1, False),
    (128, 128, 64, 8, 8, 4, 1, True), (128, 128, 64, 8, 8, 3, 1, True), (128, 128, 32, 8, 8, 5, 1, True),
    (128, 128, 64, 16, 8, 4, 1, True), (128, 256, 64, 8, 8, 3, 1, True), (128, 128, 64, 8, 4, 3, 2, True),
    (64, 256, 64, 8, 8, 4, 1, True)]
TUNE_SHAPES = ["151936x4096x4096", "151936x4096x1024", "16160x7168x4096", "37984x4096x4096"]  # V x h x rows


def tune_accumulate(args):
    """``main_grad [V, h] += dlogits.T @ x`` (``dlogits [rows, V]``) alone: the Triton kernel over tile
    settings beside torch's ``addmm(out_dtype)`` and its bf16 GEMM alone (no read of main_grad)."""
    from mindspeed_cez import fp32_accumulation as acc
    from mindspeed_cez.kernels import triton_matmul_accumulate as tma

    lines = [f"Triton fp32 accumulation kernel, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; median of {args.iters} (CUDA events)", "",
             "| V x h x rows | setting (bm, bn, bk, group_m, warps, stages, per SM, preload main_grad) | ms | / addmm(out_dtype) | TFLOP/s |",
             "|---|---|---|---|---|"]
    for shape in args.tune_shapes:
        v, hdim, n = (int(x) for x in shape.split("x"))
        dlogits = torch.randn(n, v, device="cuda").bfloat16()
        x = torch.randn(n, hdim, device="cuda").bfloat16()
        out = torch.zeros(v, hdim, device="cuda")
        flops = 2 * v * hdim * n
        ref = None
        if acc.ADDMM_OUT_DTYPE:
            ref = timed(lambda: torch.addmm(out, dlogits.t(), x, out_dtype=torch.float32, out=out), args.warmup, args.iters)
            lines.append(f"| {shape} | addmm(out_dtype) | {ref:.3f} | 1.000 | {flops / ref / 1e9:.0f} |")
        bf16 = timed(lambda: dlogits.t() @ x, args.warmup, args.iters)
        lines.append(f"| {shape} | bf16 GEMM alone (cuBLAS) | {bf16:.3f} | {bf16 / ref if ref else 0:.3f} | "
                     f"{flops / bf16 / 1e9:.0f} |")
        print(lines[-2] if ref else "", lines[-1], flush=True)
        saved = dict(tma.LAUNCH_CONFIG["cuda"])
        for bm, bn, bk, gm, warps, stages, per_core, preload in TUNE_ACCUMULATE:
            tma.LAUNCH_CONFIG["cuda"].update(block_m=bm, block_n=bn, block_k=bk, group_m=gm, warps=warps, stages=stages,
                                             per_core=per_core, preload_c=preload)
            tma.launch_plans_changed()
            try:
                ms = timed(lambda: tma.matmul_accumulate(out, dlogits.t(), x), args.warmup, args.iters)
                lines.append(f"| {shape} | {bm}, {bn}, {bk}, {gm}, {warps}, {stages}, {per_core}, {preload} | {ms:.3f} | "
                             f"{ms / ref if ref else 0:.3f} | {flops / ms / 1e9:.0f} |")
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile is reported
                lines.append(f"| {shape} | {bm}, {bn}, {bk}, {gm}, {warps}, {stages}, {per_core}, {preload} | failed: "
                             f"{type(exc).__name__} | | |")
            print(lines[-1], flush=True)
        tma.LAUNCH_CONFIG["cuda"].clear()
        tma.LAUNCH_CONFIG["cuda"].update(saved)
        tma.launch_plans_changed()
        del dlogits, x, out
        torch.cuda.empty_cache()
    return lines


def sweep_tp(args):
    """TP=2 over NCCL with sequence parallelism (``torchrun --nproc-per-node 2``): per global shape,
    the unfused layer (all-gathered hidden, cuBLAS logits of this rank's vocab slice, the op; the
    all-gather's backward reduce-scatters dhidden) beside the default path into main_grad at each block
    fraction; rank 0's time and peak; first a float64 check of the default path at a small shape."""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_gather

    from mindspeed_cez import linear_cross_entropy_zloss, vocab_parallel_cross_entropy_zloss
    from mindspeed_cez.linear_cross_entropy import default_row_block

    dist.init_process_group("nccl")
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    group = dist.group.WORLD
    lines = [f"TP={tp} + SP over NCCL, fwd+bwd into an fp32 main_grad, bf16, {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; rank 0, median of {args.iters} "
             "(CUDA events); N x h x V global (each rank: N/2 tokens of hidden, V/2 vocab rows)", ""]

    def problem(n, hdim, v, seed=0):
        hidden, weight, target = inputs(n, hdim, v, seed)  # the same on every rank
        rows, cols = slice(rank * n // tp, (rank + 1) * n // tp), slice(rank * v // tp, (rank + 1) * v // tp)
        return hidden, weight, target, rows, cols

    hidden, weight, target, rows, cols = problem(1024, 512, 8192, seed=1)
    _, exp_dh, exp_dw = linear_loss_and_grads_float64(hidden, weight, target, torch.ones(1024, device="cuda"),
                                                      z_loss_coeff=Z)
    h, w = hidden[rows].clone().requires_grad_(), weight[cols].clone().requires_grad_()
    w.main_grad = torch.zeros(w.shape, device="cuda")
    linear_cross_entropy_zloss(h, w, target, Z, tp_group=group, sequence_parallel=True,
                               token_weights=(target != -100).float(), grad_scale=1.0,
                               gradient_accumulation_fusion=True, grads="forward")[0].sum().backward()
    lines += [f"float64 check at 1024 x 512 x 8192, rank {rank}: dhidden rel. error "
              f"{relative_error(h.grad, exp_dh[rows]):.2e}, dweight (main_grad) {relative_error(w.main_grad, exp_dw[cols]):.2e}",
              "", "| N x h x V | implementation | rows per block | ms | / unfused | peak extra (x this rank's logits) |",
              "|---|---|---|---|---|---|"]
    for shape in args.shapes:
        n, hdim, v = (int(x) for x in shape.split("x"))
        hidden, weight, target, rows, cols = problem(n, hdim, v)
        h, w = hidden[rows].clone().requires_grad_(), weight[cols].clone().requires_grad_()
        mask = (target != -100).float()
        del hidden, weight
        logits_bytes = n * (v // tp) * 2

        def unfused():
            h.grad = w.grad = None
            full = torch.cat(all_gather(h, group=group))
            vocab_parallel_cross_entropy_zloss(full @ w.t(), target, Z, tp_group=group)[0].sum().backward()

        base = time_and_peak(unfused, logits_bytes, args)
        results = [("unfused: all-gather + cuBLAS + cez op", "", base)]
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda")
        for fraction in FRACTIONS:
            def fused():
                h.grad = w.grad = None
                linear_cross_entropy_zloss(h, w, target, Z, tp_group=group, sequence_parallel=True, token_weights=mask,
                                           grad_scale=1.0, gradient_accumulation_fusion=True, grads="forward",
                                           block_fraction=fraction)[0].sum().backward()
            label = "default path, fraction 0.5" if fraction == 0.5 else f"dial: fraction {fraction}"
            results.append((label, default_row_block(n, v // tp, fraction), time_and_peak(fused, logits_bytes, args)))
        for name, block, (ms, extra) in results:
            lines.append(f"| {shape} | {name} | {block} | {ms:.2f} | {ms / base[0]:.3f} | {extra:.2f} |")
            if rank == 0:
                print(lines[-1], flush=True)
        del h, w
        torch.cuda.empty_cache()
    dist.barrier()
    return lines if rank == 0 else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--chunk-cols", nargs="+", type=int, default=None,
                        help="sweep this package's op over vocab chunk widths instead")
    parser.add_argument("--row-blocks", nargs="+", type=int, default=None,
                        help="sweep the gradients-in-forward path over token rows per block instead")
    parser.add_argument("--main-grad-rows", nargs="*", type=int, default=[],
                        help="also the gradients-in-forward path into main_grad at these token rows per block")
    parser.add_argument("--profile", action="store_true", help="also the device time (profiler) at every shape")
    parser.add_argument("--accumulations", action="store_true",
                        help="the default path with each fp32 accumulation forced, and the block dial's curve")
    parser.add_argument("--tune-accumulate", action="store_true", help="the Triton accumulation kernel's tile sweep")
    parser.add_argument("--tp", action="store_true", help="TP=2 + SP over NCCL (torchrun --nproc-per-node 2): the dial")
    parser.add_argument("--tune-shapes", nargs="+", default=TUNE_SHAPES, help="V x h x rows for --tune-accumulate")
    parser.add_argument("--impls", nargs="*", default=[], help="only the implementations whose names hold one of these")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tp:
        report = sweep_tp(args)
        if report is None:
            return
    elif args.tune_accumulate:
        report = tune_accumulate(args)
    elif args.accumulations:
        report = sweep_accumulations(args)
    else:
        report = sweep_chunks(args) if args.chunk_cols else sweep_row_blocks(args) if args.row_blocks else run(args)
    print(write_report(args.out, report))


if __name__ == "__main__":
    main()
