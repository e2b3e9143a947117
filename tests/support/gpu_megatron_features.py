"""The flag under what Megatron 0.19 trains with besides its parallel layouts, on four GPUs over NCCL, as one
command; asserted, with a table of the results.

    python3 tests/support/gpu_megatron_features.py --out $OUT/features          # 4 GPUs, about 6 minutes
    python3 tests/support/gpu_megatron_features.py --only 'mfsdp|^dp4-ddp' ...  # part of it (and what it needs)
    python tests/support/gpu_megatron_features.py --cpu --out out/features_cpu   # the plumbing (gloo, 2 ranks)

Each launch runs ``examples/pretrain_gpt.py`` through its test harness (``tests/support/megatron_pretrain_harness.py``,
a data-dependent tail of every micro-batch masked, no logits dumped), bf16, this package's Triton kernels,
the local (non-TE) layer specs, ``--use-cpu-initialization`` (same seed, same weights), many launches at once on
the same GPUs. Variants: ``ce`` (Megatron's CE), ``z`` (``--lm-z-loss-coeff 1e-4 --lm-z-loss-log-lse``),
``fol`` (that with ``--lm-fused-output-layer``, forward) and ``fol_recompute``. Groups, each asserted:

* ``graphs`` (dense, TP2 + SP x DP2, 10 iterations, ``--no-check-for-nan-in-loss-and-grad`` everywhere): each
  variant eager, with ``--cuda-graph-impl full_iteration`` (the whole step captured after Megatron's 3 warm-up
  steps: a host sync or a foreign stream in it fails the capture) and with ``--cuda-graph-impl local``
  (per-layer graphs): ``lm loss``, ``lm_z_loss``, ``lm_lse``, ``lm_lse_max`` equal the eager run's at every
  iteration (bf16 noise); Megatron held its graphs; the CUDA memory allocated stays the same over the replayed
  steps; the run ends (the example releases the graphs, then the process groups; one more launch of
  Megatron's CE without that release is reported); median step times side by side.
* ``fsdp`` (dense, untied output layer, DP4; and TP2 x DP2): ``--use-megatron-fsdp`` and ``--use-torch-fsdp2``
  against DDP per variant: iteration 1's losses and grad norm equal DDP's; later iterations (their weights
  made by the output layer's gradient) within bf16 noise; the output layer's weight gradient after the
  gradient sync (iterations 1 and 2, gathered from FSDP's shards) equals DDP's; every launch's gradient of
  iteration 1 equals the float64 gradient made from what it fed its output layer (each micro-batch's input,
  weight, labels and loss mask on every rank, ``tests/support/output_grad_reference.py``), Megatron's own CE under DDP
  the reference's control.
* ``reshard`` (MoE, 4 layers, ``--ckpt-format torch_dist``, saved at iteration 4 of 8): TP2 x PP2 resumed at
  TP4 and TP4 at TP2 x PP2 with the fused layer: iterations 5-8 continue the run that never stopped (the saving
  run), ``lm_lse_max`` included; a checkpoint saved without the flag resumed with it and the reverse.
* ``faults`` (MoE, TP2 + SP x DP2): the rerun state machine in its determinism-stats mode re-runs every step
  (set by the harness: megatron-core 0.19.2's ``--rerun-mode report_stats`` fails at start): each re-run
  micro-batch's loss equals the first run's exactly in every variant; a NaN put into the output layer's input
  at iteration 3 gets the same verdict of Megatron's rerun state machine with and without the flag
  (``validate_results``: re-run, reproducible, checkpoint, exit status 16; ``disabled``: the run ends with
  Megatron's NaN error), at the same iteration, within the time limit; ``--inprocess-restart`` reported as
  Megatron handles it here.
"""

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the support package
from support.gpu_layouts import (  # noqa: E402
    CROSS_LAYOUT_REL, GRAD_NORM_ABS, GRAD_NORM_REL, ITER1_REL, LATER_REL, Checks, Row, Run, _parallel, check_line,
    finish, fmt, poll, rel, start_run, step_ms,
)
from support.launch_admission import Admission, Load, not_run_lines  # noqa: E402
from support.megatron_launch import MOE, TINY_GPT, with_args  # noqa: E402

