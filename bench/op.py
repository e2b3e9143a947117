#!/usr/bin/env python3
"""The op (``vocab_parallel_cross_entropy_zloss``) beside its peers: forward and forward+backward time
over the copy-bandwidth floor, device time by CUDA-graph replay, memory beyond the inputs (error against
float64: tests/); ``--tp``: per rank under torchrun; ``--smoke``: tiny shapes on the CPU (bench/README.md)."""

import argparse
import contextlib
import inspect
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import (Timer, cleanup, copy_bandwidth, free_port, graph_replay_ms, is_oom, log, short, version,
                     write_report)

BACKEND = os.environ.get("MINDSPEED_CEZ_BACKEND") or None  # the benchmark's choice of the op's backend
LOGIT_SCALE = 3.0  # logits ~ N(0, 3^2): a spread like a language model's output layer
SHAPES = {False: [(8192, 151936), (8192, 37984), (16384, 16160), (4096, 262144)], True: [(64, 1000), (48, 2053)]}
TP_SHAPE = {False: (8192, 151936), True: (32, 1000)}  # global N x V; each dict: GPU, --smoke
Z_LOSS_COEFF = 1e-4



def build_impls(tp_group, device, coeff, softcap=0.0):
    """[(name, callable(logits, target) -> (loss, z_loss) or None, note)]; ``softcap``: this package's op
    with that logit soft cap (``logit_softcap``; the peers are timed without one)."""
    impls = []

    def ours():
        from mindspeed_cez import LogitTransform, kernels, vocab_parallel_cross_entropy_zloss as op

        return (lambda x, t: op(x, t, z_loss_coeff=coeff, tp_group=tp_group, backend=BACKEND,
                                logit_transform=LogitTransform(cap=softcap))), \
            f"backend {kernels.backend_for(device, BACKEND).__name__.rsplit('.', 1)[-1]}" + (
                f", logit_softcap {softcap:g}" if softcap else "")

    def with_z(ce):  # the usual add-on z-loss: c * logsumexp(logits)^2 in fp32, its own autograd graph
        def fn(x, t):
            lse = torch.logsumexp(x.float(), dim=-1)
            z = coeff * lse * lse
            return ce(x, t) + z, z.detach()
        return fn

    def mcore_native():
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        kwargs = {"tp_group": tp_group} if "tp_group" in inspect.signature(vocab_parallel_cross_entropy).parameters else {}
        return with_z(lambda x, t: vocab_parallel_cross_entropy(x, t, **kwargs)), ""

    def mcore_fused():
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        return with_z(lambda x, t: fused_vocab_parallel_cross_entropy(x, t, tp_group)), ""

    def liger():
        from liger_kernel.transformers.functional import liger_cross_entropy

        def fn(x, t):
            out = liger_cross_entropy(x, t, reduction="none", lse_square_scale=coeff, return_z_loss=True)
            return (out.loss, out.z_loss) if hasattr(out, "loss") else (out[0], out[1])
        return fn, f"v{version('liger-kernel')}, loss in logits dtype"

    def compiled():
        import torch._dynamo as dynamo

        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, 64)

        def ce_z(x, t):
            xf = x.float()
            lse = torch.logsumexp(xf, dim=-1)
            z = coeff * lse * lse
            return F.cross_entropy(xf, t, reduction="none") + z, z.detach()
        return torch.compile(ce_z, dynamic=False), ""

    for name, build in (("mindspeed_cez", ours), ("megatron native CE + z", mcore_native),
                        ("megatron fused CE + z", mcore_fused), ("liger-kernel CE(z)", liger),
                        ("torch.compile CE + z", compiled)):
        try:  # a peer that does not build: its row says why
            impls.append((name, *build()))
        except Exception as exc:  # noqa: BLE001
            impls.append((name, None, short(exc)))
    return impls


class LogitsSource(torch.autograd.Function):
    """Fresh logits per iteration, NON-leaf as the output layer's result in training (Liger and this
    package overwrite their input); backward passes nothing on."""

    @staticmethod
    def forward(ctx, base, anchor):
        return base.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, None


