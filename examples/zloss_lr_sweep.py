"""What the z-loss does to training, with error bars: seeded learning-rate and coefficient sweeps in Megatron's ``pretrain``.

The small-scale proxy of Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer
training instabilities", arXiv 2309.14322): a small pre-LN GPT trained at learning rates from 1e-3
to 3e-1 with and without ``--lm-z-loss-coeff``; the final validation loss against the learning rate
shows whether the output logits diverge at high learning rates and whether the z-loss keeps them
from it. Every run is ``torchrun --nproc-per-node 1 -m mindspeed_cez.launch examples/pretrain_gpt.py
ARGS`` on one GPU (several runs share a GPU), the LM loss through this package's fused kernel in
every arm (``--lm-fused-ce``: only the coefficient differs), ``--lm-z-loss-log-lse`` for ``lm_lse``
and ``lm_lse_max``, TensorBoard events at every iteration. A seed fixes the initial weights and the
data order, so runs that differ only in the coefficient are paired. Two phases, each sized for one
call of a few minutes on four GPUs:

* ``--phase A`` (the main sweep): 6 learning rates x c in {0, 1e-4, 1e-3} x seeds 1, 2, 3, and one
  same-seed rerun (learning rate 1e-2, c = 0, seed 1) that measures the run-to-run nondeterminism.
* ``--phase B --best-lr LR``: the coefficient sweep at LR (c in {1e-5, 3e-4, 3e-3, 1e-2} x 3 seeds;
  0, 1e-4 and 1e-3 come from phase A); decoupled weight decay 0.1 (Megatron's usual setting) and
  the paper's independent weight decay 1e-4 at LR, 1e-1 and 3e-1 with c in {0, 1e-4} x 2 seeds;
  hidden 1024 and 512 (4 layers, head size 64) at 1e-2 .. 3e-1 with c in {0, 1e-4}, one seed.

* ``--phase pilot`` / ``--phase study``: does the z-loss prevent divergence? Long runs (a 10 000-iteration
  schedule, 16 x 256 tokens an iteration, learning rates up to 1) stopped as soon as they meet the
  divergence rule of ``zloss_divergence.py``, fixed before the runs; the pilot looks for where c = 0
  fails (learning rates 0.1, 0.3, 1; three weight-decay modes; with and without clipping), the study
  counts it (``--edge-lrs``, ``--below-lrs``, seeds, ``--coeffs``, judged at ``--horizon``).

Runs start in that order of priority (the widest first within phase B, so they are not the ones cut);
a run still going at ``--budget-s`` is stopped and recorded as stopped, one never started as such.

    pip install ".[sweep]"      # what it and its report need besides torch (megatron-core, tokenizers, ...)
    python examples/pypi_text_corpus.py build --dir data/pypi_32k           # the data, once (CPU, network)
    python examples/zloss_lr_sweep.py --data data/pypi_32k --phase A --out out/zloss_A       # 4 GPUs: ~7 min
    python examples/zloss_lr_sweep.py --data data/pypi_32k --phase B --best-lr 0.01 --out out/zloss_B
    python examples/zloss_lr_sweep.py --data data/pypi_32k --phase pilot --out out/zloss_pilot
    python examples/zloss_lr_sweep.py --data data/pypi_32k --phase study --edge-lrs 0.3 0.2 --below-lrs 0.1 \
        --gpu-capacity 13 --horizon 4000 --out out/zloss_study
    python examples/zloss_lr_sweep.py --quick --out out/zloss_quick          # CPU smoke run of the plumbing
    python examples/zloss_sweep_report.py out/zloss_A out/zloss_B --out report   # the report of both

The data: ``pypi_text_corpus.py`` (pinned wheels' source files; ``--quick`` builds a small corpus from
this checkout's own files instead). The model and its differences from the paper: docs/z_loss_training.md.
"""

import argparse
import importlib.util
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
# module -> pip requirement: what every run needs, and tokenizers to build the data (not to train on a build)
# (pyproject's "sweep" extra holds them all, matplotlib for the report too)
NEEDS = {"megatron.training": "megatron-core>=0.18", "tensorboard": "tensorboard", "tokenizers": "tokenizers==0.23.3"}


def missing_requirements(modules=tuple(NEEDS)):
    """The pip requirements of the ``modules`` this sweep needs and cannot import."""
    missing = []
    for module in modules:
        requirement = NEEDS[module]
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing (megatron)
            found = False
        if not found:
            missing.append(requirement)
    return missing


sys.path.insert(0, HERE)
from zloss_divergence import Divergence, parse_line  # noqa: E402

