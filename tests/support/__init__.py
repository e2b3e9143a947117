"""What the tests share: a free port, real ranks, float64
references, error measures, CUDA-graph capture and the adaptor's grad-scale record.

The references are written independently of the package: plain log-softmax in float64, no
online softmax, no sharding.
"""

import contextlib
import datetime
import importlib.util
import os
import pickle
import queue
import random
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the suite's root: tests/
REPO = os.path.dirname(TESTS)
STAND_INS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stand_ins")  # put first on sys.path by the tests that use them


# A tiny GPT's Megatron command line (mock data, NullTokenizer): what Megatron's parser needs to validate
# the --lm-* flags beside it
TINY_MEGATRON_ARGV = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
]


def load_example(name):
    """``examples/NAME.py`` as the module ``NAME``, only where that script is the subject under test: the tests
    of tests/examples/ and the end-to-end harness (``megatron_pretrain_harness.py`` runs
    ``examples/pretrain_gpt.py`` as a user launches it). Nothing the tests share comes from examples/ (the CPU
    mode is the package's: ``mindspeed_cez.patches.cpu_mode``); examples/ stays off ``sys.path``. Loaded once
    per process."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "examples", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look the module up by name
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------- processes
def _ephemeral_range():
    """The kernel's range for ports it hands out on its own (NCCL's bootstrap sockets, clients)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = (int(v) for v in fh.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_PORTS = random.Random()  # its own generator: seeded tests do not make processes pick alike


def free_ports(n=1):
    """``n`` distinct TCP ports free on 127.0.0.1 right now, drawn at random below the ephemeral range
    (a port bound to 0 comes from that range, where NCCL and every other process also take theirs
    between the pick and the rendezvous store's bind: two test runs side by side collided there)."""
    low, _ = _ephemeral_range()
    first = 10000 if low > 12000 else 1024
    chosen, held = [], []
    try:
        while len(chosen) < n:
            port = _PORTS.randrange(first, low)
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            held.append(sock)  # held until all are chosen: none repeats
            chosen.append(port)
        return chosen
    finally:
        for sock in held:
            sock.close()


def free_port():
    """A TCP port free on 127.0.0.1 right now (see :func:`free_ports`)."""
    return free_ports(1)[0]


def _rank_main(rank, world_size, port, backend, fn, args, reports):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # Every rank done before any tears the group down: a rank that destroys its gloo group
        # while a peer still talks to it can abort ("terminate called without an active exception").
        dist.barrier()
        reports.put((rank, None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        reports.put((rank, f"rank {rank}:\n{traceback.format_exc()}"))
    # The outcome is reported: the teardown decides nothing. torch 2.7.1's gloo was seen to hang in
    # destroy_process_group (holding the GIL) after every rank passed the barrier, and gloo's threads
    # to abort a rank (exit -6) in the interpreter's teardown (CI, 2026-11-23): the parent ends a rank
    # that has not left a few seconds after every rank reported, and os._exit skips the interpreter's.
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


TEARDOWN_S = 20  # how long ranks that reported may take to leave before they are ended


def run_on_ranks(world_size, fn, *args, timeout=300, backend="gloo"):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes (one torch thread
    each; rank r on cuda:r with NCCL); re-raise any rank's failure, and fail if a rank reports
    nothing within ``timeout`` seconds (a hang, or a crash). ``fn`` must be module-level."""
    ctx = mp.get_context("spawn")
    reports = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, backend, fn, args, reports))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcome, deadline = {}, time.monotonic() + timeout
    while len(outcome) < world_size and time.monotonic() < deadline:
        if not reports.empty():
            rank, error = reports.get()
            outcome[rank] = error
        elif any(p.exitcode is not None for r, p in enumerate(procs) if r not in outcome):
            time.sleep(0.5)  # a rank left without a report (crashed): let a late report arrive, then stop
            while not reports.empty():
                rank, error = reports.get()
                outcome[rank] = error
            break
        else:
            time.sleep(0.02)
    for p in procs:
        p.join(TEARDOWN_S if len(outcome) == world_size else 1)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    failures = [error for error in outcome.values() if error]
    if failures:
        raise AssertionError("\n".join(failures))
    silent = {r: p.exitcode for r, p in enumerate(procs) if r not in outcome}
    assert not silent, f"ranks that reported nothing within {timeout} s (rank: exit code): {silent}"


def _pool_rank_main(rank, world_size, port, jobs, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # a job that leaves the ranks out of step ends in a timeout here, reported, not a hang
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    groups, size = {world_size: dist.group.WORLD}, world_size // 2
    while size > 1:  # every rank makes every subgroup, in the same order
        groups[size] = dist.new_group(list(range(size)))
        size //= 2
    while True:
        payload = jobs.get()
        if payload is None:
            break
        fn, tp_size, args = pickle.loads(payload)
        try:
            outcome = ("ok", fn(rank, tp_size, groups[tp_size], *args) if rank < tp_size else None)
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
            outcome = ("error", f"rank {rank}:\n{traceback.format_exc()}")
        results.put((rank, pickle.dumps(outcome)))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as _rank_main: the outcome is reported, the teardown decides nothing


class RankPool:
    """``world_size`` spawned ranks (gloo, one torch thread each) kept for many jobs: tests that run
    many small examples on real processes (the property tests) pay the spawn once. :meth:`run` calls
    ``fn(rank, tp_size, group, *args)`` on ranks ``0 .. tp_size-1`` (``group``: the world, or the
    subgroup of the first ``tp_size`` ranks; ``tp_size`` a power of two) and returns their results in
    rank order. Jobs and results travel pickled as bytes (no shared-memory tensors). A rank's
    exception, or no answer within ``timeout`` seconds, fails the call; after a timeout the pool is
    closed and every later call fails."""

    def __init__(self, world_size, timeout=120):
        ctx = mp.get_context("spawn")
        self.world_size, self.timeout, self.broken = world_size, timeout, None
        self.jobs = [ctx.SimpleQueue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_pool_rank_main, args=(r, world_size, port, self.jobs[r], self.results),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, tp_size, *args):
        assert self.broken is None, f"the rank pool stopped earlier: {self.broken}"
        assert tp_size in (1 << k for k in range(self.world_size.bit_length())) and tp_size <= self.world_size
        payload = pickle.dumps((fn, tp_size, args))
        for jobs in self.jobs:
            jobs.put(payload)
        outcome, deadline = {}, time.monotonic() + self.timeout
        while len(outcome) < self.world_size:
            try:
                rank, answer = self.results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.broken = f"ranks {sorted(set(range(self.world_size)) - set(outcome))} gave no answer within " \
                              f"{self.timeout} s"
                self.close()
                raise AssertionError(self.broken) from None
            outcome[rank] = pickle.loads(answer)
        failures = [value for status, value in outcome.values() if status == "error"]
        if failures:
            raise AssertionError("\n".join(failures))
        return [outcome[r][1] for r in range(tp_size)]

    def close(self):
        if self.broken is None:
            for jobs in self.jobs:
                jobs.put(None)
        for p in self.procs:
            p.join(TEARDOWN_S if self.broken is None else 0)
            if p.is_alive():
                p.kill()
                p.join()


# ---------------------------------------------------------------------------- float64 references
def cross_entropy_zloss_float64(logits, target, z_loss_coeff=0.0, label_smoothing=0.0, ignore_index=-100,
                                logit_scale=1.0, logit_softcap=0.0):
    """Per-token (loss, z_loss, lse) in float64; logits [..., V] over the GLOBAL vocab, first scaled
    by ``logit_scale``, then soft-capped ``cap * tanh(x / cap)`` where ``logit_softcap`` is not 0."""
    x = logits.double() * logit_scale
    if logit_softcap:
        x = logit_softcap * torch.tanh(x / logit_softcap)
    lse = torch.logsumexp(x, dim=-1)
    log_probs = x - lse.unsqueeze(-1)
    valid = target != ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target))
    nll = -log_probs.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
    smooth = -log_probs.mean(dim=-1)
    z_loss = z_loss_coeff * lse * lse
    loss = (1.0 - label_smoothing) * nll + z_loss
    if label_smoothing:  # not 0 * smooth: a -inf logit makes smooth inf
        loss = loss + label_smoothing * smooth
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(valid, loss, zero), torch.where(valid, z_loss, zero), lse


def loss_and_grad_float64(logits, target, upstream, return_lse=False, **kwargs):
    """(loss, z_loss, d(sum(upstream*loss))/d(logits)) in float64; (loss, z_loss, grad, lse) with ``return_lse``."""
    x = logits.detach().double().requires_grad_(True)
    loss, z_loss, lse = cross_entropy_zloss_float64(x, target, **kwargs)
    (grad,) = torch.autograd.grad(loss, x, upstream.double())
    out = loss.detach(), z_loss.detach(), grad
    return (*out, lse.detach()) if return_lse else out


def loss_and_grad_float64_chunked(logits, target, upstream, rows=512, **kwargs):
    """(loss, [grad of each block of ``rows`` rows]): a few hundred rows at a time in float64, for
    sizes whose full float64 copy would be huge."""
    losses, grads = [], []
    for start in range(0, logits.shape[0], rows):
        block = slice(start, start + rows)
        loss, _, grad = loss_and_grad_float64(logits[block], target[block], upstream[block], **kwargs)
        losses.append(loss)
        grads.append(grad)
    return torch.cat(losses), grads


def linear_loss_and_grads_float64(hidden, weight, target, upstream, return_lse=False, **kwargs):
    """(loss, dhidden, dweight) of ``sum(upstream * loss(hidden @ weight.T))`` in float64; with
    ``return_lse`` also the z-loss and the lse: (loss, dhidden, dweight, z_loss, lse)."""
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    loss, z_loss, lse = cross_entropy_zloss_float64(h @ w.t(), target, **kwargs)
    dh, dw = torch.autograd.grad(loss, (h, w), upstream.double())
    out = loss.detach(), dh, dw
    return (*out, z_loss.detach(), lse.detach()) if return_lse else out


# --------------------------------------------------------------------------------------- errors
def relative_error(actual, expected):
    """||actual - expected|| / ||expected|| (L2, in float64)."""
    expected = expected.double()
    diff = (actual.double() - expected).norm()
    return (diff / expected.norm().clamp_min(1e-30)).item()


def relative_error_chunked(actual, expected_blocks):
    """:func:`relative_error` of ``actual`` against its row blocks (``loss_and_grad_float64_chunked``)."""
    num = den = 0.0
    start = 0
    for expected in expected_blocks:
        got = actual[start : start + expected.shape[0]].double()
        num += (got - expected).norm().item() ** 2
        den += expected.norm().item() ** 2
        start += expected.shape[0]
    return (num / den) ** 0.5


# ------------------------------------------------------------------------------------ CUDA graph
def capture_cuda_graph(step, warmup=2):
    """(graph, what ``step()`` returned while captured): warm-up calls on a side stream (kernels
    compiled, lazy state made), then one call captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@contextlib.contextmanager
def recorded_grad_scales():
    """While open, every result of ``patches.loss_wrappers.megatron_grad_scale``, in a list: the
    upstream gradient the adaptor knew in forward for each micro-batch (None where it did not)."""
    from mindspeed_cez.patches import loss_wrappers

    original, scales = loss_wrappers.megatron_grad_scale, []

    def recording(*args):
        scales.append(original(*args))
        return scales[-1]

    loss_wrappers.megatron_grad_scale = recording
    try:
        yield scales
    finally:
        loss_wrappers.megatron_grad_scale = original


def split_transform(kwargs):
    """``(the rest, LogitTransform)`` of keywords written with the loss's loose ``logit_scale`` /
    ``logit_softcap`` (the float64 references' names): the ops take the two as one ``logit_transform``."""
    from mindspeed_cez import LogitTransform

    rest = {k: v for k, v in kwargs.items() if k not in ("logit_scale", "logit_softcap")}
    return rest, LogitTransform(kwargs.get("logit_scale", 1.0), kwargs.get("logit_softcap", 0.0))