def make_inputs(n, v, device, seed, global_vocab=None):
    """bf16 logits, targets and upstream gradient (random loss_mask / num_tokens); drawn on the device
    (the CPU would take seconds per GiB), in fp32 chunks of <= 1 GiB."""
    gen = torch.Generator(device=device).manual_seed(seed)
    base = torch.empty(n, v, dtype=torch.bfloat16, device=device)
    chunk = max(1, (1 << 28) // v)
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        base[start : start + rows] = torch.randn(rows, v, device=device, generator=gen) * LOGIT_SCALE
    target = torch.randint(0, global_vocab or v, (n,), device=device, generator=gen)
    mask = (torch.rand(n, device=device, generator=gen) < 0.95).float()
    return base, target, mask / mask.sum().clamp_min(1.0)


def median_ms(step, base, timer, iters, align=None):
    """Median ms of ``step(x)`` over fresh non-leaf copies ``x`` of ``base`` (each copy untimed)."""
    anchor = torch.zeros((), device=base.device, requires_grad=True)
    for _ in range(iters):
        x = LogitsSource.apply(base, anchor)
        if align:
            align()
        timer.prepare()
        started = timer.start()
        out = step(x)
        timer.stop(started)
        del x, out  # the graph is freed after the timed region
    return timer.median_ms()


def time_impl(fn, base, target, upstream, timer, warmup, iters, graph=False):
    """Median ms of forward and of forward+backward, memory (bytes) beyond the inputs, and with
    ``graph`` the device time of forward+backward by CUDA-graph replay."""
    anchor, grads = torch.zeros((), device=base.device, requires_grad=True), {}

    def fwd_bwd(x):
        loss, _ = fn(x, target)
        if loss.dtype not in grads:  # the upstream gradient in the loss's dtype, cast once (outside the timings)
            grads[loss.dtype] = upstream.to(loss.dtype)
        torch.autograd.backward(loss, grads[loss.dtype])

    for _ in range(warmup):
        fwd_bwd(LogitsSource.apply(base, anchor))
    r = {"fwd": median_ms(lambda x: fn(x, target), base, timer, iters), "fwd+bwd": median_ms(fwd_bwd, base, timer, iters),
         "held": None, "peak": None, "graph": None}
    if base.device.type == "cuda":
        x = LogitsSource.apply(base, anchor)
        cleanup(base.device)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss, z = fn(x, target)
        torch.cuda.synchronize()
        r["held"] = torch.cuda.memory_allocated() - before  # saved for backward + outputs
        torch.autograd.backward(loss, grads[loss.dtype])
        torch.cuda.synchronize()
        r["peak"] = torch.cuda.max_memory_allocated() - before
        del x, loss, z
        if graph:
            r["graph"] = graph_replay_ms(lambda: fwd_bwd(LogitsSource.apply(base, anchor)), timer, iters)
    return r


def fmt_ms(ms):
    return "-" if ms is None else (f"{ms:.3f}" if ms < 10 else f"{ms:.2f}")


def fmt_ratio(a, b):
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}"


def fmt_mem(nbytes, logits_bytes):
    return "n/a" if nbytes is None else f"{nbytes / 2**30:.2f} ({nbytes / logits_bytes:.1f}x)"



