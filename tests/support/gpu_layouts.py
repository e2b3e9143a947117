"""The parallel layouts of Megatron's own ``pretrain`` on GPUs over NCCL, with and without the
adaptor's flags, as one command; asserted, with a table of the results.

    python3 tests/support/gpu_layouts.py --out $OUT/layouts            # every layout the GPUs found can hold
    python tests/support/gpu_layouts.py --cpu --out out/layouts_cpu     # the plumbing on the CPU (gloo, 2 ranks)

Each layout launches ``examples/pretrain_gpt.py`` through its test harness
(``tests/support/megatron_pretrain_harness.py``: logits dumped at iteration ``DUMP_ITERATION``, a
data-dependent tail of every micro-batch masked) four times at once on the same GPUs (own master
ports, a time limit each): Megatron's CE (no flag), ``--lm-z-loss-coeff 1e-4``, and that with
``--lm-fused-output-layer`` (forward, the default) and ``--lm-fused-output-layer recompute``
(with ``--lm-z-loss-log-lse``: ``lm_lse`` and ``lm_lse_max`` logged too).
Layouts run one after another, or side by side where the GPUs hold several. Same seed, data and
(``--use-cpu-initialization``) weights; bf16, this package's Triton kernels, Megatron's CUDA paths
(the package's CPU mode applies only without CUDA). Layouts that need more GPUs than present, or
that could not end before ``--deadline-s`` (admission by load: tests/support/launch_admission.py), are named as not
run. Asserted (exit status 1 on any failure):

* every run ends, logs every iteration, all values finite, no skipped or NaN iteration;
* ``lm_z_loss`` on every log line of the flag's runs (Megatron prints it from the last rank, the
  last pipeline stage), never without the flag;
* iteration 1 (same weights): ``lm loss`` with the flag equals Megatron's CE; the fused layer's
  ``lm loss``, ``lm_z_loss``, grad norm and MTP losses equal the unfused run's; forward equals
  recompute (later iterations within ``LATER_REL``);
* iteration ``DUMP_ITERATION``: ``lm loss``, ``lm_z_loss`` and ``lm_lse`` equal the token-weighted CE,
  z-loss and log-sum-exp recomputed in float64 from the dumped logits of every micro-batch and
  data-parallel (and context-parallel) rank, ``lm_lse_max`` their largest log-sum-exp;
  the fused layer made no logits, and its default path knew Megatron's gradient in forward and
  added the weight gradient into the ``main_grad`` of Megatron's DDP buckets;
* layouts that build the same weights (same expert and pipeline split) agree at iteration 1.

``--cpu`` runs the same on the CPU (gloo, 2 ranks, the layouts scaled down, fp32, 4 iterations:
the package's CPU mode), to check the plumbing before device time is spent.
"""

import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the support package
from support.launch_admission import Admission, Load, not_run_lines  # noqa: E402
from support.megatron_launch import (  # noqa: E402
    DUMP_ITERATION, MOE, REPO, TINY_GPT, ce_mean, dumped_flags, launch_command, lse_max, parse_log,
    per_micro_batch_z_mean, recompute_from_dump, token_mean, with_args, z_loss_mean,
)

Z_COEFF = 1e-4
FLAG = ["--lm-z-loss-coeff", str(Z_COEFF), "--lm-z-loss-log-lse"]  # lm_lse, lm_lse_max logged too
VARIANTS = {
    "ce": [],  # Megatron's own cross entropy
    "z": FLAG,
    "fol": FLAG + ["--lm-fused-output-layer"],  # forward: gradients made in the forward
    "fol_recompute": FLAG + ["--lm-fused-output-layer", "recompute"],
}
FLAGGED = ("z", "fol", "fol_recompute")

