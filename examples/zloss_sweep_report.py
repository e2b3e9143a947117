"""The z-loss sweeps' run folders (``zloss_lr_sweep.py``) -> ``summary.json``, statistics with intervals, plots, tables.

``summarize(RUN)`` reads every run's TensorBoard events back (what a user sees: ``lm loss``,
``lm_z_loss``, ``lm_lse``, ``lm_lse_max``, ``grad-norm``, ``lm loss validation``, written at every
iteration) and its training log, into ``RUN/summary.json``: per run its settings, how it ended
(complete, stopped by the time budget, never started, failed), the final validation loss and
aggregates taken at full resolution (the largest ``lm_lse_max`` of the run, the means of the last
100 steps), and the series every ``SERIES_EVERY`` steps (``RUN/series_full.json.gz``: every step).

``report([summary, ...], DIR)`` writes from those files alone, pooling the phases:

* ``stats.json`` / ``tables.md``: per (width, weight decay, learning rate, coefficient) the mean
  over seeds and its 95 % interval (Student t); the paired differences against c = 0 (same seed:
  the same initial weights and data order) with their 95 % intervals; the LR sensitivity of
  Wortsman et al. 2023 (Section 2.2: mean over the learning rates of min(final loss, loss at
  init) - the best final loss) per seed, its mean and interval per coefficient, and the paired
  difference against c = 0; the same-seed rerun's differences (the run-to-run nondeterminism).
* ``lr_sensitivity.png``: the final validation loss as the paired difference from c = 0 per
  learning rate (the absolute losses on a zoomed axis beside it);
* ``coeff_sweep.png``: the difference from c = 0 against the coefficient at the best learning rate;
* ``lse.png``: the largest ``lm_lse_max`` of each run and the mean ``lm_lse`` of the last 100 steps;
* ``widths_wd.png``: the wider models and the weight-decay arms, difference c = 1e-4 minus c = 0;
* ``lse_curves.png``: ``lm_lse`` / ``lm_lse_max`` per step at the highest learning rate, per width.

A complete run counts as diverged when its final validation loss is not finite or its training loss
over the last 5 % of the steps lies more than ``DIVERGED_NATS`` above the lowest it reached. An LR
sensitivity needs every learning rate of its seed complete; one that lacks a run is listed as
incomplete, never computed from fewer learning rates.

    python examples/zloss_sweep_report.py RUN_OR_SUMMARY [...] [--out DIR]     # DIR default FIRST/report
"""

import argparse
import concurrent.futures
import gzip
import importlib.util
import json
import math
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TAGS = ("lm loss", "lm_z_loss", "lm_lse", "lm_lse_max", "grad-norm", "lm loss validation")
DIVERGED_NATS = 1.0
LAST = 100  # steps averaged at the end of a run
SERIES_EVERY = 10
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|.*?\| lm loss: ([-+\w.]+) \|")
VALIDATION = re.compile(r"validation loss at iteration (\d+) on validation set \| lm loss value: ([-+\w.]+) \|")
# two-sided 95 % Student t quantiles by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t95(df):
    return T95.get(df) or T95[max(k for k in T95 if k <= df)]


def interval(values):
    """``{"n", "mean", "ci95"}`` of the finite values: the mean and the half-width of its 95 % interval
    (None with one value)."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return {"n": 0, "mean": None, "ci95": None}
    half = t95(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None
    return {"n": len(xs), "mean": statistics.fmean(xs), "ci95": half}


def read_events(tb_dir):
    """``{tag: [[step, value], ...]}`` of the TAGS in one run's TensorBoard folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not os.path.isdir(tb_dir):
        return {}
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    present = set(acc.Tags().get("scalars", []))
    return {tag: [[e.step, float(e.value)] for e in acc.Scalars(tag)] for tag in TAGS if tag in present}


def read_log(path):
    """From a run's stdout: the first and last logged ``lm loss`` and the final validation loss as
    printed (a cross-check of the TensorBoard value)."""
    try:
        with open(path, errors="replace") as fh:
            text = fh.read()
    except OSError:
        return {}
    rows = [(int(i), float(v)) for i, v in ITERATION.findall(text)]
    vals = [(int(i), float(v)) for i, v in VALIDATION.findall(text)]
    return {"first_logged": rows[0] if rows else None, "last_logged": rows[-1] if rows else None,
            "validation_log": vals[-1][1] if vals else None, "validation_log_step": vals[-1][0] if vals else None}


def _finite(x):
    return x is not None and math.isfinite(x)


