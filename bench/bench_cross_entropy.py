#!/usr/bin/env python3
"""Benchmark: fused vocab-parallel cross entropy + z-loss against its peers.

One run times forward and forward+backward (median of CUDA-event timings), the memory each
implementation adds on top of its inputs, and the loss / gradient error against a float64
reference, for:

  1. mindspeed_cez (this package),
  2. Megatron-Core's vocab_parallel_cross_entropy + a separate z-loss,
  3. Megatron-Core's fused_vocab_parallel_cross_entropy + the same z-loss,
  4. Liger-Kernel's cross entropy with its built-in z-loss (lse_square_scale),
  5. torch.compile of F.cross_entropy + z-loss.

Times are set beside a floor from the device-to-device copy bandwidth measured in the same
run: forward reads the logits once (1 pass), forward+backward reads them twice and writes the
gradient once (3 passes). bench/NOTES.md explains the method.

    python bench/bench_cross_entropy.py --out out/bench.md            # one GPU
    torchrun --nproc-per-node 2 bench/bench_cross_entropy.py --tp     # per-rank TP=2 timings
    python bench/bench_cross_entropy.py --smoke                       # tiny shapes on the CPU

An implementation that does not import, or fails, gets a row saying so; the run goes on.
"""

import argparse
import datetime
import gc
import inspect
import os
import platform
import socket
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

GPU_SHAPES = [(8192, 151936), (8192, 37984), (16384, 16160), (4096, 262144)]
SMOKE_SHAPES = [(64, 1000), (48, 2053)]
GPU_CHECK_SHAPE = (512, 50257)  # correctness: odd vocab, not a multiple of any block width
SMOKE_CHECK_SHAPE = (24, 517)
TP_GLOBAL_SHAPE = (8192, 151936)
SMOKE_TP_GLOBAL_SHAPE = (32, 1000)
Z_LOSS_COEFF = 1e-4
BACKEND = os.environ.get("MINDSPEED_CEZ_BACKEND") or None  # this benchmark's choice of the op's backend
LOGIT_SCALE = 3.0  # logits ~ N(0, 3^2): a spread like a language model's output layer
PRE_DELAY_MS = 2.0  # GPU busy-wait before each timed region so the host queues it whole
L2_FLUSH_BYTES = 256 << 20

ROW_UNAVAILABLE = "unavailable"


# --------------------------------------------------------------------------- helpers


def _log(*args):
    print(*args, flush=True)