# Tolerances (relative). Logits are bf16 on GPUs (fp32 on the CPU); every loss is computed from them
# in fp32, Megatron's CE and this package's kernels alike, and printed with 7 significant digits.
# Iteration 1 (same weights, same data): the flag's runs see bitwise the same logits as Megatron's
# CE (the fused layer: logits re-made by its own blocked GEMMs, which may round a logit to the
# neighbouring bf16 value, 2^-8 relative); a token's CE moves by at most such a rounding of its
# logits, and the token mean over the iteration averages them: 1e-4 leaves room for that (the
# dump check below holds the exact weighting to 1e-5).
ITER1_REL = 1e-4
GRAD_NORM_REL, GRAD_NORM_ABS = 2e-3, 1.01e-3  # printed with 3 decimals; summed in another order
# Later iterations: the same gradients up to bf16 rounding, through several Adam steps.
LATER_REL = 2e-2
# Against float64 recomputed from the dumped logits: the unfused run's dump holds the very logits its
# loss read (fp32 math: 1e-5); the fused layer's are re-made by the harness (one bf16 GEMM).
DUMP_REL = {"z": 1e-5, "fol": 1e-4, "fol_recompute": 1e-4}
# Layouts with the same weights: the same bf16 model split differently (TP sums partial products in
# another order, DP/TP all-reduce in bf16), over the same tokens.
CROSS_LAYOUT_REL = 2e-3

GPU_ITERS, CPU_ITERS = 20, 4
GPU_LAUNCH_TIMEOUT_S, CPU_LAUNCH_TIMEOUT_S = 240, 900


# ----------------------------------------------------------------------------------- layouts
def model_args(cpu):
    """The tiny MoE GPT every layout trains: 4 layers (1 per virtual stage at PP=2 x VPP=2), 4 experts
    top-2, RoPE, init std 0.1 (log-sum-exps that vary over tokens, so weightings differ)."""
    args = with_args(TINY_GPT, num_layers=4, position_embedding_type="rope", init_method_std=0.1, eval_iters=0,
                     eval_interval=1000)
    if cpu:  # fp32 (Megatron's bf16 optimizer needs CUDA), short sequences
        return with_args(args, seq_length=64, max_position_embeddings=64, micro_batch_size=2, global_batch_size=8,
                         train_iters=CPU_ITERS) + MOE
    # 1536 tokens per micro-batch: the fused layer's forward path makes them in two blocks (1024 + 512)
    return with_args(args, seq_length=768, max_position_embeddings=768, micro_batch_size=2, global_batch_size=16,
                     train_iters=GPU_ITERS) + MOE + ["--bf16"]


@dataclass
class Layout:
    name: str
    ranks: int
    parallel: list  # Megatron's parallelism flags
    note: str = ""
    probe_gaf: bool = False  # also launch Megatron's gradient-accumulation fusion (expected refusal)
    env: dict = field(default_factory=dict)  # for the harness

    def flag(self, name, default=1):
        flag = "--" + name.replace("_", "-")
        return int(self.parallel[self.parallel.index(flag) + 1]) if flag in self.parallel else default

    @property
    def weights(self):
        """Layouts with equal keys build the same weights from ``--use-cpu-initialization``: Megatron's CPU
        init draws each full weight and keeps this rank's slice (TP, SP, DP, MTP's extra layer drawn
        after the main model: same weights), but seeds each pipeline stage apart and draws only this
        rank's experts (EP)."""
        return (f"ep{self.flag('expert_model_parallel_size')}-pp{self.flag('pipeline_model_parallel_size')}"
                f"-vpp{self.flag('num_layers_per_virtual_pipeline_stage', 0)}")


def _parallel(tp=1, pp=1, ep=1, etp=None, sp=False, vpp=None, extra=()):
    """Megatron's flags for these sizes (``vpp``: layers per virtual pipeline stage; ``etp``: expert TP)."""
    sizes = {"tensor-model-parallel-size": tp, "pipeline-model-parallel-size": pp, "expert-model-parallel-size": ep}
    optional = {"expert-tensor-parallel-size": etp, "num-layers-per-virtual-pipeline-stage": vpp}
    args = [a for flag, value in sizes.items() if value != 1 for a in (f"--{flag}", str(value))]
    args += [a for flag, value in optional.items() if value is not None for a in (f"--{flag}", str(value))]
    return args + (["--sequence-parallel"] if sp else []) + list(extra)


