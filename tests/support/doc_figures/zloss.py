"""Where each figure quoted in docs/z_loss_training.md comes from, beyond the rows in __init__.py: rows as there."""
import math
import os
import re
import statistics

from .results_files import ROOT, load

DOC = "docs/z_loss_training.md"
STUDY_DIR = "bench/results/2026-11-28_zloss_study_4xh200/"
PILOT_DIR = "bench/results/2026-11-28_zloss_pilot_4xh200/"
SHORT_DIR = "bench/results/2026-11-27_zloss_4xh100/"
CLAIMS = STUDY_DIR + "claims.json"  # python examples/zloss_claims.py
POOLED = STUDY_DIR + "report_with_pilot/long_stats.json"  # pilot and study, as the report pools them
STUDY = STUDY_DIR + "report/long_stats.json"
PILOT = PILOT_DIR + "report/long_stats.json"
SHORT = SHORT_DIR + "report/stats.json"  # the short sweeps' report (report/tables.md prints the same)
TOKENS_PER_ITERATION = 16 * 256  # the pilot's and study's batch (checked against study_sweep.json below)
TRAIN_TOKENS = 32180264  # the training split (checked against study_sweep.json below)


def _i(x):
    """An integer as the doc rounds it (half up)."""
    return int(math.floor(x + 0.5))


def _e(x):
    """0.001 -> 1e-3, 0 -> 0: a coefficient or learning rate as the doc writes it."""
    return "0" if x == 0 else f"{x:.0e}".replace("e-0", "e-")


def _span(values, fmt="{}"):
    lo, hi = min(values), max(values)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def _signed(x):
    return f"{x:+d}"


# --- the pilot and the study (2026-11-28) ---

def _arm_runs(stats, lr, modes, clip, coeff, hidden=256):
    return [a for m in modes for a in stats["arms"] if a["arm"] == {
        "hidden": hidden, "wd_mode": m, "clip": clip, "steps": 10000, "lr": lr, "coeff": coeff}]


def _pilot_cell(stats, lr, modes, clip, coeff, hidden=256, rule="above_init", dedupe=False):
    """'diverged / started (@ iterations)' of the pilot's arms, the iterations in the modes' then the seeds' order."""
    arms = _arm_runs(stats, lr, modes, clip, coeff, hidden)
    if not arms:
        return "-"
    verdicts = [a["verdicts"][str(s)] for a in arms for s in a["diverged"]]
    if any(v["rule"] != rule for v in verdicts):
        return "(another rule)"
    steps = [v["step"] for v in verdicts]
    at = _span(steps) if dedupe else ", ".join(map(str, steps))
    return f"{len(verdicts)} / {sum(len(a['seeds']) for a in arms)} (@ {at})"


def _pilot_row(lr, modes, clip, hidden=256, dedupe=False):
    return lambda s: {"c0": _pilot_cell(s, lr, modes, clip, 0.0, hidden, dedupe=dedupe),
                      "c4": _pilot_cell(s, lr, modes, clip, 1e-4, hidden, dedupe=dedupe)}


def _console(text, pattern):
    return [float(x) for x in re.findall(pattern, text)]


def _pilot_throughput(text):
    runs = re.findall(r"(h\d+)_\S+: rc=\S+ in \d+ s, step \d+, ([\d.]+) steps/s on GPU (\d)", text)
    gpus = re.findall(r"GPU (\d): \d+ runs, ([\d.]+) steps/s together \(.*\), MPS (on|off)", text)
    mps = {g for g, _, m in gpus if m == "on"}
    each = lambda on: [_i(float(v)) for h, v, g in runs if h == "h256" and (g in mps) == on]  # noqa: E731
    on = [float(v) for g, v, m in gpus if m == "on"]
    off = [float(v) for g, v, m in gpus if m == "off"]
    return {"each_on": _span(each(True)), "each_off": _span(each(False)), "on": " and ".join(str(_i(x)) for x in on),
            "off": _i(off[0]), "gpus_on": ", ".join(sorted(mps)),
            "gain": _i(round(100 * (statistics.mean(on) / off[0] - 1), -1)),
            "setup": _i(_console(text, r"\[\s*(\d+) s\] MPS on GPUs")[0])}


def _points(run):
    """A pilot / study run's log lines as dicts (its series' columns differ with c)."""
    return [dict(zip(run["series"]["columns"], row)) for row in run["series"]["rows"]]


def _at(run, step, key):
    return next(p[key] for p in _points(run) if p["step"] == step)


def _runs(summary, **kw):
    return [r for r in summary["runs"] if all(r[k] == v for k, v in kw.items())]


def _smoothed_low(run, until):
    """The lowest training loss averaged over 5 log lines (the rule's smoothing) up to iteration ``until``."""
    p = _points(run)
    return min(statistics.mean(x["loss"] for x in p[i - 4:i + 1]) for i in range(4, len(p)) if p[i]["step"] <= until)


def _warmup(summary):
    return _i(summary["warmup_fraction"] * summary["config"]["steps"])


def _pilot_03(s):
    """At 0.3 (c = 0, clip 1, no or independent weight decay): the loss's low in warmup, log Z from the peak
    learning rate to the iteration the rule dates."""
    runs = [r for m in ("none", "independent") for r in _runs(s, lr=0.3, coeff=0.0, clip=1.0, hidden=256, wd_mode=m)]
    warm, at = _warmup(s), [r["verdict"]["step"] for r in runs]
    return {"lo": min(_smoothed_low(r, warm) for r in runs), "hi": max(_smoothed_low(r, warm) for r in runs),
            "start": _i(statistics.median(_at(r, warm, "lse") for r in runs)),
            "top": _span([_i(_at(r, r["verdict"]["step"], "lse")) for r in runs]),
            "within": math.ceil((max(at) - warm) / 100) * 100}


def _pilot_10(s):
    """At 1.0: where the loss passed its initial value (claims.json) and log Z by the iteration the rule dates."""
    runs = _runs(s, lr=1.0)
    rule = {r["verdict"]["step"] for r in runs}
    if len(rule) != 1 or rule.pop() != _warmup(s) + 10:
        return {}
    dated = runs[0]["verdict"]["step"]
    lse = [max(p["lse"] for p in _points(r) if p["step"] <= dated) for r in runs]
    return {"near": statistics.median(load(CLAIMS)["lr1_above_init"]["loss_passed_initial"]),
            "lo": f"{round(min(lse), -1):.0f}", "hi": f"{round(max(lse), -1):.0f}", "at": dated}


def _decoupled_spike(s):
    run = _runs(s, lr=0.3, coeff=0.0, clip=1.0, wd_mode="decoupled")[0]
    p = _points(run)
    jump = max(zip(p[1:], p), key=lambda ab: ab[0]["loss"] - ab[1]["loss"])[0]
    return {"at": jump["step"], "v": jump["loss"], "last": run["last_step"]}


