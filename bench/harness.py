"""Measuring one implementation of the loss: fresh non-leaf logits per iteration, the
per-iteration timer (CUDA events on a GPU, perf_counter on the CPU), the copy-bandwidth floor,
memory beyond the inputs, the check against float64 (``tests/support.py``), and the inputs."""

import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from support import capture_cuda_graph, relative_error  # noqa: E402

BACKEND = os.environ.get("MINDSPEED_CEZ_BACKEND") or None  # the benchmarks' choice of the op's backend
LOGIT_SCALE = 3.0  # logits ~ N(0, 3^2): a spread like a language model's output layer
PRE_DELAY_MS = 2.0  # GPU busy-wait before each timed region so the host queues it whole
L2_FLUSH_BYTES = 256 << 20


def log(*args):
    print(*args, flush=True)


def is_oom(exc):
    oom = getattr(torch.cuda, "OutOfMemoryError", ())
    return (oom and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


def reset_compiled():
    """Forget compiled graphs, so each shape compiles for its own static sizes, as in training
    (where the loss sees one shape) rather than switching to dynamic-shape kernels after the
    first recompile. Affects torch.compile and Megatron's jit_fuser (torch.compile) functions."""
    try:
        import torch._dynamo

        torch._dynamo.reset()
    except Exception:  # noqa: BLE001
        pass


def cleanup(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class LogitsSource(torch.autograd.Function):
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



def timed(fn, warmup, iters):
    """Median ms of ``fn()`` between CUDA events, synchronized after each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def check_correctness(fn, base, target, upstream, ref):
    anchor = torch.zeros((), device=base.device, requires_grad=True)
    sink = []
    x = LogitsSource.apply(base, anchor, sink)
    loss, z = fn(x, target)
    torch.autograd.backward(loss, upstream.to(loss.dtype))
    ref_loss, ref_z, ref_grad = ref
    if not sink:
        raise RuntimeError("no gradient reached the logits")
    return relative_error(loss.detach(), ref_loss), relative_error(z.detach(), ref_z), relative_error(sink[0], ref_grad)


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
        x = LogitsSource.apply(base, anchor, None)
        loss, z = fn(x, target)
        torch.autograd.backward(loss, grad_for(loss))
        del x, loss, z

    results = {}
    for mode in ("fwd", "fwd+bwd"):
        for _ in range(iters):
            x = LogitsSource.apply(base, anchor, None)
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
        x = LogitsSource.apply(base, anchor, None)
        cleanup(dev)
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


def graph_replay_ms(fn, base, target, upstream, timer, iters):
    """Device time of one forward+backward: the step captured in a CUDA graph and replayed, L2
    flushed before each replay (no host or launch cost). None off CUDA."""
    if base.device.type != "cuda":
        return None
    anchor = torch.zeros((), device=base.device, requires_grad=True)
    g = upstream.float()

    def step():
        loss, _ = fn(LogitsSource.apply(base, anchor, None), target)
        torch.autograd.backward(loss, g.to(loss.dtype))

    try:
        graph, _ = capture_cuda_graph(step, warmup=2)
    except RuntimeError as exc:  # not capturable here: the event timings still stand
        log(f"CUDA graph capture failed: {exc}")
        return None
    for _ in range(iters):
        timer.prepare()
        started = timer.start()
        graph.replay()
        timer.stop(started)
    ms = timer.median_ms()
    del graph
    return ms


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
    cleanup(device)
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
