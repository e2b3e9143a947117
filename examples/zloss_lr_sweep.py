"""What the z-loss does to training: a learning-rate sweep with and without it, in Megatron's ``pretrain``.

The small-scale proxy of Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer
training instabilities", arXiv 2309.14322): a small pre-LN GPT trained at learning rates from 1e-3
to 3e-1 with ``--lm-z-loss-coeff`` 0, 1e-4 and 1e-3; the final validation loss against the learning
rate shows whether the output logits diverge at high learning rates and whether the z-loss keeps
them from it. Every run is ``torchrun --nproc-per-node 1 -m mindspeed_cez.launch
examples/pretrain_gpt.py ARGS`` on one GPU (several runs share a GPU; GPUs taken from the machine),
the same seed and data order in all runs, the LM loss through this package's fused kernel in every
arm (``--lm-fused-ce``: only the coefficient differs), ``--lm-z-loss-log-lse`` for ``lm_lse`` and
``lm_lse_max``, TensorBoard events per run. Then ``zloss_sweep_report.py`` reads the events back
into ``summary.json`` and draws the plots and the table.

    python examples/zloss_lr_sweep.py --out out/zloss_sweep                  # GPUs: ~6 min on 4 H100
    python examples/zloss_lr_sweep.py --quick --out out/zloss_quick          # CPU smoke run of the plumbing

The data is the Python standard library's text (``stdlib_text_dataset.py``), built into ``--data``
unless a finished build is there. The model and its differences from the paper: docs/z_loss_training.md.
"""

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import stdlib_text_dataset  # noqa: E402
import zloss_sweep_report  # noqa: E402

# The paper's proxy at the small end, sized so that 18 runs sharing 4 GPUs end within minutes.
FULL = dict(layers=4, hidden=256, heads=4, seq=512, micro_batch=32, steps=1500, warmup=75, eval_iters=10,
            eval_every=300, vocab=32768, max_mb=None, log_interval=10, tb_interval=5, lrs=[1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1])
# --quick: the same plumbing on the CPU (gloo, the CPU shims of pretrain_gpt.py), a few steps of a tiny model.
QUICK = dict(layers=2, hidden=64, heads=2, seq=64, micro_batch=4, steps=12, warmup=2, eval_iters=2,
             eval_every=12, vocab=4096, max_mb=1.0, log_interval=2, tb_interval=1, lrs=[1e-3, 1e-1])
COEFFS = [0.0, 1e-4, 1e-3]
MIN_LR = 1e-5
SEED = 1234


def run_name(lr, coeff):
    return f"lr{lr:g}_c{coeff:g}"


def megatron_args(cfg, lr, coeff, data, run_dir, name, on_gpu):
    """Megatron's arguments of one run (all runs differ only in ``--lr`` and ``--lm-z-loss-coeff``)."""
    h = cfg["hidden"]
    args = [
        # pre-LN GPT, no biases, RoPE, untied embeddings, qk-layernorm; init std 1/sqrt(hidden)
        "--num-layers", cfg["layers"], "--hidden-size", h, "--ffn-hidden-size", 4 * h,
        "--num-attention-heads", cfg["heads"], "--seq-length", cfg["seq"], "--max-position-embeddings", cfg["seq"],
        "--disable-bias-linear", "--normalization", "LayerNorm", "--norm-epsilon", "1e-6", "--qk-layernorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--init-method-std", f"{h ** -0.5:.6g}",
        # AdamW (0.9, 0.95, 1e-8), no weight decay, clipping at 1, linear warmup then cosine decay
        "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8",
        "--weight-decay", "0", "--clip-grad", "1.0", "--lr", f"{lr:g}", "--min-lr", f"{MIN_LR:g}",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", cfg["warmup"], "--lr-decay-iters", cfg["steps"],
        "--micro-batch-size", cfg["micro_batch"], "--global-batch-size", cfg["micro_batch"],
        "--train-iters", cfg["steps"], "--seed", SEED,
        # the data: real text, its own held-out split; evaluated every eval_every steps and after the last
        "--train-data-path", os.path.join(data, stdlib_text_dataset.TRAIN),
        "--valid-data-path", os.path.join(data, stdlib_text_dataset.VALID),
        "--data-cache-path", os.path.join(run_dir, "cache", name), "--num-workers", "1",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", cfg["vocab"],
        "--null-tokenizer-eod-id", stdlib_text_dataset.EOD_ID,
        "--eval-iters", cfg["eval_iters"], "--eval-interval", cfg["eval_every"],
        "--log-interval", cfg["log_interval"], "--tensorboard-dir", os.path.join(run_dir, "tb", name),
        "--tensorboard-log-interval", cfg["tb_interval"], "--tensorboard-queue-size", "50",
        # megatron-core alone (no Transformer Engine / Apex): the local implementation, no fused kernels
        "--transformer-impl", "local", "--attention-backend", "unfused", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
        "--no-persist-layer-norm", "--manual-gc",
        # a diverging run goes on to the end (NaN included) instead of stopping: its final loss is the measurement
        "--no-check-for-nan-in-loss-and-grad",
        # this package: the fused kernel in every arm, only the coefficient differs
        "--lm-fused-ce", "--lm-z-loss-log-lse", "--lm-z-loss-coeff", f"{coeff:g}",
        "--distributed-backend", "nccl" if on_gpu else "gloo",
    ]
    args += ["--bf16"] if on_gpu else ["--use-cpu-initialization"]
    return [str(a) for a in args]