Z_COEFF = 1e-4
FLAG = ["--lm-z-loss-coeff", str(Z_COEFF), "--lm-z-loss-log-lse"]
VARIANTS = {"ce": [], "z": FLAG, "fol": FLAG + ["--lm-fused-output-layer"],
            "fol_recompute": FLAG + ["--lm-fused-output-layer", "recompute"]}
FLAGGED = ("z", "fol", "fol_recompute")
METRICS = ("lm loss", "lm_z_loss", "lm_lse", "lm_lse_max")
NO_DUMP = {"CEZ_DUMP_LOGITS_DIR": ""}
NAN_ITERATION = 3
LAUNCH_TIMEOUT_S = {"gpu": 200, "cpu": 600}


@dataclass
class Spec:
    """One launch: ``needs``: launches whose checkpoints it loads (it starts once they ended well)."""

    name: str
    group: str
    variant: str
    args: list
    ranks: int
    env: dict = field(default_factory=dict)
    needs: tuple = ()
    iters: int = 0
    expect_rc0: bool = True


def base_args(cpu, iters, moe=True, layers=4):
    args = with_args(TINY_GPT, num_layers=layers, position_embedding_type="rope", init_method_std=0.1, eval_iters=0,
                     eval_interval=1000, train_iters=iters, micro_batch_size=2)
    if cpu:
        args = with_args(args, seq_length=64, max_position_embeddings=64, global_batch_size=8)
    else:
        args = with_args(args, seq_length=512, max_position_embeddings=512, global_batch_size=16) + ["--bf16"]
    return args + (MOE if moe else [])


