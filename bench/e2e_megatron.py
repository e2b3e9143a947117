"""End to end in Megatron's own ``pretrain`` (this script, relaunched by torchrun as ``worker()``): step
time and peak memory per LM loss variant, variants alternated and repeated; ``--profile`` adds the
GPU-idle and output-layer shares; every run lands in ``e2e_<config>.json`` with the run's stamp.
Variants and method: bench/README.md."""

import argparse
import bisect
import gzip
import json
import os
import re
import statistics
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import REPO, free_port, run_info  # noqa: E402

VOCAB = 151936
Z_COEFF = 1e-4

COMMON = (  # mock data, bf16, MoE of 8 experts top-2, the local transformer implementation, no fusions
    "--micro-batch-size 1 --global-batch-size 8 --seq-length 4096 --max-position-embeddings 4096 --bf16 "
    "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
    "--moe-token-dispatcher-type alltoall --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --lr 1e-4 "
    "--lr-decay-style constant --log-interval 1 --eval-iters 0 --eval-interval 100000 --seed 1234 --mock-data "
    "--tokenizer-type NullTokenizer --transformer-impl local --attention-backend unfused "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
    "--no-rope-fusion --no-persist-layer-norm --position-embedding-type rope --distributed-backend nccl "
    f"--vocab-size {VOCAB}").split()