# The paper's proxy at the small end: 4 layers, hidden 256, sized so 55 runs share 4 GPUs in minutes
# (12 units a GPU: 12 runs of hidden 256 at once, about 5 GB each). unit_s: the GPU seconds budgeted for one
# such run (the 2026-11-27 sweep on four H100s ran with 32; 34 leaves a margin); startup_s: a run's start before its
# first step. A run starts only if the GPU's admitted work is predicted to end within the budget.
FULL = dict(layers=4, hidden=256, seq=512, micro_batch=32, steps=1500, vocab=32768, log_interval=10,
            tb_interval=1, lrs=[1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1], seeds=[1, 2, 3], gpu_capacity=12,
            unit_s=34, startup_s=25)
# --quick: the same plumbing on the CPU (gloo, the CPU mode of pretrain_gpt.py), a few steps of a tiny model.
QUICK = dict(layers=2, hidden=64, seq=64, micro_batch=4, steps=12, vocab=4096, log_interval=4, tb_interval=1,
             lrs=[1e-3, 1e-1], seeds=[1, 2], coeffs=[0.0, 1e-3], gpu_capacity=1, unit_s=None, startup_s=0)
# pilot / study: long runs of fewer tokens a step (smaller batches are also less stable), stopped as soon as
# they meet the divergence rule (zloss_divergence.py); every log line kept, no TensorBoard (its per-step syncs)
LONG = dict(layers=4, hidden=256, seq=256, micro_batch=16, steps=10000, vocab=32768, log_interval=10,
            tb_interval=None, lrs=[1e-1, 3e-1, 1.0], seeds=[1, 2, 3, 4, 5], gpu_capacity=8, unit_s=None, startup_s=0)
QUICK_LONG = dict(QUICK, steps=40, tb_interval=None, lrs=[1e-2, 1.0], seeds=[1, 2])
MAIN_COEFFS = [0.0, 1e-4, 1e-3]
COEFF_SWEEP = [0.0, 1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2]
RERUN = dict(lr=1e-2, coeff=0.0, seed=1)  # the same-seed rerun (phase A)
SHORT_STEPS = 500  # phase B's wider models: as many steps as one call of a few minutes holds
WORK = {512: 2.3, 1024: 5.7}  # GPU time per step against hidden 256 (the FLOPs of the layers and the output layer)
WEIGHT_DECAY = {"none": 0.0, "decoupled": 0.1, "independent": 1e-4}
MIN_LR = 1e-5
NO_CLIP = 1e9  # "no clipping": a norm never reached (Megatron logs the gradient norm only when it clips)
WARMUP_FRACTION = 0.05  # the paper's linear warmup


# The mitigations beside the z-loss (--mitigations), each with the value its paper uses (arXiv 2601.02031:
# mu-loss 1e-4; its soft-capping runs cap at 30, as Gemma 2's final logits do).
MITIGATIONS = {"softcap": ["--lm-logit-softcap", "30"], "mu_centering": ["--lm-mu-centering"],
               "mu_loss": ["--lm-mu-loss-coeff", "1e-4"]}


def run_name(run):
    wd = "" if run["wd_mode"] == "none" else f"_{run['wd_mode'][:3]}wd{run['wd']:g}"
    steps = "" if run.get("steps") is None else f"_{run['steps']}st"
    clip = "" if run.get("clip", 1.0) == 1.0 else "_noclip" if not run["clip"] else f"_clip{run['clip']:g}"
    return (f"h{run['hidden']}_lr{run['lr']:g}_c{run['coeff']:g}{wd}{clip}_s{run['seed']}{steps}"
            + ("_rerun" if run.get("rerun") else "") + (f"_{run['mitigation']}" if run.get("mitigation") else ""))


def make_run(group, lr, coeff, seed, hidden, wd_mode="none", rerun=False, steps=None, clip=1.0, mitigation=None):
    """One run; ``steps`` None: the configuration's. ``cost``: its share of a GPU's memory (about 5 GB
    a unit); ``work``: its GPU time per step, both against the hidden-256 run. ``clip``: the gradient
    clipping norm (0: none: Megatron then clips at NO_CLIP, so the gradient norm is still logged)."""
    run = dict(group=group, lr=lr, coeff=coeff, seed=seed, hidden=hidden, wd_mode=wd_mode,
               wd=WEIGHT_DECAY[wd_mode], rerun=rerun, steps=steps, cost={512: 2, 1024: 4}.get(hidden, 1),
               work=WORK.get(hidden, 1.0), clip=clip)
    if mitigation:
        run["mitigation"] = mitigation
    run["name"] = run_name(run)
    return run