def specs(cpu, work):
    out, n = [], (2 if cpu else 4)

    def add(name, group, variant, args, iters, **kw):
        out.append(Spec(name, group, variant, args + VARIANTS[variant], kw.pop("ranks", n),
                        {**NO_DUMP, **kw.pop("env", {})}, iters=iters, **kw))

    # --- resume that reshards (first: its resumed runs wait for the saving ones)
    iters, at = (4, 2) if cpu else (8, 4)
    layouts = ({"a": _parallel(tp=2, sp=True), "b": _parallel(pp=2)} if cpu else
               {"a": _parallel(tp=2, pp=2, sp=True), "b": _parallel(tp=4, sp=True)})
    for key, variant in (("a", "fol"), ("b", "fol"), ("a", "ce")):
        ckpt = work / f"ckpt_{key}_{variant}"
        add(f"save-{key}-{variant}", "reshard", variant,
            base_args(cpu, iters) + layouts[key] + ["--save", str(ckpt), "--save-interval", str(at)], iters)
    for src, dst, saved, variant in (("a", "b", "fol", "fol"), ("b", "a", "fol", "fol"), ("a", "b", "ce", "fol"),
                                     ("a", "b", "fol", "ce")):
        add(f"resume-{src}{saved}-at-{dst}-{variant}", "reshard", variant,
            base_args(cpu, iters) + layouts[dst] + ["--load", str(work / f"ckpt_{src}_{saved}"),
                                                    "--ckpt-step", str(at)],
            iters, needs=(f"save-{src}-{saved}",))

    # --- fault tolerance
    faults = base_args(cpu, 5) + _parallel(tp=2, sp=True)
    for variant in VARIANTS:
        # megatron-core 0.19.2's --rerun-mode report_stats fails at start (RerunMode calls it
        # report_determinism_stats): the harness sets that mode itself
        add(f"stats-{variant}", "faults", variant, faults, 5, env={"CEZ_TEST_RERUN_MODE": "report_determinism_stats"})
    nan_env = {"CEZ_TEST_NAN_ITERATION": str(NAN_ITERATION)}
    for mode, variants in (("validate_results", VARIANTS), ("disabled", ("ce", "fol"))):
        for variant in variants:
            save = ["--save", str(work / f"ckpt_nan_{mode}_{variant}"), "--save-interval", "1000"]
            add(f"nan-{mode}-{variant}", "faults", variant, faults + ["--rerun-mode", mode] + save, 5, env=nan_env,
                expect_rc0=False)
    add("inprocess-restart-fol", "faults", "fol", faults + ["--inprocess-restart"], 5,
        env={"TORCH_CPP_LOG_LEVEL": "error"})
    if cpu:
        return out

    # --- CUDA graphs (dense: the MoE dispatcher's token counts go through the host)
    graphs = base_args(cpu, 10, moe=False) + _parallel(tp=2, sp=True) + ["--no-check-for-nan-in-loss-and-grad"]
    for impl in ("none", "full_iteration", "local"):
        for variant in VARIANTS:
            add(f"graph-{impl}-{variant}", "graphs", variant, graphs + ["--cuda-graph-impl", impl], 10,
                env={"CEZ_TEST_LOG_MEMORY": "1"})
    # Megatron's own CE, its CUDA graphs and process groups left to the interpreter's exit (the example releases
    # them after pretrain): does the exit hang without the flags too?
    add("graph-full_iteration-ce-exit", "graphs", "ce", graphs + ["--cuda-graph-impl", "full_iteration"], 10,
        env={"CEZ_TEST_LOG_MEMORY": "1", "CEZ_TEST_SKIP_TEARDOWN": "1"}, expect_rc0=False)

    # --- FSDP (torch FSDP2 needs an untied output layer, torch_dist checkpoints and more than one CUDA connection)
    dense = base_args(cpu, 6, moe=False) + ["--untie-embeddings-and-output-weights"]
    kinds = {"ddp": [], "mfsdp": ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],  # as Megatron requires
             "fsdp2": ["--use-torch-fsdp2"]}
    def dumps(name):  # the output layer's gradient (iterations 1, 2) and what it was made from (iteration 1)
        return {"CEZ_DUMP_OUTPUT_GRAD": str(work / f"grad-{name}"), "CEZ_DUMP_OUTPUT_INPUTS": str(work / f"in-{name}")}

    for kind, extra in kinds.items():
        # Megatron's own CE under DDP: the float64 reference's control (c = 0)
        for variant in FLAGGED + (("ce",) if kind == "ddp" else ()):
            add(f"dp4-{kind}-{variant}", "fsdp", variant, dense + extra, 6,
                env={"CUDA_DEVICE_MAX_CONNECTIONS": "8", **dumps(f"dp4-{kind}-{variant}")})
    for kind in ("ddp", "mfsdp", "fsdp2"):
        for variant in ("fol", "fol_recompute"):
            # Megatron wants one CUDA connection with TP, FSDP more than one (with TP: a warning)
            add(f"tp2dp2-{kind}-{variant}", "fsdp", variant, dense + _parallel(tp=2, sp=True) + kinds[kind], 6,
                env={**dumps(f"tp2dp2-{kind}-{variant}"), "CUDA_DEVICE_MAX_CONNECTIONS": "8" if kind != "ddp" else "1"})
    return out


# ------------------------------------------------------------------------------------------- checks
def ended(checks, run, spec):
    rows = run.rows
    if run.rc != 0 or sorted(rows)[-1:] != [spec.iters]:
        why = "timed out" if run.timed_out else f"rc {run.rc}"
        return checks.add(f"{spec.name}: ran to iteration {spec.iters}", False,
                          detail=f"{why}, logged {sorted(rows)}; {tail(run, 'Error')}")
    bad = [(it, k, v) for it, row in rows.items() for k, v in row.items() if not math.isfinite(v)]
    bad += [(it, "skipped/nan", row.get("number of skipped iterations"), row.get("number of nan iterations"))
            for it, row in rows.items()
            if row.get("number of skipped iterations", 0) != 0 or row.get("number of nan iterations", 0) != 0]
    return checks.add(f"{spec.name}: ran to iteration {spec.iters}, finite, none skipped", not bad,
                      detail=f"first offending: {bad[:3]}" if bad else "")


def tail(run, word):
    """The last log line with ``word`` (an error's one line)."""
    lines = [ln.strip() for ln in run.log_path.read_text(errors="replace").splitlines() if word in ln]
    return lines[-1][:240] if lines else ""


def rows_of(run):
    return {it: Row(row) for it, row in run.rows.items()}


GRAPH_WARMUP = 3  # Megatron's --cuda-graph-warmup-steps: eager steps before the capture