def free_ports(n):
    """``n`` distinct free TCP ports (all held open while choosing, so none repeats)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch_all(plan, cfg, data, run_dir, gpus, parallel, budget_s):
    """Start every run (``parallel`` at a time on the CPU; all at once, round-robin over ``gpus``, on
    GPUs), stop what is still running after ``budget_s``; returns one record per run."""
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    ports = free_ports(len(plan))
    base_env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
                    OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2" if gpus else "1"))
    pending = list(enumerate(plan))
    running, records = {}, []
    start = time.time()
    while pending or running:
        while pending and (gpus or len(running) < parallel):
            i, (lr, coeff) = pending.pop(0)
            name = run_name(lr, coeff)
            gpu = gpus[i % len(gpus)] if gpus else None
            env = dict(base_env, **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpus else {}))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                   "--master-addr", "127.0.0.1", "--master-port", str(ports[i]),
                   "-m", "mindspeed_cez.launch", os.path.join(HERE, "pretrain_gpt.py"),
                   *megatron_args(cfg, lr, coeff, data, run_dir, name, bool(gpus))]
            log = open(os.path.join(run_dir, "logs", name + ".log"), "w")
            log.write(" ".join(cmd) + "\n\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            running[name] = (proc, log, {"name": name, "lr": lr, "coeff": coeff, "gpu": gpu,
                                         "started_s": round(time.time() - start, 1)})
        time.sleep(1.0)
        over = time.time() - start > budget_s
        for name, (proc, log, record) in list(running.items()):
            if proc.poll() is None and not over:
                continue
            if proc.poll() is None:  # out of time: stop the whole torchrun session, keep what it wrote
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                record["stopped_at_budget"] = True
            log.close()
            record.update(rc=proc.returncode, wall_s=round(time.time() - start - record["started_s"], 1))
            records.append(record)
            del running[name]
            print(f"[{time.time() - start:5.0f} s] {name}: rc={proc.returncode} in {record['wall_s']:.0f} s"
                  + (" (stopped: out of time)" if record.get("stopped_at_budget") else ""), flush=True)
    return records


def detect_gpus():
    """The GPUs a run may be given, as ``CUDA_VISIBLE_DEVICES`` values (a list the caller set is honoured)."""
    import torch

    if not torch.cuda.is_available():
        return []
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[:torch.cuda.device_count()] if visible else [str(i) for i in range(torch.cuda.device_count())]


def environment(gpus):
    """What the numbers ran on: versions, the GPUs and their compute mode (runs share a GPU: an
    exclusive-process GPU would refuse the second)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for package in ("megatron-core", "triton", "mindspeed_cez"):
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            env[package] = None
    if gpus:
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(len(gpus))]
        try:
            env["compute_mode"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"], capture_output=True,
                text=True, timeout=30).stdout.split()
        except (OSError, subprocess.SubprocessError):
            env["compute_mode"] = None
    return env


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "out", "zloss_sweep"), help="the run folder")
    parser.add_argument("--data", default=None,
                        help="the dataset folder (stdlib_text_dataset.py); built there unless a finished build of "
                             "this size is there (default: OUT/data)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, few steps, 2 learning rates")
    parser.add_argument("--lrs", type=float, nargs="+", default=None, help="default: 1e-3 3e-3 1e-2 3e-2 1e-1 3e-1")
    parser.add_argument("--coeffs", type=float, nargs="+", default=COEFFS)
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 1500)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default 32)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all; 0: CPU)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time on the CPU")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop runs still going after this many seconds (default: 480 on GPUs, 900 on the CPU)")
    args = parser.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    for key in ("lrs", "steps", "micro_batch"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if args.steps is not None and not args.quick:  # the paper's 5 % warmup; five evaluations
        cfg.update(warmup=max(1, args.steps // 20), eval_every=max(1, args.steps // 5))
    bad = [c for c in args.coeffs if not (math.isfinite(c) and c >= 0)] + [lr for lr in cfg["lrs"] if not lr > 0]
    if bad:
        parser.error(f"--lrs must be > 0 and --coeffs finite and >= 0, got {bad}")
    gpus = detect_gpus()
    if args.gpus is not None:
        if args.gpus > len(gpus):
            parser.error(f"--gpus {args.gpus}: this machine has {len(gpus)}")
        gpus = gpus[:args.gpus]
    if args.quick:
        gpus = []
    budget_s = args.budget_s or (480 if gpus else 900)
    out = os.path.abspath(args.out)
    data = os.path.abspath(args.data or os.path.join(out, "data"))
    os.makedirs(out, exist_ok=True)

    start = time.time()
    manifest = stdlib_text_dataset.matches(data, cfg["vocab"], cfg["max_mb"])
    if manifest is None:
        print(f"building the dataset in {data} ...", flush=True)
        manifest = stdlib_text_dataset.build(data, cfg["vocab"], cfg["max_mb"])
    print(f"data: {manifest['files']} files of Python {manifest['python']}'s standard library, "
          f"{manifest['splits'][stdlib_text_dataset.TRAIN]['tokens']} training / "
          f"{manifest['splits'][stdlib_text_dataset.VALID]['tokens']} validation tokens "
          f"({time.time() - start:.0f} s)", flush=True)

    env = environment(gpus)
    print("environment:", json.dumps(env), flush=True)
    plan = [(lr, c) for lr in cfg["lrs"] for c in args.coeffs]
    where = f"{len(gpus)} GPU(s)" if gpus else f"the CPU, {args.parallel} at a time"
    print(f"{len(plan)} runs on {where}, {cfg['steps']} steps each, budget {budget_s:.0f} s", flush=True)
    records = launch_all(plan, cfg, data, out, gpus, args.parallel, budget_s)
    shutil.rmtree(os.path.join(out, "cache"), ignore_errors=True)  # Megatron's sample indices, rebuilt per run
    sweep = {"config": cfg, "coeffs": args.coeffs, "seed": SEED, "min_lr": MIN_LR, "data": manifest,
             "gpus": len(gpus), "environment": env, "runs": sorted(records, key=lambda r: (r["lr"], r["coeff"])),
             "wall_s": round(time.time() - start, 1),
             "megatron_args_example": megatron_args(cfg, cfg["lrs"][0], args.coeffs[0], data, out, "NAME", bool(gpus))}
    with open(os.path.join(out, "sweep.json"), "w") as fh:
        json.dump(sweep, fh, indent=1)
    summary = zloss_sweep_report.summarize(out)
    zloss_sweep_report.report(summary, os.path.join(out, "report"))
    failed = [r["name"] for r in records if r["rc"] != 0 and not r.get("stopped_at_budget")]
    print(f"done in {time.time() - start:.0f} s; report in {os.path.join(out, 'report')}"
          + (f"; failed: {failed} (logs in {os.path.join(out, 'logs')})" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