CONFIGS = {
    # quick: 4 layers, hidden 1024, 8 experts top-2, seq 4096 (host-bound on an H100)
    "small": ("--num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 --moe-ffn-hidden-size 1024 "
              "--num-attention-heads 16").split(),
    # GPU-bound: attention on torch's SDPA (flash kernels, no s^2 scores; what a TE run has), hidden 3072,
    # 8 layers, 4 experts top-2 of ffn 6144, seq 8192; experts padded to capacity 1.0 (no host sync per MoE
    # layer: the GPU drained at each one); Python's GC off during training (Megatron's --manual-gc)
    "busy": ("--num-layers 8 --hidden-size 3072 --ffn-hidden-size 12288 --num-attention-heads 24 --num-experts 4 "
             "--moe-ffn-hidden-size 6144 --seq-length 8192 --max-position-embeddings 8192 "
             "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --manual-gc").split(),
    # GPU-bound at TP=4 + SP on H100s (busy is host-bound there, ~48 % idle): per GPU ~4x busy's TP=4 work
    # in half its launches (hidden 4096, seq 32768, 4 micro-batches of 8 layers): ~0.65 PFLOP per GPU per
    # step (~1.5 s) against ~0.5 s of host time; ~3.3B parameters, an estimated ~45 GB per GPU at TP=4 (TP >= 4)
    # long context on one GPU (bench/long_context.py sets the sequence, recompute and micro-batch): 4 layers,
    # hidden 2048, 8 experts top-2 of ffn 768 padded to capacity 1.0, SDPA attention, GC off, 2 sequences a step
    "long": ("--num-layers 4 --hidden-size 2048 --ffn-hidden-size 6144 --moe-ffn-hidden-size 768 --num-attention-heads 16 "
             "--global-batch-size 2 --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --manual-gc "
             "--no-create-attention-mask-in-dataloader").split(),
    # long's width 4x as deep: the transformer's activations, not the logits, set the memory of the fused layer
    # and the op (bench/long_context.py runs it at sequences of 8192, micro-batches of several)
    "deep": ("--num-layers 16 --hidden-size 2048 --ffn-hidden-size 6144 --moe-ffn-hidden-size 768 --num-attention-heads 16 "
             "--global-batch-size 2 --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --manual-gc "
             "--no-create-attention-mask-in-dataloader").split(),
    "busy_tp4": ("--num-layers 8 --hidden-size 4096 --ffn-hidden-size 16384 --num-attention-heads 32 --num-experts 4 "
                 "--moe-ffn-hidden-size 8192 --seq-length 32768 --max-position-embeddings 32768 --global-batch-size 4 "
                 "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --manual-gc").split(),
}
BUSY_ENV = {"CEZ_BENCH_ATTENTION": "sdpa", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
CONFIG_ENV = {"busy": BUSY_ENV, "busy_tp4": BUSY_ENV, "long": BUSY_ENV, "deep": BUSY_ENV}
MIN_TP = {"busy_tp4": 4}  # below it the parameters and activations outgrow an 80 GB GPU
VARIANTS = {
    "native": ([], {}),
    "fused": (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"], {}),
    "z_by_hand": ([], {"CEZ_BENCH_HAND_Z": str(Z_COEFF)}),
    # liger-kernel's own Megatron patch of both CE entry points (rms_norm off: only the loss changes)
    "liger": ([], {"CEZ_BENCH_LIGER": "1"}),
    # the z-loss with each mitigation beside it (their cost per step): the soft cap at 30, mu-centering, mu-loss 1e-4
    "cez_softcap": (["--lm-z-loss-coeff", str(Z_COEFF), "--lm-logit-softcap", "30"], {}),
    "cez_mu_centering": (["--lm-z-loss-coeff", str(Z_COEFF), "--lm-mu-centering"], {}),
    "cez_mu_loss": (["--lm-z-loss-coeff", str(Z_COEFF), "--lm-mu-loss-coeff", "1e-4"], {}),
    "cez": (["--lm-z-loss-coeff", str(Z_COEFF)], {}),
    # --lm-fused-output-layer: output layer + loss as one op (default: grads in forward; logits recomputed)
    "cez_fol": (["--lm-z-loss-coeff", str(Z_COEFF), "--lm-fused-output-layer"], {}),
    "cez_fol_recompute": (["--lm-z-loss-coeff", str(Z_COEFF), "--lm-fused-output-layer", "recompute"], {}),
}
OPT_IN = ("liger", "cez_softcap", "cez_mu_centering", "cez_mu_loss")  # run only when named
STEP = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|.*?elapsed time per iteration \(ms\):\s*([\d.]+)")
PEAK = re.compile(r"CEZ_BENCH peak_allocated_bytes=(\d+)")
OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|Failed to CUDA calloc")  # torch; NCCL
ALLOCATOR = re.compile(r"CEZ_BENCH allocator=(\{.*\})")
ALTERNATE_STEP = re.compile(r"CEZ_BENCH step=(\d+) fused=([01]) peak=(\d+)")
ALTERNATE = ("cez", "cez_fol")  # --alternate: the op, the fused layer; steps A B B A, A B B A, ...


# --------------------------------------------------------------------------- the profiled step


def _union(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def profile_summary(directory, vocab):
    """From the newest chrome trace under ``directory``, over its ``ProfilerStep#`` span:
    ``gpu_busy_share`` (union of kernel intervals / wall time) and ``lm_head_share`` (kernels of the
    output layer and the loss / wall time: this package's Triton kernels, and kernels launched inside
    a CPU op with ``vocab`` among its input dims (needs ``--pytorch-profiler-collect-shapes``) or
    inside this package's autograd Functions)."""
    paths = [os.path.join(root, f) for root, _, files in os.walk(directory) for f in files
             if f.endswith((".json", ".json.gz"))]
    if not paths:
        return None
    path = max(paths, key=os.path.getmtime)
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as fh:
        events = json.load(fh)["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and "dur" in e]
    if not steps:
        return None
    start, end = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    kernels = [e for e in events if e.get("cat") == "kernel" and e["ts"] < end and e["ts"] + e["dur"] > start]
    launches = {e["args"]["correlation"]: (e["tid"], e["ts"]) for e in events  # kernel -> its launch's thread, time
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    vocab_ops = {}
    for e in events:
        if e.get("cat") == "cpu_op" and "dur" in e and (
                any(vocab in d for d in e.get("args", {}).get("Input Dims", []) if isinstance(d, list))
                or any(f in e["name"] for f in ("VocabParallelCrossEntropyZLoss", "LinearCrossEntropyZLoss"))):
            vocab_ops.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    vocab_ops = {tid: _union(v) for tid, v in vocab_ops.items()}

    def in_vocab_op(kernel):
        tid, t = launches.get(kernel.get("args", {}).get("correlation"), (None, None))
        merged = vocab_ops.get(tid)
        i = bisect.bisect_right([a for a, _ in merged], t) - 1 if merged else -1
        return i >= 0 and t <= merged[i][1]

    ours = ("_forward_kernel", "_grad_kernel", "_rescale_kernel", "_loss_from_partials_kernel", "_partials_kernel",
            "_merge_kernel")
    clip = [(k, (max(k["ts"], start), min(k["ts"] + k["dur"], end))) for k in kernels]
    head = [span for k, span in clip if k["name"].startswith(ours) or in_vocab_op(k)]
    n_steps = len({e["name"] for e in steps})
    busy = _union([span for _, span in clip])
    per_kernel = {}
    for k, (a, b) in clip:
        per_kernel[k["name"][:100]] = per_kernel.get(k["name"][:100], 0.0) + (b - a) / 1e3 / n_steps
    ordered = sorted(clip, key=lambda ks: ks[1][0])
    gaps, reach, before = [], start, "(step start)"
    for k, (a, b) in ordered:  # idle stretches between kernels, with the kernels on either side
        if a - reach > 0:
            gaps.append(((a - reach) / 1e3, before[:60], k["name"][:60]))
        if b > reach:
            reach, before = b, k["name"]
    fused_ops = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "cpu_op" and "dur" in e
                 and "LinearCrossEntropyZLossForwardGrads" in e["name"]]
    per_step = []  # each traced step: whether the fused layer ran in it, its kernel, idle and output-layer time
    for st in sorted((e for e in steps if e.get("cat") != "gpu_user_annotation"), key=lambda e: e["ts"]):
        a0, b0 = st["ts"], st["ts"] + st["dur"]
        spans = [(max(a, a0), min(b, b0)) for _, (a, b) in clip if b > a0 and a < b0]
        mine = _union(spans)
        per_step.append({"step": st["name"], "fused": any(a0 <= a < b0 for a, _ in fused_ops),
                         "wall_ms": (b0 - a0) / 1e3, "kernel_ms": sum(b - a for a, b in spans) / 1e3,
                         "idle_ms": (b0 - a0 - sum(b - a for a, b in mine)) / 1e3,
                         "lm_head_ms": sum(min(b, b0) - max(a, a0) for a, b in _union(head) if b > a0 and a < b0) / 1e3})
    return {"steps": n_steps, "window_ms": (end - start) / 1e3, "per_step": per_step,
            "gpu_busy_share": sum(b - a for a, b in busy) / (end - start),
            "lm_head_share": sum(b - a for a, b in _union(head)) / (end - start),
            "kernel_ms_per_step": sum(b - a for _, (a, b) in clip) / 1e3 / n_steps,
            "lm_head_ms_per_step": sum(b - a for a, b in _union(head)) / 1e3 / n_steps,
            "top_kernels_ms_per_step": dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])[:30]),
            "idle_ms_per_step": (end - start - sum(b - a for a, b in busy)) / 1e3 / n_steps,
            "longest_gaps_ms": sorted(gaps, reverse=True)[:15]}


# --------------------------------------------------------------------------- the runs


def vocab_per_rank(tp, divisible_by=128):
    """This rank's slice of Megatron's padded vocab (padded to a multiple of
    ``--make-vocab-size-divisible-by`` x TP: 151936 -> 152064 at TP=2 and 4)."""
    multiple = divisible_by * tp
    return -(-VOCAB // multiple) * multiple // tp


ALTERNATE_TRACE = (8, 12)  # --alternate: Megatron's profile window (steps 9-12: one A B B A block), early in the run


def _run_until(cmd, env, timeout_s):
    """``cmd``'s (return code, stdout, stderr); at ``timeout_s`` its whole process group (torchrun and its
    workers) is stopped and what it printed so far returned, with return code None."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        out = err = ""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                out, err = proc.communicate(timeout=20)
                break
            except subprocess.TimeoutExpired:
                continue
        return None, out, err + f"\n[stopped at the deadline, {timeout_s:.0f} s]"


def launch(variant, config, iters, log_path, tp=1, profile_dir=None, alternate=False, timeout_s=600, extra_args=()):
    """One Megatron run of ``variant``: its step times, peak memory, LM losses (and profile summary);
    ``extra_args`` come after the config's (Megatron takes the last of a repeated flag).
    ``alternate``: one run of ``cez_fol`` whose worker turns the fused layer off for the steps of
    ``cez`` (A B B A order); ``alternate_steps``: per step, whether the fused layer ran and its peak.
    At ``timeout_s`` the run is stopped and the steps it logged kept (``rc`` None)."""
    args, env_extra = VARIANTS[variant]
    env_extra = {**CONFIG_ENV.get(config, {}), **env_extra, **({"CEZ_BENCH_ALTERNATE": "1"} if alternate else {})}
    parallel = ["--tensor-model-parallel-size", str(tp), "--sequence-parallel"] if tp > 1 else []
    window = ALTERNATE_TRACE if alternate else (iters - 4, iters - 2)
    if profile_dir:  # Megatron's own torch-profiler hook, two steps in the steady state (alternate: four), rank 0
        parallel += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(window[0]),
                     "--profile-step-end", str(window[1]), "--profile-ranks", "0", "--pytorch-profiler-collect-shapes",
                     "--tensorboard-dir", os.path.join(profile_dir, "tb")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), os.path.abspath(__file__), *COMMON, *CONFIGS[config], *extra_args,
           *parallel, "--train-iters", str(iters), *args]
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1", CEZ_BENCH_WORKER="1", **env_extra)
    start = time.time()
    rc, stdout, stderr = _run_until(cmd, env, timeout_s)
    with open(log_path, "w") as fh:
        fh.write(" ".join(cmd) + "\n\n" + stdout + stderr)
    peaks = [int(v) for v in PEAK.findall(stdout)]  # one line per rank
    return {"variant": variant, "rc": rc, "wall_s": time.time() - start, "peak_bytes": max(peaks, default=None),
            "out_of_memory": bool(OUT_OF_MEMORY.search(stdout + stderr)),
            "steps_ms": {int(i): float(ms) for i, ms in STEP.findall(stdout)},
            # the profiler's warm-up, traced steps and the trace's writing: host time inflated
            "traced": [window[0] - 1, window[1] + 2] if profile_dir else None,
            # the output layer's ops carry this rank's vocab slice
            "profile": profile_summary(profile_dir, vocab_per_rank(tp)) if profile_dir else None,
            "lm_loss": [float(v) for v in re.findall(r"\| lm loss: ([\d.E+-]+)", stdout)],
            # the caching allocator's retries (each frees cached blocks after a device sync) and cudaMalloc / free
            "allocator": [json.loads(v) for v in ALLOCATOR.findall(stdout)],
            "alternate_steps": _alternate_marks(stdout)}


def _alternate_marks(stdout):
    """Per iteration: (whether the fused layer ran, the largest peak any rank printed)."""
    marks = {}
    for i, fused, peak in ALTERNATE_STEP.findall(stdout):
        marks[int(i)] = (fused == "1", max(int(peak), marks.get(int(i), (None, 0))[1]))
    return marks


def steady_steps(run, skip):
    """Step times after ``skip``; in a profiled run without the profiler's steps (warm-up, the traced
    steps, the trace's writing), whose host time it inflates."""
    traced = range(*run["traced"]) if run.get("traced") else range(0)
    return [ms for i, ms in sorted(run["steps_ms"].items()) if i > skip and i not in traced]


def unprofiled_shares(run, skip):
    """GPU-idle and output-layer + loss shares of an unprofiled step: the kernels' busy time per traced
    step (kernel durations do not depend on the profiler; the host's time does) over the median
    unprofiled step of the same run."""
    prof, steady = run.get("profile"), steady_steps(run, skip)
    if not prof or not steady:
        return None
    per_step = prof["window_ms"] / prof["steps"]
    step = statistics.median(steady)
    return {"gpu_idle_share": 1 - prof["gpu_busy_share"] * per_step / step,
            "lm_head_share": prof["lm_head_share"] * per_step / step if prof["lm_head_share"] is not None else None,
            "gpu_idle_share_traced": 1 - prof["gpu_busy_share"]}


def summarize(runs, skip):
    rows = {}
    for run in runs:
        steady = steady_steps(run, skip)
        if run["rc"] not in (0, None) or not steady:
            continue
        row = rows.setdefault(run["variant"], {"medians": [], "peaks": [], "shares": None})
        row["medians"].append(statistics.median(steady))
        row["shares"] = row["shares"] or unprofiled_shares(run, skip)
        if run["peak_bytes"]:
            row["peaks"].append(run["peak_bytes"])
    return {v: {"median_ms": statistics.median(r["medians"]), "min_ms": min(r["medians"]),
                "max_ms": max(r["medians"]), "runs": len(r["medians"]),
                "peak_gb": max(r["peaks"]) / 1e9 if r["peaks"] else None, **(r["shares"] or {})}
            for v, r in rows.items()}


def alternated(runs, skip):
    """Steps of ``--alternate`` runs: per variant the median step, spread of run medians and peak of its
    steps; and per A B B A block after ``skip`` (blocks starting at a multiple of 4 steps) the fused
    layer's step time over the op's, (B1 + B2) / (A1 + A2) - 1: median, quartiles, mean +- 2 standard errors."""
    per, blocks = {v: {"steps": [], "medians": [], "peaks": []} for v in ALTERNATE}, []
    for run in runs:
        steps, marks = dict(run["steps_ms"]), run.get("alternate_steps") or {}
        for i in range(*run["traced"]) if run.get("traced") else ():  # the profiler's steps: host time inflated
            steps.pop(i, None)
        mine = {v: [] for v in ALTERNATE}
        for i, ms in steps.items():
            if i > skip and i in marks:
                variant = ALTERNATE[int(marks[i][0])]
                mine[variant].append(ms)
                per[variant]["peaks"].append(marks[i][1])
        for v in ALTERNATE:
            per[v]["steps"] += mine[v]
            if mine[v]:
                per[v]["medians"].append(statistics.median(mine[v]))
        first = -(-(skip + 1 - 1) // 4) * 4 + 1  # iterations k..k+3 with k - 1 a multiple of 4 (A B B A)
        for k in range(first, max(steps, default=0) - 2, 4):
            block = [steps.get(k + j) for j in range(4)]
            fused = [marks.get(k + j, (None,))[0] for j in range(4)]
            if None not in block and fused == [False, True, True, False]:
                blocks.append((block[1] + block[2]) / (block[0] + block[3]) - 1)
    out = {"variants": {v: {"median_ms": statistics.median(d["steps"]) if d["steps"] else None,
                            "steps": len(d["steps"]), "run_medians": d["medians"],
                            "peak_gb": max(d["peaks"]) / 1e9 if d["peaks"] else None} for v, d in per.items()},
           "blocks": len(blocks)}
    if len(blocks) >= 2:
        q = statistics.quantiles(blocks, n=4)
        sem = statistics.stdev(blocks) / len(blocks) ** 0.5
        out.update(median=statistics.median(blocks), q1=q[0], q3=q[2], mean=statistics.fmean(blocks), two_sem=2 * sem)
    return out


def alternated_table(result):
    lines = ["| variant | step median (ms) | run medians (ms) | steps | peak allocated in its steps (GB) |",
             "|---|---|---|---|---|"]
    for v, d in result["variants"].items():
        med = f"{d['median_ms']:.1f}" if d["median_ms"] else "-"
        peak = f"{d['peak_gb']:.2f}" if d["peak_gb"] else "-"
        lines.append(f"| {v} | {med} | {', '.join(f'{m:.1f}' for m in d['run_medians'])} | {d['steps']} | {peak} |")
    if "median" in result:
        lines += ["", f"fused layer / op - 1, per A B B A block ({result['blocks']} blocks): median "
                      f"{result['median']:+.2%} (quartiles {result['q1']:+.2%} to {result['q3']:+.2%}); mean "
                      f"{result['mean']:+.2%} +- {result['two_sem']:.2%} (2 standard errors)"]
    return "\n".join(lines)


def table(summary, reference="native"):
    ref = summary.get(reference)
    lines = ["| variant | step median (ms) | spread of run medians (ms) | runs | vs native | peak allocated (GB) "
             "| GPU idle | output layer + loss |", "|---|---|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        s = summary.get(variant)
        if s is None:
            continue
        rel = f"{100 * (s['median_ms'] / ref['median_ms'] - 1):+.1f}%" if ref else "-"
        peak = f"{s['peak_gb']:.2f}" if s["peak_gb"] is not None else "-"
        idle = f"{s['gpu_idle_share']:.1%} ({s['gpu_idle_share_traced']:.1%} traced)" if "gpu_idle_share" in s else "-"
        head = f"{s['lm_head_share']:.1%}" if s.get("lm_head_share") is not None else "-"
        lines.append(f"| {variant} | {s['median_ms']:.1f} | {s['min_ms']:.1f}-{s['max_ms']:.1f} | {s['runs']} | "
                     f"{rel} | {peak} | {idle} | {head} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="busy")
    parser.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                        help="default: all but liger (it needs liger-kernel) and the mitigations (cez_*: by name)")
    parser.add_argument("--pairs", type=int, default=3, help="runs per variant, alternated")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="iterations left out of each run's median")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel size (GPUs, the first visible ones; with sequence parallelism); "
                             "z_by_hand needs 1")
    parser.add_argument("--budget-s", type=float, default=540, help="no new launch after this many seconds")
    parser.add_argument("--profile", action="store_true",
                        help="first rep: torch-profile two steady steps per variant, report the GPU-busy share")
    parser.add_argument("--alternate", action="store_true",
                        help="cez and cez_fol alternated step by step inside each run (A B B A; --pairs runs): the "
                             "fused layer turned off for the op's steps; step times and per-step peaks per variant")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="--alternate: runs go on until this many seconds after the start (--iters bounds them), "
                             "each stopped there with the steps it logged")
    parser.add_argument("--out", default="out/e2e")
    args = parser.parse_args(argv)
    variants = args.variants or [v for v in VARIANTS if v not in OPT_IN and (v != "z_by_hand" or args.tp == 1)]
    if args.tp > 1 and "z_by_hand" in variants:
        parser.error("z_by_hand computes the z-loss on one rank's logits: it needs --tp 1")
    if args.tp < MIN_TP.get(args.config, 1):
        parser.error(f"--config {args.config} needs --tp {MIN_TP[args.config]} or more (memory); use --config busy below")
    import torch

    if args.tp > torch.cuda.device_count():
        parser.error(f"--tp {args.tp}: {torch.cuda.device_count()} GPUs visible (CUDA_VISIBLE_DEVICES picks them)")
    name = args.config if args.tp == 1 else f"{args.config}_tp{args.tp}"
    os.makedirs(args.out, exist_ok=True)
    if args.alternate:
        return main_alternate(args, name)
    start, runs = time.time(), []
    for rep in range(args.pairs):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for variant in order:
            if time.time() - start > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: stopping before {variant} rep {rep + 1}", flush=True)
                break
            profile_dir = os.path.join(args.out, f"trace_{name}_{variant}") if args.profile and rep == 0 else None
            run = launch(variant, args.config, args.iters, os.path.join(args.out, f"{name}_{variant}_{rep + 1}.log"),
                         tp=args.tp, profile_dir=profile_dir)
            if profile_dir:
                shutil.rmtree(profile_dir, ignore_errors=True)  # traces are large; the summary is kept in the JSON
            runs.append(run)
            steady, prof, peak = steady_steps(run, args.skip), run.get("profile"), run["peak_bytes"]
            print(f"rep {rep + 1} {variant:10s} rc={run['rc']} median step "
                  + (f"{statistics.median(steady):.1f} ms" if steady else "-")
                  + (f" peak {peak / 1e9:.2f} GB" if peak else " peak -") + f" wall {run['wall_s']:.0f} s"
                  + (f" gpu busy {prof['gpu_busy_share']:.1%}, lm head {prof['lm_head_share']:.1%}; per traced step: "
                     f"kernels {prof['kernel_ms_per_step']:.0f} ms, lm head {prof['lm_head_ms_per_step']:.1f} ms, "
                     f"idle {prof['idle_ms_per_step']:.0f} ms" if prof else "")
                  + (f"; allocator retries {run['allocator'][0]['num_alloc_retries']}, cudaMalloc "
                     f"{run['allocator'][0]['num_device_alloc']}" if run.get("allocator") else ""),
                  flush=True)
    summary = summarize(runs, args.skip)
    data = {"config": args.config, "run": run_info(), "args": vars(args),
            "command": COMMON + CONFIGS[args.config], "summary": summary, "runs": runs}
    with open(os.path.join(args.out, f"e2e_{name}.json"), "w") as fh:
        json.dump(data, fh, indent=1)
    print(table(summary))


def main_alternate(args, name):
    """``--pairs`` runs, each alternating the op and the fused layer step by step; with ``--deadline-s``
    a run goes on until the deadline (``--iters`` then only bounds it) and keeps the steps it logged.
    The JSON and the table are written after every run."""
    start, runs = time.time(), []
    for rep in range(args.pairs):
        left = (args.deadline_s or float("inf")) - (time.time() - start)
        if runs and (time.time() - start > args.budget_s or left < 120):
            print(f"stopping before run {rep + 1}: {time.time() - start:.0f} s spent", flush=True)
            break
        profile_dir = os.path.join(args.out, f"trace_{name}_alternate") if args.profile and rep == 0 else None
        run = launch("cez_fol", args.config, args.iters, os.path.join(args.out, f"{name}_alternate_{rep + 1}.log"),
                     tp=args.tp, profile_dir=profile_dir, alternate=True, timeout_s=min(600, left))
        if profile_dir:
            shutil.rmtree(profile_dir, ignore_errors=True)
            for st in (run.get("profile") or {}).get("per_step", []):
                print(f"  traced {st['step']}: fused {st['fused']}, wall {st['wall_ms']:.0f} ms, kernels "
                      f"{st['kernel_ms']:.0f} ms, idle {st['idle_ms']:.0f} ms, output layer + loss {st['lm_head_ms']:.1f} ms",
                      flush=True)
        runs.append(run)
        part = alternated([run], args.skip)
        print(f"run {rep + 1} rc={run['rc']} wall {run['wall_s']:.0f} s, {len(run['steps_ms'])} steps: " + ", ".join(
            f"{v} {d['median_ms']:.1f} ms ({d['steps']} steps)" for v, d in part["variants"].items() if d["median_ms"])
            + (f"; fused / op - 1 median {part['median']:+.2%} over {part['blocks']} blocks" if "median" in part else ""),
            flush=True)
        result = alternated(runs, args.skip)
        with open(os.path.join(args.out, f"e2e_{name}_alternate.json"), "w") as fh:
            json.dump({"config": args.config, "run": run_info(), "args": vars(args),
                       "command": COMMON + CONFIGS[args.config], "result": result, "runs": runs}, fh, indent=1)
    print(alternated_table(alternated(runs, args.skip)))


def _alternate_steps():
    """``CEZ_BENCH_ALTERNATE``: Megatron's ``train_step`` wrapped so that steps 1, 4, 5, 8, 9, ... (A B B A)
    run with the fused layer off (the op on the logits) and the others with it on, each step's peak
    allocated memory printed with its iteration number."""

    import torch
    from megatron.training import training

    from mindspeed_cez.patches import runtime as adaptor_runtime  # the active settings the patches read

    inner, count, both = training.train_step, [0], {}

    def train_step(*args, **kwargs):
        if not both:  # the run's settings and the same without the fused layer, built once
            active = adaptor_runtime.get_active()
            if active is None or not active.fused_output_layer:
                raise RuntimeError("CEZ_BENCH_ALTERNATE needs a run with --lm-fused-output-layer")
            both.update({True: active, False: active.replace(fused_output_layer=False)})
        fused = count[0] % 4 in (1, 2)
        adaptor_runtime.set_active(both[fused])
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            return inner(*args, **kwargs)
        finally:
            count[0] += 1
            print(f"CEZ_BENCH step={count[0]} fused={int(fused)} peak={torch.cuda.max_memory_allocated() if cuda else 0}",
                  flush=True)

    training.train_step = train_step


# --------------------------------------------------------------------------- one launch (the worker)


def _sdpa_forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                  packed_seq_params=None):
    """Megatron's local core attention (``DotProductAttention``, which materializes ``[b, heads, s, s]``
    scores: at sequence 8192 most of the step, unlike any TE or flash-attn run) on torch's SDPA
    (flash kernels on Hopper): causal self-attention without dropout, bias or packing; else raises."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType

    mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
    if mask_type != AttnMaskType.causal or attention_bias is not None or packed_seq_params is not None:
        raise NotImplementedError(f"sdpa attention: causal self-attention only, got {mask_type}")
    if self.attention_dropout.p or getattr(self.config, "softmax_type", "vanilla") != "vanilla":
        raise NotImplementedError("sdpa attention: no attention dropout, vanilla softmax only")
    # [s, b, heads, d] -> [b, heads, s, d]; key / value carry the query groups (GQA)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                         enable_gqa=q.shape[1] > k.shape[1])
    return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], self.hidden_size_per_partition)


def _apply_liger():
    """liger-kernel's Megatron patch: Megatron's CE (fused and unfused) on Liger's Triton CE."""
    try:
        from liger_kernel.megatron import apply_liger_kernel_to_megatron
    except ImportError as exc:
        sys.exit(f"CEZ_BENCH_LIGER (variant liger) needs liger-kernel with its Megatron patch "
                 f"(pip install liger-kernel==0.8.5): {exc}")
    apply_liger_kernel_to_megatron(rms_norm=False, cross_entropy=True)
    print("CEZ_BENCH liger: apply_liger_kernel_to_megatron(rms_norm=False, cross_entropy=True)", flush=True)


