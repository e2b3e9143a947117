"""Where each figure quoted in README.md and docs/ comes from: one row per quoted passage.

A row is ``(doc, passage, source, compute)``: ``compute(data)`` reads the committed results file ``source``
(its parsed JSON, any other file's text, or the bench/ module named) and returns the values the ``passage`` template is formatted with; the
formatted passage must appear in ``doc`` (whitespace and line breaks ignored). So a figure that drifts from its
source, or a passage reworded without its row, fails tests/package/test_doc_figures.py. To quote a new figure: add its row.
Rows for README.md (and the first ones for docs/z_loss_training.md) live here; the others in <topic>.py,
joined below.
"""
import re
import statistics

from .results_files import load

LONG_CONTEXT = "bench/results/2026-12-06_h100_long_context/long_context.json"
THROUGHPUT = "bench/results/2026-12-06_h100_long_context/throughput.json"
CLAIMS = "bench/results/2026-11-28_zloss_study_4xh200/claims.json"
MAIN_JOB = "bench/results/2026-12-06_cpu_main_job/"  # README command 1's job on a 2-core CPU machine to itself
MAIN_JOB_LINES = "bench/results/2026-12-07_cpu_main_job/printed.txt"  # its printed lines, after the log-line change
FRESH = "bench/results/2026-12-07_cpu_tests/reported.txt"  # both commands on a fresh 2-core machine, as reported
PEERS = "bench/results/2026-12-07_h100_peers/"  # Megatron's fused CE, Liger's patch, the z-loss by hand
PEER_CALLS = ("peers_call1.json", "peers_call3.json", "peers_call4.json")
LONG_STATS = "bench/results/2026-11-28_zloss_study_4xh200/report_with_pilot/long_stats.json"


def _peer_runs(variant):
    """The peers' runs of ``variant``: (tokens, recompute, trained, out of memory, tokens/s)."""
    runs = [r for f in PEER_CALLS for r in load(PEERS + f)]
    return [(int(t), rc, r["rc"] == 0 and not r["oom"], r["oom"], r["tokens_per_s"])
            for r in runs for v, t, _, rc, _ in [r["run"].split(":")] if v == variant]


def _peer_row(variant):
    """Longest that trained (any recompute), the smallest out-of-memory above it with full recompute, and
    tokens/s at micro-batch 1 without recompute (the only setting the peers ran at 32768 tokens)."""
    runs = _peer_runs(variant)
    fit = max(t for t, _, ok, _, _ in runs if ok)
    fail = min(t for t, rc, _, oom, _ in runs if oom and rc == "full" and t > fit)
    tps = next(s for t, rc, ok, _, s in runs if ok and t == 32768 and rc == "none")
    return {"fit": fit, "fail": fail, "tps": tps}


def _no_fit(variant):
    runs = _peer_runs(variant)
    if any(ok for _, _, ok, _, _ in runs) or {rc for t, rc, _, oom, _ in runs if oom and t == 32768} != {
            "none", "selective", "full"}:
        return {"missing": True}
    return {"tokens": 32768}


def _paired(stats, lr, coeff):
    return next(p for p in stats["paired"] if p["value"] == "tail_loss" and p["arm"]["lr"] == lr
                and p["arm"]["coeff"] == coeff and p["arm"]["wd_mode"] == "none")


def _warning(stats, key, threshold):
    row = next(r for r in stats["early_warning"][key] if r["threshold"] == threshold)
    leads = [x for x in row["leads"] if x is not None]
    return dict(row, median=f"{statistics.median(leads):g}", lo=min(leads), hi=max(leads))


def _selfcheck_ok(report):
    return sum(r["status"] == "ok" for r in report["results"])


def _lse(claims, coeff):
    v = claims["lm_lse_iters_3901_4000_lr0.2"][coeff]
    return f"{v['min']:.1f}-{v['max']:.1f}"


