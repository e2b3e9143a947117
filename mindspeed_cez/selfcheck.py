"""Check the fused loss on this machine before a long run, and make a report for a bug.

    python -m mindspeed_cez.selfcheck                 # a table; exit status 0: every check passed
    python -m mindspeed_cez.selfcheck --json out.json # the same, with device and versions, as JSON
    torchrun --nproc-per-node 2 -m mindspeed_cez.selfcheck   # TP = world size, through the collectives

On the current device (CUDA, an Ascend NPU through torch_npu, else the CPU) it runs both ops,
``vocab_parallel_cross_entropy_zloss`` and ``linear_cross_entropy_zloss``, with every backend the
package would pick there (marked ``*``) and each alternative (``triton``, ``torch``, on NPUs
``cann``; the fused layer's ``gemm`` / ``triton`` projections and its ``grads="forward"`` path),
at a small size and at a real one (vocab 151936), in each dtype, on fresh random inputs with
ignored tokens, label smoothing and a z-loss; it compares loss, z-loss and gradients with a
float64 reference computed a block of rows at a time (on the CPU where the device has no fast
float64: NPUs), and times forward + backward beside torch's own cross entropy. Under ``torchrun``
(or an initialized process group) each rank holds a vocab slice of the same global logits; the
errors are the largest over the ranks, which all print the same verdict (rank 0 prints).

Only the public ops and ``mindspeed_cez.kernels`` are used: no Megatron, no patches.
"""

import argparse
import gc
import importlib
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mindspeed_cez import linear_cross_entropy_zloss, vocab_parallel_cross_entropy_zloss
from mindspeed_cez.linear_cross_entropy import GradientPath, LinearCrossEntropyOptions, TrainerInputs
from mindspeed_cez.kernels import cann
from mindspeed_cez.environment import read_backends
from mindspeed_cez.selfcheck_cases import REAL_VOCAB, absent_backends, ce_backends, linear_variants, sizes
from mindspeed_cez.selfcheck_report import environment, table

IGNORE = -100
Z_LOSS_COEFF = 1e-4
SMOOTHING = 0.1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Relative L2 error allowed, (loss and z-loss, gradients), per input dtype: fp32 results of
# 16-bit inputs, gradients written in the input dtype. The vendor op returns 16-bit losses, and the
# fused layer's GEMM path rounds its logits to the input dtype: those take LOSS_16BIT_ROUNDED.
TOLERANCE = {"fp32": (2e-5, 2e-5), "bf16": (2e-5, 1.2e-2), "fp16": (2e-5, 2e-3)}
LOSS_16BIT_ROUNDED = 1.2e-2
LINEAR_GRAD_16BIT = 2.5e-2  # dhidden / dweight: GEMMs over 16-bit gradient tiles