def diverged(run):
    """Not finite at the end, or the training loss of the last 5 % of the steps more than
    ``DIVERGED_NATS`` above the lowest window of that length."""
    if not _finite(run.get("final_validation")):
        return True
    losses = [v for _, v in run["series"].get("lm loss", [])]
    if not losses:
        return False
    width = max(1, len(losses) // 20)
    windows = [sum(losses[i:i + width]) / width for i in range(0, len(losses) - width + 1)]
    finite = [w for w in windows if math.isfinite(w)]
    return not math.isfinite(windows[-1]) or not finite or windows[-1] > min(finite) + DIVERGED_NATS


def _tail_mean(points, last_step, n=LAST):
    xs = [v for s, v in points if s > last_step - n]
    return statistics.fmean(xs) if xs else None


def aggregates(series, steps):
    """Full-resolution numbers of one run: the largest lse of the run, the last 100 steps' means."""
    lse, lse_max = series.get("lm_lse", []), series.get("lm_lse_max", [])
    means = dict(map(tuple, lse))
    gaps = [(s, v - means[s]) for s, v in lse_max if s in means]
    finite_max = [v for _, v in lse_max if math.isfinite(v)]
    return {
        "lse_max_run": max(finite_max) if finite_max else None,
        "lse_max_run_step": max(lse_max, key=lambda p: p[1] if math.isfinite(p[1]) else -1e30)[0] if lse_max else None,
        "lse_min_mean": min((v for _, v in lse), default=None),
        "lse_first": lse[0][1] if lse else None,
        "lse_last100": _tail_mean(lse, steps), "lse_max_last100": _tail_mean(lse_max, steps),
        "gap_last100": _tail_mean(gaps, steps),
        "train_loss_last100": _tail_mean(series.get("lm loss", []), steps),
        "z_loss_last100": _tail_mean(series.get("lm_z_loss", []), steps),
        "grad_norm_max": max((v for _, v in series.get("grad-norm", []) if math.isfinite(v)), default=None),
        "tb_points": {tag: len(v) for tag, v in series.items()},
    }


def summarize(run_dir):
    """Read one phase's runs back; writes and returns ``RUN/summary.json`` (and ``series_full.json.gz``)."""
    with open(os.path.join(run_dir, "sweep.json")) as fh:
        sweep = json.load(fh)
    steps = sweep["config"]["steps"]
    runs, full = [], {}
    folders = [os.path.join(run_dir, "tb", record["name"]) for record in sweep["runs"]]
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        events = list(pool.map(read_events, folders))
    for record, series in zip(sweep["runs"], events):
        log = read_log(os.path.join(run_dir, "logs", record["name"] + ".log"))
        validation = series.get("lm loss validation", [])
        # the validation loss after the last step from TensorBoard, else as the log printed it (no tensorboard)
        run_steps = record.get("steps") or steps
        if validation:
            final, final_step = validation[-1][1], validation[-1][0]
        else:
            final, final_step = log.get("validation_log"), log.get("validation_log_step")
        final = final if final_step == run_steps else None
        run = dict(record, **log, final_validation=final, steps=run_steps,
                   last_step=max((s for s, _ in series.get("lm loss", [])), default=0),
                   init_loss=dict(map(tuple, series.get("lm loss", []))).get(1))
        # complete: validated after its last step; a run stopped by the budget while it exited counts too
        run["complete"] = final is not None and (run.get("rc") == 0 or bool(record.get("stopped_at_budget")))
        run["status"] = ("complete (stopped while exiting)" if run["complete"] and record.get("stopped_at_budget")
                         else "complete" if run["complete"]
                         else f"stopped at the budget (step {run['last_step']})" if record.get("stopped_at_budget")
                         else "not started" if record.get("not_started") else f"failed (rc {run.get('rc')})")
        run["series"] = series
        run["diverged"] = diverged(run) if run["complete"] else None
        run["agg"] = aggregates(series, run["last_step"] or steps)
        full[record["name"]] = series
        run["series"] = {tag: [p for p in pts if p[0] % SERIES_EVERY == 0 or p[0] == 1 or tag == "lm loss validation"]
                         for tag, pts in series.items()}
        runs.append(run)
    summary = {k: v for k, v in sweep.items() if k != "runs"}
    summary.update(steps=steps, runs=runs, series_every=SERIES_EVERY,
                   diverged_rule=f"final validation loss not finite, or the last 5% of the training loss "
                                 f"> {DIVERGED_NATS} nat above its lowest window of that length")
    with open(os.path.join(run_dir, "summary.json"), "w") as fh:
        json.dump(summary, fh)
    with gzip.open(os.path.join(run_dir, "series_full.json.gz"), "wt") as fh:
        json.dump(full, fh)
    return summary


def _compact(x):
    return x if x is None or not math.isfinite(x) else float(f"{x:.5g}")


def summarize_logs(run_dir):
    """The long runs (pilot / study) from their logs alone: per run its settings, how it ended, the
    divergence verdict (zloss_divergence.py, the rule the sweep stopped runs by), the final validation
    loss when it got there, and every log line's values as columns (``series``: step, loss, z_loss,
    lse, lse_max, grad_norm, lr, nan_iters). Writes and returns ``RUN/summary.json``."""
    from zloss_divergence import COLUMNS, divergence, parse_log

    with open(os.path.join(run_dir, "sweep.json")) as fh:
        sweep = json.load(fh)
    warmup_fraction = sweep.get("warmup_fraction", 0.05)
    runs = []
    for record in sweep["runs"]:
        try:
            with open(os.path.join(run_dir, "logs", record["name"] + ".log"), errors="replace") as fh:
                text = fh.read()
        except OSError:
            text = ""
        points = parse_log(text)
        steps = record.get("steps") or sweep["config"]["steps"]
        verdict = divergence(points, max(1, int(steps * warmup_fraction)))
        vals = [(int(i), float(v)) for i, v in VALIDATION.findall(text)]
        last = points[-1]["step"] if points else 0
        run = dict(record, steps=steps, last_step=last, verdict=verdict, diverged=verdict is not None,
                   horizon=sweep["config"].get("horizon") or steps,
                   init_loss=points[0].get("loss") if points else None,
                   final_validation=vals[-1][1] if vals and vals[-1][0] == steps else None)
        run["status"] = ("diverged (stopped)" if record.get("stopped_diverged") else
                         "diverged" if verdict else "complete" if run["final_validation"] is not None else
                         f"stopped at the budget (step {last})" if record.get("stopped_at_budget") else
                         "not started" if record.get("not_started") else f"failed (rc {record.get('rc')})")
        cols = [c for c in COLUMNS if any(c in p for p in points)]
        run["series"] = {"columns": cols, "rows": [[_compact(p.get(c)) if c != "step" else p["step"] for c in cols]
                                                   for p in points]}
        runs.append(run)
    summary = {k: v for k, v in sweep.items() if k != "runs"}
    from zloss_divergence import RECOVER_NATS, RECOVER_STEPS, SMOOTH, SPIKE_NATS

    summary.update(runs=runs, divergence_rule=dict(smooth_log_lines=SMOOTH, spike_nats=SPIKE_NATS,
                                                   recover_nats=RECOVER_NATS, recover_steps=RECOVER_STEPS))
    with open(os.path.join(run_dir, "summary.json"), "w") as fh:
        json.dump(summary, fh, separators=(",", ":"))
    return summary


# ------------------------------------------------------------------------------------- statistics
def pool(summaries):
    """Every run of the phases, each tagged with its phase. A run that did not complete in one phase
    and did in a later one counts once, as completed (the later phase reran it). Runs shorter than
    their phase's steps form arms of their own (``wd_mode`` "none, 500 steps")."""
    runs = []
    for summary in summaries:
        for run in summary["runs"]:
            run = dict(run, phase=summary.get("phase"))
            if run.get("steps") and run["steps"] != summary["steps"]:
                run["wd_mode"] = f"{run['wd_mode']}, {run['steps']} steps"
            runs.append(run)
    completed = {r["name"] for r in runs if r.get("complete")}
    kept, seen = [], set()
    for run in reversed(runs):  # the last complete run of a name wins
        if run["name"] in seen or (not run.get("complete") and run["name"] in completed):
            continue
        seen.add(run["name"])
        kept.append(run)
    return kept[::-1]


def cell_key(run):
    return (run["hidden"], run["wd_mode"], run["lr"], run["coeff"])


def cells(runs, value=lambda r: r["final_validation"]):
    """``{(hidden, wd_mode, lr, coeff): {seed: value}}`` of the complete runs (reruns left out)."""
    table = {}
    for run in runs:
        if run.get("complete") and not run.get("rerun"):
            table.setdefault(cell_key(run), {})[run["seed"]] = value(run)
    return table


def paired(table, key, base=0.0):
    """The paired differences (cell minus the same cell at c = base, seed by seed) and their interval."""
    hidden, wd_mode, lr, coeff = key
    other = table.get((hidden, wd_mode, lr, base), {})
    diffs = [table[key][s] - other[s] for s in sorted(table[key]) if s in other
             and _finite(table[key][s]) and _finite(other[s])]
    return dict(interval(diffs), diffs=diffs)


def lr_sensitivity(by_lr, init, lrs):
    """Wortsman et al.'s LR sensitivity of one seed over ``lrs``: mean of min(final, init) - the best;
    None unless every learning rate has a complete run."""
    if init is None or any(lr not in by_lr for lr in lrs):
        return None
    capped = [min(by_lr[lr], init) if _finite(by_lr[lr]) else init for lr in lrs]
    return sum(capped) / len(capped) - min(capped)


def sensitivities(runs, hidden, wd_mode, lrs, coeffs):
    """Per coefficient: the sensitivity of each seed over ``lrs``, their interval, the paired
    difference against c = 0, and the seeds left out for lack of a complete run."""
    table = cells(runs)
    inits = [r["init_loss"] for r in runs if r.get("init_loss") is not None and r["hidden"] == hidden]
    init = min(inits) if inits else None
    out = {}
    seeds = sorted({r["seed"] for r in runs if r["hidden"] == hidden and r["wd_mode"] == wd_mode})
    per_seed = {}
    for c in coeffs:
        values, missing = {}, []
        for s in seeds:
            by_lr = {lr: table[(hidden, wd_mode, lr, c)][s] for lr in lrs if s in table.get((hidden, wd_mode, lr, c), {})}
            v = lr_sensitivity(by_lr, init, lrs)
            if v is None:
                if any(r["seed"] == s and cell_key(r) == (hidden, wd_mode, r["lr"], c) and r["lr"] in lrs
                       and not r.get("rerun") for r in runs):
                    missing.append(s)  # planned, but some learning rate's run did not complete
            else:
                values[s] = v
        per_seed[c] = values
        out[c] = dict(interval(list(values.values())), per_seed=values, incomplete_seeds=missing)
    for c in coeffs:
        base = per_seed.get(0.0, {})
        diffs = [per_seed[c][s] - base[s] for s in per_seed[c] if s in base]
        out[c]["minus_c0"] = dict(interval(diffs), diffs=diffs) if c != 0.0 else None
    return {"hidden": hidden, "wd_mode": wd_mode, "lrs": lrs, "init_loss": init, "by_coeff": out}


def swept(runs, hidden, wd_mode):
    """The learning rates and coefficients of a group's LR sweep: the coefficients planned at two or more
    learning rates, and the learning rates where every one of them was planned (whatever became of the runs)."""
    planned = {}
    for r in runs:
        if (r["hidden"], r["wd_mode"]) == (hidden, wd_mode) and not r.get("rerun"):
            planned.setdefault(r["coeff"], set()).add(r["lr"])
    coeffs = sorted(c for c, lrs in planned.items() if len(lrs) > 1)
    lrs = sorted(set.intersection(*(planned[c] for c in coeffs))) if coeffs else []
    return lrs, coeffs


def nondeterminism(runs):
    """The same-seed reruns against their originals: the differences of the final numbers."""
    out = []
    by_name = {r["name"]: r for r in runs}
    for run in runs:
        if not run.get("rerun"):
            continue
        original = by_name.get(run["name"].replace("_rerun", ""))
        if not original or not (run.get("complete") and original.get("complete")):
            out.append({"run": run["name"], "status": run.get("status"), "original": original and original.get("status")})
            continue
        out.append({"run": run["name"],
                    "final_validation": [original["final_validation"], run["final_validation"]],
                    "final_validation_diff": run["final_validation"] - original["final_validation"],
                    "lse_max_run_diff": _sub(run["agg"]["lse_max_run"], original["agg"]["lse_max_run"]),
                    "lse_last100_diff": _sub(run["agg"]["lse_last100"], original["agg"]["lse_last100"]),
                    "step1_loss_equal": run.get("init_loss") == original.get("init_loss")})
    return out


def _sub(a, b):
    return None if a is None or b is None else a - b


def statistics_of(runs):
    """Everything the tables and the docs quote, from the pooled runs."""
    keys = sorted({cell_key(r) for r in runs})
    metrics = {
        "final_validation": lambda r: r["final_validation"],
        "lse_max_run": lambda r: r["agg"]["lse_max_run"],
        "lse_last100": lambda r: r["agg"]["lse_last100"],
        "gap_last100": lambda r: r["agg"]["gap_last100"],
    }
    tables = {m: cells(runs, f) for m, f in metrics.items()}
    per_cell = []
    for key in keys:
        hidden, wd_mode, lr, coeff = key
        row = {"hidden": hidden, "wd_mode": wd_mode, "lr": lr, "coeff": coeff}
        for m in metrics:
            if key in tables[m]:
                row[m] = interval(list(tables[m][key].values()))
                row[m]["per_seed"] = tables[m][key]
                if coeff != 0.0:
                    row[m + "_minus_c0"] = paired(tables[m], key)
        row["runs"] = {r["name"]: r["status"] for r in runs if cell_key(r) == key}
        row["diverged"] = sorted(r["name"] for r in runs if cell_key(r) == key and r.get("diverged"))
        per_cell.append(row)
    groups = sorted({(r["hidden"], r["wd_mode"]) for r in runs})
    sens = []
    for hidden, wd_mode in groups:
        lrs, coeffs = swept(runs, hidden, wd_mode)
        if len(lrs) > 1 and coeffs:
            sens.append(sensitivities(runs, hidden, wd_mode, lrs, coeffs))
    # the wider models and the weight-decay arms cover fewer learning rates: hidden 256 without weight decay over
    # the same ones, for comparison
    for hidden, wd_mode in groups:
        if (hidden, wd_mode) == (256, "none"):
            continue
        lrs, coeffs = swept(runs, hidden, wd_mode)
        base_lrs, base_coeffs = swept(runs, 256, "none")
        coeffs = [c for c in coeffs if c in base_coeffs]
        done = {(tuple(e["lrs"]), tuple(e["by_coeff"])) for e in sens if e.get("compare_with")}
        if len(lrs) > 1 and set(lrs) <= set(base_lrs) and coeffs and (tuple(lrs), tuple(coeffs)) not in done:
            entry = sensitivities(runs, 256, "none", lrs, coeffs)
            entry["compare_with"] = [hidden, wd_mode]
            sens.append(entry)
    best = {}
    for hidden, wd_mode in groups:
        c0 = [row for row in per_cell if (row["hidden"], row["wd_mode"], row["coeff"]) == (hidden, wd_mode, 0.0)
              and row.get("final_validation", {}).get("mean") is not None]
        if c0:
            top = min(c0, key=lambda row: row["final_validation"]["mean"])
            best[f"{hidden}/{wd_mode}"] = top["lr"]
    status = {}
    for r in runs:
        status[r["status"]] = status.get(r["status"], 0) + 1
    return {"cells": per_cell, "lr_sensitivity": sens, "nondeterminism": nondeterminism(runs),
            "best_lr_c0": best, "run_status": status,
            "not_complete": sorted(f"{r['name']}: {r['status']}" for r in runs if not r.get("complete")),
            "diverged": sorted(r["name"] for r in runs if r.get("diverged"))}


# ------------------------------------------------------------------------------------------ tables
def _fmt(x, spec=".3f"):
    return "-" if x is None else (format(x, spec) if math.isfinite(x) else str(x))


def _ci(iv, spec=".3f"):
    if not iv or iv.get("mean") is None:
        return "-"
    if iv.get("ci95") is None:
        return f"{_fmt(iv['mean'], spec)} (n=1)"
    return f"{_fmt(iv['mean'], spec)} ± {_fmt(iv['ci95'], spec)}"


def _label(coeff):
    return "c=0" if coeff == 0 else f"c={coeff:g}"


def _learning_rate_axes(axes):
    """Each axis: the learning rate on a log scale, a light grid, the legend."""
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def tables_md(stats, summaries):
    env = [s.get("environment", {}) for s in summaries]
    lines = ["# The z-loss sweeps: numbers", ""]
    for s, e in zip(summaries, env):
        lines.append(f"- phase {s.get('phase')}: {len(s['runs'])} runs, {s['steps']} steps, "
                     f"{', '.join(sorted(set(e.get('gpus') or ['CPU'])))} x {max(1, s.get('gpus', 0))}, commit "
                     f"{e.get('commit')}, {e.get('date_utc')} UTC, torch {e.get('torch')}, megatron-core "
                     f"{e.get('megatron-core')}, wall {s.get('wall_s')} s of a {s.get('budget_s')} s budget")
    lines += ["", "Mean over seeds ± the half-width of its 95 % interval (Student t); `minus c=0`: the paired "
              "difference from the same seed at c = 0. Runs not complete: "
              + (", ".join(stats["not_complete"]) or "none") + ". Diverged: " + (", ".join(stats["diverged"]) or "none")
              + ".", ""]
    groups = sorted({(c["hidden"], c["wd_mode"]) for c in stats["cells"]})
    for hidden, wd_mode in groups:
        rows = [c for c in stats["cells"] if (c["hidden"], c["wd_mode"]) == (hidden, wd_mode)]
        lines += [f"## hidden {hidden}, weight decay: {wd_mode}", "",
                  "| LR | c | seeds | final val. loss | minus c=0 | largest lse_max | minus c=0 | lse, last 100 | "
                  "lse_max - lse, last 100 |", "|---|---|---|---|---|---|---|---|---|"]
        for c in sorted(rows, key=lambda c: (c["lr"], c["coeff"])):
            fv = c.get("final_validation")
            lines.append(f"| {c['lr']:g} | {c['coeff']:g} | {fv['n'] if fv else 0} | {_ci(fv)} | "
                         f"{_ci(c.get('final_validation_minus_c0'))} | {_ci(c.get('lse_max_run'), '.1f')} | "
                         f"{_ci(c.get('lse_max_run_minus_c0'), '.1f')} | {_ci(c.get('lse_last100'), '.2f')} | "
                         f"{_ci(c.get('gap_last100'), '.2f')} |")
        lines.append("")
    lines += ["## LR sensitivity (Wortsman et al. 2023), per seed then over seeds", "",
              "| hidden | weight decay | learning rates | c | seeds | sensitivity | minus c=0 | incomplete seeds |",
              "|---|---|---|---|---|---|---|---|"]
    for entry in stats["lr_sensitivity"]:
        for c, v in entry["by_coeff"].items():
            what = f"{entry['hidden']}" + (" (compare)" if entry.get("compare_with") else "")
            lines.append(f"| {what} | {entry['wd_mode']} | {', '.join(f'{lr:g}' for lr in entry['lrs'])} | {c:g} | "
                         f"{v['n']} | {_ci(v)} | {_ci(v.get('minus_c0'))} | {v['incomplete_seeds'] or '-'} |")
    lines += ["", "## Same-seed reruns (run-to-run nondeterminism)", ""]
    for r in stats["nondeterminism"]:
        lines.append(f"- {r['run']}: " + (f"final validation {r['final_validation'][0]:.4f} vs "
                                          f"{r['final_validation'][1]:.4f} (diff {r['final_validation_diff']:+.4f}); "
                                          f"largest lse_max diff {_fmt(r['lse_max_run_diff'], '+.2f')}; last-100 lse "
                                          f"diff {_fmt(r['lse_last100_diff'], '+.3f')}"
                                          if "final_validation" in r else f"{r['status']} / original {r['original']}"))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- plots
def report(summaries, out_dir):
    """Write stats.json, tables.md and the PNGs into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    runs = pool(summaries)
    stats = statistics_of(runs)
    paths = {"stats": os.path.join(out_dir, "stats.json"), "tables": os.path.join(out_dir, "tables.md")}
    with open(paths["stats"], "w") as fh:
        json.dump(stats, fh, indent=1)
    with open(paths["tables"], "w") as fh:
        fh.write(tables_md(stats, summaries))
    cfg = summaries[0]["config"]
    subtitle = (f"{cfg['layers']}-layer GPT, seq {cfg['seq']}, batch {cfg['micro_batch']}, "
                f"{summaries[0]['steps']} steps; mean over seeds, bars: 95 % interval")
    cell = {(c["hidden"], c["wd_mode"], c["lr"], c["coeff"]): c for c in stats["cells"]}
    base_coeffs = sorted({k[3] for k in cell if k[:2] == (cfg["hidden"], "none")})
    main_lrs = sorted({k[2] for k in cell if k[:2] == (cfg["hidden"], "none")})

    def errorbar(ax, xs, ivs, shift=0, **kw):
        """Means with their 95 % bars; ``shift`` moves a curve sideways (x 1.06^shift) so bars do not overlap."""
        pts = [(x * 1.06 ** shift, iv) for x, iv in zip(xs, ivs) if iv and iv.get("mean") is not None]
        if pts:
            ax.errorbar([x for x, _ in pts], [iv["mean"] for _, iv in pts],
                        yerr=[iv["ci95"] or 0 for _, iv in pts], capsize=3, marker="o", **kw)

    # LR sensitivity: the paired difference per learning rate, the absolute loss zoomed beside it
    main_coeffs = [c for c in base_coeffs if any(cell.get((cfg["hidden"], "none", lr, c), {}).get("final_validation",
                                                   {}).get("n", 0) > 1 for lr in main_lrs)]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5), gridspec_kw={"width_ratios": [0.6, 1, 1]})
    sens = next((e for e in stats["lr_sensitivity"] if (e["hidden"], e["wd_mode"]) == (cfg["hidden"], "none")
                 and not e.get("compare_with")), None)
    if sens:  # the LR sensitivity itself: every seed a dot, the mean and its 95 % interval beside them
        for i, (c, v) in enumerate(sorted(sens["by_coeff"].items())):
            seeds = sorted(v["per_seed"].items())
            axes[0].scatter([i - 0.1] * len(seeds), [x for _, x in seeds], color=f"C{i}", s=16)
            if v["mean"] is not None:
                axes[0].errorbar([i + 0.1], [v["mean"]], yerr=[v["ci95"] or 0], color=f"C{i}", marker="o", capsize=3)
        axes[0].set_xticks(range(len(sens["by_coeff"])))
        axes[0].set_xticklabels([f"{_label(c)}\n{v['n']} seeds" for c, v in sorted(sens["by_coeff"].items())],
                                fontsize=8)
        axes[0].set_ylabel("LR sensitivity (nats): dots per seed, mean and 95 % interval")
        axes[0].set_title(f"over LR {', '.join(f'{lr:g}' for lr in sens['lrs'])}", fontsize=8)
        axes[0].grid(alpha=0.3)
    for i, c in enumerate(main_coeffs):
        rows = [cell.get((cfg["hidden"], "none", lr, c), {}) for lr in main_lrs]
        n = sorted({(r.get("final_validation") or {}).get("n", 0) for r in rows} - {0})
        errorbar(axes[2], main_lrs, [r.get("final_validation") for r in rows], shift=i - 1, color=f"C{i}",
                 label=f"{_label(c)} ({'/'.join(map(str, n))} seeds)")
        if c != 0.0:
            errorbar(axes[1], main_lrs, [r.get("final_validation_minus_c0") for r in rows], shift=i - 1.5,
                     color=f"C{i}", label=f"{_label(c)} minus c=0 ({'/'.join(map(str, n))} seeds)")
    axes[1].axhline(0, color="gray", linewidth=1)
    axes[1].set_ylabel("final validation loss, paired difference from c=0 (nats)")
    axes[2].set_ylabel("final validation loss (zoomed)")
    _learning_rate_axes(axes[1:])
    fig.suptitle(f"hidden {cfg['hidden']}, no weight decay: {subtitle}", fontsize=9)
    fig.tight_layout()
    paths["lr_sensitivity"] = os.path.join(out_dir, "lr_sensitivity.png")
    fig.savefig(paths["lr_sensitivity"], dpi=110)
    plt.close(fig)

    # the coefficient sweep at the best learning rate
    best_lr = next((s.get("best_lr") for s in summaries if s.get("best_lr")), None)
    if best_lr is not None:
        coeffs = sorted(k[3] for k in cell if k[:3] == (cfg["hidden"], "none", best_lr) and k[3] > 0)
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        diffs = [cell[(cfg["hidden"], "none", best_lr, c)].get("final_validation_minus_c0") for c in coeffs]
        errorbar(ax, coeffs, diffs, color="C0")
        for c, d in zip(coeffs, diffs):
            if d and d.get("mean") is not None:
                ax.annotate(f"{d['n']} seeds", (c, d["mean"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.axhline(0, color="gray", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("z-loss coefficient c")
        ax.set_ylabel("final validation loss minus c=0 (paired, nats)")
        ax.set_title(f"coefficient sweep at LR {best_lr:g}, hidden {cfg['hidden']}\n{subtitle}", fontsize=9)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths["coeff_sweep"] = os.path.join(out_dir, "coeff_sweep.png")
        fig.savefig(paths["coeff_sweep"], dpi=110)
        plt.close(fig)

    # log Z: the largest lse_max of the run and the mean lse of the last 100 steps
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, c in enumerate(main_coeffs):
        rows = [cell.get((cfg["hidden"], "none", lr, c), {}) for lr in main_lrs]
        n = sorted({(r.get("lse_max_run") or {}).get("n", 0) for r in rows} - {0})
        for lr, r in zip(main_lrs, rows):  # a maximum is skewed: every seed's value, no symmetric bar
            vals = list((r.get("lse_max_run") or {}).get("per_seed", {}).values())
            axes[0].scatter([lr * 1.06 ** (i - 1)] * len(vals), vals, color=f"C{i}", s=14,
                            label=f"{_label(c)} ({'/'.join(map(str, n))} seeds)" if lr == main_lrs[0] else None)
        errorbar(axes[1], main_lrs, [r.get("lse_last100") for r in rows], shift=i - 1, color=f"C{i}",
                 label=f"{_label(c)} ({'/'.join(map(str, n))} seeds)")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("largest lm_lse_max of the run (each seed)")
    axes[1].set_ylabel("mean lm_lse, last 100 steps")
    _learning_rate_axes(axes)
    fig.suptitle(f"log-sum-exp of the logits, hidden {cfg['hidden']}: {subtitle}", fontsize=9)
    fig.tight_layout()
    paths["lse"] = os.path.join(out_dir, "lse.png")
    fig.savefig(paths["lse"], dpi=110)
    plt.close(fig)

    # widths and weight-decay arms: c = 1e-4 minus c = 0 per learning rate, and the c = 0 loss
    arms = sorted({k[:2] for k in cell if k[:2] != (cfg["hidden"], "none")})
    if arms:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for i, arm in enumerate([(cfg["hidden"], "none")] + arms):
            lrs = sorted({k[2] for k in cell if k[:2] == arm})
            n = max((cell.get((*arm, lr, 0.0), {}).get("final_validation") or {}).get("n", 0) for lr in lrs)
            wd, _, steps = arm[1].partition(", ")
            label = (f"hidden {arm[0]}" + ("" if wd == "none" else f", {wd} wd") + f", {steps or str(cfg['steps']) + ' steps'}"
                     + f", {n} seed{'s' if n != 1 else ''}")
            errorbar(axes[0], lrs, [cell.get((*arm, lr, 1e-4), {}).get("final_validation_minus_c0") for lr in lrs],
                     shift=i - len(arms) / 2, color=f"C{i}", label=label)
            errorbar(axes[1], lrs, [cell.get((*arm, lr, 0.0), {}).get("final_validation") for lr in lrs],
                     shift=i - len(arms) / 2, color=f"C{i}", label=label)
        axes[0].axhline(0, color="gray", linewidth=1)
        axes[0].set_ylabel("final validation loss, c=1e-4 minus c=0 (paired)")
        axes[1].set_ylabel("final validation loss at c=0")
        _learning_rate_axes(axes)
        fig.suptitle("wider models and weight decay (one seed: no bars; steps and seeds in the legend): "
                     + f"{cfg['layers']}-layer GPT, seq {cfg['seq']}, batch {cfg['micro_batch']}", fontsize=9)
        fig.tight_layout()
        paths["widths_wd"] = os.path.join(out_dir, "widths_wd.png")
        fig.savefig(paths["widths_wd"], dpi=110)
        plt.close(fig)

    # lse per step at the highest learning rate, per width, first seed
    widths = sorted({r["hidden"] for r in runs})
    top = max(r["lr"] for r in runs)
    fig, axes = plt.subplots(1, len(widths), figsize=(6 * len(widths), 4.2), squeeze=False)
    for ax, hidden in zip(axes[0], widths):
        chosen = [r for r in runs if r["hidden"] == hidden and r["wd_mode"].split(",")[0] == "none" and r["lr"] == top
                  and not r.get("rerun") and r["series"]]
        longest = max((r.get("steps") or 0 for r in chosen), default=0)
        chosen = [r for r in chosen if (r.get("steps") or 0) == longest]  # the longest runs of that width
        seed = min((r["seed"] for r in chosen), default=None)
        for i, r in enumerate(sorted((r for r in chosen if r["seed"] == seed), key=lambda r: r["coeff"])):
            for tag, style in (("lm_lse", "-"), ("lm_lse_max", "--")):
                pts = r["series"].get(tag, [])
                ax.plot([s for s, _ in pts], [v for _, v in pts], style, color=f"C{i}", linewidth=1,
                        label=f"{_label(r['coeff'])}, {'mean' if tag == 'lm_lse' else 'max'}")
        steps = max((r["last_step"] for r in chosen if r["seed"] == seed), default=0)
        ax.set_title(f"hidden {hidden}, LR {top:g}, seed {seed}, {steps} steps, no weight decay", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("log Z")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths["lse_curves"] = os.path.join(out_dir, "lse_curves.png")
    fig.savefig(paths["lse_curves"], dpi=110)
    plt.close(fig)
    return paths


# ------------------------------------------------------------------------------------- the long runs
WARNING_GRID = {"loss_rise": [0.5, 1.0, 1.5, 2.0], "lse_max": [20, 30, 40, 50, 60, 80, 100, 150, 200, 300], "lse": [12, 13, 14, 15, 16, 18, 20, 25, 30],
                "z_loss": [0.03, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0], "grad_norm": [1, 2, 3, 5, 10, 20, 50]}


def pooled_long_runs(summaries):
    """The started runs of the summaries with their log points; a run of the same setting and seed in a
    later summary replaces the earlier one (the study repeats a pilot run that the budget cut)."""
    import zloss_divergence as zd

    runs = {}
    for summary in summaries:
        for run in summary["runs"]:
            if run.get("not_started"):
                continue
            pts = zd.run_points(run)
            finite = [p.get("lse_max") for p in pts if p.get("lse_max") is not None and math.isfinite(p["lse_max"])]
            runs[(zd.arm_key(run), run["seed"])] = dict(
                {k: v for k, v in run.items() if k != "series"}, phase=summary.get("phase"), points=pts,
                tail_loss=(zd.tail_loss(pts, at=zd.horizon_of(run)) if pts and pts[-1]["step"] >= zd.horizon_of(run)
                           and not (run.get("verdict") and run["verdict"]["step"] <= zd.horizon_of(run))
                           else None),
                lse_max_run=max(finite) if finite else None, lse_last=pts[-1].get("lse") if pts else None,
                last_loss=zd.tail_loss(pts) if pts else None)
    return list(runs.values())


def long_statistics(summaries):
    """The long runs (pilot, study) pooled: per run its outcome, per arm the diverged seeds and Fisher's
    test against c = 0, the paired final losses against c = 0, and the early-warning rules."""
    import zloss_divergence as zd

    runs = pooled_long_runs(summaries)
    table = zd.arms(runs)
    arms = [{"arm": dict(zip(("hidden", "wd_mode", "clip", "steps", "lr", "coeff"), key)),
             **{k: v for k, v in arm.items() if k != "verdicts"},
             "verdicts": {str(s): v for s, v in arm["verdicts"].items()}} for key, arm in sorted(table.items())]
    fisher = [dict(row, arm=dict(zip(("hidden", "wd_mode", "clip", "steps", "lr", "coeff"), row["arm"])))
              for row in zd.compare_to_zero(table)]
    by = {(zd.arm_key(r), r["seed"]): r for r in runs}
    paired_rows = []
    for key in sorted(table):
        if key[-1] == 0:
            continue
        for what in ("tail_loss", "final_validation"):
            diffs = {}
            for seed in table[key]["seeds"]:
                a, b = by.get((key, seed)), by.get((key[:-1] + (0.0,), seed))
                if a and b and a.get(what) is not None and b.get(what) is not None:
                    diffs[seed] = a[what] - b[what]
            if diffs:
                paired_rows.append({"arm": dict(zip(("hidden", "wd_mode", "clip", "steps", "lr", "coeff"), key)),
                                    "value": what, **interval(list(diffs.values())), "per_seed": diffs})
    # every run that logged: a diverged one (whenever) gives the lead, one that did not a false alarm or not, over
    # the iterations it ran (``observed``: how many a non-diverged run had for a false alarm to fire)
    logged = [r for r in runs if r["points"]]
    warnings = {key: [zd.early_warning([{"points": zd.with_loss_rise(r["points"]), "verdict": r.get("verdict")}
                                        for r in logged
                                        if key != "z_loss" or r["coeff"] > 0], key, t, skip=100) for t in grid]
                for key, grid in WARNING_GRID.items()}
    observed = sorted(r["last_step"] for r in logged if not r.get("verdict"))
    return {"runs": [{k: v for k, v in r.items() if k != "points"} for r in runs], "arms": arms, "fisher": fisher,
            "paired": paired_rows, "early_warning": warnings, "not_diverged_iterations": observed}


def _arm_label(arm):
    clip = "no clip" if arm["clip"] != 1.0 else "clip 1"
    return (f"h{arm['hidden']}, wd {arm['wd_mode']}, {clip}, {arm['steps']} steps, LR {arm['lr']:g}, "
            f"c = {arm['coeff']:g}")


def long_tables_md(stats):
    lines = ["## Diverged seeds per arm (the rule: examples/zloss_divergence.py), judged at each run's horizon", "",
             "| arm | seeds started | diverged by the horizon | reached it, not diverged (diverged later) | "
             "stopped by the budget before it | rules (seed: rule @ step) |", "|---|---|---|---|---|---|"]
    for arm in stats["arms"]:
        rules = ", ".join(f"{s}: {v['rule']} @ {v['step']}" for s, v in arm["verdicts"].items())
        later = f" ({len(arm['later'])})" if arm.get("later") else ""
        lines.append(f"| {_arm_label(arm['arm'])} | {len(arm['seeds'])} | {len(arm['diverged'])} | "
                     f"{len(arm['complete'])}{later} | {len(arm['undecided'])} | {rules} |")
    lines += ["", "## Fisher's exact test against c = 0 (two-sided; decided seeds only)", "",
              "| arm | diverged / decided | c = 0: diverged / decided | p |", "|---|---|---|---|"]
    for row in stats["fisher"]:
        p = "" if row["p"] is None else f"{row['p']:.3g}"
        lines.append(f"| {_arm_label(row['arm'])} | {row['diverged']} / {row['decided']} | "
                     f"{row['diverged_c0']} / {row['decided_c0']} | {p} |")
    lines += ["", "## Paired differences against c = 0 (same seed; runs that neither diverged nor were cut)", "",
              "| arm | value | seeds | mean difference | 95 % interval half-width |", "|---|---|---|---|---|"]
    for row in stats["paired"]:
        lines.append(f"| {_arm_label(row['arm'])} | {row['value']} | {row['n']} | {_fmt(row['mean'], '+.3f')} | "
                     f"{_fmt(row['ci95'], '.3f') if row['ci95'] is not None else '(one seed)'} |")
    lines += ["", "## Early warning: a threshold on one logged value (first 100 iterations ignored)", "",
              "Every run that logged: a diverged one gives the steps between the first log line at or above the "
              "threshold and its divergence; one that did not diverge (iterations it ran: "
              + ", ".join(map(str, stats.get("not_diverged_iterations", []))) + ") a false alarm if it ever crossed.", "",
              "| value | threshold | diverged runs warned | steps ahead (each) | runs not diverged where it fired |",
              "|---|---|---|---|---|"]
    for key, rows in stats["early_warning"].items():
        for row in rows:
            lines.append(f"| {key} | {row['threshold']:g} | {row['warned']} / {row['diverged']} | "
                         f"{', '.join('-' if x is None else str(x) for x in row['leads'])} | "
                         f"{row['false_alarms']} / {row['not_diverged']} |")
    lines += ["", "## Runs", "", "| run | phase | status | last step | steps/s | GPU (MPS) | train loss, last 100 | "
              "final val. loss | largest lm_lse_max | last lm_lse |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in stats["runs"]:
        lines.append(f"| {r['name']} | {r['phase']} | {r['status']} | {r.get('last_step')} | {r.get('steps_per_s')} | "
                     f"{r.get('gpu')} ({'on' if r.get('mps') else 'off'}) | {_fmt(r.get('tail_loss'))} | "
                     f"{_fmt(r.get('final_validation'))} | {_fmt(r.get('lse_max_run'), '.1f')} | "
                     f"{_fmt(r.get('lse_last'), '.2f')} |")
    return "\n".join(lines) + "\n"


def report_long(summaries, out_dir, setting=None):
    """``long_stats.json``, ``long_tables.md`` and ``divergence.png`` of the long runs. ``setting``:
    (hidden, wd_mode, clip, steps) of the plot (default: the study's, else the pilot's most common)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import zloss_divergence as zd

    os.makedirs(out_dir, exist_ok=True)
    stats = long_statistics(summaries)
    with open(os.path.join(out_dir, "long_stats.json"), "w") as fh:
        json.dump(stats, fh, indent=1)
    with open(os.path.join(out_dir, "long_tables.md"), "w") as fh:
        fh.write(long_tables_md(stats))
    pooled = pooled_long_runs(summaries)
    points = {r["name"] + r["phase"]: r["points"] for r in pooled}
    runs = stats["runs"]
    if setting is None:
        study = [r for r in runs if r["phase"] == "study"] or runs
        keys = [(r["hidden"], r["wd_mode"], r.get("clip", 1.0), r["steps"]) for r in study]
        setting = max(set(keys), key=keys.count)
    runs = [r for r in runs if (r["hidden"], r["wd_mode"], r.get("clip", 1.0), r["steps"]) == tuple(setting)]
    coeffs = sorted({r["coeff"] for r in runs})
    colors = {c: plt.cm.viridis(i / max(1, len(coeffs) - 1)) for i, c in enumerate(coeffs)}
    lrs = sorted({r["lr"] for r in runs})
    top = lrs[-2:]
    fig = plt.figure(figsize=(11, 11), constrained_layout=True)
    grid = fig.add_gridspec(3, max(1, len(top)))
    ax = fig.add_subplot(grid[0, :])
    init = [r["init_loss"] for r in runs if r.get("init_loss")]
    lo, threshold = (min(init), max(init)) if init else (math.log(32768), math.log(32768))
    # the rule compares each run with its own loss at initialization: a band over the seeds' values
    ax.axhspan(lo, threshold, color="red", alpha=0.25, lw=0,
               label=f"loss at initialization, each seed's own ({lo:.2f}-{threshold:.2f}): a run above its own diverged")
    for i, c in enumerate(coeffs):
        shift = 1 + 0.06 * (i - (len(coeffs) - 1) / 2)
        mine = [r for r in runs if r["coeff"] == c]
        ok = [r for r in mine if r.get("tail_loss") is not None]
        bad = [r for r in mine if r.get("verdict") and r["verdict"]["step"] <= zd.horizon_of(r)]
        cut = [dict(r, tail_loss=r["last_loss"]) for r in mine if r.get("tail_loss") is None and r not in bad
               and r.get("last_loss") is not None]
        n = {lr: sum(1 for r in mine if r["lr"] == lr) for lr in lrs}
        ax.scatter([r["lr"] * shift for r in ok], [r["tail_loss"] for r in ok], color=colors[c], s=18,
                   label=f"c = {c:g} ({', '.join(f'{n[lr]}' for lr in lrs)} seeds by LR)")
        ax.scatter([r["lr"] * shift for r in cut], [r["tail_loss"] for r in cut], facecolors="none",
                   edgecolors=[colors[c]], s=18)
        ax.scatter([r["lr"] * shift for r in bad], [threshold + 0.3 + 0.15 * (r["seed"] % 5) for r in bad], marker="x",
                   color=colors[c], s=30)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    horizons = {}
    for r in runs:
        horizons.setdefault(zd.horizon_of(r), set()).add(r["phase"])
    horizon = min(horizons)
    judged = "; ".join(f"{'/'.join(sorted(ph))} runs judged at iteration {h}" for h, ph in sorted(horizons.items()))
    ax.set_ylabel("training loss, the 100 iterations up to\nthe iteration a run is judged at")
    ax.set_title(f"hidden {setting[0]}, weight decay {setting[1]}, clip {setting[2]:g}, a {setting[3]}-iteration schedule; "
                 f"{judged}\nevery seed (open: stopped by the time budget before it, at its last "
                 "loss; x above the band: diverged by then)", fontsize=8)
    ax.legend(fontsize=7)
    for col, lr in enumerate(top):
        ax_loss, ax_lse = fig.add_subplot(grid[1, col]), fig.add_subplot(grid[2, col])
        for r in runs:
            if r["lr"] != lr:
                continue
            pts = points[r["name"] + r["phase"]]
            steps = [p["step"] for p in pts]
            ax_loss.plot(steps, [p.get("loss") for p in pts], color=colors[r["coeff"]], lw=0.7, alpha=0.8)
            ax_lse.plot(steps, [p.get("lse") for p in pts], color=colors[r["coeff"]], lw=0.7, alpha=0.8)
        ax_loss.axhspan(lo, threshold, color="red", alpha=0.25, lw=0)
        ax_loss.set_ylim(0, threshold + 2)  # a diverged run's loss in the hundreds would flatten the rest
        ax_loss.set_title(f"LR {lr:g}: training loss (log line, every 10 iterations)", fontsize=9)
        if horizon < setting[3]:  # the study's horizon (the pilot's runs are judged at their end)
            ax_loss.axvline(horizon, color="gray", lw=0.8, ls=":")
            ax_lse.axvline(horizon, color="gray", lw=0.8, ls=":")
        ax_lse.set_title(f"LR {lr:g}: mean log Z (lm_lse)", fontsize=9)
        ax_lse.set_xlabel("iteration")
    path = os.path.join(out_dir, "divergence.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"stats": os.path.join(out_dir, "long_stats.json"), "tables": os.path.join(out_dir, "long_tables.md"),
            "plot": path}


def load(run):
    """A run folder's summary (summarized now when its TensorBoard events are there), or a summary file."""
    if os.path.isfile(run):
        with open(run) as fh:
            return json.load(fh)
    if os.path.isdir(os.path.join(run, "tb")) and os.path.exists(os.path.join(run, "sweep.json")):
        return summarize(run)
    with open(os.path.join(run, "summary.json")) as fh:
        return json.load(fh)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="the phases' run folders (sweep.json and tb/, or summary.json alone), "
                                               "or their summary files")
    parser.add_argument("--out", default=None, help="where the PNGs and tables go (default FIRST_RUN/report)")
    args = parser.parse_args(argv)
    summaries = [load(run) for run in args.runs]
    first = args.runs[0] if os.path.isdir(args.runs[0]) else os.path.dirname(os.path.abspath(args.runs[0]))
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit('zloss_sweep_report.py needs: pip install ".[sweep]" (missing: matplotlib)')
    if all(s.get("phase") in ("pilot", "study") for s in summaries):
        paths = report_long(summaries, args.out or os.path.join(first, "report"))
    else:
        paths = report(summaries, args.out or os.path.join(first, "report"))
    print("\n".join(paths.values()))


if __name__ == "__main__":
    main()
