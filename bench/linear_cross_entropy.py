"""The fused output layer (``linear_cross_entropy_zloss``) beside cuBLAS + the op and the peers' fused
linear CE: forward+backward time over the 3-GEMM floor (CUDA events), peak memory (error against
float64: tests/); ``--accumulations``, ``--tune-accumulate``, ``--tp``, ``--profile``: bench/README.md.
Per ``N x h x V``: bf16 hidden [N, h], weight [V, h], 10 % ignored targets, loss = sum, c = 1e-4."""

import argparse
import functools
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import GEMM_KERNELS, kernel_ms, kernel_table, run_stamp, short, step_timeline, time_and_peak, timed, write_report  # noqa: E402

Z = 1e-4
# issue 31's table; the last: a DeepSeek-V3-like vocab slice (V/8)
SHAPES = ["8192x4096x151936", "8192x4096x37984", "32768x4096x151936", "16384x4096x75968", "8192x7168x16160"]
FRACTIONS = [0.125, 0.25, 0.5, 1.0]  # the dial: the lean setting ... one block of every token


def dims(shape):
    return tuple(int(x) for x in shape.split("x"))


def fused_loss(h, w, t, tp_group=None, sequence_parallel=False, path=None, trainer=None, **options):
    """The fused layer's summed loss; ``path``: a GradientPath (None: its default), ``options``: the
    rest of its :class:`LinearCrossEntropyOptions`, ``trainer``: its :class:`TrainerInputs`."""
    from mindspeed_cez import GradientPath, LinearCrossEntropyOptions, linear_cross_entropy_zloss

    options = LinearCrossEntropyOptions(path=path or GradientPath(), **options)
    return linear_cross_entropy_zloss(h, w, t, Z, tp_group=tp_group, sequence_parallel=sequence_parallel,
                                      options=options, trainer=trainer)[0].sum()


def with_main_grad(w):
    """``w`` with an fp32 ``main_grad`` (made once, counted with the inputs' gradients, as Megatron's grad buffer)."""
    if not hasattr(w, "main_grad"):
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    return w


def into_main_grad(h, w, t, tp_group=None, sequence_parallel=False, token_weights=None, block_fraction=None,
                   row_block=None, accumulation=None):
    """The gradients-in-forward path as Megatron runs it: the upstream gradient known in forward
    (``grad_scale``; here 1 per counted token, the benchmark's ``sum``), ``dweight`` added into an fp32
    ``weight.main_grad`` (made once, counted with the inputs' gradients, as Megatron's grad buffer);
    ``accumulation``: the fp32 accumulation's kind (None: this torch's choice)."""
    from mindspeed_cez import ForwardGradientLedger, GradientPath, TrainerInputs
    from mindspeed_cez.patches.loss_wrappers import main_grad_target

    with_main_grad(w)
    trainer = TrainerInputs(token_weights=(t != -100).float() if token_weights is None else token_weights,
                            grad_scale=1.0, weight_grad=main_grad_target(w), ledger=ForwardGradientLedger())
    return fused_loss(h, w, t, tp_group, sequence_parallel, GradientPath("forward", block_fraction, row_block=row_block),
                      trainer, accumulation=accumulation)


def unfused(h, w, t, tp_group=None):
    from mindspeed_cez import vocab_parallel_cross_entropy_zloss

    return vocab_parallel_cross_entropy_zloss(h @ w.t(), t, Z, tp_group=tp_group)[0].sum()