GAF_FLAG = "--no-gradient-accumulation-fusion"
DIST_OPT = ["--use-distributed-optimizer", "--overlap-grad-reduce"]
MTP_NOTE = ("MoE at TP=2 needs SP (Megatron's MoE layer raises in training without it), which the local spec's MTP "
            "norms (WrappedTorchNorm) refuse: the example builds them as its sequence-parallel torch norms")
CP_NOTE = ("attention: the test-only stand-in of tests/support/context_parallel_attention.py, as Megatron's local "
           "DotProductAttention refuses CP and Transformer Engine cannot travel to the GPU machine "
           "(transformer_engine_cu13 2.20.2, its core library, is a 276 MB wheel against the 64 MiB a device call "
           "carries; transformer_engine_torch, the PyTorch binding, is a source archive only, to be compiled there)")
CP_ENV = {"CEZ_TEST_CP_ATTENTION": "1"}


def gpu_layouts():
    return [
        Layout("tp4-sp", 4, _parallel(tp=4, sp=True)),
        Layout("tp2-pp2-vpp2", 4, _parallel(tp=2, pp=2, vpp=1, sp=True), "interleaved 1F1B, 1 layer per virtual stage"),
        Layout("ep4-dp4", 4, _parallel(ep=4), "alltoall dispatcher"),
        Layout("tp2-ep2-etp1-sp", 4, _parallel(tp=2, ep=2, etp=1, sp=True)),
        Layout("mtp1-tp2-sp", 4, _parallel(tp=2, sp=True, extra=["--mtp-num-layers", "1"]), MTP_NOTE),
        Layout("dp4-distopt", 4, _parallel(extra=DIST_OPT), probe_gaf=True),
        Layout("cp2-dp2", 4, _parallel(extra=["--context-parallel-size", "2"]), CP_NOTE, env=CP_ENV),
        Layout("tp2-pp2-ep2-dp2", 8, _parallel(tp=2, pp=2, ep=2, etp=1, sp=True)),
    ]


def cpu_layouts():
    return [
        Layout("tp2-sp", 2, _parallel(tp=2, sp=True)),
        Layout("pp2-vpp2", 2, _parallel(pp=2, vpp=1)),
        Layout("ep2-dp2", 2, _parallel(ep=2)),
        Layout("tp2-ep2-etp1-sp", 2, _parallel(tp=2, ep=2, etp=1, sp=True)),
        Layout("mtp1-tp2-sp", 2, _parallel(tp=2, sp=True, extra=["--mtp-num-layers", "1"]), MTP_NOTE),
        # Megatron's distributed optimizer wants CUDA tensors
        Layout("dp2-overlap", 2, _parallel(extra=["--overlap-grad-reduce"]), probe_gaf=True),
        Layout("cp2", 2, _parallel(extra=["--context-parallel-size", "2"]), CP_NOTE, env=CP_ENV),
    ]