def init_single_process(device):
    """World size 1 (NCCL on a GPU, gloo on the CPU) and Megatron's parallel state, TP=1."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1)
        return parallel_state.get_tensor_model_parallel_group(), "Megatron parallel_state TP=1"
    except Exception as exc:  # noqa: BLE001
        return dist.group.WORLD, f"tp_group = WORLD (size 1); Megatron parallel_state not initialized ({short(exc, 100)})"


def run_single(args, device):
    t_begin, (tp_group, tp_note) = time.time(), init_single_process(device)
    impls = [i for i in build_impls(tp_group, device, Z_LOSS_COEFF, args.logit_softcap)
             if i[0].startswith(tuple(args.impls or ("",)))]
    bw = copy_bandwidth(device)
    log(f"copy bandwidth: {bw / 1e12:.3f} TB/s (read + write)")

    report = [f"- {tp_note}; z_loss_coeff {Z_LOSS_COEFF}; bf16 logits ~ N(0, {LOGIT_SCALE:g}^2); "
              f"warm-up {args.warmup}, timed {args.iters} (median)",
              f"- device-to-device copy bandwidth (read + write): {bw / 1e12:.3f} TB/s; "
              "floor: forward = 1 pass over the logits, forward+backward = 3 passes (read, read + write)",
              "- implementations: " + "; ".join(f"{name} ({note or 'ok'})" if fn else f"{name}: unavailable ({note})"
                                                for name, fn, note in impls)]
    report += ["", "### Time (median ms) and memory beyond the inputs (error against float64: tests/ops/test_cross_entropy_zloss.py)", "",
               "| N x V | impl | fwd ms | fwd / floor | fwd+bwd ms | fwd+bwd / floor | fwd+bwd graph replay ms (/ floor) "
               "| held after fwd GiB (x logits) | peak fwd+bwd GiB (x logits) | peak bytes / token |",
               "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    log(write_report(args.out, report))

    timer, empty = Timer(device), " | | | | | | | |"
    for n, v in args.shapes or SHAPES[args.smoke]:
        logits_bytes, shape = n * v * 2, f"{n} x {v}"
        floor_fwd, floor_all = logits_bytes / bw * 1e3, 3 * logits_bytes / bw * 1e3
        report.append(f"| {shape} | floor ({bw / 1e12:.2f} TB/s copy) | {fmt_ms(floor_fwd)} | 1 | {fmt_ms(floor_all)} | 1 | | | | |")
        torch.compiler.reset()  # each shape compiles for its own static sizes, as in training
        try:
            base, target, upstream = make_inputs(n, v, device, seed=n + v)
        except Exception as exc:  # noqa: BLE001
            report.append(f"| {shape} | (inputs) | {'OOM' if is_oom(exc) else 'error'}: {short(exc)}{empty}")
            cleanup(device)
            continue
        for name, fn, _ in impls:
            t0 = time.time()
            if fn is None:
                row = f"| {shape} | {name} | unavailable{empty}"
            elif args.budget_s and time.time() - t_begin > args.budget_s:
                row = f"| {shape} | {name} | skipped: time budget {args.budget_s} s spent{empty}"
            else:
                try:
                    r = time_impl(fn, base, target, upstream, timer, args.warmup, args.iters, name == "mindspeed_cez")
                    per_token = "n/a" if r["peak"] is None else f"{r['peak'] / n:.0f}"
                    row = (f"| {shape} | {name} | {fmt_ms(r['fwd'])} | {fmt_ratio(r['fwd'], floor_fwd)} "
                           f"| {fmt_ms(r['fwd+bwd'])} | {fmt_ratio(r['fwd+bwd'], floor_all)} "
                           f"| {fmt_ms(r['graph'])} ({fmt_ratio(r['graph'], floor_all)}) "
                           f"| {fmt_mem(r['held'], logits_bytes)} | {fmt_mem(r['peak'], logits_bytes)} | {per_token} |")
                except Exception as exc:  # noqa: BLE001
                    row = f"| {shape} | {name} | {'OOM' if is_oom(exc) else 'error'}: {short(exc)}{empty}"
                    if not is_oom(exc):
                        traceback.print_exc()
                timer.pairs = []
            report.append(row)
            log(f"{row}   [{time.time() - t0:.1f} s]")
            cleanup(device)
            write_report(args.out, report)
        del base, target, upstream
        cleanup(device)
    report += ["", f"total wall time {time.time() - t_begin:.0f} s"]
    log("\n" + write_report(args.out, report))


TP_KERNELS_OF_OURS = ("_forward_kernel", "_grad_kernel", "_loss_from_partials_kernel")


def profiled_ms(step, make_input, device, iters, align):
    """Device time per ``step(x)`` from the torch profiler's kernel sums, split (op kernels, the
    op's all-gather kernel incl. its wait for peers); the clone that makes ``x`` and the NCCL
    all-reduce that aligns the ranks before each call are left out. None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            x = make_input()
            align()
            step(x)
        torch.cuda.synchronize(device)
    kernels = gather = 0.0
    by_name = {}
    for e in prof.events():
        # GPU-side ranges (user annotations: record_function, autograd's) span kernels counted already
        if (e.device_type != torch.autograd.DeviceType.CUDA or e.device_time <= 0
                or getattr(e, "is_user_annotation", False)):
            continue
        name = e.name.lower()
        if "nccl" in name:
            gather += e.device_time if "allgather" in name else 0.0
        elif "copy" not in name and "memcpy" not in name:  # the untimed clone of the input (a DtoD memcpy)
            kernels += e.device_time
            by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.device_time / 1e3 / iters
    top = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:6])
    return kernels / 1e3 / iters, gather / 1e3 / iters, top