# ------------------------------------------------------------------------------------ device
def current_device():
    """CUDA, else an NPU (torch_npu imported and a device present), else the CPU; the local rank's."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    try:
        importlib.import_module("torch_npu")
        if torch.npu.is_available():  # torch.npu exists once torch_npu is imported
            torch.npu.set_device(local % torch.npu.device_count())
            return torch.device("npu", torch.npu.current_device())
    except (ImportError, AttributeError):
        pass
    return torch.device("cpu")


def _synchronize(device):
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and module is not None and hasattr(module, "synchronize"):
        module.synchronize()


# ----------------------------------------------------------------------- float64, row blocks
def _reference_device(device):
    return device if device.type in ("cuda", "cpu") else torch.device("cpu")  # NPUs: no fast float64


def _loss64(x, target):
    lse = torch.logsumexp(x, dim=-1)
    log_probs = x - lse[:, None]
    valid = target != IGNORE
    safe = torch.where(valid, target, torch.zeros_like(target))
    nll = -log_probs.gather(1, safe[:, None]).squeeze(1)
    z = Z_LOSS_COEFF * lse * lse
    loss = (1 - SMOOTHING) * nll - SMOOTHING * log_probs.mean(-1) + z
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(valid, loss, zero), torch.where(valid, z, zero)


class _Error:
    """Relative L2 error accumulated over blocks: ||got - want|| / ||want||."""

    def __init__(self):
        self.num = self.den = 0.0

    def add(self, got, want):
        self.num += (got.double() - want).norm().item() ** 2
        self.den += want.norm().item() ** 2

    def value(self):
        return math.sqrt(self.num) / max(math.sqrt(self.den), 1e-30)


def _block_rows(vocab):
    return max(1, (1 << 25) // vocab)  # ~256 MiB of float64 logits per block


# ---------------------------------------------------------------------------------- the checks
def _inputs(rows, vocab, hidden, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)  # the same global tensors on every rank
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[::5] = IGNORE
    mask = (target != IGNORE).float()
    upstream = (torch.rand(rows, generator=gen) + 0.5) * mask
    h = torch.randn(rows, hidden, generator=gen) / hidden ** 0.25
    w = torch.randn(vocab, hidden, generator=gen) / hidden ** 0.25
    return [t.to(device) for t in (target, mask, upstream)] + [h.to(dtype).to(device), w.to(dtype).to(device)]


def _shard(t, rank, world, dim=-1):
    width = t.shape[dim] // world
    return t.narrow(dim, rank * width, width).contiguous()


WARMUP_MIN, WARMUP_MAX = 2, 8  # untimed calls before the timed ones


def _call_ms(fn, device):
    start = time.perf_counter()
    fn()
    _synchronize(device)
    return 1e3 * (time.perf_counter() - start)


def _time_ms(fn, device, reps, group=None):
    """The median of at least ``reps`` timed calls, after untimed warm-up calls (at least ``WARMUP_MIN``,
    until two in a row agree within 25 %, at most ``WARMUP_MAX``): a first call's compilation, allocations
    and thread start-up stay out of the timed region, as does Python's garbage collector. Where the
    median is still over twice the fastest call (a machine that stalls this process for seconds now and
    then), up to ``2 * reps`` more calls join, so that a few stalls do not make the median. With a
    ``group`` every rank makes the same number of calls (``fn`` runs collectives): a rank goes on while
    any rank would."""

    def any_rank(flag):
        return bool(_max_over_ranks([float(flag)], device, group)[0])

    last = _call_ms(fn, device)
    for done in range(1, WARMUP_MAX):
        now = _call_ms(fn, device)
        settled = done + 1 >= WARMUP_MIN and abs(now - last) <= 0.25 * max(now, last)
        if not any_rank(not settled):
            break
        last = now
    gc.collect()
    gc.disable()
    try:
        times = [_call_ms(fn, device) for _ in range(reps)]
        while len(times) < 3 * reps and any_rank(statistics.median(times) > 2 * min(times)):
            times.append(_call_ms(fn, device))
    finally:
        gc.enable()
    return statistics.median(times)


def check_ce(backend, dtype, rows, vocab, device, group, reps, seed):
    """Errors and timings of ``vocab_parallel_cross_entropy_zloss`` on this rank's vocab slice."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    target, _, upstream, h, w = _inputs(rows, vocab, 32, dtype, device, seed)
    logits = (h.float() @ w.float().t() * 2.0).to(dtype)  # logits of a real head's spread
    local = _shard(logits, rank, world).requires_grad_(True)

    def step():
        local.grad = None
        loss, z_loss = vocab_parallel_cross_entropy_zloss(local, target, Z_LOSS_COEFF, SMOOTHING, IGNORE, group,
                                                          backend=backend)
        loss.backward(upstream)
        return loss, z_loss

    loss, z_loss = step()
    errors = {k: _Error() for k in ("loss", "z_loss", "grad")}
    ref_device = _reference_device(device)
    width = vocab // world
    for start in range(0, rows, _block_rows(vocab)):
        block = slice(start, start + _block_rows(vocab))
        x = logits[block].to(ref_device).double().requires_grad_(True)
        loss64, z64 = _loss64(x, target[block].to(ref_device))
        (grad64,) = torch.autograd.grad(loss64, x, upstream[block].to(ref_device).double())
        errors["loss"].add(loss[block].detach().to(ref_device), loss64.detach())
        errors["z_loss"].add(z_loss[block].to(ref_device), z64.detach())
        errors["grad"].add(local.grad[block].to(ref_device), grad64[:, rank * width:(rank + 1) * width])
    timing = {}
    if reps:
        timing["ms"] = _time_ms(step, device, reps, group)
        full = logits.detach().requires_grad_(True)

        def torch_step():
            full.grad = None
            F.cross_entropy(full.float(), target, ignore_index=IGNORE, reduction="none").backward(upstream)

        timing["torch_ms"] = _time_ms(torch_step, device, reps, group)
    return errors, timing