def gaf_available():
    """Megatron's local linear layers fuse the weight-gradient accumulation with apex's
    ``fused_weight_gradient_mlp_cuda`` only; without it ``ColumnParallelLinear`` raises at model build."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def layout_args(layout, cpu, gaf):
    args = model_args(cpu) + layout.parallel
    if layout.probe_gaf and gaf:
        args.remove(GAF_FLAG)  # Megatron's default: fused
    return args


# --------------------------------------------------------------------------------- launching
@dataclass
class Run:
    layout: str
    variant: str
    out: Path
    proc: subprocess.Popen = None
    start: float = 0.0
    deadline: float = 0.0
    rc: int = None
    wall_s: float = 0.0
    timed_out: bool = False
    rows: dict = field(default_factory=dict)

    @property
    def log_path(self):
        return self.out / "train.log"


def start_run(run, args, nproc, devices, timeout_s, env=None):
    cmd, env = launch_command(run.out, args, nproc, env, backend="gloo" if devices is None else "nccl")
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env["CUDA_VISIBLE_DEVICES"] = "" if devices is None else ",".join(map(str, devices))  # CPU: none
    log = open(run.log_path, "w")
    log.write(" ".join(cmd) + "\n\n")
    log.flush()
    # a session of its own: on timeout the whole torchrun tree is ended, nothing else
    run.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    run.start, run.deadline = time.time(), time.time() + timeout_s


def poll(run):
    """True once ``run`` ended (or was ended at its deadline)."""
    if run.rc is not None:
        return True
    rc = run.proc.poll()
    if rc is None and time.time() > run.deadline:
        run.timed_out = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(run.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                rc = run.proc.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                continue
    if rc is None:
        return False
    run.rc, run.wall_s = rc, time.time() - run.start
    run.rows = parse_log(run.log_path.read_text(errors="replace"))
    return True


def take_gpus(slots, n):
    """``n`` distinct GPUs with a free slot (the freest first), taken from ``slots``; None if too few."""
    free = sorted((gpu for gpu, left in slots.items() if left > 0), key=lambda gpu: (-slots[gpu], gpu or 0))
    if len(free) < n:
        return None
    chosen = sorted(free[:n], key=lambda gpu: gpu or 0)  # CPU: [None]
    for gpu in chosen:
        slots[gpu] -= 1
    return chosen


def start_layout(layout, work, cpu, gaf, devices, timeout_s):
    """Start the layout's four variants (and, where apex is absent and the layout asks, a launch with
    Megatron's gradient-accumulation fusion on); returns ``(layout, {variant: Run}, devices, [probe])``."""
    args = layout_args(layout, cpu, gaf)
    runs = {v: Run(layout.name, v, work / layout.name / v) for v in VARIANTS}
    launches = [(run, args + VARIANTS[v]) for v, run in runs.items()]
    probes = []
    if layout.probe_gaf and not gaf:
        probes.append(Run(layout.name, "gaf_probe", work / layout.name / "gaf_probe"))
        launches.append((probes[0], with_args([a for a in args if a != GAF_FLAG], train_iters=2)))
    for run, run_args in launches:
        run.out.mkdir(parents=True, exist_ok=True)
        start_run(run, run_args, layout.ranks, devices, timeout_s, layout.env)
    return layout, runs, devices, probes


# ------------------------------------------------------------------------------------ checks
def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


class Checks:
    """The asserted results of one layout (or of the comparisons across layouts)."""

    def __init__(self, layout):
        self.layout, self.items = layout, []

    def add(self, name, ok, value=None, limit=None, detail=""):
        self.items.append({"layout": self.layout, "check": name, "ok": bool(ok), "value": value, "limit": limit,
                           "detail": detail})
        return ok

    def close(self, name, values, limit):
        """``values``: {label: (a, b)}; ok when every ``rel(a, b) <= limit``; records the largest."""
        diffs = {label: rel(a, b) for label, (a, b) in values.items()}  # NaN: a value missing
        worst = max(diffs, key=lambda label: (math.isnan(diffs[label]), diffs[label])) if diffs else None
        return self.add(name, all(d <= limit for d in diffs.values()), diffs.get(worst), limit,
                        f"largest: {worst}" if worst else "nothing to compare")

    @property
    def ok(self):
        return all(item["ok"] for item in self.items)


class Row(dict):
    """A log line's values; NaN for one it lacks (a check compares it and fails, naming it)."""

    def __missing__(self, key):
        return math.nan


def check_run_ended(checks, run, iters):
    rows = run.rows
    if run.rc != 0 or sorted(rows) != list(range(1, iters + 1)):
        why = "timed out" if run.timed_out else f"rc {run.rc}"
        return checks.add(f"{run.variant}: ran {iters} iterations", False,
                          detail=f"{why}, logged iterations {sorted(rows)[:3]}...{sorted(rows)[-3:]}; see {run.log_path}")
    bad = [(it, key, value) for it, row in rows.items() for key, value in row.items() if not math.isfinite(value)]
    counters = [(it, row.get("number of skipped iterations"), row.get("number of nan iterations"))
                for it, row in rows.items()]
    bad += [(it, "skipped/nan", (s, n)) for it, s, n in counters if s != 0 or n != 0]  # None: not printed
    return checks.add(f"{run.variant}: {iters} iterations, finite, none skipped or NaN", not bad,
                      detail=f"first offending: {bad[:3]}" if bad else "")