def worker():
    """``examples/pretrain_gpt.py`` with the adaptor, and what the variant's environment asks for:
    ``CEZ_BENCH_HAND_Z=C``: the LM loss plus ``C * logsumexp(logits.float())**2`` in torch (TP=1);
    ``CEZ_BENCH_LIGER=1``: liger-kernel's ``apply_liger_kernel_to_megatron(rms_norm=False, cross_entropy=True)``
    before the model is built; ``CEZ_BENCH_ATTENTION=sdpa``: ``_sdpa_forward``; ``CEZ_BENCH_GPU_GIB=G``: the
    caching allocator capped at G GiB (a larger card measured as a smaller one); at exit,
    ``CEZ_BENCH peak_allocated_bytes=N``."""
    import atexit

    import torch

    if os.environ.get("CEZ_BENCH_GPU_GIB") and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        cap = float(os.environ["CEZ_BENCH_GPU_GIB"]) * (1 << 30)
        if cap < total:
            torch.cuda.set_per_process_memory_fraction(cap / total)
            print(f"CEZ_BENCH allocator capped at {cap / (1 << 30):.2f} GiB of {total / (1 << 30):.2f}", flush=True)

    if os.environ.get("CEZ_BENCH_LIGER"):
        _apply_liger()
    if os.environ.get("CEZ_BENCH_HAND_Z"):
        from megatron.core.models.common.language_module.language_module import LanguageModule

        coeff, megatron_loss = float(os.environ["CEZ_BENCH_HAND_Z"]), LanguageModule.compute_language_model_loss

        def compute_language_model_loss(self, labels, logits):
            # logits [s, b, v] (TP=1), in fp32 (a copy: Megatron's CE then works on them in place)
            fp32 = logits.float() if logits.dtype != torch.float32 else logits.clone()
            z = coeff * torch.logsumexp(fp32, dim=-1).square()
            return megatron_loss(self, labels, logits) + z.transpose(0, 1)

        LanguageModule.compute_language_model_loss = compute_language_model_loss
    if os.environ.get("CEZ_BENCH_ATTENTION") == "sdpa":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        DotProductAttention.forward = _sdpa_forward
        print("CEZ_BENCH attention: torch scaled_dot_product_attention (causal)", flush=True)
    def report():
        if torch.cuda.is_available():
            stats = torch.cuda.memory_stats()
            print(f"CEZ_BENCH peak_allocated_bytes={torch.cuda.max_memory_allocated()}", flush=True)
            print("CEZ_BENCH allocator=" + json.dumps({k: stats.get(k) for k in (
                "num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free", "num_ooms")}),
                flush=True)

    atexit.register(report)
    if os.environ.get("CEZ_BENCH_ALTERNATE"):
        _alternate_steps()
    from mindspeed_cez import launch

    sys.exit(launch.main([os.path.join(REPO, "examples", "pretrain_gpt.py"), *sys.argv[1:]]))


if __name__ == "__main__":
    worker() if os.environ.get("CEZ_BENCH_WORKER") else main()