def memory_growth(run, after):
    """The largest growth of a rank's allocated CUDA memory from one logged step to a later one, over steps >
    ``after`` (NaN without the harness's ``cez-memory`` lines)."""
    found = {}
    text = run.log_path.read_text(errors="replace")
    for m in re.finditer(r"cez-memory iteration (\d+) rank (\d+): allocated (\d+)", text):
        if int(m.group(1)) > after:
            found.setdefault(int(m.group(2)), []).append(int(m.group(3)))
    if not found:
        return math.nan
    return max(max(v) - v[0] for v in found.values())


def graphs_held(run):
    """The CUDA graphs the harness last saw Megatron hold (``full``, ``local``), per its ``cez-memory`` lines."""
    found = re.findall(r"cez-memory iteration \d+ rank \d+: allocated \d+ reserved \d+ graphs ([a-z,]+)",
                       run.log_path.read_text(errors="replace"))
    return found[-1] if found else "unknown"


def check_graphs(runs, specs_by_name):
    checks = Checks("graphs")
    ok = {name: ended(checks, run, specs_by_name[name]) for name, run in runs.items() if specs_by_name[name].expect_rc0}
    exit_run = runs.get("graph-full_iteration-ce-exit")
    if exit_run is not None:  # reported, not asserted: Megatron's behaviour without the example's teardown
        rows = sorted(exit_run.rows)
        checks.add("graph-full_iteration-ce-exit (Megatron's CE, graphs left to the interpreter's exit): "
                   + ("hangs at exit after training" if exit_run.timed_out and rows[-1:] == [10] else
                      f"rc {exit_run.rc}, logged to {rows[-1:] or 'none'}"), True)
    for variant in VARIANTS:
        eager = f"graph-none-{variant}"
        for impl in ("full_iteration", "local"):
            name = f"graph-{impl}-{variant}"
            if not (ok.get(eager) and ok.get(name)):
                continue
            a, b = rows_of(runs[name]), rows_of(runs[eager])
            keys = [k for k in METRICS if k in b[1]]
            checks.close(f"{name}: {', '.join(keys)} = eager at every iteration",
                         {f"{it} {k}": (a[it][k], b[it][k]) for it in sorted(b) for k in keys}, LATER_REL)
            checks.items[-1]["detail"] += (f"; median step {fmt(step_ms(runs[name]), 3)} ms, eager "
                                           f"{fmt(step_ms(runs[eager]), 3)} ms (launches sharing the GPUs)")
            held = graphs_held(runs[name])
            checks.add(f"{name}: Megatron held its CUDA graphs ({'full' if impl == 'full_iteration' else 'local'})",
                       ("full" if impl == "full_iteration" else "local") in held.split(","), detail=f"held: {held}")
            grown = memory_growth(runs[name], after=GRAPH_WARMUP + 1)  # captured in step 4, replayed from 5
            checks.add(f"{name}: CUDA memory allocated steady over the steps after the capture", grown == 0, grown,
                       0, "bytes, largest growth on a rank")
    return checks


GRAD_REL = 2e-2  # the output layer's gradient, bf16 GEMMs summed over tokens and ranks in another order
# The output layer's gradient against float64 from the same inputs: the bf16 run rounds the logits' gradient to bf16
# (relative 2**-9 an element, of random sign: far less over the Frobenius norm of a sum over 1024 tokens x 8
# micro-batches) and sums in fp32; bf16's own epsilon (2**-8 = 4e-3) five times over
GRAD_REF_REL = 2e-2
WEIGHT_CHECK_REL = 1e-2  # Megatron's bf16 logits against the dumped input @ weight.T in fp32