def check_layout(layout, runs, iters, cpu):
    """The checks of one layout's four runs (``runs``: {variant: Run})."""
    checks = Checks(layout.name)
    ended = {v: check_run_ended(checks, r, iters) for v, r in runs.items()}
    if not all(ended.values()):
        return checks
    rows = {v: {it: Row(row) for it, row in r.rows.items()} for v, r in runs.items()}
    first = {v: rows[v][1] for v in rows}
    checks.add("lm_z_loss on every log line with the flag, on none without",
               all("lm_z_loss" in row for v in FLAGGED for row in rows[v].values())
               and not any("lm_z_loss" in row for row in rows["ce"].values()))
    checks.close("iteration 1: lm loss with the flag = Megatron's CE",
                 {v: (first[v]["lm loss"], first["ce"]["lm loss"]) for v in FLAGGED}, ITER1_REL)
    losses = [k for k in first["z"] if "loss" in k or k.startswith("lm_lse")]  # + MoE, MTP losses, lm_lse(_max)
    checks.close("iteration 1: fused layer = unfused (losses)",
                 {f"{v} {k}": (first[v][k], first["z"][k]) for v in ("fol", "fol_recompute") for k in losses},
                 ITER1_REL)
    mtp = [k for k in first["ce"] if k.startswith("mtp")]
    if mtp:  # Megatron's MTP losses stay its CE with the flag
        checks.close("iteration 1: MTP losses equal with and without the flag",
                     {f"{v} {k}": (first[v][k], first["ce"][k]) for v in FLAGGED for k in mtp}, ITER1_REL)
    norms = {v: first[v]["grad norm"] for v in FLAGGED}
    worst = max(abs(norms[v] - norms["z"]) for v in FLAGGED)
    checks.add("iteration 1: grad norm, fused layer = unfused", worst <= GRAD_NORM_ABS + GRAD_NORM_REL * norms["z"],
               worst, GRAD_NORM_ABS + GRAD_NORM_REL * norms["z"], f"grad norms {norms}")
    checks.close(f"iterations 2-{iters}: forward = recompute (lm loss, lm_z_loss)",
                 {f"{it} {k}": (rows["fol"][it][k], rows["fol_recompute"][it][k])
                  for it in range(2, iters + 1) for k in ("lm loss", "lm_z_loss")}, LATER_REL)
    for v in FLAGGED:
        check_dump(checks, layout, runs[v], cpu)
    return checks


def check_dump(checks, layout, run, cpu):
    """Iteration ``DUMP_ITERATION``'s logged losses against float64 from every dumped micro-batch."""
    v, dump = run.variant, run.out / "dump"
    micro_batches = recompute_from_dump(dump)
    row = Row(run.rows[DUMP_ITERATION])
    expected_z, expected_ce = z_loss_mean(micro_batches, Z_COEFF), ce_mean(micro_batches)
    checks.close(f"{v}: iteration {DUMP_ITERATION} = float64 from the dumped logits",
                 {"lm_z_loss": (row["lm_z_loss"], expected_z), "lm loss": (row["lm loss"], expected_ce),
                  "lm_lse": (row["lm_lse"], token_mean(micro_batches, lambda lse, ce: lse)),
                  "lm_lse_max": (row["lm_lse_max"], lse_max(micro_batches))}, DUMP_REL[v])
    if v == "z":  # the comparison can tell token weighting from a mean of micro-batch means
        sensitivity = rel(per_micro_batch_z_mean(micro_batches, Z_COEFF), expected_z)
        checks.add("dumped micro-batches weigh differently per token than per micro-batch", sensitivity > DUMP_REL[v],
                   sensitivity, DUMP_REL[v])
    if v in ("fol", "fol_recompute"):
        checks.add(f"{v}: the output layer made no logits", all(dumped_flags(dump, "deferred")))
    if v == "fol":
        # under CP the adaptor leaves the scale to backward (the op's k-scaled path, checked there)
        cp = layout.flag("context_parallel_size") > 1
        known = dumped_flags(dump, "grad_scale_known")
        checks.add("fol: Megatron's gradient " + ("left to backward (CP)" if cp else "known in forward"),
                   not any(known) if cp else all(known))
        checks.add("fol: weight gradient into the main_grad of Megatron's DDP", all(dumped_flags(dump, "into_main_grad")))