class _LinearIntoMainGrad(torch.autograd.Function):
    """Megatron's linear layer with gradient-accumulation fusion: ``x @ w.T`` forward; backward ``dx = g @ w``
    and ``g.T @ x`` added into the fp32 ``w.main_grad`` (one GEMM with an fp32 output, as apex / TE do)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        from mindspeed_cez.linear_forward_grads import Accumulator

        x, w = ctx.saved_tensors
        Accumulator(g.device)(w.main_grad, g.t(), x)
        return g @ w, None


class _SequenceParallelLinearIntoMainGrad(torch.autograd.Function):
    """Megatron's ``ColumnParallelLinear`` with sequence parallelism and gradient-accumulation fusion:
    forward all-gathers this rank's hidden rows and makes this rank's logits; backward makes the whole
    ``dx = g @ w``, starts its reduce-scatter, adds ``g.T @ x`` into the fp32 ``w.main_grad`` meanwhile
    (as Megatron overlaps them), then waits."""

    @staticmethod
    def forward(ctx, x_local, w, group):
        import torch.distributed as dist

        tp = dist.get_world_size(group)
        x = x_local.new_empty((x_local.shape[0] * tp, *x_local.shape[1:]))
        dist.all_gather_into_tensor(x, x_local.contiguous(), group=group)
        ctx.save_for_backward(x, w)
        ctx.group, ctx.tp = group, tp
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist

        from mindspeed_cez.linear_forward_grads import Accumulator

        x, w = ctx.saved_tensors
        dx = g @ w
        dx_local = dx.new_empty((dx.shape[0] // ctx.tp, *dx.shape[1:]))
        work = dist.reduce_scatter_tensor(dx_local, dx, group=ctx.group, async_op=True)
        Accumulator(g.device)(w.main_grad, g.t(), x)
        work.wait()
        return dx_local, None, None


def unfused_into_main_grad(h, w, t):
    from mindspeed_cez import vocab_parallel_cross_entropy_zloss

    return vocab_parallel_cross_entropy_zloss(_LinearIntoMainGrad.apply(h, with_main_grad(w)), t, Z)[0].sum()


def liger():
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as exc:
        print(f"liger-kernel not installed ({exc})")
        return {}
    return {"liger fused linear CE": lambda h, w, t: liger_fused_linear_cross_entropy(
        h, w, t, lse_square_scale=Z, reduction="sum")}


def implementations(args):
    """name -> loss(h, w, t). ``--accumulations``: the unfused op, Liger, the default path into main_grad
    with each fp32 accumulation forced (``addmm_out_dtype``: torch >= 2.8; ``triton``: what torch < 2.8
    runs; ``gemm_add``: 16-bit GEMM + fp32 add), and the block dial on the accumulation this torch chooses."""
    from mindspeed_cez import TrainerInputs

    impls = {"unfused: cuBLAS + cez op": unfused,
             "unfused, weight gradient into fp32 main_grad (Megatron's accumulation fusion)": unfused_into_main_grad}
    if args.accumulations:
        from mindspeed_cez import linear_forward_grads as acc

        for kind in ("addmm_out_dtype", "triton", "gemm_add")[0 if acc.ADDMM_OUT_DTYPE else 1:]:
            impls[f"default path (blocks of at most 4 GiB of logits), {kind}"] = functools.partial(
                into_main_grad, accumulation=kind)
        for fraction in FRACTIONS:
            impls[f"dial: fraction {fraction}, {acc.kind_for(torch.device('cuda'))}"] = functools.partial(
                into_main_grad, block_fraction=fraction)
        return {**impls, **liger()}
    impls.update({
        "cez fused, Triton tl.dot": lambda h, w, t: fused_loss(h, w, t, linear_backend="triton"),
        "cez fused, cuBLAS chunks": lambda h, w, t: fused_loss(h, w, t, linear_backend="gemm"),
        # the loss mask as token weights (upstream gradient mask / const, as in Megatron)
        "cez fused, grads in forward": lambda h, w, t: fused_loss(
            h, w, t, trainer=TrainerInputs(token_weights=(t != -100).float())),
        "cez fused, grads in forward into main_grad (default rows)": into_main_grad})
    for rows in args.main_grad_rows:
        impls[f"cez fused, grads in forward into main_grad, {rows} rows"] = functools.partial(into_main_grad,
                                                                                              row_block=rows)
    impls.update(liger())
    try:
        from cut_cross_entropy import linear_cross_entropy

        impls["CCE default (no z)"] = lambda h, w, t: linear_cross_entropy(h, w, t, reduction="sum")
    except ImportError as exc:
        print(f"cut-cross-entropy not installed ({exc})")
    return impls


def inputs(n, h, v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * (4.0 / h**0.5)).bfloat16()
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    target[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
    return hidden, weight, target


def stepper(fn, h, w, t):
    """One forward+backward of ``fn``."""

    def step():
        h.grad = w.grad = None
        fn(h, w, t).backward()
    return step


def gemm_floor_ms(n, h, v, args):
    a, b = torch.randn(n, h, device="cuda").bfloat16(), torch.randn(h, v, device="cuda").bfloat16()
    return 3 * timed(lambda: a @ b, args.warmup, args.iters)


def run(args):
    impls = implementations(args)
    if args.impls:
        impls = {name: fn for name, fn in impls.items() if any(part in name for part in args.impls)}
    lines = [f"Output projection + CE (+ z-loss), fwd+bwd, bf16; median of {args.iters} (CUDA events). Peak extra: "
             "beyond the inputs and their gradients (Megatron's fp32 main_grad where the path writes it), in multiples "
             "of the bf16 logits.", "", "| N x h x V | implementation | ms | / 3-GEMM floor | / unfused "
             "| peak extra (x logits) |", "|---|---|---|---|---|---|"]
    for shape in args.shapes:
        n, hdim, v = dims(shape)
        floor, unfused_ms = gemm_floor_ms(n, hdim, v, args), None
        lines.append(f"| {shape} | 3 GEMMs (cuBLAS) | {floor:.3f} | 1.00 | | |")
        for name, fn in impls.items():
            hidden, weight, target = inputs(n, hdim, v)
            try:  # a peer that cannot run a shape is reported
                ms, extra = time_and_peak(stepper(fn, hidden.requires_grad_(), weight.requires_grad_(), target),
                                          args.warmup, args.iters)
                unfused_ms = ms if name.startswith("unfused:") else unfused_ms
                lines.append(f"| {shape} | {name} | {ms:.3f} | {ms / floor:.2f} | "
                             f"{f'{ms / unfused_ms:.3f}' if unfused_ms else '-'} | {extra / (n * v * 2):.2f} |")
            except Exception as exc:  # noqa: BLE001
                lines.append(f"| {shape} | {name} | failed: {type(exc).__name__}: {str(exc)[:80]} | | | |")
            print(lines[-1], flush=True)
            del hidden, weight, target
            torch.cuda.empty_cache()
    for shape in args.shapes if args.profile else ():
        lines += ["", f"Device time per fwd+bwd at {shape} (torch profiler, sum of kernel durations, 3 steps)", "",
                  "| implementation | device ms | GEMM ms | other ms | kernels |", "|---|---|---|---|---|"]
        for name, fn in impls.items():
            hidden, weight, target = inputs(*dims(shape))
            try:
                gemm, other, count = kernel_ms(stepper(fn, hidden.requires_grad_(), weight.requires_grad_(), target))
                lines.append(f"| {name} | {gemm + other:.3f} | {gemm:.3f} | {other:.3f} | {count:.0f} |")
            except Exception as exc:  # noqa: BLE001
                lines.append(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:80]} | | | |")
            print(lines[-1], flush=True)
            del hidden, weight, target
            torch.cuda.empty_cache()
    return lines


OVERHEAD_IMPLS = ("unfused: cuBLAS + cez op", "unfused, weight gradient into fp32 main_grad (Megatron's accumulation fusion)",
                  "cez fused, grads in forward into main_grad (default rows)",
                  "liger fused linear CE", "CCE default (no z)")


def overhead(args):
    """Each call's time outside its kernels: CUDA events (synchronized, host included) beside the kernel sum
    and the host's lead and the GPU's idle gaps (profiler timeline, which slows the host: indicative). The
    bar: the fused layer's events <= 1.05 x (its kernels + the unfused layer's events - its kernels)."""
    impls = {name: fn for name, fn in implementations(args).items() if name in OVERHEAD_IMPLS}
    lines = [f"Time outside the kernels, fwd+bwd, bf16; events: median of {args.iters}, synchronized per call; "
             "kernels / lead / gaps / host: torch profiler (CPU + CUDA), median of 5 steps", "",
             "| N x h x V | implementation | events ms | kernels ms | outside ms | lead ms | gaps ms | host ms "
             "| kernels | / unfused | / unfused into main_grad | bar (1.05 x (kernels + unfused outside)) |", "|" + "---|" * 12]
    tables = []
    for shape in args.shapes:
        n, hdim, v = dims(shape)
        unfused_row = megatron_ms = None
        for name, fn in impls.items():
            hidden, weight, target = inputs(n, hdim, v)
            step = stepper(fn, hidden.requires_grad_(), weight.requires_grad_(), target)
            try:
                ms = timed(step, args.warmup, args.iters)
                timeline, table = step_timeline(step)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run a shape is reported
                lines.append(f"| {shape} | {name} | failed: {type(exc).__name__}: {str(exc)[:80]} |" + " |" * 9)
                print(lines[-1], flush=True)
                continue
            outside = ms - timeline["kernels"]
            if name.startswith("unfused:"):
                unfused_row = (ms, outside)
            elif name.startswith("unfused,"):
                megatron_ms = ms
            bar = 1.05 * (timeline["kernels"] + unfused_row[1]) if unfused_row else None
            verdict = f"{bar:.3f} {'ok' if ms <= bar else 'MISSED'}" if bar and not name.startswith("unfused") else ""
            lines.append(f"| {shape} | {name} | {ms:.3f} | {timeline['kernels']:.3f} | {outside:.3f} | "
                         f"{timeline['lead']:.3f} | {timeline['gaps']:.3f} | {timeline['host']:.3f} | "
                         f"{timeline['count']:.0f} | {ms / unfused_row[0]:.3f} | "
                         f"{ms / megatron_ms if megatron_ms else float('nan'):.3f} | {verdict} |")
            print(lines[-1], flush=True)
            if shape == args.shapes[-1] or name.startswith("cez"):
                tables += ["", f"Host self time, {name} at {shape} (5 steps, profiler)", "", "```", table, "```"]
            del hidden, weight, target, step
            torch.cuda.empty_cache()
    return lines + tables


def liger_cute():
    """Liger 0.8.5's Hopper CuTe fused linear scaled CE (no z-loss), where its CuTe DSL imports: (loss fn,
    None) or (None, why not)."""
    try:
        from liger_kernel.ops import fused_linear_scaled_cross_entropy as scaled

        scaled._load_sm90_function()  # imports nvidia-cutlass-dsl's cutlass.cute
    except Exception as exc:  # noqa: BLE001 - not installed, or its DSL packages not on the path
        return None, f"not run: liger_kernel.ops.fused_linear_scaled_cross_entropy's sm90 path does not import ({short(exc, 120)})"
    return (lambda h, w, t: scaled.LigerFusedLinearScaledCrossEntropyFunction.apply(h, w, t).sum()), None


def peer_impls():
    """The final table's rows: name -> (loss(h, w, t), with z-loss) or (None, why not run)."""
    impls = {"3 GEMMs (cuBLAS)": (None, None),
             "unfused into fp32 main_grad (Megatron)": (unfused_into_main_grad, True),
             "unfused: cuBLAS + cez op (16-bit dweight)": (unfused, True),
             "fused layer, default, into main_grad": (into_main_grad, True)}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        impls["Liger 0.8.5 FLCE, Triton (z-loss)"] = (lambda h, w, t: liger_fused_linear_cross_entropy(
            h, w, t, lse_square_scale=Z, reduction="sum"), True)
    except ImportError as exc:
        impls["Liger 0.8.5 FLCE, Triton (z-loss)"] = (None, f"not run: {short(exc, 100)}")
    fn, why = liger_cute()
    impls["Liger 0.8.5 CuTe fused linear scaled CE, sm90 (no z)"] = (fn, False) if fn else (None, why)
    try:
        from cut_cross_entropy import linear_cross_entropy

        impls["cut-cross-entropy 25.1.1 (no z)"] = (lambda h, w, t: linear_cross_entropy(h, w, t, reduction="sum"),
                                                    False)
    except ImportError as exc:
        impls["cut-cross-entropy 25.1.1 (no z)"] = (None, f"not run: {short(exc, 100)}")
    return impls