def reference_check(checks, name, spec):
    """``name``'s output layer weight gradient of iteration 1 (after the sync) against the float64 gradient from
    what the run fed its output layer (``tests/support/output_grad_reference.py``)."""
    from support.output_grad_reference import reference_output_grad

    what = f"{name}: iteration 1's output-layer weight gradient (after the gradient sync) = float64 from its inputs"
    try:
        reference, facts = reference_output_grad(spec.env["CEZ_DUMP_OUTPUT_INPUTS"])
    except (OSError, ValueError, NotImplementedError, KeyError) as error:
        return checks.add(what, False, detail=f"no reference: {error}")
    dumped = output_grads(spec, 1)
    diff = grad_difference(dumped, {t: (g, "float64") for t, g in reference.items()})
    weight_ok = facts["weight_check"] is None or facts["weight_check"] <= WEIGHT_CHECK_REL
    want_c = 0.0 if spec.variant == "ce" else Z_COEFF
    c_ok = facts["z_loss_coeff"] == want_c
    return checks.add(what, diff <= GRAD_REF_REL and weight_ok and c_ok, diff, GRAD_REF_REL,
                      ("" if c_ok else f"the run's c is not {want_c:g}; ")
                      + f"read from {sorted({w for _, w in dumped.values()})}; DP {facts['dp']} x TP {facts['tp']}, "
                      f"{facts['micro_batches']} micro-batches, c = {facts['z_loss_coeff']:g}, loss scale "
                      f"{facts['loss_scale']:g}, " + ("the fused layer's deferred call" if facts["deferred"] else
                      f"logits = input @ weight.T within {fmt(facts['weight_check'], 2)} (limit {WEIGHT_CHECK_REL:g})"))


def output_grads(spec, iteration):
    """{tp rank: (gradient, where it was read)} the harness dumped for ``spec``'s ``iteration`` (1 or 2)."""
    import torch

    folder = Path(spec.env.get("CEZ_DUMP_OUTPUT_GRAD", ""))
    paths = sorted(folder.glob(f"output_grad_it{iteration}_tp*.pt")) if folder.name else []
    dumps = [torch.load(path) for path in paths]
    return {d["tp_rank"]: (d["grad"], f"{d['kind']}.{d['source']}") for d in dumps}


def grad_difference(a, b):
    """``|a - b| / |b|`` (Frobenius) over every tensor-parallel shard; NaN where one is missing."""
    if not a or sorted(a) != sorted(b) or any(a[t][0] is None or b[t][0] is None for t in a):
        return math.nan
    if any(a[t][0].shape != b[t][0].shape for t in a):
        return math.inf  # the detail names the shapes
    num = sum(float((a[t][0].double() - b[t][0].double()).norm() ** 2) for t in a)
    return math.sqrt(num / max(sum(float(b[t][0].double().norm() ** 2) for t in b), 1e-300))


def check_fsdp(runs, specs_by_name):
    checks = Checks("fsdp")
    ok = {name: ended(checks, run, specs_by_name[name]) for name, run in runs.items() if specs_by_name[name].expect_rc0}
    pairs = [(f"dp4-{k}-{v}", f"dp4-ddp-{v}") for k in ("mfsdp", "fsdp2") for v in FLAGGED]
    pairs += [(f"tp2dp2-{k}-{v}", f"tp2dp2-ddp-{v}") for k in ("mfsdp", "fsdp2") for v in ("fol", "fol_recompute")]
    pairs += [(f"dp4-ddp-{v}", "dp4-ddp-z") for v in ("fol", "fol_recompute")]
    for name in runs:
        if ok.get(name):
            reference_check(checks, name, specs_by_name[name])
    for name, ref in pairs:
        if not (ok.get(name) and ok.get(ref)):
            continue
        a, b = rows_of(runs[name]), rows_of(runs[ref])
        checks.close(f"{name}: iteration 1 = {ref}", {k: (a[1][k], b[1][k]) for k in METRICS}, ITER1_REL)
        limit = GRAD_NORM_ABS + GRAD_NORM_REL * b[1]["grad norm"]
        diff = abs(a[1]["grad norm"] - b[1]["grad norm"])
        checks.add(f"{name}: iteration 1 grad norm = {ref}", diff <= limit, diff, limit,
                   f"{a[1]['grad norm']} vs {b[1]['grad norm']}")
        checks.close(f"{name}: later iterations = {ref}",
                     {f"{it} {k}": (a[it][k], b[it][k]) for it in sorted(b) if it > 1 for k in METRICS}, LATER_REL)
        for it in (1, 2):  # iteration 2: a main_grad left from iteration 1 would show
            ga, gb = output_grads(specs_by_name[name], it), output_grads(specs_by_name[ref], it)
            diff = grad_difference(ga, gb)
            checks.add(f"{name}: iteration {it}'s output-layer weight gradient (after the gradient sync) = {ref}'s",
                       diff <= GRAD_REL, diff, GRAD_REL,
                       f"read from {sorted({w for _, w in ga.values()})} and {sorted({w for _, w in gb.values()})}"
                       + (f"; shapes {[tuple(g.shape) for g, _ in ga.values() if g is not None]} and "
                          f"{[tuple(g.shape) for g, _ in gb.values() if g is not None]}" if math.isinf(diff) else ""))
    return checks