def check_across(results):
    """Iteration 1 of layouts that build the same weights: Megatron's lm loss and lm_z_loss agree."""
    checks = Checks("across layouts")
    groups = {}
    for name, (layout, runs, own) in results.items():
        if own.ok:
            groups.setdefault(layout.weights, []).append((name, runs))
    for key, members in sorted(groups.items()):
        if len(members) < 2:
            continue
        ref_name, ref = members[0]
        for metric, variant in (("lm loss", "ce"), ("lm_z_loss", "z")):
            checks.close(f"{key}: iteration 1 {metric} ({variant}) of {', '.join(n for n, _ in members)}",
                         {f"{n} vs {ref_name}": (r[variant].rows[1][metric], ref[variant].rows[1][metric])
                          for n, r in members[1:]}, CROSS_LAYOUT_REL)
    return checks


def check_gaf_probe(run, available):
    """Megatron with gradient-accumulation fusion on and no apex: refused loudly at model build."""
    checks = Checks("gradient-accumulation fusion")
    text = run.log_path.read_text(errors="replace")
    refused = run.rc != 0 and "fused_weight_gradient_mlp_cuda" in text and not run.rows
    checks.add("Megatron refuses --gradient-accumulation-fusion at model build without apex's "
               "fused_weight_gradient_mlp_cuda" if not available else "runs with it",
               refused if not available else run.rc == 0,
               detail=next((ln.partition("RuntimeError: ")[2][:160] for ln in text.splitlines()
                            if "RuntimeError: " in ln), f"rc {run.rc}"))
    return checks


# ------------------------------------------------------------------------------------ report
def step_ms(run):
    steps = [row["elapsed time per iteration (ms)"] for it, row in run.rows.items()
             if it > 2 and "elapsed time per iteration (ms)" in row]
    return statistics.median(steps) if steps else None


def fmt(x, digits=4):
    return "-" if x is None else f"{x:.{digits}g}"