def _short(exc, limit=160):
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_oom(exc):
    oom = getattr(torch.cuda, "OutOfMemoryError", ())
    return (oom and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _reset_compiled():
    """Forget compiled graphs, so each shape compiles for its own static sizes, as in training
    (where the loss sees one shape) rather than switching to dynamic-shape kernels after the
    first recompile. Affects torch.compile and Megatron's jit_fuser (torch.compile) functions."""
    try:
        import torch._dynamo

        torch._dynamo.reset()
    except Exception:  # noqa: BLE001
        pass


def _cleanup(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _version(module_name):
    try:
        from importlib import metadata

        return metadata.version(module_name)
    except Exception:  # noqa: BLE001
        return "not installed"


class _Source(torch.autograd.Function):
    """Fresh logits for each iteration, as a NON-leaf tensor of the autograd graph.

    In training the loss gets the output layer's result: an intermediate of the graph, whose
    buffer nobody reads after the loss. A fresh copy per iteration also matters because two of
    the implementations overwrite their input (Liger in forward, ours in backward). The copy is
    made before the timed region starts; backward passes nothing further (the gradient that
    reaches this node is what the timed implementation produced).
    """

    @staticmethod
    def forward(ctx, base, anchor, sink):
        ctx.sink = sink
        return base.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.sink is not None:
            ctx.sink.append(grad.detach().clone())
        return None, None, None


class Timer:
    """Per-iteration device timing: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.pairs = []
        self.sleep_cycles = 0
        self.flush = None
        if self.cuda:
            self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
            self.sleep_cycles = self._calibrate_sleep()

    def _calibrate_sleep(self):
        """Cycles of torch.cuda._sleep that last PRE_DELAY_MS at the highest clock seen (at a
        lower clock the delay only grows, which is harmless)."""
        cycles = 1_000_000
        torch.cuda._sleep(50 * cycles)  # busy the GPU first so its clocks ramp up
        best = float("inf")
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            torch.cuda.synchronize()
            best = min(best, a.elapsed_time(b))
        return int(cycles * PRE_DELAY_MS / max(best, 1e-3))

    def prepare(self):
        """Untimed: push the previous data out of L2 and give the host a head start."""
        if self.cuda:
            self.flush.zero_()
            torch.cuda._sleep(self.sleep_cycles)

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, started):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.pairs.append((started, ev))
        else:
            self.pairs.append((started, time.perf_counter()))

    def median_ms(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            times = [a.elapsed_time(b) for a, b in self.pairs]
        else:
            times = [(b - a) * 1e3 for a, b in self.pairs]
        self.pairs = []
        return statistics.median(times)


# --------------------------------------------------------------------------- implementations


def _z_loss_separate(logits, coeff):
    """The usual add-on z-loss: c * logsumexp(logits)^2 in fp32, its own autograd graph."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    return coeff * lse * lse


def build_impls(tp_group, device):
    """[(name, callable(logits, target) -> (loss, z_loss) or None, note)]."""
    impls = []
    coeff = Z_LOSS_COEFF

    # 1. this package
    try:
        import mindspeed_cez
        from mindspeed_cez import kernels as cez_kernels

        backend = cez_kernels.backend_for(device, BACKEND).__name__.rsplit(".", 1)[-1]

        def ours(x, t):
            return mindspeed_cez.vocab_parallel_cross_entropy_zloss(x, t, z_loss_coeff=coeff, tp_group=tp_group,
                                                                    backend=BACKEND)

        impls.append(("mindspeed_cez", ours, f"backend {backend}"))
    except Exception as exc:  # noqa: BLE001
        impls.append(("mindspeed_cez", None, _short(exc)))

    # 2. Megatron-Core native vocab-parallel CE + separate z-loss
    try:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        kwargs = {}
        if "tp_group" in inspect.signature(vocab_parallel_cross_entropy).parameters:
            kwargs["tp_group"] = tp_group

        def mcore_native(x, t):
            z = _z_loss_separate(x, coeff)
            ce = vocab_parallel_cross_entropy(x, t, **kwargs)
            return ce + z, z.detach()

        impls.append(("megatron native CE + z", mcore_native, ""))
    except Exception as exc:  # noqa: BLE001
        impls.append(("megatron native CE + z", None, _short(exc)))

    # 3. Megatron-Core fused CE + separate z-loss
    try:
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        def mcore_fused(x, t):
            z = _z_loss_separate(x, coeff)
            ce = fused_vocab_parallel_cross_entropy(x, t, tp_group)
            return ce + z, z.detach()

        impls.append(("megatron fused CE + z", mcore_fused, ""))
    except Exception as exc:  # noqa: BLE001
        impls.append(("megatron fused CE + z", None, _short(exc)))

    # 4. Liger-Kernel CE with built-in z-loss (lse_square_scale)
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        params = inspect.signature(liger_cross_entropy).parameters
        missing = [p for p in ("lse_square_scale", "return_z_loss", "reduction") if p not in params]
        if missing:
            raise ImportError(f"liger_cross_entropy has no {missing}")

        def liger(x, t):
            out = liger_cross_entropy(x, t, reduction="none", lse_square_scale=coeff, return_z_loss=True)
            if hasattr(out, "loss"):
                return out.loss, out.z_loss
            return out[0], out[1]

        impls.append(("liger-kernel CE(z)", liger, f"v{_version('liger-kernel')}, loss in logits dtype"))
    except Exception as exc:  # noqa: BLE001
        impls.append(("liger-kernel CE(z)", None, _short(exc)))

    # 5. torch.compile of CE + z-loss
    try:
        import torch._dynamo as dynamo

        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, 64)

        def ce_z(x, t):
            xf = x.float()
            lse = torch.logsumexp(xf, dim=-1)
            z = coeff * lse * lse
            ce = F.cross_entropy(xf, t, reduction="none")
            return ce + z, z.detach()

        compiled = torch.compile(ce_z, dynamic=False)
        impls.append(("torch.compile CE + z", compiled, ""))
    except Exception as exc:  # noqa: BLE001
        impls.append(("torch.compile CE + z", None, _short(exc)))
    return impls


# --------------------------------------------------------------------------- measurements


def float64_reference(base, target, upstream, coeff):
    x = base.double()
    lse = torch.logsumexp(x, dim=-1)
    loss = lse - x.gather(1, target[:, None]).squeeze(1) + coeff * lse * lse
    z = coeff * lse * lse
    grad = torch.softmax(x, dim=-1) * (1.0 + 2.0 * coeff * lse)[:, None]
    grad.scatter_add_(1, target[:, None], -torch.ones_like(lse)[:, None])
    grad *= upstream.double()[:, None]
    return loss, z, grad


def _rel(actual, expected):
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def check_correctness(fn, base, target, upstream, ref):
    anchor = torch.zeros((), device=base.device, requires_grad=True)
    sink = []
    x = _Source.apply(base, anchor, sink)
    loss, z = fn(x, target)
    torch.autograd.backward(loss, upstream.to(loss.dtype))
    ref_loss, ref_z, ref_grad = ref
    if not sink:
        raise RuntimeError("no gradient reached the logits")
    return _rel(loss.detach(), ref_loss), _rel(z.detach(), ref_z), _rel(sink[0], ref_grad)


def time_impl(fn, base, target, upstream, timer, warmup, iters):
    """Median ms of forward and of forward+backward, and memory (bytes) beyond the inputs."""
    anchor = torch.zeros((), device=base.device, requires_grad=True)
    grads = {}

    def grad_for(loss):
        g = grads.get(loss.dtype)
        if g is None:
            g = grads[loss.dtype] = upstream.to(loss.dtype)
        return g

    for _ in range(warmup):
        x = _Source.apply(base, anchor, None)
        loss, z = fn(x, target)
        torch.autograd.backward(loss, grad_for(loss))
        del x, loss, z

    results = {}
    for mode in ("fwd", "fwd+bwd"):
        for _ in range(iters):
            x = _Source.apply(base, anchor, None)
            timer.prepare()
            started = timer.start()
            loss, z = fn(x, target)
            if mode == "fwd+bwd":
                torch.autograd.backward(loss, grad_for(loss))
            timer.stop(started)
            del x, loss, z
        results[mode] = timer.median_ms()

    results["held"] = results["peak"] = None
    if base.device.type == "cuda":
        dev = base.device
        x = _Source.apply(base, anchor, None)
        _cleanup(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        loss, z = fn(x, target)
        torch.cuda.synchronize(dev)
        results["held"] = torch.cuda.memory_allocated(dev) - before  # saved for backward + outputs
        torch.autograd.backward(loss, grad_for(loss))
        torch.cuda.synchronize(dev)
        results["peak"] = torch.cuda.max_memory_allocated(dev) - before
        del x, loss, z
    return results


def copy_bandwidth(device, nbytes=2 << 30, iters=20):
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    if device.type != "cuda":
        nbytes = 64 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    timer = Timer(device)
    for _ in range(3):
        dst.copy_(src)
    for _ in range(iters):
        started = timer.start()
        dst.copy_(src)
        timer.stop(started)
    ms = timer.median_ms()
    del src, dst, timer
    _cleanup(device)
    return 2 * nbytes / (ms * 1e-3)


def make_inputs(n, v, device, seed, vocab_offset=0, global_vocab=None):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    base = (torch.randn(n, v, generator=gen) * LOGIT_SCALE).to(torch.bfloat16).to(device)
    target = torch.randint(0, global_vocab or v, (n,), generator=gen).to(device)
    mask = (torch.rand(n, generator=gen) < 0.95).float()
    upstream = (mask / mask.sum().clamp_min(1.0)).to(device)  # loss_mask / num_tokens
    return base, target, upstream


def make_inputs_on_device(n, v, device, seed, global_vocab=None):
    """Large inputs are drawn on the device (the CPU would take seconds per GiB)."""
    if device.type != "cuda":
        return make_inputs(n, v, device, seed, global_vocab=global_vocab)
    gen = torch.Generator(device=device).manual_seed(seed)
    base = torch.empty(n, v, dtype=torch.bfloat16, device=device)
    chunk = max(1, (1 << 28) // v)
    for start in range(0, n, chunk):  # fp32 working chunks of <= 1 GiB
        rows = min(chunk, n - start)
        base[start : start + rows] = torch.randn(rows, v, device=device, generator=gen) * LOGIT_SCALE
    target = torch.randint(0, global_vocab or v, (n,), device=device, generator=gen)
    mask = (torch.rand(n, device=device, generator=gen) < 0.95).float()
    upstream = mask / mask.sum().clamp_min(1.0)
    return base, target, upstream


# --------------------------------------------------------------------------- reporting


def _fmt_ms(ms):
    return "-" if ms is None else (f"{ms:.3f}" if ms < 10 else f"{ms:.2f}")


def _fmt_ratio(a, b):
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}"


def _fmt_mem(nbytes, logits_bytes):
    if nbytes is None:
        return "n/a"
    return f"{nbytes / 2**30:.2f} ({nbytes / logits_bytes:.1f}x)"


def _fmt_per_token(nbytes, tokens):
    return "n/a" if nbytes is None else f"{nbytes / tokens:.0f}"


def header_lines(device, extra=()):
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    else:
        name = f"CPU ({platform.processor() or platform.machine()})"
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "not installed"
    try:
        import mindspeed_cez

        cez = f"{mindspeed_cez.__version__} from {os.path.dirname(mindspeed_cez.__file__)}"
    except Exception as exc:  # noqa: BLE001
        cez = _short(exc)
    lines = [
        f"- device: {name}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- python {platform.python_version()}, torch {torch.__version__}, triton {triton_version}, "
        f"megatron-core {_version('megatron-core')}, liger-kernel {_version('liger-kernel')}",
        f"- mindspeed_cez {cez}",
        f"- env: TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}, "
        f"MINDSPEED_CEZ_BACKEND={os.environ.get('MINDSPEED_CEZ_BACKEND', '')!r}",
    ]
    return lines + list(extra)


def write_report(path, lines):
    text = "\n".join(lines) + "\n"
    if path:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
    return text


# --------------------------------------------------------------------------- single-process run


def init_single_process(device):
    """World size 1 (NCCL on a GPU, gloo on the CPU) and Megatron's parallel state, TP=1."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    tp_group, note = dist.group.WORLD, "tp_group = WORLD (size 1)"
    try:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        note = "Megatron parallel_state TP=1"
    except Exception as exc:  # noqa: BLE001
        note += f"; Megatron parallel_state not initialized ({_short(exc, 100)})"
    return tp_group, note


def run_single(args, device):
    t_begin = time.time()
    tp_group, tp_note = init_single_process(device)
    impls = build_impls(tp_group, device)
    if args.impls:
        impls = [impl for impl in impls if any(impl[0].startswith(prefix) for prefix in args.impls)]
    shapes = args.shapes or (SMOKE_SHAPES if args.smoke else GPU_SHAPES)
    check_shape = SMOKE_CHECK_SHAPE if args.smoke else GPU_CHECK_SHAPE

    bw = copy_bandwidth(device)
    _log(f"copy bandwidth: {bw / 1e12:.3f} TB/s (read + write)")
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
    ref = float64_reference(base, target, upstream, Z_LOSS_COEFF)
    check_rows = []
    for name, fn, note in impls:
        if fn is None:
            check_rows.append(f"| {name} | - | - | - | {ROW_UNAVAILABLE}: {note} |")
            continue
        try:
            loss_err, z_err, grad_err = check_correctness(fn, base, target, upstream, ref)
            check_rows.append(f"| {name} | {loss_err:.1e} | {z_err:.1e} | {grad_err:.1e} | {note} |")
        except Exception as exc:  # noqa: BLE001
            check_rows.append(f"| {name} | - | - | - | error: {_short(exc)} |")
            traceback.print_exc()
        _log(check_rows[-1])
        _cleanup(device)
    del base, target, upstream, ref
    _cleanup(device)

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
        "| N x V | impl | fwd ms | fwd / floor | fwd+bwd ms | fwd+bwd / floor | held after fwd GiB (x logits) "
        "| peak fwd+bwd GiB (x logits) | peak bytes / token |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    _log(write_report(args.out, report))

    timer = Timer(device)
    for n, v in shapes:
        logits_bytes = n * v * 2
        floor_fwd = logits_bytes / bw * 1e3
        floor_all = 3 * logits_bytes / bw * 1e3
        shape = f"{n} x {v}"
        report.append(f"| {shape} | floor ({bw / 1e12:.2f} TB/s copy) | {_fmt_ms(floor_fwd)} | 1 | {_fmt_ms(floor_all)} | 1 | | | |")
        _reset_compiled()
        try:
            base, target, upstream = make_inputs_on_device(n, v, device, seed=n + v)
        except Exception as exc:  # noqa: BLE001
            report.append(f"| {shape} | (inputs) | {'OOM' if _is_oom(exc) else 'error'}: {_short(exc)} | | | | | | |")
            _cleanup(device)
            continue
        for name, fn, note in impls:
            if fn is None:
                report.append(f"| {shape} | {name} | {ROW_UNAVAILABLE} | | | | | | |")
                continue
            if args.budget_s and time.time() - t_begin > args.budget_s:
                report.append(f"| {shape} | {name} | skipped: time budget {args.budget_s} s spent | | | | | | |")
                continue
            t0 = time.time()
            try:
                r = time_impl(fn, base, target, upstream, timer, args.warmup, args.iters)
                row = (
                    f"| {shape} | {name} | {_fmt_ms(r['fwd'])} | {_fmt_ratio(r['fwd'], floor_fwd)} "
                    f"| {_fmt_ms(r['fwd+bwd'])} | {_fmt_ratio(r['fwd+bwd'], floor_all)} "
                    f"| {_fmt_mem(r['held'], logits_bytes)} | {_fmt_mem(r['peak'], logits_bytes)} "
                    f"| {_fmt_per_token(r['peak'], n)} |"
                )
            except Exception as exc:  # noqa: BLE001
                kind = "OOM" if _is_oom(exc) else "error"
                row = f"| {shape} | {name} | {kind}: {_short(exc)} | | | | | | |"
                if kind == "error":
                    traceback.print_exc()
            timer.pairs = []
            report.append(row)
            _log(f"{row}   [{time.time() - t0:.1f} s]")
            _cleanup(device)
            write_report(args.out, report)
        del base, target, upstream
        _cleanup(device)

    report += ["", f"total wall time {time.time() - t_begin:.0f} s"]
    text = write_report(args.out, report)
    _log("\n" + text)
    if args.out:
        _log(f"written to {args.out}")


# --------------------------------------------------------------------------- tensor-parallel run


def run_tp(args, device):
    """Per rank: our kernels alone on the shard, the op at TP=1 on the shard, the op at TP=world."""
    from mindspeed_cez import kernels as cez_kernels
    from mindspeed_cez import vocab_parallel_cross_entropy_zloss as op
    from mindspeed_cez.cross_entropy_zloss import cross_entropy_zloss_with_lse

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
            step(_Source.apply(shard, anchor, None))
        for _ in range(args.iters):
            x = _Source.apply(shard, anchor, None)
            aligned()
            timer.prepare()
            started = timer.start()
            step(x)
            timer.stop(started)
            del x
        return timer.median_ms()

    # lse for the gradient kernel (computed once, untimed): the op's value at TP=world
    with torch.no_grad():
        loss_ref, _, lse = cross_entropy_zloss_with_lse(shard, target, Z_LOSS_COEFF, tp_group=group)
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
    ref_loss, _, _ = float64_reference(full, target[:check_rows], upstream[:check_rows], Z_LOSS_COEFF)
    loss_err = _rel(loss_ref[:check_rows], ref_loss)

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
                f"| {item['rank']} | {what} | {_fmt_ms(fwd)} | {_fmt_ratio(fwd, floor_fwd)} "
                f"| {_fmt_ms(both)} | {_fmt_ratio(both, floor_all)} |"
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
    _log("\n" + text)
    if args.out:
        _log(f"written to {args.out}")


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
        _log("no CUDA device: running the CPU smoke shapes (pass --smoke to say so)")
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