def _earlier(stats, lr, coeff):
    arms = {a["arm"]["coeff"]: a["verdicts"] for a in stats["arms"] if a["arm"]["lr"] == lr
            and a["arm"]["wd_mode"] == "none" and a["arm"]["clip"] == 1.0}
    return [arms[0.0][seed]["step"] - arms[coeff][seed]["step"] for seed in arms[0.0]]


def _every_seed(stats, lr):
    arms = [a for a in stats["arms"] if a["arm"]["lr"] == lr and a["arm"]["wd_mode"] == "none"
            and a["arm"]["clip"] == 1.0]
    assert arms and all(len(a["diverged"]) == len(a["seeds"]) for a in arms)
    return {"coeffs": sorted(a["arm"]["coeff"] for a in arms)}


ROWS = [
    # docs/performance.md: long context (the table is the plot script's own output, from LONG_CONTEXT)
    ("docs/performance.md", "{table}", "plot_long_context", lambda m: {"table": m.table([m.DEFAULT])}),
    # README's first screen: the longest micro-batch each trains, and tokens per second at each one's best
    ("README.md", "On one H100 80GB, Megatron's `pretrain` of a 4-layer MoE with a {vocab} vocabulary, {date}",
     LONG_CONTEXT, lambda d: {"date": d["date"], "vocab": d["megatron_args"].split("--vocab-size ")[1].split()[0]}
     if "H100 80GB" in d["device"] and "--num-layers 4" in d["megatron_args"] else {}),
    ("README.md", "| Megatron's CE | {fit} tokens ({fail} fails) | {tps:.0f} |", LONG_CONTEXT,
     lambda d: {"fit": d["search"]["native"]["largest_fit"], "fail": d["search"]["native"]["smallest_failure"],
                "tps": load(THROUGHPUT)["best"]["native"]["tokens_per_s"]}),
    ("README.md", "| Megatron's fused CE (`--cross-entropy-loss-fusion`)² | {fit} tokens ({fail} fails) | {tps} (micro-batch "
     "1, no recompute: the only setting run) |", PEERS + "peers_call1.json", lambda d: _peer_row("fused")),
    ("README.md", "| Liger 0.8.5's `apply_liger_kernel_to_megatron(cross_entropy=True)`² | {fit} tokens ({fail} fails) | "
     "{tps} (micro-batch 1, no recompute: the only setting run) |", PEERS + "peers_call1.json", lambda d: _peer_row("liger")),
    ("README.md", "in torch² | none: out of memory at {tokens} with no, selective and full recompute | out of memory |",
     PEERS + "peers_call3.json", lambda d: _no_fit("z_by_hand")),
    ("README.md", "| `--lm-z-loss-coeff 1e-4` | {fit} tokens ({fail} fails) | {tps:.0f} ({r:.2f}x) |", THROUGHPUT,
     lambda d: {"fit": load(LONG_CONTEXT)["search"]["cez"]["largest_fit"],
                "fail": load(LONG_CONTEXT)["search"]["cez"]["smallest_failure"], "tps": d["best"]["cez"]["tokens_per_s"],
                "r": d["best"]["cez"]["tokens_per_s"] / d["best"]["native"]["tokens_per_s"]}),
    ("README.md", "| `+ --lm-fused-output-layer` | {fit} tokens ({fail} fails) | {tps:.0f} ({r:.2f}x) |", THROUGHPUT,
     lambda d: {"fit": load(LONG_CONTEXT)["search"]["cez_fol"]["largest_fit"],
                "fail": load(LONG_CONTEXT)["search"]["cez_fol"]["smallest_failure"],
                "tps": d["best"]["cez_fol"]["tokens_per_s"],
                "r": d["best"]["cez_fol"]["tokens_per_s"] / d["best"]["native"]["tokens_per_s"]}),
    ("README.md", "tokens/s at {tokens} per sequence, fastest setting that fits", THROUGHPUT,
     lambda d: {"tokens": d["tokens_per_sequence"]}),
    ("README.md", "(rows marked ²: {date}, commit {commit}, measured outside these sessions", PEERS + "README.md",
     lambda t: dict(zip(("date", "commit"), re.search(r"H100 80GB, (\S+), commit (\w+)\)", t).groups()))),
    ("docs/performance.md", "| `--lm-z-loss-coeff 1e-4` | micro-batch {mbs}, no recompute (micro-batch 2: 574 ms) | "
     "{step:.0f} ms | {tps:,.0f} | {ratio:.2f}x |", THROUGHPUT,
     lambda d: (lambda r: {"mbs": r["micro_batch"], "step": 2 * d["tokens_per_sequence"] / r["tokens_per_s"] * 1e3,
                           "tps": r["tokens_per_s"], "ratio": r["tokens_per_s"] / d["best"]["native"]["tokens_per_s"]})(
         d["best"]["cez"])),
    ("README.md", "dashed: the card's {gib:.1f} GiB", "bench/results/2026-12-06_h100_long_context/env.txt",
     lambda t: {"gib": int(re.search(r"H100 80GB HBM3, (\d+) MiB", t).group(1)) / 1024}),
    # README: the main job's time and its printed lines (the last ones: its z-loss run's)
    ("README.md", "the main job ran in {lo}-{hi} s after the install (60 iterations without, then with, z-loss; "
     "{runs} runs", MAIN_JOB + "wall.txt", lambda t: (lambda w: {"lo": f"{min(w):.1f}", "hi": f"{max(w):.1f}", "runs": len(w)})(
         [float(v) for v in re.findall(r"^run \d+: ([\d.]+) s$", t, re.M)])),
    ("README.md", "on a 2-core {cpu} to itself the main job ran", MAIN_JOB + "env.txt",
     lambda t: {"cpu": "Intel Xeon"} if "Intel(R) Xeon(R)" in t else {}),
    ("README.md", "On a fresh 2-core {cpu} without a GPU (Python {py}) the tests took {time}: {passed} passed, {skipped} "
     "skipped", FRESH, lambda t: dict(zip(("cpu", "py"), re.search(r"fresh 2-core (.+), no GPU, Python ([\d.]+)", t).groups()),
                                      **dict(zip(("passed", "skipped", "time"), re.search(
                                          r"(\d+) passed, (\d+) skipped in (.+)$", t, re.M).groups())))),
    ("README.md", "and the main job {s} s", FRESH, lambda t: {"s": re.search(r"main job: (\d+) s", t).group(1)}),
    *[("README.md", "{line}", MAIN_JOB_LINES, lambda t, p=pattern: {"line": re.findall(p, t, re.M)[-1]})
      for pattern in (r"^ iteration +60/ +60 \|.*$", r"^c=0: final .*$", r"^c=0\.01: final .*$")],
    # README: choosing a mitigation (its study's rows: mitigations.py)
    ("README.md", "the z-loss at 1e-4 cost no loss the seeds resolve", LONG_STATS,
     lambda s: {} if all(abs(_paired(s, lr, 1e-4)["mean"]) < _paired(s, lr, 1e-4)["ci95"] for lr in (0.1, 0.2))
     else {"missing": True}),
    # docs/z_loss_training.md: the early-warning table, every row
    *[("docs/z_loss_training.md", f"| {label} | {{warned}} / {{diverged}} | {{median}} ({{lo}}-{{hi}}) | "
       f"{{false_alarms}} / {{not_diverged}} |", LONG_STATS, lambda s, k=key, t=t: _warning(s, k, t))
      for label, key, t in [("training loss, 50-iteration mean 1 nat above its lowest", "loss_rise", 1.0),
                            ("`lm_lse` (mean log Z) >= 18", "lse", 18), ("`lm_lse` >= 16", "lse", 16),
                            ("`lm_lse_max` >= 100", "lse_max", 100), ("`lm_lse_max` >= 300", "lse_max", 300),
                            ("`lm_z_loss` >= 0.3 (c > 0 runs)", "z_loss", 0.3), ("`grad norm` >= 50", "grad_norm", 50)]],
    ("docs/z_loss_training.md", "Dated where the loss passed its initial value, `lm_lse >= 18` warned a median "
     "{median:g} iterations ahead ({min}-{max})", CLAIMS, lambda c: c["lse_18"]["lr1_dated_when_loss_passed_initial"]),
    ("docs/z_loss_training.md", "those {runs} runs' loss passed its initial value during warmup (iterations {lo}-{hi}), "
     "but the rule dates them at {rule}", CLAIMS,
     lambda c: dict(runs=c["lr1_above_init"]["runs"], lo=min(c["lr1_above_init"]["loss_passed_initial"]),
                    hi=max(c["lr1_above_init"]["loss_passed_initial"]), rule=c["lr1_above_init"]["dated_by_rule"][0])),
    ("docs/z_loss_training.md", "36 of the 37 divergences are dated by the rule's `above_init`", CLAIMS,
     lambda c: {} if (c["verdict_rules"]["above_init"], c["diverged"]) == (36, 37) else {"missing": True}),
    ("docs/z_loss_training.md", "never fired in a run that did not diverge, over the {lo}-{hi} iterations each ran",
     CLAIMS, lambda c: dict(zip(("lo", "hi"), c["quiet_runs_iterations"]))),
    ("docs/z_loss_training.md", "14.2-14.6 at c = 0, {c6} at 1e-6, {c4} at 1e-4 and {c3} at 1e-3", CLAIMS,
     lambda c: {"c6": _lse(c, "1e-06"), "c4": _lse(c, "0.0001"), "c3": _lse(c, "0.001")}
     if _lse(c, "0.0") == "14.2-14.6" else {}),
    ("docs/z_loss_training.md", "its loss reached its lowest, {low:.2f}, at iteration {at} and stayed between {a:.2f} and "
     "{b:.2f} from iteration 300; the rule dates it at {rule}", CLAIMS,
     lambda c: (lambda r: dict(low=r["lowest"], at=r["lowest_smoothed_loss_step"], a=r["smoothed_loss_300_to_2150"][0],
                               b=r["smoothed_loss_300_to_2150"][1], rule=r["verdict"]["step"]))(c["decoupled_wd_lr0.3"][0])),
    # docs/ascend.md: the self-check on GPUs (both runs on two H200s; the TP=4 run's printed line is in op_tp/)
    *[("docs/ascend.md", "TP = 4 on four H100s (2026-11-26, {ok} checks each", source,
       lambda d: {"ok": _selfcheck_ok(d)} if _selfcheck_ok(d) == len(d["results"]) else {})
      for source in ("bench/results/2026-11-26_2xh200/gpu_checks_final/selfcheck_1gpu.json",
                     "bench/results/2026-11-26_2xh200/gpu_checks_final/selfcheck_tp2.json")],
    # docs/z_loss_training.md, "In short": 1e-3 against c = 0 at learning rate 0.3, seed by seed
    ("docs/z_loss_training.md", "1e-3 diverged {lo}-{hi} iterations *earlier* than c = 0 in every seed", LONG_STATS,
     lambda s: (lambda d: {"lo": min(d), "hi": max(d)} if min(d) > 0 else {})(_earlier(s, 0.3, 0.001))),
]

# The other docs' rows, one module per topic.
from .performance import ROWS as _PERFORMANCE  # noqa: E402
from .layer import ROWS as _LAYER  # noqa: E402
from .integration import ROWS as _INTEGRATION  # noqa: E402
from .zloss import ROWS as _ZLOSS  # noqa: E402
from .mitigations import ROWS as _MITIGATIONS  # noqa: E402

ROWS += _PERFORMANCE + _LAYER + _INTEGRATION + _ZLOSS + _MITIGATIONS