def table(results, not_run, across, gaf_checks):
    lines = ["| layout | ranks | weights | lm loss @1 (CE) | lm_z_loss @1 | flag vs CE @1 | fused vs unfused @1 "
             "| fwd vs recompute, later | dump vs float64 | median step ms (ce / z / fol / recompute) | checks |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def value(checks, prefix):
        found = [c["value"] for c in checks.items if c["check"].startswith(prefix) and c["value"] is not None]
        return max(found) if found else None

    for name, (layout, runs, checks) in results.items():
        first = {v: r.rows.get(1, {}) for v, r in runs.items()}
        dump = max((c["value"] for c in checks.items if "float64" in c["check"] and c["value"] is not None),
                   default=None)
        failed = [c["check"] for c in checks.items if not c["ok"]]
        lines.append(
            f"| {name} | {layout.ranks} | {layout.weights} | {fmt(first['ce'].get('lm loss'), 7)} "
            f"| {fmt(first['z'].get('lm_z_loss'), 7)} | {fmt(value(checks, 'iteration 1: lm loss'), 2)} "
            f"| {fmt(value(checks, 'iteration 1: fused layer = unfused'), 2)} "
            f"| {fmt(value(checks, 'iterations 2-'), 2)} | {fmt(dump, 2)} "
            f"| {' / '.join(fmt(step_ms(runs[v]), 3) for v in VARIANTS)} "
            f"| {'ok' if checks.ok else 'FAILED: ' + '; '.join(failed)} ({len(checks.items)}) |")
    for layout, reason in not_run:
        lines.append(f"| {layout.name} | {layout.ranks} | - | not run: {reason} |||||||| - |")
    lines.append("")
    for checks in (across, gaf_checks):
        lines += [check_line(c) for c in (checks.items if checks else [])]
    return "\n".join(lines)


def check_line(c):
    """One check of a results table: ``- ok|FAILED: where: what (largest relative difference, limit); detail``."""
    return (f"- {'ok' if c['ok'] else 'FAILED'}: {c['layout']}: {c['check']}"
            + (f" (largest relative difference {fmt(c['value'], 2)}, limit {c['limit']:g})"
               if c["value"] is not None and c["limit"] is not None else "")
            + (f"; {c['detail']}" if c["detail"] else ""))


# -------------------------------------------------------------------------------------- main
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/layouts", help="results.md, results.json, logs.tar.gz")
    parser.add_argument("--cpu", action="store_true", help="gloo, 2 ranks, the layouts scaled down")
    parser.add_argument("--layouts", nargs="+", help="names to run (default: all that fit)")
    parser.add_argument("--work", help="where the runs write (default: a temporary folder, removed)")
    parser.add_argument("--timeout-s", type=float, help="per launch on an idle host, scaled by the load")
    parser.add_argument("--deadline-s", type=float, help="the script ends within this many seconds: a layout starts "
                        "only where its timeout ends before then (default: 540 on GPUs, none on the CPU)")
    parser.add_argument("--layouts-per-gpu", type=int, default=2,
                        help="layouts that may share a GPU at once (each runs its 4 variants on it at once)")
    args = parser.parse_args(argv)

    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    gpus = 0 if cpu else torch.cuda.device_count()
    ranks_there = 2 if cpu else gpus
    iters = CPU_ITERS if cpu else GPU_ITERS
    timeout_s = args.timeout_s or (CPU_LAUNCH_TIMEOUT_S if cpu else GPU_LAUNCH_TIMEOUT_S)
    layouts = cpu_layouts() if cpu else gpu_layouts()
    if args.layouts:
        unknown = set(args.layouts) - {lay.name for lay in layouts}
        if unknown:
            parser.error(f"unknown layouts {sorted(unknown)}; known: {[lay.name for lay in layouts]}")
        layouts = [lay for lay in layouts if lay.name in args.layouts]
    gaf = gaf_available()
    not_run = [(lay, f"needs {lay.ranks} GPUs, {gpus} present") for lay in layouts if lay.ranks > ranks_there]
    todo = [lay for lay in layouts if lay.ranks <= ranks_there]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_layouts_"))
    t0 = time.time()
    admission = Admission(deadline=t0 + (args.deadline_s or (math.inf if cpu else 540)), timeout_s=timeout_s)

    def say(msg):
        print(f"[{time.time() - t0:5.0f}s] {msg}", flush=True)

    say(f"{'CPU (gloo, 2 ranks)' if cpu else f'{gpus} GPUs (NCCL)'}; {len(todo)} layouts x {len(VARIANTS)} variants, "
        f"{iters} iterations; not run: {[lay.name for lay, _ in not_run] or 'none'}; "
        f"gradient-accumulation fusion {'available' if gaf else 'absent (apex)'}; work in {work}")
    results, slots = {}, {gpu: args.layouts_per_gpu for gpu in range(gpus)} if not cpu else {None: 1}
    active, probes = [], []
    while todo or active:
        load = Load.now(sum(lay.ranks * (len(runs) + len(extra)) for lay, runs, _, extra in active), gpus=not cpu)
        for layout in list(todo):
            launches = len(VARIANTS) + (1 if layout.probe_gaf and not gaf else 0)
            devices = take_gpus(dict(slots), 1 if cpu else layout.ranks)  # a look: taken below
            decision = admission.decide(layout.name, layout.ranks * launches, None if cpu else devices, load,
                                        time.time())
            if decision.startswith("not run: "):
                not_run.append((layout, decision[len("not run: "):]))
                todo.remove(layout)
                continue
            if devices is not None and decision == "start":
                devices = take_gpus(slots, 1 if cpu else layout.ranks)
                todo.remove(layout)
                active.append(start_layout(layout, work, cpu, gaf, None if cpu else devices, admission.timeout(load)))
                load.ranks += layout.ranks * launches
                probes += active[-1][3]
                say(f"{layout.name}: started {len(VARIANTS) + len(active[-1][3])} launches of {layout.ranks} ranks"
                    + (f" on GPUs {devices}" if not cpu else ""))
        for _, runs, _, extra in active:  # timeouts follow the load
            for run in [*runs.values(), *extra]:
                run.deadline = admission.run_deadline(run.start, load)
        for item in list(active):
            layout, runs, devices, extra = item
            if all([poll(r) for r in [*runs.values(), *extra]]):
                active.remove(item)
                for gpu in devices or [None]:
                    slots[gpu] += 1
                checks = check_layout(layout, runs, iters, cpu)
                results[layout.name] = (layout, runs, checks)
                say(f"{layout.name}: " + ", ".join(f"{v} rc={r.rc} {r.wall_s:.0f}s" for v, r in runs.items())
                    + f"; checks {sum(c['ok'] for c in checks.items)}/{len(checks.items)} ok"
                    + "".join(f"\n    FAILED {c['check']}: {fmt(c['value'], 3)} (limit {c['limit']}) {c['detail']}"
                              for c in checks.items if not c["ok"]))
                for run in runs.values():
                    shutil.rmtree(run.out / "dump", ignore_errors=True)  # large; checked
        time.sleep(1)
    gaf_checks = check_gaf_probe(probes[0], gaf) if probes else None
    across = check_across(results)
    report = table(results, not_run, across, gaf_checks)
    print(report, flush=True)
    all_checks = [c for _, _, checks in results.values() for c in checks.items] + across.items + (
        gaf_checks.items if gaf_checks else [])
    (out / "results.md").write_text(report + "\n")
    (out / "results.json").write_text(json.dumps({
        "mode": "cpu" if cpu else "gpu", "gpus": gpus, "iterations": iters, "gradient_accumulation_fusion": gaf,
        "tolerances": {"iteration_1": ITER1_REL, "grad_norm": [GRAD_NORM_REL, GRAD_NORM_ABS], "later": LATER_REL,
                       "dump": DUMP_REL, "across_layouts": CROSS_LAYOUT_REL},
        "layouts": {name: {"ranks": lay.ranks, "args": layout_args(lay, cpu, gaf), "note": lay.note,
                           "weights": lay.weights,
                           "runs": {v: {"rc": r.rc, "wall_s": r.wall_s, "timed_out": r.timed_out,
                                        "step_ms": step_ms(r), "rows": r.rows} for v, r in runs.items()}}
                    for name, (lay, runs, _) in results.items()},
        "not_run": {lay.name: reason for lay, reason in not_run},
        "checks": all_checks}, indent=1))
    failed = finish(out, work, "*/*/train.log", not args.work, all_checks,
                    f"{len(results)} layouts run, {len(not_run)} not run", say)
    print("\n".join(not_run_lines({lay.name: why for lay, why in not_run})), flush=True)
    cut = [lay.name for lay, why in not_run if not why.startswith("needs ")]  # not the GPUs' count: the deadline
    return 1 if failed or not results or cut else 0


def finish(out, work, logs, remove_work, all_checks, counts, say):
    """The end of a GPU script's run: the launches' ``logs`` (a glob under ``work``) packed into
    ``out/logs.tar.gz``, ``work`` removed where asked, the count of checks said; the number that failed."""
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for log in sorted(work.glob(logs)):
            tar.add(log, arcname=str(log.relative_to(work)))
    if remove_work:
        shutil.rmtree(work, ignore_errors=True)
    failed = sum(not c["ok"] for c in all_checks)
    say(f"{len(all_checks) - failed}/{len(all_checks)} checks ok; {counts}; results in {out}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
