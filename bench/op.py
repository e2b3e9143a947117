#!/usr/bin/env python3
"""Benchmark: fused vocab-parallel cross entropy + z-loss against its peers.

One run times forward and forward+backward (median of CUDA-event timings, L2 flushed, with a
head start for the host), the memory each implementation adds on top of its inputs, and the loss /
gradient error against a float64 reference, for the implementations below; for this package's op
also its device time alone (forward+backward replayed from a CUDA graph):

  1. mindspeed_cez (this package),
  2. Megatron-Core's vocab_parallel_cross_entropy + a separate z-loss,
  3. Megatron-Core's fused_vocab_parallel_cross_entropy + the same z-loss,
  4. Liger-Kernel's cross entropy with its built-in z-loss (lse_square_scale),
  5. torch.compile of F.cross_entropy + z-loss.

Times are set beside a floor from the device-to-device copy bandwidth measured in the same
run: forward reads the logits once (1 pass), forward+backward reads them twice and writes the
gradient once (3 passes). bench/NOTES.md explains the method.

    python bench/op.py --out out/bench.md            # one GPU
    torchrun --nproc-per-node 2 bench/op.py --tp     # per-rank TP=2 timings
    python bench/op.py --smoke                       # tiny shapes on the CPU

An implementation that does not import, or fails, gets a row saying so; the run goes on.
"""

import argparse
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from harness import (BACKEND, LOGIT_SCALE, LogitsSource, Timer, check_correctness, cleanup, copy_bandwidth,
                     graph_replay_ms, is_oom, log, make_inputs, make_inputs_on_device, reset_compiled, time_impl)
from peers import build_impls
from report import fmt_mem, fmt_ms, fmt_per_token, fmt_ratio, header_lines, short, write_report
from support import free_port, loss_and_grad_float64, relative_error  # tests/support.py, on the path by harness

GPU_SHAPES = [(8192, 151936), (8192, 37984), (16384, 16160), (4096, 262144)]
SMOKE_SHAPES = [(64, 1000), (48, 2053)]
GPU_CHECK_SHAPE = (512, 50257)  # correctness: odd vocab, not a multiple of any block width
SMOKE_CHECK_SHAPE = (24, 517)
TP_GLOBAL_SHAPE = (8192, 151936)
SMOKE_TP_GLOBAL_SHAPE = (32, 1000)
Z_LOSS_COEFF = 1e-4

ROW_UNAVAILABLE = "unavailable"


# --------------------------------------------------------------------------- single-process run