def _parameters(summary):
    """The model's parameters from its Megatron arguments: without and with the (untied) embeddings. Megatron's
    log (A_logs.tgz) prints the total, 19928576, for hidden 256."""
    flags = summary["megatron_args_example"]
    arg = lambda f: int(flags[flags.index(f) + 1])  # noqa: E731
    h, layers, ffn, heads, vocab = (arg(f) for f in ("--hidden-size", "--num-layers", "--ffn-hidden-size",
                                                      "--num-attention-heads", "--vocab-size"))
    if not {"--disable-bias-linear", "--qk-layernorm", "--untie-embeddings-and-output-weights"} <= set(flags) \
            or flags[flags.index("--normalization") + 1] != "LayerNorm":
        return {}
    linear = 4 * h * h + 2 * h * ffn  # QKV and the attention's projection, the MLP's two
    norms = 2 * 2 * h + 2 * 2 * (h // heads)  # two LayerNorms (weight and bias), the q and k norms over a head
    core = layers * (linear + norms) + 2 * h  # and the final LayerNorm
    return {"h": h, "vocab": vocab, "core": core / 1e6, "total": (core + 2 * vocab * h) / 1e6}


def _study_row(lr):
    """Per coefficient: 'diverged / seeds' and the span of the iterations they diverged at; Fisher's p of each c."""
    def compute(s):
        out = {"lr": f"{lr:g}", "p": ", ".join(f"{f['p']:g}" for f in s["fisher"] if f["arm"]["lr"] == lr)}
        for key, c in (("0", 0.0), ("6", 1e-6), ("4", 1e-4), ("3", 1e-3)):
            arm = _arm_runs(s, lr, ["none"], 1.0, c)[0]
            if arm["undecided"]:
                return {}
            out["n" + key] = f"{len(arm['diverged'])} / {len(arm['seeds'])}"
            out["s" + key] = _span([v["step"] for v in arm["verdicts"].values()]) if arm["diverged"] else ""
        return out
    return compute


def _lag(stats, lr, coeff):
    """Per seed: the iteration c diverged at minus that of c = 0."""
    a0, ac = (_arm_runs(stats, lr, ["none"], 1.0, c)[0]["verdicts"] for c in (0.0, coeff))
    return [ac[s]["step"] - a0[s]["step"] for s in a0]


def _paired(stats, lr, coeff):
    p = next(p for p in stats["paired"] if p["value"] == "tail_loss" and p["arm"]["lr"] == lr
             and p["arm"]["coeff"] == coeff)
    return p


def _pm3(p, bold=False):
    text = f"{p['mean']:+.3f} ± {p['ci95']:.3f}"
    return f"**{text}**" if bold else text


def _claims_lse(c, key, coeff):
    v = c[key][coeff]
    return f"{v['min']:.1f}-{v['max']:.1f}"


# --- the short sweeps (2026-11-27) ---

PAPER_TOKENS = 100_000 * 256 * 512  # the paper's default run: 1e5 steps of 256 sequences of 512 tokens
T95 = {1: 12.706, 2: 4.303}  # Student's t, two-sided 95 %, by degrees of freedom (zloss_sweep_report.T95)


def _run_tokens(summary):
    c = summary["config"]
    return c["steps"] * c["micro_batch"] * c["seq"]


def _both_phases(a):
    return a["runs"] + load(SHORT_DIR + "B_summary.json")["runs"]


def _phase_a(a):
    runs = a["runs"]
    started = [r for r in runs if r.get("started_s") is not None]
    at_once = [r for r in started if r["started_s"] == 0]
    later = [r["started_s"] for r in started if r["started_s"] > 0]
    cut = [r for r in runs if r["status"].startswith("stopped at the budget")]
    if len(at_once) != a["config"]["gpu_capacity"] * a["gpus"]:
        return {}
    return {"at_once": len(at_once), "runs": len(runs), "cap": a["config"]["gpu_capacity"], "later": len(later),
            "after": _span([_i(x) for x in later]), "never": sum(r["status"] == "not started" for r in runs),
            "cut": len(cut), "lo": min(r["last_step"] for r in cut), "hi": max(r["last_step"] for r in cut),
            "valid": sum(r["final_validation"] is not None for r in runs),
            "exiting": sum(r["status"] == "complete (stopped while exiting)" for r in runs)}


def _phase_b_first(b):
    lacked = {r["name"] for r in load(SHORT_DIR + "A_summary.json")["runs"] if not r["status"].startswith("complete")}
    first = [r for r in b["runs"] if r["group"] == "main"]
    extra = {r["name"] for r in first} - lacked
    if not lacked <= {r["name"] for r in first} or [n for n in extra if not n.endswith("_rerun")] \
            or not all(r["status"] == "complete" for r in first):
        return {}
    return {"n": len(lacked), "done": sum(r["status"] == "complete" for r in b["runs"]), "of": len(b["runs"])}


def _best_in_a(a):
    """Phase A's best learning rate at c = 0 among its complete runs, and their seeds."""
    by_lr = {}
    for r in a["runs"]:
        if r["coeff"] == 0 and r["hidden"] == 256 and not r["rerun"] and r["status"].startswith("complete"):
            by_lr.setdefault(r["lr"], []).append(r["final_validation"])
    best = min(by_lr, key=lambda lr: statistics.mean(by_lr[lr]))
    if best != load(SHORT_DIR + "B_summary.json")["best_lr"]:
        return {}
    return {"best": _e(best), "n": len(by_lr[best])}


def _lr_paired(s, lr, base):
    """base minus lr at c = 0, seed by seed: mean and the 95 % half-width."""
    a, b = (_cell(s, x, 0.0)["final_validation"]["per_seed"] for x in (base, lr))
    d = [a[k] - b[k] for k in a]
    return {"d": statistics.mean(d), "ci": T95[len(d) - 1] * statistics.stdev(d) / math.sqrt(len(d))}


def _lse_min_c0(a):
    """The smallest mean log Z of any run without the z-loss, both phases (TensorBoard, every iteration)."""
    return {"v": min(r["agg"]["lse_min_mean"] for r in _both_phases(a) if r["coeff"] == 0
                     and r["agg"].get("lse_min_mean") is not None)}


def _cell(stats, lr, coeff, hidden=256, wd="none"):
    return next(c for c in stats["cells"] if (c["hidden"], c["wd_mode"], c["lr"], c["coeff"]) == (hidden, wd, lr, coeff))


def _pm(v, digits, signed=False, bold=False):
    """mean ± half-width; bold where a difference's interval excludes 0, as the doc marks it."""
    text = f"{v['mean']:{'+' if signed else ''}.{digits}f} ± {v['ci95']:.{digits}f}"
    return f"**{text}**" if bold and abs(v["mean"]) > v["ci95"] else text


def _main_row(s, lr):
    c0, c4, c3 = (_cell(s, lr, c) for c in (0.0, 1e-4, 1e-3))
    return {"lr": _e(lr), "c0": _pm(c0["final_validation"], 3), "d4": _pm(c4["final_validation_minus_c0"], 3, True, True),
            "d3": _pm(c3["final_validation_minus_c0"], 3, True, True)}


def _lse_row(s, lr):
    cs = [_cell(s, lr, c) for c in (0.0, 1e-4, 1e-3)]
    return {"lr": _e(lr), "lse": " / ".join(_pm(c["lse_last100"], 2) for c in cs), "max0": _pm(cs[0]["lse_max_run"], 1),
            "d4": _pm(cs[1]["lse_max_run_minus_c0"], 1, True, True), "d3": _pm(cs[2]["lse_max_run_minus_c0"], 1, True, True)}


def _coeff_row(s, coeff):
    c = _cell(s, 0.003, coeff)
    n = c["final_validation"]["n"]
    loss = f"({_pm(c['final_validation'], 3)})" if coeff == 0 else _pm(c["final_validation_minus_c0"], 3, True)
    mx = (_pm(c["lse_max_run"], 1) if n > 2 else
          ", ".join(f"{v:.1f}" for _, v in sorted(c["lse_max_run"]["per_seed"].items())) + " (the two seeds)")
    return {"c": _e(coeff), "n": n, "loss": loss, "lse": _pm(c["lse_last100"], 2), "max": mx}


def _seed1(cell, key):
    return cell[key]["per_seed"]["1"]


def _wd_row(s, lr, wd):
    cs = [_cell(s, lr, c, wd=wd) for c in (0.0, 1e-4)]
    return {"lr": _e(lr), "loss": " / ".join(f"{_seed1(c, 'final_validation'):.3f}" for c in cs),
            "max": " / ".join(f"{_seed1(c, 'lse_max_run'):.1f}" for c in cs),
            "lse": " / ".join(f"{_seed1(c, 'lse_last100'):.2f}" for c in cs)}


def _width_runs(summary, hidden, lr):
    """Phase B's 500-step runs of one width and learning rate: c -> run."""
    return {r["coeff"]: r for r in summary["runs"] if r["group"] == "width" and r["hidden"] == hidden and r["lr"] == lr}


def _width_row(summary, hidden):
    loss = lambda lr: " / ".join(  # noqa: E731
        "(failed at start)" if r["status"].startswith("failed") else f"{r['final_validation']:.3f}"
        for r in (_width_runs(summary, hidden, lr)[c] for c in (0.0, 1e-4)))
    r3 = _width_runs(summary, hidden, 0.3)
    low = min(v for _, v in r3[0.0]["series"]["lm loss"])  # the series every 10 steps
    return {"h": hidden, "l2": loss(0.03), "l1": loss(0.3), "low": f"{low:.2f}",
            "max": " / ".join(str(_i(r3[c]["agg"]["lse_max_run"])) for c in (0.0, 1e-4))}


def _peak_lse(summary, hidden, coeff):
    """The largest mean log Z of a run at learning rate 0.3 (the series every 10 steps)."""
    return _i(max(v for _, v in _width_runs(summary, hidden, 0.3)[coeff]["series"]["lm_lse"]))


ROWS = [
    # "In short"
    (DOC, "(a small GPT in Megatron's `pretrain`, learning rates up to {top:.1f}, 2026-11-28)", POOLED,
     lambda s: {"top": max(r["lr"] for r in s["runs"])}),
    (DOC, "at learning rate 0.3 every seed diverged at c = {coeffs} alike ({n} of {n} each; Fisher's p = {p}), at 0.2 "
     "and 0.1 none did", STUDY,
     lambda s: {"coeffs": ", ".join(_e(a["arm"]["coeff"]) for a in s["arms"] if a["arm"]["lr"] == 0.3)
                .replace(", 1e-3", " and 1e-3"),
                "n": _span([len(a["diverged"]) for a in s["arms"] if a["arm"]["lr"] == 0.3]),
                "p": _span([f"{f['p']:g}" for f in s["fisher"]])}
     if all(not a["diverged"] for a in s["arms"] if a["arm"]["lr"] < 0.3)
     and all(len(a["diverged"]) == len(a["seeds"]) for a in s["arms"] if a["arm"]["lr"] == 0.3) else {}),
    (DOC, "1e-3 costs up to {cost:.2f} nats at a low learning rate", STUDY,
     lambda s: {"cost": max(p["mean"] for p in s["paired"] if p["arm"]["coeff"] == 1e-3)}),
    (DOC, "1e-4 moved the mean `lm_lse` from about {c0:.1f} to {c4:.1f}, far from 0", CLAIMS,
     lambda c: {"c0": c["lm_lse_iters_3901_4000_lr0.2"]["0.0"]["median"],
                "c4": c["lm_lse_iters_3901_4000_lr0.2"]["0.0001"]["median"]}),

    # the divergence rule: the loss at initialization over every run of the pilot and the study
    (DOC, "(the loss at initialization: {lo:.1f}-{hi:.1f} here, with", CLAIMS,
     lambda c: dict(zip(("lo", "hi"), c["initial_loss_range"]))),
    # settings: the batch and the data
    (DOC, "the batch is small ({mb} sequences of {seq} tokens, {tok} tokens an iteration: {steps} iterations are "
     "{total:.0f} M tokens, {passes:.1f} passes over the {train:.1f} M training tokens)", STUDY_DIR + "study_sweep.json",
     lambda s: (lambda c, t: {"mb": c["micro_batch"], "seq": c["seq"], "tok": c["micro_batch"] * c["seq"],
                              "steps": f"{c['steps']:,}".replace(",", " "), "total": c["steps"] * c["micro_batch"] * c["seq"] / 1e6,
                              "passes": c["steps"] * c["micro_batch"] * c["seq"] / t, "train": t / 1e6})(
         s["config"], s["data"]["splits"]["pypi_train"]["tokens"])
     if s["config"]["micro_batch"] * s["config"]["seq"] == TOKENS_PER_ITERATION
     and s["data"]["splits"]["pypi_train"]["tokens"] == TRAIN_TOKENS else {}),

    # the pilot: how it ran, and its table, row by row
    (DOC, "stopped when they met the rule or when the call's time ran out ({budget} s of runs;", PILOT_DIR + "console.log",
     lambda t: {"budget": re.search(r"23 runs on 3 GPU\(s\), 10000 steps each, budget (\d+) s", t).group(1)}),
    (DOC, "| 1.0 | none, clip 1 | {c0} | {c4} |", PILOT,
     lambda s: {"c0": _pilot_cell(s, 1.0, ["none"], 1.0, 0.0).replace("(@", "(above_init @"),
                "c4": _pilot_cell(s, 1.0, ["none"], 1.0, 1e-4)}),
    (DOC, "| 1.0 | independent 1e-4, clip 1 | {c0} | {c4} |", PILOT, _pilot_row(1.0, ["independent"], 1.0)),
    (DOC, "| 1.0 | decoupled 0.1, clip 1 | {c0} | {c4} |", PILOT, _pilot_row(1.0, ["decoupled"], 1.0)),
    (DOC, "| 1.0 | none / independent / decoupled, no clip | {c0} | {c4} |", PILOT,
     _pilot_row(1.0, ["none", "independent", "decoupled"], 0.0, dedupe=True)),
    (DOC, "| 1.0 | none, clip 1, hidden 512 | {c0} | {c4} |", PILOT, _pilot_row(1.0, ["none"], 1.0, hidden=512)),
    (DOC, "| 0.3 | none, clip 1 | {c0} | {c4} |", PILOT,
     lambda s: {"c0": _pilot_cell(s, 0.3, ["none"], 1.0, 0.0).replace("(@", "(above_init @"),
                "c4": _pilot_cell(s, 0.3, ["none"], 1.0, 1e-4)}),
    (DOC, "| 0.3 | independent 1e-4, clip 1 | {c0} | {c4} |", PILOT, _pilot_row(0.3, ["independent"], 1.0)),
    (DOC, "| 0.3 | decoupled 0.1, clip 1 | {c0}; a spike at 2150-{jump}, not recovered by {last}) | {c4} |", CLAIMS,
     lambda c: (lambda r: {"c0": f"1 / 1 ({r['verdict']['rule']} rule @ {r['verdict']['step']}", "c4": "-",
                           "jump": r["largest_jump_between_log_lines_at"], "last": r["last_step"]})(
         c["decoupled_wd_lr0.3"][0])),
    (DOC, "| 0.3 | none / independent, no clip | {c0} | {c4} |", PILOT, _pilot_row(0.3, ["none", "independent"], 0.0)),
    (DOC, "| 0.1 | none / independent / decoupled, clip 1 | 0 / {n} (stopped by the time budget at {at}) | {c4} |", PILOT,
     lambda s: (lambda arms: {"n": len(arms), "c4": _pilot_cell(s, 0.1, ["none"], 1.0, 1e-4),
                              "at": _span(s["not_diverged_iterations"])}
                if all(a["undecided"] and not a["diverged"] for a in arms) else {})(
         _arm_runs(s, 0.1, ["none", "independent", "decoupled"], 1.0, 0.0))),
    # the pilot's bullets
    (DOC, "Clipping delays it (0.3: {clip} with clipping, {noclip} without).", PILOT,
     lambda s: {"clip": _span([v["step"] for a in _arm_runs(s, 0.3, ["none", "independent"], 1.0, 0.0)
                               for v in a["verdicts"].values()]),
                "noclip": _span([v["step"] for a in _arm_runs(s, 0.3, ["none", "independent"], 0.0, 0.0)
                                 for v in a["verdicts"].values()])}),
    (DOC, "**c = 1e-4 did not prevent it** in any of the {pairs} pairs (same seed, same setting): it diverged at the "
     "same iteration or {lo}-{hi} later.", PILOT,
     lambda s: (lambda lags: {"pairs": len(lags), "lo": min(x for x in lags if x), "hi": max(lags)}
                if min(lags) == 0 else {})(
         [a4["verdicts"]["1"]["step"] - a0["verdicts"]["1"]["step"] for a4 in s["arms"] if a4["arm"]["coeff"] == 1e-4
          for a0 in s["arms"] if a0["arm"] == dict(a4["arm"], coeff=0.0)])),
    (DOC, "8 runs sharing a GPU ran {each_on} iterations/s each, {on} a GPU together through CUDA MPS (GPUs {gpus_on}) "
     "and {each_off} each, {off} together, time-sliced without it (GPU 2): MPS gave about {gain} % more. Installing, "
     "encoding the corpus and starting MPS took {setup} s.", PILOT_DIR + "console.log", _pilot_throughput),

    (DOC, "At learning rate 0.3 the loss falls to {lo:.1f}-{hi:.1f} during warmup; from the peak learning rate on, the "
     "mean `log Z` (`lm_lse`) climbs from about {start} to {top} within {within} iterations", PILOT_DIR + "pilot_summary.json",
     _pilot_03),
    (DOC, "(the loss passes its initial value near iteration {near:g}, `log Z` reaches {lo}-{hi} by iteration {at}; the "
     "rule can only date it at {at}, the end of warmup)", PILOT_DIR + "pilot_summary.json", _pilot_10),
    (DOC, "the loss spiked at 2150-{at} (to {v:.1f}) without recovering by {last}.", PILOT_DIR + "pilot_summary.json",
     _decoupled_spike),
    (DOC, "At 0.3 its z-loss term was {z} when the loss had already passed 11.", PILOT_DIR + "pilot_summary.json",
     lambda s: {"z": _span([f"{next(p['z_loss'] for p in _points(r) if p['step'] > 1 and p['loss'] > 11):.2f}"
                            for r in _runs(s, lr=0.3, coeff=1e-4)])}),
    (DOC, "**Learning rate 0.1 trained** (loss {lo:.1f}-{hi:.1f} when the time ran out) in every weight-decay mode",
     PILOT_DIR + "pilot_summary.json",
     lambda s: (lambda runs: {"lo": min(_points(r)[-1]["loss"] for r in runs), "hi": max(_points(r)[-1]["loss"] for r in runs)}
                if all(not r["diverged"] for r in runs) and len({r["wd_mode"] for r in runs}) == 3 else {})(
         _runs(s, lr=0.1))),
    (DOC, "which gave about {gain} % more iterations per second when 8 small runs share a GPU", PILOT_DIR + "console.log",
     _pilot_throughput),

    # the study: how it ran
    (DOC, "x learning rates 0.3 and 0.2 with {edge} seeds each, 0.1 with {below}**: {runs} runs, all started at once, "
     "{cap} a GPU through CUDA MPS, {budget:g} s of runs", STUDY_DIR + "study_sweep.json",
     lambda s: {"edge": len({r["seed"] for r in s["runs"] if r["lr"] == 0.3}),
                "below": len({r["seed"] for r in s["runs"] if r["lr"] == 0.1}), "runs": len(s["runs"]),
                "cap": s["config"]["gpu_capacity"], "budget": s["budget_s"]}),
    (DOC, "in the event {each} iterations/s a run at 13 a GPU, {together} a GPU); runs went on until they diverged or "
     "the time ran out ({ran} iterations)", STUDY_DIR + "console.log",
     lambda t: {"each": _i(statistics.median(_console(t, r"step \d+, ([\d.]+) steps/s on GPU"))),
                "together": _span([_i(x) for x in _console(t, r"13 runs, ([\d.]+) steps/s together")]),
                "ran": _span([int(x) for x in _console(t, r"step (\d+), [\d.]+ steps/s on GPU \d \(stopped: out")])}),
    # the study's table, and the note under it
    (DOC, "| {lr} | {n0} diverged (iterations {s0}) | {n6} ({s6}) | {n4} ({s4}) | {n3} ({s3}) | {p} |", STUDY,
     _study_row(0.3)),
    *[(DOC, "| {lr} | {n0} | {n6} | {n4} | {n3} | {p} |", STUDY, _study_row(lr)) for lr in (0.2, 0.1)],
    (DOC, "every run was decided: none was cut before iteration {h}. All {n} divergences are `above_init`", STUDY,
     lambda s: {"h": s["runs"][0]["horizon"], "n": sum(r["diverged"] for r in s["runs"])}
     if all(r["verdict"]["rule"] == "above_init" for r in s["runs"] if r["diverged"])
     and not any(a["undecided"] for a in s["arms"]) else {}),
    # the study's bullets
    (DOC, "Paired by seed, c = 1e-4 diverged {a} to {b} iterations from c = 0 (the near-zero 1e-6: {c} to {d}, the "
     "noise), and **c = 1e-3 diverged earlier in every seed, by {e} to {f} iterations**", STUDY,
     lambda s: (lambda l4, l6, l3: {"a": _signed(min(l4)), "b": _signed(max(l4)), "c": _signed(min(l6)),
                                    "d": _signed(max(l6)), "e": -max(l3), "f": -min(l3)} if max(l3) < 0 else {})(
         _lag(s, 0.3, 1e-4), _lag(s, 0.3, 1e-6), _lag(s, 0.3, 1e-3))),
    (DOC, "{n} comparisons at p = 1: nothing to correct for multiplicity.", STUDY,
     lambda s: {"n": {9: "Nine"}.get(len(s["fisher"]), len(s["fisher"]))} if all(f["p"] == 1 for f in s["fisher"])
     else {}),
    (DOC, "at 0.2, 1e-6 {a}, 1e-4 {b}, 1e-3 {c} ({n2} seeds); at 0.1, 1e-6 {d}, 1e-4 {e}, **1e-3 {f}** ({n1} seeds; a "
     "cost of {lo:.2f} to {hi:.2f} nats)", STUDY,
     lambda s: (lambda p: {"a": _pm3(p(0.2, 1e-6)), "b": _pm3(p(0.2, 1e-4)), "c": _pm3(p(0.2, 1e-3)),
                           "d": _pm3(p(0.1, 1e-6)), "e": _pm3(p(0.1, 1e-4)), "f": _pm3(p(0.1, 1e-3)),
                           "n2": p(0.2, 1e-3)["n"], "n1": p(0.1, 1e-3)["n"],
                           "lo": p(0.1, 1e-3)["mean"] - p(0.1, 1e-3)["ci95"],
                           "hi": p(0.1, 1e-3)["mean"] + p(0.1, 1e-3)["ci95"]})(lambda lr, c: _paired(s, lr, c))),
    (DOC, "learning rate 0.2; {c0}, {c4} and {c3} at 0.1); the largest `lm_lse_max` by then {m0} at c = 0, {m4} at "
     "1e-4, {m3} at 1e-3.", CLAIMS,
     lambda c: {"c0": _claims_lse(c, "lm_lse_iters_3901_4000_lr0.1", "0.0"),
                "c4": _claims_lse(c, "lm_lse_iters_3901_4000_lr0.1", "0.0001"),
                "c3": _claims_lse(c, "lm_lse_iters_3901_4000_lr0.1", "0.001"),
                **{k: _span([_i(v["min"]), _i(v["max"])]) for k, v in
                   zip(("m0", "m4", "m3"), (c["lm_lse_max_to_4000_lr0.2"][x] for x in ("0.0", "0.0001", "0.001")))}}),
    (DOC, "with 1e-3 at 0.1 the mean `log Z` went below 0 in {without_lse} of {lines} log lines", CLAIMS,
     lambda c: c["log_lines_without_lm_lse_lr0.1"]["0.001"]),

    # the log as an early warning (the table is in __init__.py)
    (DOC, "Over the {diverged} runs that diverged and the {not_diverged} that did not (pilot and study;", CLAIMS,
     lambda c: c),
    (DOC, "in the study's {n} divergences it had risen a nat above its best {lo}-{hi} iterations (median {med:g}) before "
     "`lm_lse` reached 18", STUDY,
     lambda s: (lambda a, b: (lambda d: {"n": len(d), "lo": min(d), "hi": max(d), "med": statistics.median(d)})(
         [x - y for x, y in zip(a, b)]))(
         next(r for r in s["early_warning"]["loss_rise"] if r["threshold"] == 1.0)["leads"],
         next(r for r in s["early_warning"]["lse"] if r["threshold"] == 18)["leads"])),
    (DOC, "(a single token's `log Z` reached {lo}-{hi} in the study's c = 0 runs that trained fine)", STUDY,
     lambda s: (lambda v: {"lo": _i(min(v)), "hi": _i(max(v))})(
         [r["lse_max_run"] for r in s["runs"] if not r["diverged"] and r["coeff"] == 0])),

    (DOC, "**`lm_lse` above {t}** ({n} nats above its value at initialization, {v}, with this 32768-token vocabulary)",
     CLAIMS, lambda c: (lambda v: {"t": 18, "n": _i(18 - float(v)), "v": v})(
         _span({f"{x:.1f}" for x in c["lm_lse_first_log_line"]}))),

    # what the budget held
    (DOC, "stopped by the time budget at {it} iterations (study) and", STUDY,
     lambda s: {"it": _span(s["not_diverged_iterations"])}),
    (DOC, "and {it} (pilot, learning rate 0.1)", PILOT, lambda s: {"it": _span(s["not_diverged_iterations"])}),
    (DOC, "(pilot, learning rate 0.1), {lo:.0f}-", STUDY,
     lambda s: {"lo": min(s["not_diverged_iterations"]) * TOKENS_PER_ITERATION / 1e6}),
    (DOC, "-{hi:.0f} M tokens, up to {passes:.2f} passes over the training split", PILOT,
     lambda s: (lambda n: {"hi": n * TOKENS_PER_ITERATION / 1e6, "passes": n * TOKENS_PER_ITERATION / TRAIN_TOKENS})(
         max(s["not_diverged_iterations"]))),
    (DOC, "the divergences all came within {within} iterations of the start, except the decoupled-weight-decay run "
     "(dated {dec}", POOLED,
     lambda s: (lambda steps: {"within": _i(math.ceil(steps[-2] / 100) * 100), "dec": steps[-1]})(
         sorted(r["verdict"]["step"] for r in s["runs"] if r["diverged"]))),
    *[(DOC, "**GPU time**: two calls of about {m} minutes on 4 H200s: the pilot's", source,
       lambda t: {"m": _i(_console(t, r"\[\s*(\d+) s\] done")[0] / 60)})
      for source in (PILOT_DIR + "console.log", STUDY_DIR + "console.log")],
    (DOC, "the pilot's {n} runs (on 3 of them)", PILOT, lambda s: {"n": len(s["runs"])}),
    (DOC, "and the study's {n}.", STUDY, lambda s: {"n": len(s["runs"])}),

    # run it
    (DOC, "(about {mb} MB for the study's {n} runs)", STUDY_DIR + "study_summary.json",
     lambda s: {"n": len(s["runs"]), "mb": _i(os.path.getsize(os.path.join(ROOT, STUDY_DIR, "study_summary.json")) / 1e6)}),
    (DOC, "(`--unit-s`: the GPU seconds of one hidden-256 run; phase B used {u:g}, on H100s shared by up to {cap} runs)",
     SHORT_DIR + "B_summary.json",
     lambda b: {"u": b["config"]["unit_s"], "cap": b["config"]["gpu_capacity"]}
     if all("H100" in g for g in b["environment"]["gpus"]) else {}),
    (DOC, "`--budget-s` (default {b} s on GPUs)", "examples/zloss_lr_sweep.py",
     lambda t: {"b": re.search(r"budget_s = args.budget_s or \((\d+) if gpus", t).group(1)}),

    # the data
    (DOC, "from the rest every such line found in training is dropped. {before} held-out files became {after} ({v} "
     "vendored and {c} copies dropped;", STUDY_DIR + "study_data.json",
     lambda d: (lambda h: {"before": d["splits"]["pypi_valid"]["documents"] + len(h["files_vendored"])
                           + len(h["files_copied"]), "after": d["splits"]["pypi_valid"]["documents"],
                           "v": len(h["files_vendored"]), "c": len(h["files_copied"])})(d["heldout_dedup"])),
    (DOC, "and {lines_dropped} lines were dropped from the rest ({kept} kept)", STUDY_DIR + "study_data.json",
     lambda d: dict(d["heldout_dedup"], kept=f"{d['heldout_dedup']['lines_kept']:,}".replace(",", " "))),
    *[(DOC, "| " + label + " | {documents} | {mb:.1f} MB | {tok} |", source,
       lambda d, k=key: (lambda s: dict(s, mb=s["bytes"] / 1e6, tok=f"{s['tokens']:,}".replace(",", " ")))(
           d["splits"][k]))
      for label, key, source in [("training", "pypi_train", STUDY_DIR + "study_data.json"),
                                 ("validation (deduplicated: the study)", "pypi_valid", STUDY_DIR + "study_data.json"),
                                 ("validation (the short sweeps and the pilot)", "pypi_valid",
                                  PILOT_DIR + "pilot_data.json")]],

    (DOC, "A run takes {steps} x {mb} x {seq} = {tok:.1f} M tokens: three quarters of the training split",
     SHORT_DIR + "A_summary.json",
     lambda a: (lambda c, n: {"steps": c["steps"], "mb": c["micro_batch"], "seq": c["seq"], "tok": n / 1e6}
                if 0.7 < n / a["data"]["splits"]["pypi_train"]["tokens"] < 0.8 else {})(a["config"], _run_tokens(a))),
    (DOC, "split: {it} batches of {mb} x {seq}, {used} of its {seqs} sequences of {seq} (Megatron's samples of one pass; "
     "the {left} left out", SHORT_DIR + "A_summary.json",
     lambda a: (lambda c, seqs: {"it": a["eval_iters"], "mb": c["micro_batch"], "seq": c["seq"], "seqs": seqs,
                                 "used": a["eval_iters"] * c["micro_batch"],
                                 "left": seqs - a["eval_iters"] * c["micro_batch"]})(
         a["config"], (a["valid_tokens"] - 1) // a["config"]["seq"])),

    # the model table
    (DOC, "at hidden {h} {core:.1f} M parameters without the embeddings, {total:.0f} M with the two untied {vocab} x {h} "
     "embeddings", SHORT_DIR + "A_summary.json", _parameters),
    (DOC, "| schedule | linear warmup over {w} steps ({pct:.0f} %), cosine decay to {min_lr} | a {steps}-iteration schedule: "
     "linear warmup over {w2} ({pct2:.0f} %), cosine decay to {min_lr}", SHORT_DIR + "A_summary.json",
     lambda a: (lambda p: {"w": _warmup(a), "pct": 100 * a["warmup_fraction"], "min_lr": _e(a["min_lr"]),
                           "steps": f"{p['config']['steps']:,}".replace(",", " "), "w2": _warmup(p),
                           "pct2": 100 * p["warmup_fraction"]})(load(PILOT_DIR + "pilot_summary.json"))
     if str(_warmup(a)) in a["megatron_args_example"] else {}),
    (DOC, "(at most {most} iterations ran)", PILOT_DIR + "pilot_summary.json",
     lambda s: {"most": max(r["last_step"] for r in s["runs"] + load(STUDY_DIR + "study_summary.json")["runs"])}),
    (DOC, "| steps x batch | {steps} x {mb} sequences of {seq} tokens: {tok:.1f} M tokens, each seen at most once | up to "
     "{most} x {mb2} sequences of {seq2} tokens: at most {tok2:.1f} M tokens, {passes:.2f} passes over the training split "
     "| 1e5 steps x 256 x 512: about {paper:.0f} B tokens of C4, about {times} times more |", SHORT_DIR + "A_summary.json",
     lambda a: (lambda c, p, most: {
         "steps": c["steps"], "mb": c["micro_batch"], "seq": c["seq"], "tok": _run_tokens(a) / 1e6, "most": most,
         "mb2": p["config"]["micro_batch"], "seq2": p["config"]["seq"],
         "tok2": most * p["config"]["micro_batch"] * p["config"]["seq"] / 1e6,
         "passes": most * p["config"]["micro_batch"] * p["config"]["seq"] / p["data"]["splits"]["pypi_train"]["tokens"],
         "paper": PAPER_TOKENS / 1e9, "times": f"{round(PAPER_TOKENS / _run_tokens(a), -1):.0f}"})(
         a["config"], load(PILOT_DIR + "pilot_summary.json"),
         max(r["last_step"] for r in load(PILOT_DIR + "pilot_summary.json")["runs"]
             + load(STUDY_DIR + "study_summary.json")["runs"]))),
    (DOC, "(the same weights and batch in all runs of a seed) | the same ({v:.2f} at iteration 1 for seed 1)",
     PILOT_DIR + "pilot_summary.json",
     lambda s: (lambda v: {"v": v.pop()} if len(v) == 1 else {})(
         {r["init_loss"] for r in s["runs"] + load(STUDY_DIR + "study_summary.json")["runs"]
          if r["seed"] == 1 and r["hidden"] == 256})),

    # what ran on 2026-11-27
    (DOC, "{at_once} of the {runs} runs started at once, {cap} a GPU, {later} more after {after} s, {never} never; the "
     "budget stopped {cut} before their validation ({lo} to {hi} steps in). {valid} runs have their final validation loss "
     "({exiting} of them were stopped by the budget while exiting, after it).", SHORT_DIR + "A_summary.json", _phase_a),
    (DOC, "first the {n} runs phase A lacked and the rerun once more (all completed:", SHORT_DIR + "B_summary.json",
     _phase_b_first),
    (DOC, "{done} of {of} complete.", SHORT_DIR + "B_summary.json", _phase_b_first),
    (DOC, "The learning rate of phase B's sweeps, {best}, was the best at c = 0 among phase A's complete runs ({n} seeds "
     "then).", SHORT_DIR + "A_summary.json", _best_in_a),
    (DOC, "With all three seeds, 1e-2 is lower by {d:.3f} ± {ci:.3f} (paired)", SHORT, lambda s: _lr_paired(s, 0.01, 0.003)),

    # the short sweeps: the main sweep's table, every row
    *[(DOC, "| {lr} | {c0} | {d4} | {d3} |", SHORT, lambda s, lr=lr: _main_row(s, lr))
      for lr in (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)],
    (DOC, "| **LR sensitivity** | {c0} | {d4} | {d3} |", SHORT,
     lambda s: (lambda b: {"c0": _pm(b["0.0"], 3), "d4": _pm(b["0.0001"]["minus_c0"], 3, True, True),
                           "d3": _pm(b["0.001"]["minus_c0"], 3, True, True)})(
         next(x for x in s["lr_sensitivity"] if (x["hidden"], x["wd_mode"]) == (256, "none"))["by_coeff"])),
    (DOC, "**The LR sensitivity** (Wortsman et al.'s measure over the six learning rates) is {c0} without the z-loss; "
     "1e-4 and 1e-3 change it by {d4} and {d3}: no measurable effect.", SHORT,
     lambda s: (lambda b: {"c0": _pm(b["0.0"], 3), "d4": _pm(b["0.0001"]["minus_c0"], 3, True),
                           "d3": _pm(b["0.001"]["minus_c0"], 3, True)})(
         next(x for x in s["lr_sensitivity"] if (x["hidden"], x["wd_mode"]) == (256, "none"))["by_coeff"])),
    (DOC, "the same final validation loss to the last bit ({v:.7f})", SHORT,
     lambda s: (lambda r: {"v": r["final_validation"][0]} if r["final_validation_diff"] == 0 else {})(
         s["nondeterminism"][0])),
    (DOC, "where 1e-3 costs {d}. The seeds differ far more than the coefficients (the 95 % interval of the c = 0 loss "
     "is ±{lo:.2f} to ±{hi:.2f} wide)", SHORT,
     lambda s: (lambda cis: {"d": _pm(_cell(s, 0.001, 1e-3)["final_validation_minus_c0"], 3).replace("+", ""),
                             "lo": min(cis), "hi": max(cis)})(
         [_cell(s, lr, 0.0)["final_validation"]["ci95"] for lr in (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)])),
    # the short sweeps: log Z, every row
    *[(DOC, "| {lr} | {lse} | {max0} | {d4} | {d3} |", SHORT, lambda s, lr=lr: _lse_row(s, lr))
      for lr in (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)],
    (DOC, "**log Z drifts up without the z-loss**, from 10.9 to {lo:.1f}-{hi:.1f} over 1500 steps", SHORT,
     lambda s: (lambda v: {"lo": min(v), "hi": max(v)})(
         [_cell(s, lr, 0.0)["lse_last100"]["mean"] for lr in (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)])),
    (DOC, "**1e-3 pulls the mean `log Z` to {lo:.1f}-{hi:.1f}** within the run at learning rates from 3e-3 up ({low:.1f} "
     "at 1e-3); **1e-4 only by {a:.1f}-{b:.1f} nats** in 1500 steps.", SHORT,
     lambda s: (lambda v, d: {"lo": min(v), "hi": max(v), "low": _cell(s, 0.001, 1e-3)["lse_last100"]["mean"],
                              "a": min(d), "b": max(d)})(
         [_cell(s, lr, 1e-3)["lse_last100"]["mean"] for lr in (0.003, 0.01, 0.03, 0.1, 0.3)],
         [-_cell(s, lr, 1e-4)["lse_last100_minus_c0"]["mean"] for lr in (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)])),
    (DOC, "climbs with the learning rate: {a} at 1e-3, {b} at 1e-1, {c} at 3e-1. 1e-3 lowers the largest value of the "
     "run at 1e-1 and 3e-1 by {d} and {e}; 1e-4 lowers it by {f} to {g} up to 3e-2, and at 1e-1 and 3e-1 by {h} and "
     "{k} (not resolved).", SHORT,
     lambda s: (lambda m, d3, d4: {"a": _i(m(0.001)), "b": _i(m(0.1)), "c": _i(m(0.3)), "d": d3(0.1), "e": d3(0.3),
                                   "f": min(_i(-_cell(s, lr, 1e-4)["lse_max_run_minus_c0"]["mean"])
                                            for lr in (0.001, 0.003, 0.01, 0.03)),
                                   "g": max(_i(-_cell(s, lr, 1e-4)["lse_max_run_minus_c0"]["mean"])
                                            for lr in (0.001, 0.003, 0.01, 0.03)),
                                   "h": d4(0.1), "k": d4(0.3)})(
         lambda lr: _cell(s, lr, 0.0)["lse_max_run"]["mean"],
         lambda lr: (lambda v: f"{_i(-v['mean'])} ± {_i(v['ci95'])}")(_cell(s, lr, 1e-3)["lse_max_run_minus_c0"]),
         lambda lr: (lambda v: f"{_i(-v['mean'])} ± {_i(v['ci95'])}")(_cell(s, lr, 1e-4)["lse_max_run_minus_c0"]))),
    (DOC, "(last 100 steps: {a:.1f} against {b:.1f} at 3e-3, {c:.1f} against {d:.1f} at 1e-2), because it pulls the mean "
     "down much more than the worst token. At 1e-1 and 3e-1 without the z-loss the gap is {e} and {f} (±{g} and ±{h})",
     SHORT,
     lambda s: (lambda g: {"a": g(0.003, 1e-3)["mean"], "b": g(0.003, 0.0)["mean"], "c": g(0.01, 1e-3)["mean"],
                           "d": g(0.01, 0.0)["mean"], "e": _i(g(0.1, 0.0)["mean"]), "f": _i(g(0.3, 0.0)["mean"]),
                           "g": _i(g(0.1, 0.0)["ci95"]), "h": _i(g(0.3, 0.0)["ci95"])})(
         lambda lr, c: _cell(s, lr, c)["gap_last100"])),
    (DOC, "(the mean `log Z` without the z-loss never fell below {v:.1f})", SHORT_DIR + "A_summary.json", _lse_min_c0),
    (DOC, "(3 seeds per cell; `log Z` is {v} at initialization.", SHORT_DIR + "A_summary.json",
     lambda a: {"v": _span({f"{r['agg']['lse_first']:.1f}" for r in _both_phases(a) if r["agg"].get("lse_first")})}),
    # the coefficient sweep at 3e-3, every row
    *[(DOC, "| {c} | {n} | {loss} | {lse} | {max} |", SHORT, lambda s, c=c: _coeff_row(s, c))
      for c in (0.0, 1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2)],
    (DOC, "The mean `log Z` falls with the coefficient as expected: {a:.1f} at 0, {b:.1f} at 1e-3, {c:.1f} at 1e-2.",
     SHORT, lambda s: {k: _cell(s, 0.003, c)["lse_last100"]["mean"] for k, c in zip("abc", (0.0, 1e-3, 1e-2))}),
    (DOC, "with two seeds the interval reaches {k:.1f} standard errors either side of the mean", SHORT,
     lambda s: (lambda v: {"k": v["ci95"] / (statistics.stdev(v["diffs"]) / math.sqrt(v["n"]))})(
         _cell(s, 0.003, 0.003)["final_validation_minus_c0"])),
    # weight decay (one seed), every row
    *[(DOC, "| {lr} | " + label + " | {loss} | {max} | {lse} |", SHORT, lambda s, lr=lr, wd=wd: _wd_row(s, lr, wd))
      for lr in (0.003, 0.3) for label, wd in (("none", "none"), ("decoupled 0.1", "decoupled"),
                                               ("independent 1e-4", "independent"))],
    (DOC, "the run at learning rate 0.3 ended {d:.2f} lower and its worst token at {a} instead of {b}, and the z-loss "
     "1e-4 changed neither ({z:+.3f})", SHORT,
     lambda s: (lambda n, dc, dc4: {"d": _seed1(n, "final_validation") - _seed1(dc, "final_validation"),
                                    "a": _i(_seed1(dc, "lse_max_run")), "b": _i(_seed1(n, "lse_max_run")),
                                    "z": _seed1(dc4, "final_validation_minus_c0") if "per_seed" in
                                    dc4["final_validation_minus_c0"] else dc4["final_validation_minus_c0"]["mean"]})(
         _cell(s, 0.3, 0.0), _cell(s, 0.3, 0.0, wd="decoupled"), _cell(s, 0.3, 1e-4, wd="decoupled"))),
    (DOC, "decays by 1e-4 x s(t) per step: {a} times less than decoupled 0.1 at learning rate 0.3, {b} times less at "
     "3e-3)", SHORT_DIR + "B_summary.json",
     lambda b: (lambda ratio: {"a": ratio(0.3), "b": ratio(0.003)})(
         lambda lr: _i(lr * _runs(b, lr=lr, coeff=0.0, wd_mode="decoupled")[0]["wd"]
                       / _runs(b, lr=lr, coeff=0.0, wd_mode="independent")[0]["wd"]))),
    # wider models (500 steps, one seed), every row
    *[(DOC, "| {h} | {l2} | {l1} | {max} | {low} |", SHORT_DIR + "B_summary.json", lambda d, h=h: _width_row(d, h))
      for h in (256, 512, 1024)],
    (DOC, "the *mean* `log Z` rose to {a} (hidden 512) and {b} (hidden 1024) within the first", SHORT_DIR + "B_summary.json",
     lambda d: {"a": _peak_lse(d, 512, 0.0), "b": _peak_lse(d, 1024, 0.0)}),
    (DOC, "the mean `log Z` peaked at {a} and {b} with it; final losses {c} against {d} at hidden 256, {e} against {f} "
     "at 512, {g} against {h} at 1024)", SHORT_DIR + "B_summary.json",
     lambda d: dict({"a": _peak_lse(d, 512, 1e-4), "b": _peak_lse(d, 1024, 1e-4)}, **{
         k: f"{_width_runs(d, h, 0.3)[c]['final_validation']:.2f}"
         for k, h, c in zip("cdefgh", (256, 256, 512, 512, 1024, 1024), (1e-4, 0.0) * 3)})),
    (DOC, "The gap between the two learning rates is {a} nats at c = 0 for hidden 256 / 512 / 1024", SHORT_DIR +
     "B_summary.json", lambda d: {"a": " / ".join(
         f"{_width_runs(d, h, 0.3)[0.0]['final_validation'] - _width_runs(d, h, 0.03)[0.0]['final_validation']:.2f}"
         for h in (256, 512, 1024))}),
    (DOC, "their training loss never went below {a:.1f} ({b:.1f} at hidden 256 in the same 500 steps)",
     SHORT_DIR + "B_summary.json",
     lambda d: (lambda low: {"a": min(low(512), low(1024)), "b": low(256)})(
         lambda h: min(v for _, v in _width_runs(d, h, 0.3)[0.0]["series"]["lm loss"]))),
    (DOC, "within the first {w} steps, then fell back to {lo}-{hi} by step {end}, the loss stuck near {loss}",
     SHORT_DIR + "B_summary.json",
     lambda d: (lambda runs: {
         "w": math.ceil(max(max(r["series"]["lm_lse"], key=lambda x: x[1])[0] for r in runs) / 100) * 100,
         "lo": min(_i(r["series"]["lm_lse"][-1][1]) for r in runs),
         "hi": max(_i(r["series"]["lm_lse"][-1][1]) for r in runs),
         "end": runs[0]["steps"], "loss": _span({_i(r["series"]["lm loss"][-1][1]) for r in runs})})(
         [_width_runs(d, h, 0.3)[0.0] for h in (512, 1024)])),

    # did the output-logit divergence appear?
    (DOC, "(the smallest mean `log Z` without the z-loss was {v:.1f})", SHORT_DIR + "A_summary.json", _lse_min_c0),
    (DOC, "`log Z` drifting up by {lo}-{hi} nats without the z-loss", SHORT_DIR + "A_summary.json",
     lambda a: (lambda d: {"lo": _i(min(d)), "hi": _i(max(d))})(
         [r["agg"]["lse_last100"] - r["agg"]["lse_first"] for r in _both_phases(a) if r["coeff"] == 0
          and r["hidden"] == 256 and r["steps"] == 1500 and r["status"].startswith("complete")])),
    (DOC, "These runs are {m:.1f} M tokens long, about {times} times fewer than the paper's", SHORT_DIR + "A_summary.json",
     lambda a: {"m": _run_tokens(a) / 1e6, "times": f"{round(PAPER_TOKENS / _run_tokens(a), -1):.0f}"}),
]