def check_linear(linear_backend, grads, ce_backend, dtype, rows, vocab, hidden, device, group, reps, seed):
    """Errors and timings of ``linear_cross_entropy_zloss`` on this rank's weight rows."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    target, mask, _, h, w = _inputs(rows, vocab, hidden, dtype, device, seed)
    upstream = 0.5 * mask  # k * token_weights: what grads="forward" requires (any works for "recompute")
    h = h.requires_grad_(True)
    w_local = _shard(w, rank, world, dim=0).requires_grad_(True)
    options = LinearCrossEntropyOptions(path=GradientPath(grads), backend=ce_backend, linear_backend=linear_backend)
    trainer = TrainerInputs(token_weights=mask, grad_scale=0.5) if grads == "forward" else None

    def step():
        h.grad = w_local.grad = None
        loss, z_loss = linear_cross_entropy_zloss(h, w_local, target, Z_LOSS_COEFF, SMOOTHING, IGNORE, group,
                                                  options=options, trainer=trainer)
        loss.backward(upstream)
        return loss, z_loss

    loss, z_loss = step()
    errors = {k: _Error() for k in ("loss", "z_loss", "dhidden", "dweight")}
    ref_device = _reference_device(device)
    w64 = w.to(ref_device).double()
    dw64 = torch.zeros_like(w64)
    for start in range(0, rows, _block_rows(vocab)):
        block = slice(start, start + _block_rows(vocab))
        h64 = h[block].detach().to(ref_device).double().requires_grad_(True)
        w64.requires_grad_(True)
        loss64, z64 = _loss64(h64 @ w64.t(), target[block].to(ref_device))
        dh64, dw_block = torch.autograd.grad(loss64, (h64, w64), upstream[block].to(ref_device).double())
        dw64 += dw_block
        errors["loss"].add(loss[block].detach().to(ref_device), loss64.detach())
        errors["z_loss"].add(z_loss[block].to(ref_device), z64.detach())
        errors["dhidden"].add(h.grad[block].to(ref_device), dh64)
    width = vocab // world
    errors["dweight"].add(w_local.grad.to(ref_device), dw64[rank * width:(rank + 1) * width])
    timing = {}
    if reps:
        timing["ms"] = _time_ms(step, device, reps, group)
        hf, wf = h.detach().requires_grad_(True), w.detach().requires_grad_(True)

        def torch_step():
            hf.grad = wf.grad = None
            F.cross_entropy((hf @ wf.t()).float(), target, ignore_index=IGNORE, reduction="none").backward(upstream)

        timing["torch_ms"] = _time_ms(torch_step, device, reps, group)
    return errors, timing


def _max_over_ranks(values, device, group):
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device if device.type != "cpu" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def run(args, device, group=None, chosen=None):
    """Every check; a list of result dicts (identical on every rank). ``chosen``: the variables'
    backends (:func:`mindspeed_cez.environment.read_backends`): the ``auto`` column marks what a run uses."""
    world = dist.get_world_size(group) if group is not None else 1
    dtypes = args.dtypes or (["fp32", "bf16"] if device.type == "cpu" else ["fp32", "bf16", "fp16"])
    results = []
    for size, rows, vocab, hidden in sizes(device, args):
        reps = args.reps if size == "real" else 0
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            cases = [("vocab_parallel_cross_entropy_zloss", b, None, None, auto)
                     for b, auto in ce_backends(device, world, chosen)]
            cases += [("linear_cross_entropy_zloss", lb, g, ce, auto) for lb, g, ce, auto in linear_variants(device, world, chosen)]
            for op, backend, grads, ce_backend, auto in cases:
                interpreted = device.type == "cpu" and "triton" in (backend, ce_backend)
                row = {"op": op, "backend": backend or "auto", "ce_backend": ce_backend, "grads": grads, "auto": auto,
                       "dtype": dtype_name,
                       "size": size, "rows": rows, "vocab": vocab, "tp": world}
                if interpreted and size == "real":
                    row.update(status="skipped", reason="Triton's CPU interpreter: small size only")
                    results.append(row)
                    continue
                seed = len(results) + 1
                failure = None
                try:
                    if op.startswith("vocab"):
                        errors, timing = check_ce(backend, dtype, rows, vocab, device, group, reps, seed)
                    else:
                        errors, timing = check_linear(backend, grads, ce_backend, dtype, rows, vocab, hidden, device,
                                                      group, reps, seed)
                    names = list(errors)
                    values = [errors[k].value() for k in names]
                except Exception as exc:  # noqa: BLE001 - reported in the table, the run goes on
                    failure = f"{type(exc).__name__}: {exc}"
                    row["traceback"] = traceback.format_exc(limit=6)
                    names, values, timing = [], [], {}
                failed = _max_over_ranks([float(failure is not None)], device, group)[0]
                if failed:
                    row.update(status="FAIL", reason=failure or "failed on another rank")
                    results.append(row)
                    continue
                values = _max_over_ranks(values, device, group)
                row["errors"] = dict(zip(names, values))
                row["tolerance"] = _tolerance(op, backend, dtype_name)
                row.update({k: round(v, 3) for k, v in timing.items()})
                bad = [k for k, v in row["errors"].items() if not v <= row["tolerance"][k]]  # NaN fails
                row["status"] = "FAIL" if bad else "ok"
                if bad:
                    row["reason"] = "over tolerance: " + ", ".join(bad)
                results.append(row)
    return results


def _tolerance(op, backend, dtype_name):
    loss_tol, grad_tol = TOLERANCE[dtype_name]
    sixteen = dtype_name != "fp32"
    if sixteen and (backend == cann.NAME or op.startswith("linear")):
        loss_tol = LOSS_16BIT_ROUNDED
    if op.startswith("linear"):
        grad_tol = LINEAR_GRAD_16BIT if sixteen else 1e-4
        return {"loss": loss_tol, "z_loss": loss_tol, "dhidden": grad_tol, "dweight": grad_tol}
    return {"loss": loss_tol, "z_loss": loss_tol, "grad": grad_tol}




def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mindspeed_cez.selfcheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write device, versions and results as JSON ('-': stdout)")
    parser.add_argument("--dtypes", type=lambda s: s.split(","), help="comma-separated, of fp32,bf16,fp16 "
                        "(default: fp32,bf16,fp16 on accelerators, fp32,bf16 on the CPU)")
    parser.add_argument("--skip-real", action="store_true", help="only the small size (no vocab 151936)")
    parser.add_argument("--real-rows", type=int, help="tokens at the real size (default: 2048, on the CPU 8)")
    parser.add_argument("--small-rows", type=int, default=64, help="tokens at the small size (default 64)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions at the real size (0: no timing)")
    args = parser.parse_args(argv)
    bad = [d for d in args.dtypes or () if d not in DTYPES]
    if bad:
        parser.error(f"--dtypes: unknown {bad}; choose from {list(DTYPES)}")
    if args.real_rows is not None and args.real_rows < 1 or args.small_rows < 1 or args.reps < 0:
        parser.error("--real-rows and --small-rows must be >= 1, --reps >= 0")
    return args


def main(argv=None, group=None):
    """Run, print the table (rank 0), write --json; returns the exit status (0: all passed)."""
    args = parse_args(argv)
    try:  # the MINDSPEED_CEZ_* variables, checked as on every route; set, they mark the rows a run uses
        chosen = read_backends()
    except ValueError as err:
        sys.exit(f"selfcheck: error: {err}")
    device = current_device()
    created = group is None and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if created:  # under torchrun: the group this run makes, and destroys at its end
        dist.init_process_group({"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo"))
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size(group) if group is not None else 1
    if 1000 % world or REAL_VOCAB % world:
        sys.exit(f"selfcheck: the small vocab (1000) and 151936 must divide by the world size, got {world}")
    info = environment(device)
    results = run(args, device, group if world > 1 else None, chosen)
    absent = absent_backends(device, world)
    ok = all(r["status"] != "FAIL" for r in results)
    if rank == 0:
        print(f"mindspeed_cez selfcheck on {info['device']} ({info['device_name']}), tensor-parallel size {world}: "
              f"torch {info['torch']}, triton {info['triton']}"
              + (f", triton-ascend {info['triton-ascend']}" if info["triton-ascend"] else "")
              + (f", torch_npu {info['torch_npu']}, CANN {info['cann']}" if info["torch_npu"] else ""))
        print(table(results))
        for name, why in absent.items():
            print(f"no {name} rows: {why}")
        print(f"\n{'PASSED' if ok else 'FAILED'}: {sum(r['status'] == 'ok' for r in results)} ok, "
              f"{sum(r['status'] == 'FAIL' for r in results)} failed, "
              f"{sum(r['status'] == 'skipped' for r in results)} skipped  (* = picked automatically here; errors: "
              "relative L2 against float64; ms: forward + backward, median)")
        if device.type == "cpu" and any("ms" in r for r in results):
            interpreted = any("ms" in r and "triton" in (r["backend"], r["ce_backend"]) for r in results)
            print("ms on the CPU: indicative only (" + ("the Triton rows run in its interpreter; " if interpreted else "")
                  + "other work on the machine moves every row); compare times on an accelerator")
        if args.json:
            report = json.dumps({"ok": ok, "environment": info, "results": results, "absent_backends": absent},
                                indent=1, default=str)
            if args.json == "-":
                print(report)
            else:
                with open(args.json, "w") as f:
                    f.write(report + "\n")
                print(f"wrote {os.path.abspath(args.json)} (device, versions, results: what a bug report needs)")
    if created:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