def init_single_process(device):
    """World size 1 (NCCL on a GPU, gloo on the CPU) and Megatron's parallel state, TP=1."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    tp_group, note = dist.group.WORLD, "tp_group = WORLD (size 1)"
    try:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        note = "Megatron parallel_state TP=1"
    except Exception as exc:  # noqa: BLE001
        note += f"; Megatron parallel_state not initialized ({short(exc, 100)})"
    return tp_group, note


def run_single(args, device):
    t_begin = time.time()
    tp_group, tp_note = init_single_process(device)
    impls = build_impls(tp_group, device, Z_LOSS_COEFF)
    if args.impls:
        impls = [impl for impl in impls if any(impl[0].startswith(prefix) for prefix in args.impls)]
    shapes = args.shapes or (SMOKE_SHAPES if args.smoke else GPU_SHAPES)
    check_shape = SMOKE_CHECK_SHAPE if args.smoke else GPU_CHECK_SHAPE

    bw = copy_bandwidth(device)
    log(f"copy bandwidth: {bw / 1e12:.3f} TB/s (read + write)")
    head = header_lines(
        device,
        [
            f"- {tp_note}; z_loss_coeff {Z_LOSS_COEFF}; bf16 logits ~ N(0, {LOGIT_SCALE:g}^2); "
            f"warm-up {args.warmup}, timed {args.iters} (median)",
            f"- device-to-device copy bandwidth (read + write): {bw / 1e12:.3f} TB/s; "
            "floor: forward = 1 pass over the logits, forward+backward = 3 passes (read, read + write)",
        ],
    )

    # correctness on one small shape vs float64
    n, v = check_shape
    base, target, upstream = make_inputs(n, v, device, seed=1234)
    ref = loss_and_grad_float64(base, target, upstream, z_loss_coeff=Z_LOSS_COEFF)
    check_rows = []
    for name, fn, note in impls:
        if fn is None:
            check_rows.append(f"| {name} | - | - | - | {ROW_UNAVAILABLE}: {note} |")
            continue
        try:
            loss_err, z_err, grad_err = check_correctness(fn, base, target, upstream, ref)
            check_rows.append(f"| {name} | {loss_err:.1e} | {z_err:.1e} | {grad_err:.1e} | {note} |")
        except Exception as exc:  # noqa: BLE001
            check_rows.append(f"| {name} | - | - | - | error: {short(exc)} |")
            traceback.print_exc()
        log(check_rows[-1])
        cleanup(device)
    del base, target, upstream, ref
    cleanup(device)

    report = head + [
        "",
        f"### Correctness at {n} x {v} vs float64 (relative L2 error; upstream = random loss_mask / num_tokens)",
        "",
        "| impl | loss rel err | z-loss rel err | grad rel err | note |",
        "| --- | --- | --- | --- | --- |",
        *check_rows,
        "",
        "### Time (median ms) and memory beyond the inputs",
        "",
        "| N x V | impl | fwd ms | fwd / floor | fwd+bwd ms | fwd+bwd / floor | fwd+bwd graph replay ms (/ floor) "
        "| held after fwd GiB (x logits) | peak fwd+bwd GiB (x logits) | peak bytes / token |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    log(write_report(args.out, report))

    timer = Timer(device)
    for n, v in shapes:
        logits_bytes = n * v * 2
        floor_fwd = logits_bytes / bw * 1e3
        floor_all = 3 * logits_bytes / bw * 1e3
        shape = f"{n} x {v}"
        report.append(f"| {shape} | floor ({bw / 1e12:.2f} TB/s copy) | {fmt_ms(floor_fwd)} | 1 | {fmt_ms(floor_all)} | 1 "
                      "| | | | |")
        reset_compiled()
        try:
            base, target, upstream = make_inputs_on_device(n, v, device, seed=n + v)
        except Exception as exc:  # noqa: BLE001
            report.append(f"| {shape} | (inputs) | {'OOM' if is_oom(exc) else 'error'}: {short(exc)} | | | | | | | |")
            cleanup(device)
            continue
        for name, fn, note in impls:
            if fn is None:
                report.append(f"| {shape} | {name} | {ROW_UNAVAILABLE} | | | | | | | |")
                continue
            if args.budget_s and time.time() - t_begin > args.budget_s:
                report.append(f"| {shape} | {name} | skipped: time budget {args.budget_s} s spent | | | | | | | |")
                continue
            t0 = time.time()
            try:
                r = time_impl(fn, base, target, upstream, timer, args.warmup, args.iters)
                graphed = graph_replay_ms(fn, base, target, upstream, timer, args.iters) if name == "mindspeed_cez" else None
                row = (
                    f"| {shape} | {name} | {fmt_ms(r['fwd'])} | {fmt_ratio(r['fwd'], floor_fwd)} "
                    f"| {fmt_ms(r['fwd+bwd'])} | {fmt_ratio(r['fwd+bwd'], floor_all)} "
                    f"| {fmt_ms(graphed)} ({fmt_ratio(graphed, floor_all)}) "
                    f"| {fmt_mem(r['held'], logits_bytes)} | {fmt_mem(r['peak'], logits_bytes)} "
                    f"| {fmt_per_token(r['peak'], n)} |"
                )
            except Exception as exc:  # noqa: BLE001
                kind = "OOM" if is_oom(exc) else "error"
                row = f"| {shape} | {name} | {kind}: {short(exc)} | | | | | | | |"
                if kind == "error":
                    traceback.print_exc()
            timer.pairs = []
            report.append(row)
            log(f"{row}   [{time.time() - t0:.1f} s]")
            cleanup(device)
            write_report(args.out, report)
        del base, target, upstream
        cleanup(device)

    report += ["", f"total wall time {time.time() - t_begin:.0f} s"]
    text = write_report(args.out, report)
    log("\n" + text)
    if args.out:
        log(f"written to {args.out}")


# --------------------------------------------------------------------------- tensor-parallel run


def run_tp(args, device):
    """Per rank: our kernels alone on the shard, the op at TP=1 on the shard, the op at TP=world."""
    from mindspeed_cez import kernels as cez_kernels
    from mindspeed_cez import vocab_parallel_cross_entropy_zloss as op

    t_begin = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    n, global_vocab = args.tp_shape or (SMOKE_TP_GLOBAL_SHAPE if args.smoke else TP_GLOBAL_SHAPE)
    if global_vocab % world:
        raise SystemExit(f"global vocab {global_vocab} does not divide by {world} ranks")
    v_local = global_vocab // world
    vocab_start = rank * v_local

    # Each rank draws its own vocab slice; targets and upstream gradient are the same on all ranks.
    shard, _, _ = make_inputs_on_device(n, v_local, device, seed=1000 + rank, global_vocab=global_vocab)
    gen = torch.Generator(device="cpu").manual_seed(77)
    target = torch.randint(0, global_vocab, (n,), generator=gen).to(device)
    mask = (torch.rand(n, generator=gen) < 0.95).float()
    upstream = (mask / mask.sum()).to(device)
    backend = cez_kernels.backend_for(device, BACKEND)
    backend_name = backend.__name__.rsplit(".", 1)[-1]
    timer = Timer(device)
    anchor = torch.zeros((), device=device, requires_grad=True)

    def aligned():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()

    def measure(step):
        """Median ms of step(x) over fresh non-leaf copies x of the shard (the copy is untimed)."""
        for _ in range(args.warmup):
            step(LogitsSource.apply(shard, anchor, None))
        for _ in range(args.iters):
            x = LogitsSource.apply(shard, anchor, None)
            aligned()
            timer.prepare()
            started = timer.start()
            step(x)
            timer.stop(started)
            del x
        return timer.median_ms()

    # lse for the gradient kernel (computed once, untimed): the op's value at TP=world
    with torch.no_grad():
        loss_ref, _, lse = op(shard, target, Z_LOSS_COEFF, tp_group=group, return_lse=True)
    grad_loss = upstream.float()

    def kernel_fwd(x):
        backend.shard_partials(x.detach(), target, vocab_start, global_vocab, -100)

    def kernel_fwd_bwd(x):
        rows = x.detach()
        backend.shard_partials(rows, target, vocab_start, global_vocab, -100)
        backend.write_grad(rows, rows, target, lse, grad_loss, -100, vocab_start, Z_LOSS_COEFF, 0.0, global_vocab)

    # The op's two collectives alone, on buffers of the op's sizes: MAX of [n], SUM of [2, n].
    max_buffer = torch.rand(n, device=device)
    sum_buffer = torch.rand(2, n, device=device)

    def collectives(_x):
        dist.all_reduce(max_buffer, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(sum_buffer, op=dist.ReduceOp.SUM, group=group)

    def op_step(tp_group, tgt, backward):
        def step(x):
            loss, _ = op(x, tgt, z_loss_coeff=Z_LOSS_COEFF, tp_group=tp_group)
            if backward:
                torch.autograd.backward(loss, upstream)

        return step

    # The op at TP=1 on this shard size: the shard stands for a whole vocab of v_local (targets
    # folded into it), so no collective runs.
    target_local = target % v_local

    rows = {}
    rows["kernels alone (this shard)"] = (measure(kernel_fwd), measure(kernel_fwd_bwd))
    collective_ms = measure(collectives)
    rows["the two all-reduces alone"] = (collective_ms, collective_ms)
    rows[f"op, TP=1 on a {n} x {v_local} vocab"] = (
        measure(op_step(None, target_local, False)),
        measure(op_step(None, target_local, True)),
    )
    rows[f"op, TP={world} (with its all-reduces)"] = (
        measure(op_step(group, target, False)),
        measure(op_step(group, target, True)),
    )

    # Correctness: the TP op's loss vs float64 on the first rows of the gathered global logits.
    check_rows = min(n, 256)
    pieces = [torch.empty_like(shard[:check_rows]) for _ in range(world)]
    dist.all_gather(pieces, shard[:check_rows].contiguous(), group=group)
    full = torch.cat(pieces, dim=1)
    ref_loss, _, _ = loss_and_grad_float64(full, target[:check_rows], upstream[:check_rows], z_loss_coeff=Z_LOSS_COEFF)
    loss_err = relative_error(loss_ref[:check_rows], ref_loss)

    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "rows": rows, "loss_err": loss_err})
    if rank != 0:
        return
    bw = copy_bandwidth(device)
    shard_bytes = n * v_local * 2
    floor_fwd, floor_all = shard_bytes / bw * 1e3, 3 * shard_bytes / bw * 1e3
    report = header_lines(
        device,
        [
            f"- TP mode: {world} ranks over {dist.get_backend()}, global {n} x {global_vocab}, "
            f"shard {n} x {v_local} per rank; backend {backend_name}; z_loss_coeff {Z_LOSS_COEFF}; "
            f"warm-up {args.warmup}, timed {args.iters} (median); ranks aligned by a barrier before each iteration",
            f"- NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', '')!r}",
            f"- copy bandwidth (rank 0): {bw / 1e12:.3f} TB/s; shard floor: fwd {floor_fwd:.3f} ms, fwd+bwd {floor_all:.3f} ms",
            "",
            "| rank | what | fwd ms | fwd / floor | fwd+bwd ms | fwd+bwd / floor |",
            "| --- | --- | --- | --- | --- | --- |",
        ],
    )
    for item in gathered:
        for what, (fwd, both) in item["rows"].items():
            report.append(
                f"| {item['rank']} | {what} | {fmt_ms(fwd)} | {fmt_ratio(fwd, floor_fwd)} "
                f"| {fmt_ms(both)} | {fmt_ratio(both, floor_all)} |"
            )
    report.append("")
    tp_key, single_key = f"op, TP={world} (with its all-reduces)", f"op, TP=1 on a {n} x {v_local} vocab"
    kernel_key, coll_key = "kernels alone (this shard)", "the two all-reduces alone"
    report.append(
        "Collective cost (op at TP={} minus op at TP=1 on the same shard, fwd / fwd+bwd): ".format(world)
        + ", ".join(
            f"rank {i['rank']} {i['rows'][tp_key][0] - i['rows'][single_key][0]:+.3f} / "
            f"{i['rows'][tp_key][1] - i['rows'][single_key][1]:+.3f} ms"
            for i in gathered
        )
    )
    report.append("")
    report.append(
        f"Op at TP={world} / (kernels alone + the two all-reduces alone), fwd / fwd+bwd (target <= 1.10): "
        + ", ".join(
            f"rank {i['rank']} "
            f"{i['rows'][tp_key][0] / (i['rows'][kernel_key][0] + i['rows'][coll_key][0]):.3f} / "
            f"{i['rows'][tp_key][1] / (i['rows'][kernel_key][1] + i['rows'][coll_key][1]):.3f}"
            for i in gathered
        )
    )
    report.append("")
    report.append(
        "TP loss vs float64 on the gathered first rows: "
        + ", ".join(f"rank {i['rank']} rel err {i['loss_err']:.1e}" for i in gathered)
    )
    report += ["", f"total wall time {time.time() - t_begin:.0f} s"]
    text = write_report(args.out, report)
    log("\n" + text)
    if args.out:
        log(f"written to {args.out}")


# --------------------------------------------------------------------------- main


def _shape(text):
    n, v = text.lower().split("x")
    return int(n), int(v)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (perf_counter timing)")
    parser.add_argument("--tp", action="store_true", help="per-rank TP timings; launch with torchrun")
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    parser.add_argument("--shapes", type=_shape, nargs="*", default=None, help="N x V shapes, e.g. 8192x151936")
    parser.add_argument("--tp-shape", type=_shape, default=None, help="global N x V for --tp")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=0, help="skip the remaining timings after this many seconds")
    parser.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available, cpu with --smoke)")
    parser.add_argument("--impls", nargs="*", default=None,
                        help="only the implementations whose names start with these (e.g. mindspeed_cez liger)")
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = 2 if args.smoke else 20
    if args.iters is None:
        args.iters = 3 if args.smoke else 50

    if args.device:
        device = torch.device(args.device)
    elif args.smoke or not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif not args.smoke:
        log("no CUDA device: running the CPU smoke shapes (pass --smoke to say so)")
        args.smoke = True
        args.warmup, args.iters = min(args.warmup, 2), min(args.iters, 3)

    try:
        if args.tp:
            if not dist.is_initialized():
                dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            run_tp(args, device)
        else:
            run_single(args, device)
    finally:
        if dist.is_initialized():
            parallel_state = sys.modules.get("megatron.core.parallel_state")
            if parallel_state is not None:
                try:
                    parallel_state.destroy_model_parallel()
                except Exception:  # noqa: BLE001
                    pass
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