def missing_from(summary_path):
    """The runs of a finished phase that did not complete (no validation loss after the last step):
    what a later phase reruns first. A rerun whose original did not complete comes back with it."""
    with open(summary_path) as fh:
        summary = json.load(fh)
    keys = ("group", "lr", "coeff", "seed", "hidden", "wd_mode", "rerun")

    def again(r):
        steps = r.get("steps") if r.get("steps") not in (None, summary.get("steps")) else None
        return make_run(**{k: r[k] for k in keys if k in r}, steps=steps)

    missing = [again(r) for r in summary["runs"] if not r.get("complete")]
    names = {r["name"] for r in missing}
    for r in summary["runs"]:  # the rerun measures the noise between two runs of one call: both run again
        original = r["name"].replace("_rerun", "")
        if r.get("rerun") and original in names and r["name"] not in names:
            missing.append(again(r))
    order = {r["name"]: i for i, r in enumerate(summary["runs"])}
    missing.sort(key=lambda r: (r["rerun"], order.get(r["name"], 0)))
    originals = [r for r in missing if not r["rerun"]]
    for rerun in [r for r in missing if r["rerun"]]:  # each rerun right after its original
        at = next((i for i, r in enumerate(originals) if r["name"] == rerun["name"].replace("_rerun", "")), None)
        originals.insert(len(originals) if at is None else at + 1, rerun)
    return originals