def check_reshard(runs, specs_by_name, cpu):
    checks = Checks("reshard")
    ok = {name: ended(checks, run, specs_by_name[name]) for name, run in runs.items()}
    at = 2 if cpu else 4
    first_rel = 1e-4 if cpu else CROSS_LAYOUT_REL  # fp32 on the CPU; bf16 split another way on GPUs
    for name, run in runs.items():
        if not name.startswith("resume-") or not ok.get(name):
            continue
        spec = specs_by_name[name]
        saver = spec.needs[0]
        if not ok.get(saver):
            continue
        a, b = rows_of(run), rows_of(runs[saver])
        checks.add(f"{name}: logs iterations {at + 1}-{spec.iters} only",
                   sorted(a) == list(range(at + 1, spec.iters + 1)),
                   detail=f"{sorted(a)}")
        same_loss = spec.variant == specs_by_name[saver].variant
        keys = METRICS if same_loss and spec.variant != "ce" else ("lm loss",)
        checks.close(f"{name}: iteration {at + 1} = the run that never stopped ({saver}): {', '.join(keys)}",
                     {k: (a[at + 1][k], b[at + 1][k]) for k in keys}, first_rel)
        if same_loss:
            # Megatron 0.19 prints a run's first iteration without resetting its running sums: the resumed run's
            # second line averages its first two iterations
            expected = {it: {k: (b[it][k] + b[it - 1][k]) / 2 if it == at + 2 else b[it][k] for k in keys}
                        for it in range(at + 2, spec.iters + 1)}
            checks.close(f"{name}: iterations {at + 2}-{spec.iters} = {saver}",
                         {f"{it} {k}": (a[it][k], expected[it][k]) for it in expected for k in keys},
                         1e-4 if cpu else LATER_REL)
        flagged = spec.variant != "ce"
        checks.add(f"{name}: lm_z_loss logged {'on every line' if flagged else 'on none'} after resuming",
                   all(("lm_z_loss" in r) == flagged for r in run.rows.values()))
    return checks


VERDICT = re.compile(r"(iteration \d+: Unexpected result \S+ \(message='[^'\n]*'\)"
                     r"|Unexpected result \S+ \(message='[^'\n]*'\)|iteration #?\d+: [^!\n]*!"
                     r"|Unexpected result \S+ on rank \d+ at iteration #\d+ invocation #\d+ \(message='[^'\n]*'\))")


def verdict(run):
    """Megatron's verdict: its distinct lines (rank, node and device left out), sorted, and the positive exit
    statuses torchrun reported for the ranks (a rank it ended first reports SIGTERM, whichever it was)."""
    text = run.log_path.read_text(errors="replace")
    lines = sorted({re.sub(r" on rank \d+", "", m.group(1)) for m in VERDICT.finditer(text)})
    codes = sorted({int(c) for c in re.findall(r"exitcode\s*:?\s*(-?\d+)", text) if int(c) > 0})
    return lines, codes


def rerun_lines(run):
    """The harness's comparisons of re-run micro-batch losses (``cez-rerun iteration I micro-batch K rank R: ...``)."""
    return re.findall(r"cez-rerun iteration \d+ micro-batch \d+ rank \d+: (?:identical|differs: \S+? then \S+?)"
                      r"(?=cez-rerun|\s|$)", run.log_path.read_text(errors="replace"))