def reference_loss(hidden, weight, target, z_loss, rows=4096):
    """The summed loss in fp32 (CE + Z lse^2 with ``z_loss``), 4096 rows at a time."""
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    w = weight.float()
    for r in range(0, hidden.shape[0], rows):
        logits, t = hidden[r:r + rows].float() @ w.t(), target[r:r + rows]
        lse = torch.logsumexp(logits, dim=-1)
        keep = t != -100
        picked = logits.gather(1, t.clamp_min(0)[:, None])[:, 0]
        total += ((lse - picked + (Z * lse * lse if z_loss else 0)) * keep).double().sum()
    return total.item()


def interleaved_ms(steps, rounds, warmup=2):
    """Per name, the median over ``rounds`` of one call's CUDA-event time (synchronized, host included),
    the calls of every step taken in turn within a round (the first one rotating), so drifts of the
    GPU's clock land on every one alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    names, times = list(steps), {name: [] for name in steps}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            steps[name]()
            b.record()
            torch.cuda.synchronize()
            times[name].append(a.elapsed_time(b))
    return {name: statistics.median(t) for name, t in times.items()}


def interleaved_device_ms(steps, rounds=3):
    """Per name, the median over ``rounds`` of one call's device time (torch profiler kernel sum), taken
    in turn as :func:`interleaved_ms` does."""
    names, times = list(steps), {name: [] for name in steps}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            gemm, other, _ = kernel_ms(steps[name], steps=1)
            times[name].append(gemm + other)
    return {name: statistics.median(t) for name, t in times.items()}


def peers(args):
    """The fused layer beside the unfused layer into fp32 main_grad (the reference) and the peers, one
    run, one set of inputs: events (median of ``--iters`` rounds, every implementation once per round in
    turn, synchronized per call) and device time (torch profiler kernel sums, 3 rounds), peak memory
    beyond inputs and gradients, and each one's summed loss against fp32 once."""
    impls = peer_impls()
    ref_name = "unfused into fp32 main_grad (Megatron)"
    lines = [f"Output layer + CE (+ z-loss, c = {Z}), fwd+bwd, bf16, 10 % ignored targets, loss = sum, one set of "
             f"inputs per shape; events: median of {args.iters} rounds, the implementations in turn each round "
             "(synchronized per call, host included); device: torch profiler kernel sums, median of 3 rounds; peak: "
             "beyond the inputs and their gradients (main_grad where written), x the bf16 logits; loss: "
             "|sum - fp32| / fp32 (with the z-term where the row has it). Peers return a 16-bit weight gradient "
             "(no main_grad).", "",
             "| N x h x V | implementation | events ms | / unfused into main_grad | device ms | / unfused into main_grad "
             "| peak extra (x logits) | loss vs fp32 |", "|---|---|---|---|---|---|---|---|"]
    for shape in args.shapes:
        n, hdim, v = dims(shape)
        hidden, weight, target = inputs(n, hdim, v)
        h, w = hidden.requires_grad_(), weight.requires_grad_()
        with_main_grad(w)
        refs, steps, peaks, errors, failed = {}, {}, {}, {}, {}
        for name, (fn, z_loss) in impls.items():
            if fn is None:
                continue
            try:
                loss = fn(h, w, target)
                loss.backward()  # the fused layer's forward owes its backward
                value = loss.item()
                del loss
                if z_loss not in refs:
                    refs[z_loss] = reference_loss(h.detach(), w.detach(), target, z_loss)
                errors[name] = abs(value - refs[z_loss]) / abs(refs[z_loss])
                steps[name] = stepper(fn, h, w, target)
                _, peaks[name] = time_and_peak(steps[name], 0, 1)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run a shape is reported
                failed[name] = f"failed: {short(exc, 100)}"
                steps.pop(name, None)
            torch.cuda.empty_cache()
        floor = gemm_floor_ms(n, hdim, v, args)
        events = interleaved_ms(steps, args.iters)
        device = interleaved_device_ms(steps)
        base = (events.get(ref_name), device.get(ref_name))

        def ratio(a, b):
            return f"{a / b:.3f}" if b else "-"

        for name, (fn, why) in impls.items():
            if name.startswith("3 GEMMs"):
                lines.append(f"| {shape} | {name} | {floor:.3f} | {ratio(floor, base[0])} | | | | |")
            elif name in steps:
                lines.append(f"| {shape} | {name} | {events[name]:.3f} | {ratio(events[name], base[0])} | "
                             f"{device[name]:.3f} | {ratio(device[name], base[1])} | {peaks[name] / (n * v * 2):.2f} | "
                             f"{errors[name]:.1e} |")
            else:
                lines.append(f"| {shape} | {name} | {failed.get(name, why)} | | | | | |")
            print(lines[-1], flush=True)
        del hidden, weight, target, h, w, steps
        torch.cuda.empty_cache()
    return lines + peers_summary(lines, impls)