def plan_phase(phase, cfg, best_lr=None, quick=False, study=None):
    """The runs of a phase, in the order they start."""
    h, seeds, lrs = cfg["hidden"], cfg["seeds"], cfg["lrs"]
    if phase == "pilot":
        return plan_pilot(cfg, quick)
    if phase == "study":
        return plan_study(cfg, quick=quick, **(study or {}))
    if phase == "A":
        # seed by seed (a seed cut by the budget is the last one), the rerun right after the first seed
        runs = [make_run("main", lr, c, s, h) for s in seeds for lr in lrs for c in cfg.get("coeffs", MAIN_COEFFS)]
        rerun = dict(RERUN, lr=lrs[len(lrs) // 2]) if quick else RERUN
        first = len(runs) // len(seeds)
        return runs[:first] + [make_run("main", rerun["lr"], rerun["coeff"], rerun["seed"], h, rerun=True)] + runs[first:]
    if best_lr is None:
        raise ValueError("phase B needs --best-lr (the best learning rate of phase A at c = 0)")
    if best_lr not in cfg["lrs"]:
        raise ValueError(f"--best-lr {best_lr:g} is none of phase A's learning rates {cfg['lrs']}")
    if quick:  # one of each kind, tiny
        widths = [make_run("width", lrs[-1], c, seeds[0], 2 * h, steps=cfg["steps"] // 2) for c in (0.0, 1e-4)]
        coeff = [make_run("coeff", best_lr, 1e-2, s, h) for s in seeds]
        wd = [make_run("wd", best_lr, 0.0, seeds[0], h, mode) for mode in ("decoupled", "independent")]
        return widths + coeff + wd
    # In order of priority (what the budget cuts is the end of the list):
    # 1. the coefficient sweep's first seed; 2. the weight-decay arms at the highest learning rate, seed 1;
    # 3. the wider models, SHORT_STEPS steps at 3e-1 (and hidden 256 as long, their baseline); 4. the
    # coefficient sweep's second seed, the weight-decay arms at the best learning rate, the widths at 3e-2;
    # 5. the coefficient sweep's third seed.
    coeff = {s: [make_run("coeff", best_lr, c, s, h) for c in COEFF_SWEEP if c not in MAIN_COEFFS] for s in seeds}
    wd = {lr: [make_run("wd", lr, c, seeds[0], h, mode) for mode in ("decoupled", "independent") for c in (0.0, 1e-4)]
          for lr in (3e-1, best_lr)}
    widths = {lr: [make_run("width", lr, c, seeds[0], hidden, steps=SHORT_STEPS) for hidden in (1024, 512, h)
                   for c in (0.0, 1e-4)] for lr in (3e-1, 3e-2)}
    plan = coeff[seeds[0]] + wd[3e-1] + widths[3e-1] + coeff[seeds[1]] + wd[best_lr] + widths[3e-2] + coeff[seeds[2]]
    unique = {}
    for run in plan:
        unique.setdefault(run["name"], run)
    return list(unique.values())


def plan_pilot(cfg, quick=False):
    """Where does c = 0 fail? The settings most likely to diverge first (no weight decay and the paper's
    independent 1e-4 at the highest learning rates), with and without clipping, a c = 1e-4 pair for the
    most likely ones, decoupled 0.1 (Megatron's usual), a second seed and one wider model."""
    h = cfg["hidden"]
    if quick:
        return [make_run("pilot", lr, c, 1, h, clip=clip) for lr in cfg["lrs"] for c in (0.0, 1e-4) for clip in (1.0,)]
    lo, mid, hi = cfg["lrs"]
    runs = [make_run("pilot", lr, 0.0, 1, h, wd) for lr in (hi, mid, lo) for wd in ("none", "independent", "decoupled")]
    runs += [make_run("pilot", lr, 0.0, 1, h, wd, clip=0.0) for lr in (hi, mid) for wd in ("none", "independent")]
    runs += [make_run("pilot", hi, 0.0, 1, h, "decoupled", clip=0.0)]
    runs += [make_run("pilot", lr, 1e-4, 1, h, wd) for lr in (hi, mid) for wd in ("none", "independent")]
    runs += [make_run("pilot", hi, 1e-4, 1, h, wd, clip=0.0) for wd in ("none", "independent")]
    runs += [make_run("pilot", lr, 0.0, 2, h) for lr in (hi, mid)]
    runs += [make_run("pilot", hi, 0.0, 1, 2 * h)]
    return runs


STUDY_COEFFS = [0.0, 1e-4, 1e-3, 1e-6]  # 1e-6: a near-zero arm, the run-to-run noise of "a coefficient at all"


def plan_study(cfg, edge_lrs, below_lrs=(), wd_mode="none", clip=1.0, seeds_edge=5, seeds_below=3,
               coeffs=STUDY_COEFFS, quick=False, mitigations=()):
    """The coefficients at the learning rates around the edge the pilot found: ``seeds_edge`` seeds at each
    of ``edge_lrs``, ``seeds_below`` at ``below_lrs``. In order of priority (what the budget cuts is the
    end): seed by seed, c = 0 and 1e-4 (the pair the question is about) before 1e-3 and the near-zero arm."""
    h = cfg["hidden"]
    order = sorted(coeffs, key=lambda c: STUDY_COEFFS.index(c) if c in STUDY_COEFFS else len(STUDY_COEFFS))
    runs = []
    for seed in range(1, max(seeds_edge, seeds_below) + 1):
        lrs = [lr for lr in edge_lrs if seed <= seeds_edge] + [lr for lr in below_lrs if seed <= seeds_below]
        runs += [make_run("study", lr, c, seed, h, wd_mode, clip=clip) for c in order for lr in lrs]
        runs += [make_run("study", lr, 0.0, seed, h, wd_mode, clip=clip, mitigation=m) for m in mitigations
                 for lr in lrs]
    return runs


def eval_iters_for(data, cfg, valid_prefix):
    """Validation batches that cover the held-out split once (Megatron's samples of one epoch)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(os.path.join(data, valid_prefix))  # held: its arrays are views of its memory map
    tokens = int(dataset.sequence_lengths.sum())
    samples = (tokens - 1) // cfg["seq"]
    if samples < cfg["micro_batch"]:
        raise SystemExit(f"{data}: the validation split has {samples} sequences of {cfg['seq']}, fewer than a batch")
    return samples // cfg["micro_batch"], tokens


def megatron_args(cfg, run, data, run_dir, on_gpu, eval_iters, prefixes):
    """Megatron's arguments of one run."""
    h = run["hidden"]
    steps = run.get("steps") or cfg["steps"]
    # independent weight decay lambda * s(t): Megatron decays by lr(t) * wd, so wd = lambda / lr_max
    wd = run["wd"] / run["lr"] if run["wd_mode"] == "independent" else run["wd"]
    args = [
        # pre-LN GPT, no biases, RoPE, untied embeddings, qk-layernorm; head size 64; init std 1/sqrt(hidden)
        "--num-layers", cfg["layers"], "--hidden-size", h, "--ffn-hidden-size", 4 * h,
        "--num-attention-heads", max(1, h // 64), "--seq-length", cfg["seq"], "--max-position-embeddings", cfg["seq"],
        "--disable-bias-linear", "--normalization", "LayerNorm", "--norm-epsilon", "1e-6", "--qk-layernorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--init-method-std", f"{h ** -0.5:.6g}",
        # AdamW (0.9, 0.95, 1e-8), clipping at 1, linear warmup then cosine decay to MIN_LR
        "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8",
        "--weight-decay", f"{wd:.6g}", "--clip-grad", f"{run.get('clip', 1.0) or NO_CLIP:g}", "--lr", f"{run['lr']:g}",
        "--min-lr", f"{MIN_LR:g}", "--lr-decay-style", "cosine", "--lr-warmup-iters", warmup_iters(steps),
        "--lr-decay-iters", steps,
        "--micro-batch-size", cfg["micro_batch"], "--global-batch-size", cfg["micro_batch"],
        "--train-iters", steps, "--seed", run["seed"],
        # the data: its own held-out split, evaluated once after the last step, all of it
        "--train-data-path", os.path.join(data, prefixes[0]), "--valid-data-path", os.path.join(data, prefixes[1]),
        "--data-cache-path", os.path.join(run_dir, "cache", run["name"]), "--num-workers", "1",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", cfg["vocab"], "--null-tokenizer-eod-id", "0",
        "--eval-iters", eval_iters, "--eval-interval", steps + 1,
        "--log-interval", cfg["log_interval"],
        # megatron-core alone (no Transformer Engine / Apex): the local implementation, no fused kernels
        "--transformer-impl", "local", "--attention-backend", "unfused", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
        "--no-persist-layer-norm", "--manual-gc",
        # a diverging run goes on to the end (NaN included) instead of stopping: its final loss is the measurement
        "--no-check-for-nan-in-loss-and-grad",
        # this package: the fused kernel in every arm, only the coefficient differs
        "--lm-fused-ce", "--lm-z-loss-log-lse", "--lm-z-loss-coeff", f"{run['coeff']:g}",
        *MITIGATIONS.get(run.get("mitigation"), []),
        "--distributed-backend", "nccl" if on_gpu else "gloo",
    ]
    if cfg.get("tb_interval"):
        args += ["--tensorboard-dir", os.path.join(run_dir, "tb", run["name"]),
                 "--tensorboard-log-interval", cfg["tb_interval"], "--tensorboard-queue-size", "100"]
    if cfg.get("stop_at_horizon") and cfg.get("horizon"):
        args += ["--exit-interval", cfg["horizon"]]  # the judged iterations and no more
    args += ["--bf16"] if on_gpu else ["--use-cpu-initialization"]
    return [str(a) for a in args]


def warmup_iters(steps):
    return max(1, int(steps * WARMUP_FRACTION))


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


def place(run, cost, load, busy, now, cfg, capacity, deadline, unit_s):
    """Where ``run`` starts now: ``(slot, predicted end)``, or None when no slot has room for its ``cost``
    or (``unit_s`` given) its slot's admitted work would end after ``deadline``. The slot whose work
    ends first; a run adds ``unit_s * work * steps / cfg steps`` to it, after ``startup_s`` on an idle one."""
    fits = [g for g in load if load[g] + cost <= capacity]
    if not fits:
        return None
    gpu = min(fits, key=lambda g: (max(busy[g], now), load[g]))
    if not unit_s:
        return gpu, None
    steps = run.get("steps") or cfg["steps"]
    finish = max(busy[gpu], now + cfg["startup_s"]) + unit_s * run["work"] * steps / cfg["steps"]
    return None if finish > deadline else (gpu, finish)


def launch_all(plan, cfg, data, run_dir, gpus, parallel, budget_s, eval_iters, prefixes):
    """Start the runs in order while capacity allows (on GPUs: ``cfg['gpu_capacity']`` units per GPU, a
    run's ``cost`` units, the least-loaded GPU first; on the CPU: ``parallel`` at a time), stop what is
    still running after ``budget_s``; returns one record per run of the plan."""
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    base_env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
                    OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2" if gpus else "1"))
    slots = gpus or ["cpu"]
    capacity = cfg["gpu_capacity"] if gpus else parallel
    load = {g: 0 for g in slots}
    # the admission model (GPUs): runs sharing a GPU divide its time, so its admitted work ends at busy[g];
    # a run is admitted where that stays before the deadline (10 % before the budget)
    unit_s = cfg.get("unit_s") if gpus else None
    deadline = 0.9 * budget_s
    busy = {g: 0.0 for g in slots}
    pending = list(plan)
    plan_keys = set().union(*(r.keys() for r in plan)) if plan else set()
    running, records = {}, []
    monitors = {}  # name -> the divergence rule fed from its log, read as it grows
    stop_diverged = bool(cfg.get("stop_on_divergence"))
    mps_gpus = [g for g in os.environ.get("ZLOSS_MPS_GPUS", "").split(",") if g] if os.environ.get("ZLOSS_MPS_PIPE") else []
    start = time.time()
    while pending or running:
        over = time.time() - start > budget_s
        for run in list(pending):
            if over:
                break
            cost = run["cost"] if gpus else 1
            placed = place(run, cost, load, busy, time.time() - start, cfg, capacity, deadline, unit_s)
            if placed is None:
                continue
            gpu, finish = placed
            if finish is not None:
                busy[gpu] = finish
                run = dict(run, predicted_end_s=round(finish))
            pending.remove(next(r for r in pending if r["name"] == run["name"]))
            load[gpu] += cost
            env = dict(base_env, **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpus else {}))
            if str(gpu) in mps_gpus:  # this GPU's runs are clients of the MPS server started for them
                env.update(CUDA_MPS_PIPE_DIRECTORY=os.environ["ZLOSS_MPS_PIPE"],
                           CUDA_MPS_LOG_DIRECTORY=os.environ["ZLOSS_MPS_PIPE"] + "_log")
            else:
                env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
                env.pop("CUDA_MPS_LOG_DIRECTORY", None)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                   "--master-addr", "127.0.0.1", "--master-port", str(free_ports(1)[0]),  # chosen at launch
                   "-m", "mindspeed_cez.launch", os.path.join(HERE, "pretrain_gpt.py"),
                   *megatron_args(cfg, run, data, run_dir, bool(gpus), eval_iters, prefixes)]
            log = open(os.path.join(run_dir, "logs", run["name"] + ".log"), "w")
            log.write(" ".join(cmd) + "\n\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            running[run["name"]] = (proc, log, dict(run, gpu=None if not gpus else gpu, mps=str(gpu) in mps_gpus,
                                                    started_s=round(time.time() - start, 1)))
            monitors[run["name"]] = dict(rule=Divergence(warmup_iters(run.get("steps") or cfg["steps"])), offset=0,
                                         rest="", first=None, last=None)
        time.sleep(1.0)
        for name, (proc, log, record) in running.items():  # the rule on what each log has grown by
            mon = monitors[name]
            with open(log.name, "rb") as fh:
                fh.seek(mon["offset"])
                chunk = fh.read()
            mon["offset"] += len(chunk)
            lines = (mon["rest"] + chunk.decode("utf-8", "replace")).split("\n")
            mon["rest"] = lines.pop()
            now = time.time() - start
            for point in filter(None, map(parse_line, lines)):
                mon["first"] = mon["first"] or (point["step"], now)
                mon["last"] = (point["step"], now)
                mon["rule"].add(point)
            if stop_diverged and mon["rule"].verdict and proc.poll() is None and "stopped_diverged" not in record:
                os.killpg(proc.pid, signal.SIGTERM)
                record["stopped_diverged"] = mon["rule"].verdict
                print(f"[{now:5.0f} s] {name}: diverged ({mon['rule'].verdict}), stopped", flush=True)
        over = time.time() - start > budget_s
        if over:  # out of time: stop every torchrun session still going (all at once), keep what they wrote
            stopping = [(proc, record) for proc, _, record in running.values() if proc.poll() is None]
            for proc, record in stopping:
                os.killpg(proc.pid, signal.SIGTERM)
                record["stopped_at_budget"] = True
            end = time.time() + 15
            for proc, _ in stopping:
                try:
                    proc.wait(timeout=max(0.1, end - time.time()))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        for name, (proc, log, record) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            if proc.returncode != 0 and not record.get("stopped_at_budget") and not record.get("retried") \
                    and "EADDRINUSE" in open(log.name, errors="replace").read():
                # the port was free when chosen and taken before torchrun bound it: start the run once more
                os.replace(log.name, log.name + ".eaddrinuse")
                load[record["gpu"] if gpus else "cpu"] -= record["cost"] if gpus else 1
                del running[name]
                pending.insert(0, dict({k: v for k, v in record.items() if k in plan_keys}, retried=True))
                print(f"[{time.time() - start:5.0f} s] {name}: port taken at rendezvous, started again", flush=True)
                continue
            where = record["gpu"] if gpus else "cpu"
            load[where] -= record["cost"] if gpus else 1
            if load[where] == 0:  # an idle GPU's admitted work has ended, whatever was predicted
                busy[where] = min(busy[where], time.time() - start)
            record.update(rc=proc.returncode, wall_s=round(time.time() - start - record["started_s"], 1))
            mon = monitors.pop(name)
            if mon["first"] and mon["last"] and mon["last"][1] > mon["first"][1]:  # steady steps/s (startup left out)
                record["first_log_s"] = round(mon["first"][1] - record["started_s"], 1)
                record["steps_per_s"] = round((mon["last"][0] - mon["first"][0]) / (mon["last"][1] - mon["first"][1]), 2)
            record["last_step"] = mon["last"][0] if mon["last"] else 0
            records.append(record)
            del running[name]
            print(f"[{time.time() - start:5.0f} s] {name}: rc={proc.returncode} in {record['wall_s']:.0f} s, "
                  f"step {record['last_step']}"
                  + (f", {record['steps_per_s']} steps/s" if record.get("steps_per_s") is not None else "")
                  + (f" on GPU {record['gpu']}" if record.get("gpu") is not None else " on the CPU")
                  + (" (stopped: out of time)" if record.get("stopped_at_budget") else "")
                  + (" (stopped: diverged)" if record.get("stopped_diverged") else ""), flush=True)
        if pending and (over or (unit_s and not running)):  # out of time, or nothing left that fits in it
            for run in pending:
                records.append(dict(run, gpu=None, rc=None, not_started=True))
                print(f"[{time.time() - start:5.0f} s] {run['name']}: not started (out of time)", flush=True)
            pending = []
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

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "cpus": os.cpu_count()}
    for package in ("megatron-core", "triton", "mindspeed_cez", "tokenizers"):
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            env[package] = None
    env["commit"] = os.environ.get("ZLOSS_COMMIT")  # a copy without its .git says which commit it is
    if not env["commit"]:
        try:
            env["commit"] = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["commit"] = None
    if gpus:
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(len(gpus))]
        try:
            env["compute_mode"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"], capture_output=True,
                text=True, timeout=30).stdout.split()
        except (OSError, subprocess.SubprocessError):
            env["compute_mode"] = None
    return env