def check_faults(runs, specs_by_name):
    checks = Checks("faults")
    for variant in VARIANTS:
        name = f"stats-{variant}"
        if name not in runs or not ended(checks, runs[name], specs_by_name[name]):
            continue
        lines = rerun_lines(runs[name])
        differ = [ln for ln in lines if not ln.endswith("identical")]
        seen = {tuple(map(int, re.findall(r"\d+", ln)[:3])) for ln in lines}  # (iteration, micro-batch, rank)
        iterations, micro_batches, ranks = ({key[i] for key in seen} for i in range(3))
        every = (iterations == set(range(1, specs_by_name[name].iters + 1)) and len(ranks) == specs_by_name[name].ranks
                 and len(seen) == len(iterations) * len(micro_batches) * len(ranks))
        checks.add(f"{name}: every step re-run, every micro-batch's loss on every rank reproduced exactly",
                   every and not differ,
                   detail=f"{len(lines)} compared: iterations {sorted(iterations)}, {len(micro_batches)} "
                          f"micro-batches, {len(ranks)} ranks; " + "; ".join(differ[:2]))
    for mode, ref in (("validate_results", "ce"), ("disabled", "ce")):
        names = [n for n in runs if n.startswith(f"nan-{mode}-")]
        base = runs.get(f"nan-{mode}-{ref}")
        if base is None:
            continue
        expected = verdict(base)
        want = ("First rerun: unexpected result is reproducible" if mode == "validate_results"
                else "Unexpected result nan")
        checks.add(f"nan-{mode}-{ref}: Megatron's verdict on a NaN in iteration {NAN_ITERATION}",
                   not base.timed_out and base.rc != 0 and any(want in ln for ln in expected[0])
                   and expected[1] == ([16] if mode == "validate_results" else [1]),
                   detail=f"{expected[0][:3]} exit statuses {expected[1]}")
        for name in names:
            if name == f"nan-{mode}-{ref}":
                continue
            got = verdict(runs[name])
            checks.add(f"{name}: the same verdict, iteration and exit statuses as without the flag, no hang",
                       not runs[name].timed_out and got == expected,
                       detail="" if got == expected else f"{got} vs {expected}")
    name = "inprocess-restart-fol"
    if name in runs:
        run = runs[name]
        text = run.log_path.read_text(errors="replace")
        absent = "In-process restart is not available" in text
        if ended(checks, run, specs_by_name[name]):
            checks.add(f"{name}: trains with the flag" + (" (Megatron: in-process restart not available, "
                                                         "nvidia-resiliency-ext absent: plain training)" if absent else
                                                         " under Megatron's in-process restart wrapper"),
                       all("lm_z_loss" in r for r in run.rows.values()))
    return checks


CHECKERS = {"graphs": check_graphs, "fsdp": check_fsdp, "faults": check_faults}