def peers_summary(lines, impls):
    """The table again, short: per shape the reference's events ms and every other row's ratio to it."""
    names = [n for n in impls if n != "unfused into fp32 main_grad (Megatron)"]
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 8 and "x" in cells[0] and cells[0][0].isdigit():
            rows.setdefault(cells[0], {})[cells[1]] = cells[2] if cells[1].startswith("unfused into") else cells[3]
    out = ["", "Summary: events ms of the unfused layer into fp32 main_grad; every other row / it (events)", "",
           "| N x h x V | unfused into main_grad ms | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for shape, row in rows.items():
        out.append(f"| {shape} | {row.get('unfused into fp32 main_grad (Megatron)', '-')} | "
                   + " | ".join(row.get(n) or "-" for n in names) + " |")
    return out


BREAKDOWN_FRACTIONS = (0.5, 1.0, 0.25)  # the former default, one block, a leaner setting
TORCH_KERNELS = ("at::", "at_cuda_detail", "cub", "memcpy", "memset", "nccl")


def _kernel_kind(name):
    low = name.lower()
    if any(k in low for k in (*GEMM_KERNELS, "cublas")):
        return "gemm"
    return "torch" if any(k in low for k in TORCH_KERNELS) else "triton"


def gemm_pieces_ms(n, h, v, args):
    """The layer's GEMMs alone (events, median): logits, dhidden, the 16-bit weight gradient, and the
    weight gradient added into an fp32 main_grad over all n rows at once and as two halves; the
    halves' excess is what one more block costs (one more read-modify-write of main_grad, 8 V h bytes)."""
    x, w = torch.randn(n, h, device="cuda").bfloat16(), torch.randn(v, h, device="cuda").bfloat16()
    g = torch.randn(n, v, device="cuda").bfloat16()
    main_grad = torch.zeros(v, h, device="cuda")
    half = n // 2
    ms = {"logits": timed(lambda: x @ w.t(), args.warmup, args.iters),
          "dhidden": timed(lambda: g @ w, args.warmup, args.iters),
          "dweight 16-bit": timed(lambda: g.t() @ x, args.warmup, args.iters),
          "dweight into fp32, 1 block": timed(lambda: torch.addmm(main_grad, g.t(), x, out_dtype=torch.float32,
                                                                  out=main_grad), args.warmup, args.iters),
          "dweight into fp32, 2 blocks": timed(lambda: [torch.addmm(main_grad, g[i:i + half].t(), x[i:i + half],
                                                                    out_dtype=torch.float32, out=main_grad)
                                                        for i in (0, half)], args.warmup, args.iters)}
    del x, w, g, main_grad
    torch.cuda.empty_cache()
    return ms


def breakdown(args):
    """Per shape: what each path spends, from the torch profiler (device time, kernels summed by kind:
    cuBLAS GEMMs, this package's Triton kernels, torch's elementwise / reduction kernels) beside its
    events (median, synchronized: host included), against the unfused layer into fp32 main_grad (what
    Megatron runs) and the GEMMs alone; per-kernel tables in ``--detail``."""
    from mindspeed_cez.linear_cross_entropy import default_row_block

    impls = {"unfused into main_grad": unfused_into_main_grad, "fused default": into_main_grad}
    for fraction in args.fractions:
        impls[f"fused, fraction {fraction}"] = functools.partial(into_main_grad, block_fraction=fraction)
    lines = [f"Where the time goes, fwd+bwd into fp32 main_grad, bf16, one set of inputs per shape, the paths in turn "
             f"each round: device ms from the torch profiler (median of 3 rounds), events ms median of {args.iters} "
             "rounds (synchronized, host included)", "",
             "| N x h x V | path | blocks | events ms | device ms | / unfused (device) | GEMM ms | Triton ms "
             "| torch ms | kernels |", "|---|---|---|---|---|---|---|---|---|---|"]
    pieces = ["", "GEMMs alone (cuBLAS, events median): the 3-GEMM floor into main_grad = logits + dhidden + "
              "dweight into fp32 (1 block); one more block costs the 2-block excess", "",
              "| N x h x V | logits | dhidden | dweight 16-bit | dweight into fp32, 1 block | 2 blocks | "
              "extra per block | floor into main_grad |", "|---|---|---|---|---|---|---|---|"]
    detail, summary = [], {}
    for shape in args.shapes:
        n, hdim, v = dims(shape)
        g = gemm_pieces_ms(n, hdim, v, args)
        floor = g["logits"] + g["dhidden"] + g["dweight into fp32, 1 block"]
        pieces.append(f"| {shape} | {g['logits']:.3f} | {g['dhidden']:.3f} | {g['dweight 16-bit']:.3f} | "
                      f"{g['dweight into fp32, 1 block']:.3f} | {g['dweight into fp32, 2 blocks']:.3f} | "
                      f"{g['dweight into fp32, 2 blocks'] - g['dweight into fp32, 1 block']:.3f} | {floor:.3f} |")
        print(pieces[-1], flush=True)
        hidden, weight, target = inputs(n, hdim, v)  # one set of inputs, every path in turn each round
        h, w = hidden.requires_grad_(), weight.requires_grad_()
        with_main_grad(w)
        steps = {name: stepper(fn, h, w, target) for name, fn in impls.items()}
        events = interleaved_ms(steps, args.iters)
        tables = {name: [] for name in impls}
        for r in range(3):
            for name in list(impls)[r % len(impls):] + list(impls)[:r % len(impls)]:
                tables[name].append(kernel_table(steps[name], steps=1))
        base = None
        for name, fn in impls.items():
            fraction = getattr(fn, "keywords", {}).get("block_fraction")
            blocks = -(-n // default_row_block(n, v, fraction)) if name.startswith("fused") else ""
            sums = sorted(tables[name], key=lambda t: sum(ms for _, ms in t.values()))
            table = sums[len(sums) // 2]  # the round of median device time
            kinds = {"gemm": 0.0, "triton": 0.0, "torch": 0.0}
            for kname, (calls, ms) in table.items():
                kinds[_kernel_kind(kname)] += ms
            device = sum(kinds.values())
            base = device if name.startswith("unfused") else base
            summary.setdefault(shape, {"extra": g["dweight into fp32, 2 blocks"] - g["dweight into fp32, 1 block"],
                                       "floor": floor})[name] = (device, blocks)
            lines.append(f"| {shape} | {name} | {blocks} | {events[name]:.3f} | {device:.3f} | "
                         f"{device / base if base else float('nan'):.3f} | {kinds['gemm']:.3f} | "
                         f"{kinds['triton']:.3f} | {kinds['torch']:.3f} | "
                         f"{sum(c for c, _ in table.values()):.0f} |")
            print(lines[-1], flush=True)
            detail += ["", f"{shape}, {name}: per kernel (calls, device ms; the round of median device time)", "",
                       "| kernel | kind | calls | ms |", "|---|---|---|---|"]
            detail += [f"| {kname[:110]} | {_kernel_kind(kname)} | {calls:.0f} | {ms:.3f} |"
                       for kname, (calls, ms) in sorted(table.items(), key=lambda kv: -kv[1][1])]
        del hidden, weight, target, h, w, steps
        torch.cuda.empty_cache()
    names = list(impls)
    short_table = ["", "Summary: device ms (profiler) of the unfused layer into main_grad, the others / it (blocks); "
                   "floor: the GEMMs alone into main_grad; +block: one more block's dweight excess (ms)", "",
                   "| N x h x V | unfused ms | floor | " + " | ".join(names[1:]) + " | +block ms |",
                   "|---|---|---|" + "---|" * len(names)]
    for shape, row in summary.items():
        ref = row.get(names[0], (float("nan"), ""))[0]
        cells = [f"{row[n][0] / ref:.3f} ({row[n][1]})" if n in row else "-" for n in names[1:]]
        short_table.append(f"| {shape} | {ref:.2f} | {row['floor'] / ref:.3f} | " + " | ".join(cells)
                           + f" | {row['extra']:.2f} |")
    if args.detail:
        with open(args.detail, "w") as fh:
            fh.write(run_stamp() + "\n" + "\n".join(detail) + "\n")
    return lines + pieces + short_table


TUNE_ACCUMULATE = [  # block_m, block_n, block_k, group_m, warps, stages, programs per SM, main_grad tile read first
    (128, 256, 64, 8, 8, 3, 1, False), (128, 256, 32, 8, 8, 5, 1, False), (128, 128, 64, 8, 8, 4, 1, False),
    (128, 128, 64, 8, 8, 4, 1, True), (128, 128, 64, 8, 8, 3, 1, True), (128, 128, 32, 8, 8, 5, 1, True),
    (128, 128, 64, 16, 8, 4, 1, True), (128, 256, 64, 8, 8, 3, 1, True), (128, 128, 64, 8, 4, 3, 2, True),
    (64, 256, 64, 8, 8, 4, 1, True)]
TUNE_SHAPES = ["151936x4096x4096", "151936x4096x1024", "16160x7168x4096", "37984x4096x4096"]  # V x h x rows


def tune_accumulate(args):
    """``main_grad [V, h] += dlogits.T @ x`` (``dlogits [rows, V]``) alone: the Triton kernel over tile
    settings beside torch's ``addmm(out_dtype)`` and its bf16 GEMM alone (no read of main_grad)."""
    from mindspeed_cez import linear_forward_grads as acc
    from mindspeed_cez.kernels import triton_matmul_accumulate as tma

    lines = [f"Triton fp32 accumulation kernel; median of {args.iters} (CUDA events)", "",
             "| V x h x rows | setting (bm, bn, bk, group_m, warps, stages, per SM, preload main_grad) | ms "
             "| / addmm(out_dtype) | TFLOP/s |", "|---|---|---|---|---|"]
    saved = dict(tma.LAUNCH_CONFIG["cuda"])
    for shape in args.tune_shapes:
        v, hdim, n = dims(shape)
        dlogits, x = torch.randn(n, v, device="cuda").bfloat16(), torch.randn(n, hdim, device="cuda").bfloat16()
        out = torch.zeros(v, hdim, device="cuda")
        flops, ref = 2 * v * hdim * n, None

        def row(label, ms):
            lines.append(f"| {shape} | {label} | {ms:.3f} | {ms / ref if ref else 0:.3f} | {flops / ms / 1e9:.0f} |")
            print(lines[-1], flush=True)

        if acc.ADDMM_OUT_DTYPE:
            ref = timed(lambda: torch.addmm(out, dlogits.t(), x, out_dtype=torch.float32, out=out), args.warmup, args.iters)
            row("addmm(out_dtype)", ref)
        row("bf16 GEMM alone (cuBLAS)", timed(lambda: dlogits.t() @ x, args.warmup, args.iters))
        for setting in TUNE_ACCUMULATE:
            tma.LAUNCH_CONFIG["cuda"].update(zip(("block_m", "block_n", "block_k", "group_m", "warps", "stages",
                                                  "per_core", "preload_c"), setting))
            tma.launch_plans_changed()
            try:
                row(", ".join(map(str, setting)), timed(lambda: tma.matmul_accumulate(out, dlogits.t(), x),
                                                        args.warmup, args.iters))
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile is reported
                lines.append(f"| {shape} | {', '.join(map(str, setting))} | failed: {type(exc).__name__} | | |")
        tma.LAUNCH_CONFIG["cuda"].clear()
        tma.LAUNCH_CONFIG["cuda"].update(saved)
        tma.launch_plans_changed()
        dlogits = x = out = None  # freed before the next shape's
        torch.cuda.empty_cache()
    return lines


def _liger_tp():
    """Liger 0.8.5's TP fused linear scaled CE on its native CUTLASS + NVSHMEM path (no z-loss), or why not."""
    try:
        from liger_kernel.ops import fused_linear_scaled_cross_entropy as scaled

        if scaled._load_native_tp_function() is None:
            return None, "not run: Liger's native TP path is not available here (its 512-token torch fallback is no peer)"
    except Exception as exc:  # noqa: BLE001
        return None, f"not run: Liger's native TP path does not import ({short(exc, 100)})"
    return scaled.LigerFusedLinearScaledCrossEntropyTPFunction.apply, None


def sweep_tp(args):
    """TP=2 over NCCL with sequence parallelism (``torchrun --nproc-per-node 2``): per global shape, the
    unfused layer into fp32 main_grad (all-gathered hidden, cuBLAS logits of this rank's vocab slice, the
    op; dhidden's reduce-scatter beside the weight gradient's GEMM into main_grad: what Megatron runs,
    the reference), the same with a 16-bit weight gradient, the fused layer's default and
    each ``--fractions`` block fraction, Liger's TP form where it runs; rank 0's time and peak (the float64
    checks of TP + SP: tests/ops/test_linear_cross_entropy*.py)."""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_gather

    from mindspeed_cez.linear_cross_entropy import default_row_block

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # gloo: the CPU smoke test
    rank, tp, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    lines = [f"TP={tp} + SP over NCCL, fwd+bwd, bf16; rank 0, median of {args.iters} rounds, the implementations in "
             f"turn each round (CUDA events, synchronized per call); N x h x V global (each rank: N/{tp} tokens of hidden, V/{tp} vocab rows)", "",
             "| N x h x V | implementation | rows per block | ms | / unfused into main_grad | peak extra (x this rank's "
             "logits) |", "|---|---|---|---|---|---|"]
    liger_tp, why = _liger_tp()

    def gathered(h):
        return torch.cat(all_gather(h, group=group))

    for shape in args.shapes:
        n, hdim, v = dims(shape)
        hidden, weight, target = inputs(n, hdim, v)  # the same on every rank; this rank's rows of hidden and weight:
        h = hidden[rank * n // tp:(rank + 1) * n // tp].clone().requires_grad_()
        w = weight[rank * v // tp:(rank + 1) * v // tp].clone().requires_grad_()
        del hidden, weight
        mask = (target != -100).float()
        torch.cuda.empty_cache()
        with_main_grad(w)

        def unfused_main_grad(h, w, t):
            from mindspeed_cez import vocab_parallel_cross_entropy_zloss

            return vocab_parallel_cross_entropy_zloss(_SequenceParallelLinearIntoMainGrad.apply(h, w, group), t, Z,
                                                      tp_group=group)[0].sum()

        results = [("unfused into fp32 main_grad (Megatron)", "", unfused_main_grad),
                   ("unfused: cuBLAS + cez op (16-bit dweight)", "", lambda h, w, t: unfused(gathered(h), w, t, group))]
        for fraction in [None, *args.fractions]:
            label = "fused layer, default" if fraction is None else f"fused layer, fraction {fraction}"
            results.append((label, default_row_block(n, v // tp, fraction), functools.partial(
                into_main_grad, tp_group=group, sequence_parallel=True, token_weights=mask, block_fraction=fraction)))
        if liger_tp is not None:
            results.append(("Liger 0.8.5 CuTe TP fused linear scaled CE (no z)", "",
                            lambda h, w, t: liger_tp(gathered(h), w, t, group).sum()))
        steps, peaks, failed = {}, {}, {}
        for name, _, fn in results:
            try:
                steps[name] = stepper(fn, h, w, target)
                _, peaks[name] = time_and_peak(steps[name], 0, 1)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
                failed[name] = f"failed: {short(exc, 100)}"
                steps.pop(name, None)
        events = interleaved_ms(steps, args.iters)  # every rank runs the same calls in the same order
        base = events.get(results[0][0])
        for name, block, _ in results:
            if name in events:
                lines.append(f"| {shape} | {name} | {block} | {events[name]:.2f} | "
                             f"{events[name] / base if base else float('nan'):.3f} | "
                             f"{peaks[name] / (n * (v // tp) * 2):.2f} |")
            else:
                lines.append(f"| {shape} | {name} | {block} | {failed[name]} | | |")
            if rank == 0:
                print(lines[-1], flush=True)
        del steps
        if liger_tp is None:
            lines.append(f"| {shape} | Liger 0.8.5 CuTe TP fused linear scaled CE | | {why} | | |")
        del h, w
        torch.cuda.empty_cache()
    dist.barrier()
    return lines if rank == 0 else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--main-grad-rows", nargs="*", type=int, default=[],
                        help="also the gradients-in-forward path into main_grad at these token rows per block")
    parser.add_argument("--profile", action="store_true", help="also the device time (profiler) at every shape")
    parser.add_argument("--accumulations", action="store_true",
                        help="the default path with each fp32 accumulation forced, and the block dial's curve")
    parser.add_argument("--tune-accumulate", action="store_true", help="the Triton accumulation kernel's tile sweep")
    parser.add_argument("--overhead", action="store_true",
                        help="each call's time outside its kernels (events beside the profiler's timeline)")
    parser.add_argument("--peers", action="store_true",
                        help="the final table: the fused layer beside the unfused layer into main_grad and the peers, "
                             "events and device time, peak memory, each loss against fp32 once")
    parser.add_argument("--breakdown", action="store_true",
                        help="where each path's device time goes (profiler, by kernel kind) against the unfused "
                             "layer into main_grad and the GEMMs alone; per-kernel tables to --detail")
    parser.add_argument("--fractions", nargs="*", type=float, default=list(BREAKDOWN_FRACTIONS),
                        help="--breakdown: block fractions beside the default")
    parser.add_argument("--detail", default=None, help="--breakdown: the per-kernel tables' file")
    parser.add_argument("--tp", action="store_true", help="TP=2 + SP over NCCL (torchrun --nproc-per-node 2): the dial")
    parser.add_argument("--tune-shapes", nargs="+", default=TUNE_SHAPES, help="V x h x rows for --tune-accumulate")
    parser.add_argument("--impls", nargs="*", default=[], help="only the implementations whose names hold one of these")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the op's CPU smoke run: python bench/op.py --smoke)")
    report = (sweep_tp if args.tp else breakdown if args.breakdown else peers if args.peers else tune_accumulate if args.tune_accumulate else overhead if args.overhead
              else run)(args)
    if report is not None:
        print(write_report(args.out, report))


if __name__ == "__main__":
    main()