def build_data(data, quick, vocab):
    """Build (or check) the corpus in a child process (``tokenizers`` and torch in one process can crash);
    returns the build record. ``quick``: this checkout's own text files through the same builder."""
    cmd = [sys.executable, os.path.join(HERE, "pypi_text_corpus.py"), "build", "--dir", data]
    cmd += ["--from-dir", REPO, "--vocab-size", str(vocab)] if quick else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"building the data in {data} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    with open(os.path.join(data, "build.json")) as fh:
        return json.load(fh)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "out", "zloss_sweep"), help="the run folder")
    parser.add_argument("--data", default=None,
                        help="the corpus folder (pypi_text_corpus.py build --dir DATA: built there if only its text and "
                             "tokenizer are there); --quick without it: a small corpus of this checkout in OUT/data")
    parser.add_argument("--data-archive", default=None,
                        help="a .tar.xz of the built corpus (pypi_text_corpus.py pack): unpacked into --data first")
    parser.add_argument("--phase", choices=["A", "B", "pilot", "study"], default="A",
                        help="A: the main sweep; B: coefficients, weight decay, widths (needs --best-lr); pilot: where "
                             "c = 0 diverges; study: the coefficients at the learning rates around that edge")
    parser.add_argument("--steps", type=int, default=None, help="pilot / study: iterations of a run (default 10000)")
    parser.add_argument("--gpu-capacity", type=int, default=None, help="runs sharing one GPU (pilot / study: 8)")
    parser.add_argument("--edge-lrs", type=float, nargs="+", default=None, help="study: learning rates at the edge")
    parser.add_argument("--below-lrs", type=float, nargs="+", default=[], help="study: learning rates below it")
    parser.add_argument("--seeds-edge", type=int, default=5, help="study: seeds at each edge learning rate")
    parser.add_argument("--seeds-below", type=int, default=3, help="study: seeds at each learning rate below it")
    parser.add_argument("--coeffs", type=float, nargs="+", default=STUDY_COEFFS, help="study: the coefficients")
    parser.add_argument("--mitigations", nargs="+", default=[], choices=sorted(MITIGATIONS),
                        help="study: arms beside the coefficients, each at c = 0 (MITIGATIONS: their flags)")
    parser.add_argument("--stop-at-horizon", action="store_true",
                        help="pilot / study: end each run at --horizon (Megatron's --exit-interval)")
    parser.add_argument("--wd-mode", choices=sorted(WEIGHT_DECAY), default="none", help="study: the weight decay")
    parser.add_argument("--clip", type=float, default=1.0, help="study: gradient clipping norm (0: none)")
    parser.add_argument("--hidden", type=int, default=None, help="pilot / study: the model width (default 256)")
    parser.add_argument("--horizon", type=int, default=None,
                        help="pilot / study: the iteration by which a run is judged (diverged by then, or not), fixed "
                             "before the runs; runs go on to --steps or the budget (default: --steps)")
    parser.add_argument("--best-lr", type=float, default=None, help="phase B: the learning rate of its sweeps")
    parser.add_argument("--complete", default=None, metavar="SUMMARY",
                        help="first rerun the runs that did not complete in this earlier phase's summary.json")
    parser.add_argument("--unit-s", type=float, default=None,
                        help="GPU seconds of one hidden-256 run at full steps, for admission (default 34: H100)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, few steps")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all; 0: CPU)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time on the CPU")
    parser.add_argument("--only", nargs="+", default=None, help="run only these run names of the phase")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop runs still going after this many seconds (default: 480 on GPUs, 900 on the CPU)")
    args = parser.parse_args(argv)
    import pypi_text_corpus as corpus
    import zloss_sweep_report

    built = args.data and all(os.path.exists(os.path.join(args.data, f)) for f in corpus.INDEXED)
    missing = missing_requirements([m for m in NEEDS if (m != "tokenizers" or not (built or args.data_archive))
                                    and (m != "tensorboard" or args.phase in ("A", "B"))])
    if missing:
        raise SystemExit('zloss_lr_sweep.py needs: pip install ".[sweep]" (missing: ' + ", ".join(missing) + ")")

    long_phase = args.phase in ("pilot", "study")
    cfg = dict((QUICK_LONG if args.quick else LONG) if long_phase else (QUICK if args.quick else FULL))
    cfg["stop_on_divergence"] = long_phase
    if args.steps:
        cfg["steps"] = args.steps
    if args.hidden:
        cfg["hidden"] = args.hidden
    if args.horizon:
        cfg["horizon"] = args.horizon
    cfg["stop_at_horizon"] = args.stop_at_horizon
    if args.gpu_capacity:
        cfg["gpu_capacity"] = args.gpu_capacity
    gpus = [] if args.quick else detect_gpus()
    if args.gpus is not None and not args.quick:
        if args.gpus > len(gpus):
            parser.error(f"--gpus {args.gpus}: this machine has {len(gpus)}")
        gpus = gpus[:args.gpus]
    if args.best_lr is not None and not args.best_lr > 0:
        parser.error(f"--best-lr must be > 0, got {args.best_lr}")
    budget_s = args.budget_s or (480 if gpus else 900)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    start = time.time()
    if args.data is None and not args.quick:
        parser.error("--data: the built corpus folder (examples/pypi_text_corpus.py build --dir DATA)")
    data = os.path.abspath(args.data or os.path.join(out, "data"))
    if args.data_archive and not os.path.exists(os.path.join(data, corpus.TRAIN + ".bin")):
        corpus.unpack(args.data_archive, data)
    # --quick without --data: a small corpus of this checkout's files; with --data: that corpus, its vocabulary
    build = build_data(data, args.quick and args.data is None, cfg["vocab"])
    cfg["vocab"] = build["vocab_size"]
    eval_iters, valid_tokens = eval_iters_for(data, cfg, corpus.VALID)
    if args.quick:
        eval_iters = min(eval_iters, 4)
    print(f"data {data}: {json.dumps(build.get('splits'))}; matches the manifest: {build.get('matches_manifest')}; "
          f"validation: {eval_iters} batches of {cfg['micro_batch']} x {cfg['seq']} "
          f"({eval_iters * cfg['micro_batch'] * cfg['seq']} of {valid_tokens} tokens) ({time.time() - start:.0f} s)",
          flush=True)

    env = environment(gpus)
    print("environment:", json.dumps(env), flush=True)
    try:
        study = None
        if args.phase == "study":
            if not args.edge_lrs:
                parser.error("--phase study needs --edge-lrs (the learning rates where the pilot's c = 0 diverged)")
            study = dict(edge_lrs=args.edge_lrs, below_lrs=args.below_lrs, wd_mode=args.wd_mode, clip=args.clip,
                         seeds_edge=args.seeds_edge, seeds_below=args.seeds_below, coeffs=args.coeffs,
                         mitigations=args.mitigations)
        plan = plan_phase(args.phase, cfg, args.best_lr, args.quick, study)
    except ValueError as e:
        parser.error(str(e))
    if args.complete:
        first = missing_from(args.complete)
        names = {r["name"] for r in first}
        plan = first + [r for r in plan if r["name"] not in names]
    if args.only:
        plan = [r for r in plan if r["name"] in args.only]
    if args.unit_s is not None:
        cfg["unit_s"] = args.unit_s
    where = f"{len(gpus)} GPU(s)" if gpus else f"the CPU, {args.parallel} at a time"
    print(f"phase {args.phase}: {len(plan)} runs on {where}, {cfg['steps']} steps each, budget {budget_s:.0f} s",
          flush=True)
    records = launch_all(plan, cfg, data, out, gpus, args.parallel, budget_s, eval_iters, (corpus.TRAIN, corpus.VALID))
    shutil.rmtree(os.path.join(out, "cache"), ignore_errors=True)  # Megatron's sample indices, rebuilt per run
    sweep = {"phase": args.phase, "best_lr": args.best_lr, "config": cfg, "min_lr": MIN_LR,
             "warmup_fraction": WARMUP_FRACTION, "eval_iters": eval_iters, "valid_tokens": valid_tokens,
             "data": build, "gpus": len(gpus), "environment": env, "budget_s": budget_s,
             "runs": records, "wall_s": round(time.time() - start, 1),
             "megatron_args_example": megatron_args(cfg, plan[0], data, out, bool(gpus), eval_iters,
                                                    (corpus.TRAIN, corpus.VALID)) if plan else None}
    with open(os.path.join(out, "sweep.json"), "w") as fh:
        json.dump(sweep, fh, indent=1)
    if gpus:  # what the GPUs held: the study is sized from these
        for g in gpus:
            rates = [r["steps_per_s"] for r in records if r.get("gpu") == g and r.get("steps_per_s")]
            print(f"GPU {g}: {len(rates)} runs, {sum(rates):.1f} steps/s together "
                  f"(hidden-256-equivalent: {sum(r['steps_per_s'] * r['work'] for r in records if r.get('gpu') == g and r.get('steps_per_s')):.1f}), "
                  f"MPS {'on' if any(r.get('mps') for r in records if r.get('gpu') == g) else 'off'}", flush=True)
    if long_phase:
        summary = zloss_sweep_report.summarize_logs(out)
        failed = [r["name"] for r in records if r.get("rc") not in (0, None) and not r.get("stopped_at_budget")
                  and not r.get("stopped_diverged")]
        print(f"done in {time.time() - start:.0f} s; diverged: "
              f"{[r['name'] for r in summary['runs'] if r.get('diverged')]}"
              + (f"; failed: {failed}" if failed else ""), flush=True)
        return 1 if failed else 0
    summary = zloss_sweep_report.summarize(out)
    if importlib.util.find_spec("matplotlib") is None:
        print("no plots: pip install matplotlib, then: python examples/zloss_sweep_report.py " + out, flush=True)
    else:
        zloss_sweep_report.report([summary], os.path.join(out, "report"))
    failed = [r["name"] for r in records if r.get("rc") not in (0, None) and not r.get("stopped_at_budget")]
    cut = [r["name"] for r in records if r.get("stopped_at_budget") or r.get("not_started")]
    print(f"done in {time.time() - start:.0f} s; report in {os.path.join(out, 'report')}"
          + (f"; stopped or not started (out of time): {cut}" if cut else "")
          + (f"; failed: {failed} (logs in {os.path.join(out, 'logs')})" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