# --------------------------------------------------------------------------------------------- main
def table(groups, runs, not_run):
    lines = ["| launch | rc | wall s | iterations | lm loss @1 | lm_z_loss @1 | median step ms |",
             "|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        first = run.rows.get(min(run.rows, default=0), {})
        lines.append(f"| {name} | {run.rc}{' (timed out)' if run.timed_out else ''} | {run.wall_s:.0f} "
                     f"| {min(run.rows, default='-')}-{max(run.rows, default='-')} | {fmt(first.get('lm loss'), 7)} "
                     f"| {fmt(first.get('lm_z_loss'), 7)} | {fmt(step_ms(run), 3)} |")
    for name, why in not_run.items():
        lines.append(f"| {name} | not run: {why} ||||||")
    lines.append("")
    for checks in groups.values():
        lines += [check_line(c) for c in checks.items]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/features", help="results.md, results.json, logs.tar.gz")
    parser.add_argument("--cpu", action="store_true", help="gloo, 2 ranks: reshard and faults only")
    parser.add_argument("--groups", nargs="+", help="groups to run (default: all)")
    parser.add_argument("--timeout-s", type=float, help="per launch on an idle host, scaled by the load (default: 200 on "
                        "GPUs)")
    parser.add_argument("--only", help="a regular expression: run the launches whose names match (and those they need)")
    parser.add_argument("--work", help="where the runs write (default: a temporary folder, removed)")
    parser.add_argument("--parallel", type=int, default=16, help="launches at once at most (the host's cores and "
                        "the GPUs' free memory may admit fewer: tests/support/launch_admission.py)")
    parser.add_argument("--deadline-s", type=float, help="the script ends within this many seconds: a launch starts "
                        "only where its timeout ends before then (default: 540 on GPUs, none on the CPU)")
    args = parser.parse_args(argv)

    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    gpus = 0 if cpu else torch.cuda.device_count()
    if not cpu and gpus < 4:
        print(f"needs 4 GPUs, found {gpus}")
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_features_"))
    todo = [s for s in specs(cpu, work) if not args.groups or s.group in args.groups]
    if args.only:
        wanted = {s.name for s in todo if re.search(args.only, s.name)}
        wanted |= {n for s in todo if s.name in wanted for n in s.needs}
        todo = [s for s in todo if s.name in wanted]
    todo.sort(key=lambda s: ("reshard", "graphs", "fsdp", "faults").index(s.group))  # the savers first
    by_name = {s.name: s for s in todo}
    timeout_s = args.timeout_s or LAUNCH_TIMEOUT_S["cpu" if cpu else "gpu"]
    parallel = 1 if cpu else args.parallel
    t0 = time.time()
    deadline_s = args.deadline_s or (math.inf if cpu else 540)
    admission = Admission(deadline=t0 + deadline_s, timeout_s=timeout_s)

    def say(msg):
        print(f"[{time.time() - t0:5.0f}s] {msg}", flush=True)

    say(f"{'CPU (gloo, 2 ranks)' if cpu else f'{gpus} GPUs (NCCL)'}; {len(todo)} launches, {parallel} at once; "
        f"work in {work}")
    runs, active, not_run = {}, [], {}
    while todo or active:
        load = Load.now(sum(by_name[n].ranks for n in active), gpus=not cpu)
        for spec in list(todo):
            if len(active) >= parallel:
                break
            failed = [n for n in spec.needs if n in not_run or (n in runs and runs[n].rc not in (None, 0))]
            if failed:
                not_run[spec.name] = f"{failed} failed"
                todo.remove(spec)
                continue
            if any(n not in runs or runs[n].rc is None for n in spec.needs):
                continue
            devices = None if cpu else list(range(spec.ranks))
            decision = admission.decide(spec.name, spec.ranks, devices, load, time.time())
            if decision.startswith("not run: "):
                not_run[spec.name] = decision[len("not run: "):]
                todo.remove(spec)
                continue
            if decision == "wait":
                continue
            run = Run(spec.group, spec.variant, work / spec.name)
            run.out.mkdir(parents=True, exist_ok=True)
            start_run(run, spec.args, spec.ranks, devices, admission.timeout(load), spec.env)
            load.ranks += spec.ranks
            runs[spec.name] = run
            active.append(spec.name)
            todo.remove(spec)
        for name in active:  # timeouts follow the load (a save slows down as others start)
            runs[name].deadline = admission.run_deadline(runs[name].start, load)
        for name in list(active):
            if poll(runs[name]):
                active.remove(name)
                say(f"{name}: rc {runs[name].rc}, {runs[name].wall_s:.0f} s, iterations "
                    f"{min(runs[name].rows, default='-')}-{max(runs[name].rows, default='-')}")
        time.sleep(1)

    groups = {}
    for group in dict.fromkeys(s.group for s in by_name.values()):
        mine = {n: r for n, r in runs.items() if by_name[n].group == group}
        groups[group] = (check_reshard(mine, by_name, cpu) if group == "reshard" else CHECKERS[group](mine, by_name))
    report = table(groups, runs, not_run)
    print(report, flush=True)
    all_checks = [c for checks in groups.values() for c in checks.items]
    (out / "results.md").write_text(report + "\n")
    (out / "results.json").write_text(json.dumps({
        "mode": "cpu" if cpu else "gpu", "gpus": gpus,
        "launches": {n: {"args": by_name[n].args, "env": by_name[n].env, "rc": r.rc, "wall_s": r.wall_s,
                         "timed_out": r.timed_out, "step_ms": step_ms(r), "rows": r.rows} for n, r in runs.items()},
        "not_run": not_run, "checks": all_checks}, indent=1))
    failed = finish(out, work, "*/train.log", not args.work, all_checks,
                    f"{len(runs)} launches, {len(not_run)} not run", say)
    print("\n".join(not_run_lines(not_run)), flush=True)
    return 1 if failed or not runs or not_run else 0  # a launch not run: the checks are incomplete


if __name__ == "__main__":
    sys.exit(main())