def run_tp(args, device):
    """Per rank at this world size: our kernels alone on the shard, the op's one all-gather alone,
    the op at TP=1 on the shard, the op at TP=world; per call event time (ranks aligned on the
    device), host time (enqueueing it) and device time (profiler kernel sums)."""
    from mindspeed_cez import kernels as cez_kernels
    from mindspeed_cez import vocab_parallel_cross_entropy_zloss as op
    from mindspeed_cez.cross_entropy_zloss import all_gather
    from mindspeed_cez.kernels import LossSpec, VocabShard, partials_numel

    t_begin = time.time()
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    n, global_vocab = args.tp_shape or TP_SHAPE[args.smoke]
    if global_vocab % world:
        raise SystemExit(f"global vocab {global_vocab} does not divide by {world} ranks")
    v_local = global_vocab // world
    vocab = VocabShard(rank * v_local, v_local, global_vocab, rank, world)
    spec = LossSpec(-100, Z_LOSS_COEFF)

    # Each rank draws its own vocab slice; targets and upstream gradient are the same on all ranks.
    shard, _, _ = make_inputs(n, v_local, device, seed=1000 + rank, global_vocab=global_vocab)
    gen = torch.Generator(device="cpu").manual_seed(77)
    target = torch.randint(0, global_vocab, (n,), generator=gen).to(device)
    mask = (torch.rand(n, generator=gen) < 0.95).float()
    upstream = (mask / mask.sum()).to(device)
    backend = cez_kernels.backend_for(device, BACKEND)
    timer, anchor = Timer(device), torch.zeros((), device=device, requires_grad=True)
    align_buffer = torch.zeros(1, device=device)

    def host_aligned():  # every host at the same point before an iteration
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(**({"device_ids": [device.index]} if device.type == "cuda" else {}))

    def device_aligned():
        """Queued after the head-start sleep: the GPUs leave this all-reduce together, so a timed
        region starts at once on every rank (no host skew, no sleep that ran longer on one GPU)."""
        if world > 1 and args.align == "device":
            dist.all_reduce(align_buffer, group=group)

    def fresh():
        return LogitsSource.apply(shard, anchor)

    def measure(step):
        """(event ms, host ms) medians: the GPU time from the aligned start to the end of ``step``'s
        work, and the host's time to enqueue it."""
        for _ in range(args.warmup):
            step(fresh())
        hosts = []
        for _ in range(args.iters):
            x = fresh()
            host_aligned()
            timer.prepare()
            device_aligned()
            started = timer.start()
            t0 = time.perf_counter()
            out = step(x)
            hosts.append((time.perf_counter() - t0) * 1e3)
            timer.stop(started)
            del x, out
        return timer.median_ms(), statistics.median(hosts)

    # lse for the gradient kernel (computed once, untimed): the op's value at TP=world
    with torch.no_grad():
        _, _, lse = op(shard, target, Z_LOSS_COEFF, tp_group=group, return_lse=True)
    grad_loss = upstream.float()

    def kernels(backward):
        def step(x):
            rows = x.detach()
            backend.shard_partials(rows, target, spec, vocab)
            if backward:
                backend.write_grad(rows, rows, target, lse, grad_loss, spec, vocab)
        return step

    # The op's one collective alone, on buffers of its size: every rank's partials gathered.
    partials, gathered = (torch.rand(partials_numel(n), device=device),
                          torch.empty(world * partials_numel(n), device=device))

    def collective(_x):
        all_gather(gathered, partials, group=group)

    def op_step(tp_group, tgt, backward):
        def step(x):
            loss, _ = op(x, tgt, z_loss_coeff=Z_LOSS_COEFF, tp_group=tp_group)
            if backward:
                torch.autograd.backward(loss, upstream)
        return step

    def both(make):  # (fwd, fwd+bwd) of measure(make(backward))
        return tuple(measure(make(b)) for b in (False, True))

    # The op at TP=1 on this shard size: the shard stands for a whole vocab of v_local (targets
    # folded into it), so no collective runs.
    tp_key = f"op, TP={world}" + (" (its all-gather)" if world > 1 else "")
    rows = {"kernels alone (this shard)": both(kernels)}
    if world > 1:
        rows["the all-gather alone"] = (measure(collective),) * 2
        rows[f"op, TP=1 on a {n} x {v_local} vocab"] = both(lambda b: op_step(None, target % v_local, b))
    rows[tp_key] = both(lambda b: op_step(group, target, b))
    device_ms = profiled_ms(op_step(group, target, True), fresh, device, max(3, args.iters // 5),
                            lambda: (host_aligned(), device_aligned()))

    gathered_rows = [None] * world
    dist.all_gather_object(gathered_rows, {"rank": rank, "rows": rows, "device": device_ms})
    if rank != 0:
        return
    bw = copy_bandwidth(device)
    floor = (n * v_local * 2 / bw * 1e3, 3 * n * v_local * 2 / bw * 1e3)
    report = [f"- TP mode: {world} rank(s) over {dist.get_backend()}, global {n} x {global_vocab}, shard {n} x "
              f"{v_local} per rank; backend {backend.__name__.rsplit('.', 1)[-1]}; z_loss_coeff {Z_LOSS_COEFF}; "
              f"warm-up {args.warmup}, timed {args.iters} (median)",
              "- each timed call: hosts aligned by a barrier, L2 flushed, a 2 ms head-start sleep on the GPU"
              + (", then (world > 1) a 4-byte NCCL all-reduce so every GPU starts the timed region at once"
                 if args.align == "device" else " (--align host: no alignment on the device)")
              + "; event ms: GPU time from there to the call's last kernel; host ms: the host's time to enqueue the call",
              f"- copy bandwidth (rank 0): {bw / 1e12:.3f} TB/s; shard floor: fwd {floor[0]:.3f} ms (1 pass), "
              f"fwd+bwd {floor[1]:.3f} ms (3 passes)",
              "", "| rank | what | fwd ms | fwd / floor | fwd host ms | fwd+bwd ms | fwd+bwd / floor | fwd+bwd host ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for item in gathered_rows:
        for what, ((fwd, fwd_host), (all_, all_host)) in item["rows"].items():
            report.append(f"| {item['rank']} | {what} | {fmt_ms(fwd)} | {fmt_ratio(fwd, floor[0])} | {fmt_ms(fwd_host)} "
                          f"| {fmt_ms(all_)} | {fmt_ratio(all_, floor[1])} | {fmt_ms(all_host)} |")
    if device.type == "cuda":
        report += ["", f"Device time of the op at TP={world}, fwd+bwd per call (profiler kernel sums): "
                   + ", ".join(f"rank {i['rank']} kernels {i['device'][0]:.3f} ms ({i['device'][0] / floor[1]:.2f}x "
                               f"floor) + all-gather kernel {i['device'][1]:.3f} ms" for i in gathered_rows),
                   "Rank 0's kernels counted there, ms per call: "
                   + ", ".join(f"`{k}` {v:.3f}" for k, v in gathered_rows[0]["device"][2].items())]
    worst = max(i["rows"][tp_key][1][0] for i in gathered_rows)
    report += ["", f"The op at TP={world}, fwd+bwd, slowest rank: {fmt_ms(worst)} ms = {fmt_ratio(worst, floor[1])}x "
               "the three passes over the shard (target at TP >= 2: <= 1.5x)"]
    report += ["", f"total wall time {time.time() - t_begin:.0f} s"]
    log("\n" + write_report(args.out, report))


def _shape(text):
    return tuple(int(x) for x in text.lower().split("x"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (perf_counter timing)")
    parser.add_argument("--tp", action="store_true", help="per-rank TP timings; launch with torchrun")
    parser.add_argument("--out", default=None, help="also write the markdown report here (and .json beside it)")
    parser.add_argument("--shapes", type=_shape, nargs="*", default=None, help="N x V shapes, e.g. 8192x151936")
    parser.add_argument("--tp-shape", type=_shape, default=None, help="global N x V for --tp")
    parser.add_argument("--align", choices=("device", "host"), default="device",
                        help="--tp: start each timed call on every GPU at once (device: a tiny all-reduce after the "
                             "head-start sleep) or only after a host barrier (host)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=0, help="skip the remaining timings after this many seconds")
    parser.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available, cpu with --smoke)")
    parser.add_argument("--logit-softcap", type=float, default=0.0,
                        help="this package's op with this logit soft cap (the fp32 tanh in its kernels); 0: none")
    parser.add_argument("--impls", nargs="*", default=None,
                        help="only the implementations whose names start with these (e.g. mindspeed_cez liger)")
    args = parser.parse_args(argv)
    args.warmup = (2 if args.smoke else (10 if args.tp else 20)) if args.warmup is None else args.warmup
    args.iters = (3 if args.smoke else (30 if args.tp else 50)) if args.iters is None else args.iters
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device(args.device or ("cuda" if cuda else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif not args.smoke:
        log("no CUDA device: running the CPU smoke shapes (pass --smoke to say so)")
        args.smoke, args.warmup, args.iters = True, min(args.warmup, 2), min(args.iters, 3)
    try:
        if args.tp:
            if not dist.is_initialized():
                dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            run_tp(args, device)
        else:
            run_single(args, device)
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
