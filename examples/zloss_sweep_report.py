"""A z-loss learning-rate sweep's run folder (``zloss_lr_sweep.py``) -> ``summary.json``, PNGs and a table.

``summarize(RUN)`` reads every run's TensorBoard events back (what a user sees: ``lm loss``,
``lm_z_loss``, ``lm_lse``, ``lm_lse_max``, ``grad-norm``, ``lm loss validation``) and the first line
of its training log (the loss at initialization), into ``RUN/summary.json``. ``report(summary, DIR)``
writes from that file alone:

* ``lr_sensitivity.png``: final validation loss against the learning rate, one curve per
  coefficient (a diverged run drawn at the loss at initialization, as the paper's measure counts it);
* ``lse.png``: the mean (solid) and largest (dashed) log-sum-exp per step, at the highest learning
  rate where the run without z-loss stayed stable and at the highest one tried;
* ``loss_curves.png``: ``lm loss`` per step (dots: the validation loss), one panel per learning rate;
* ``table.md``: the numbers, and the LR sensitivity of Wortsman et al. 2023 (Section 2.2):
  the mean over the swept learning rates of ``min(final loss, loss at init) - best final loss``.

A run counts as diverged when its final validation loss is not finite or its training loss over
the last 5 % of the steps lies more than ``DIVERGED_NATS`` above the lowest it reached.

    python examples/zloss_sweep_report.py RUN [--out DIR]      # DIR default RUN/report
"""

import argparse
import json
import math
import os
import re

TAGS = ("lm loss", "lm_z_loss", "lm_lse", "lm_lse_max", "grad-norm", "lm loss validation")
DIVERGED_NATS = 1.0
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|.*?\| lm loss: ([-+\w.]+) \|")
VALIDATION = re.compile(r"validation loss at iteration (\d+) on validation set \| lm loss value: ([-+\w.]+) \|")


def read_events(tb_dir):
    """``{tag: [[step, value], ...]}`` of the TAGS in one run's TensorBoard folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not os.path.isdir(tb_dir):
        return {}
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    present = set(acc.Tags().get("scalars", []))
    return {tag: [[e.step, float(f"{e.value:.6g}")] for e in acc.Scalars(tag)] for tag in TAGS if tag in present}


def read_log(path):
    """From a run's stdout: the first logged ``lm loss`` (iteration 1: the initial weights) and the
    final validation loss as printed (a cross-check of the TensorBoard value)."""
    try:
        with open(path, errors="replace") as fh:
            text = fh.read()
    except OSError:
        return {}
    rows = [(int(i), float(v)) for i, v in ITERATION.findall(text)]
    vals = [(int(i), float(v)) for i, v in VALIDATION.findall(text)]
    return {"first_logged": rows[0] if rows else None, "last_logged": rows[-1] if rows else None,
            "validation_log": vals[-1][1] if vals else None}


def _finite(x):
    return x is not None and math.isfinite(x)


def diverged(run):
    """Not finite at the end, or the training loss of the last 5 % of the steps more than
    ``DIVERGED_NATS`` above the lowest window of that length."""
    if not _finite(run.get("final_validation")):
        return True
    losses = [v for _, v in run["series"].get("lm loss", [])]
    if not losses:  # too few steps for a logged training loss: the validation loss alone decides
        return False
    width = max(1, len(losses) // 20)
    windows = [sum(losses[i:i + width]) / width for i in range(0, len(losses) - width + 1)]
    finite = [w for w in windows if math.isfinite(w)]
    return not math.isfinite(windows[-1]) or not finite or windows[-1] > min(finite) + DIVERGED_NATS


def summarize(run_dir):
    """Read the sweep's runs back; writes and returns ``RUN/summary.json``."""
    with open(os.path.join(run_dir, "sweep.json")) as fh:
        sweep = json.load(fh)
    steps = sweep["config"]["steps"]
    runs = []
    for record in sweep["runs"]:
        series = read_events(os.path.join(run_dir, "tb", record["name"]))
        log = read_log(os.path.join(run_dir, "logs", record["name"] + ".log"))
        validation = series.get("lm loss validation", [])
        run = dict(record, series=series, **log,
                   final_validation=validation[-1][1] if validation else None,
                   last_step=max((s for s, _ in series.get("lm loss", [])), default=0))
        run["complete"] = bool(validation) and run["rc"] == 0 and not record.get("stopped_at_budget")
        run["diverged"] = diverged(run) if run["complete"] else None
        runs.append(run)
    firsts = [r["first_logged"][1] for r in runs if r.get("first_logged") and r["first_logged"][0] == 1]
    summary = {k: v for k, v in sweep.items() if k != "runs"}
    summary.update(steps=steps, init_loss=min(firsts) if firsts else None, runs=runs,
                   diverged_rule=f"final validation loss not finite, or the last 5% of the training loss "
                                 f"> {DIVERGED_NATS} nat above its lowest window of that length")
    with open(os.path.join(run_dir, "summary.json"), "w") as fh:
        json.dump(summary, fh)
    return summary


def _by_coeff(summary):
    table = {}
    for run in summary["runs"]:
        table.setdefault(run["coeff"], {})[run["lr"]] = run
    return {c: dict(sorted(v.items())) for c, v in sorted(table.items())}


def lr_sensitivity(runs_by_lr, init_loss):
    """Wortsman et al.'s LR sensitivity over the complete runs: mean of min(final, init) - best."""
    finals = [r["final_validation"] for r in runs_by_lr.values() if r["complete"]]
    if not finals or init_loss is None:
        return None
    capped = [min(f, init_loss) if _finite(f) else init_loss for f in finals]
    return sum(capped) / len(capped) - min(capped)


def highest_stable_lr(summary):
    """The highest learning rate at which the run without z-loss (else the smallest coefficient) stayed stable."""
    by_coeff = _by_coeff(summary)
    base = by_coeff[min(by_coeff)]
    stable = [lr for lr, r in base.items() if r["complete"] and not r["diverged"]]
    return max(stable) if stable else None


def _label(coeff):
    return "no z-loss (c=0)" if coeff == 0 else f"z-loss c={coeff:g}"


def _last(series, tag):
    values = series.get(tag) or []
    return values[-1][1] if values else None


def _fmt(x, spec=".3f"):
    return "-" if x is None else (format(x, spec) if math.isfinite(x) else str(x))


def table(summary):
    """The markdown table: per learning rate and coefficient, the final validation loss and the
    last logged mean / largest log-sum-exp; the LR sensitivity per coefficient."""
    by_coeff = _by_coeff(summary)
    coeffs = list(by_coeff)
    lrs = sorted({lr for runs in by_coeff.values() for lr in runs})
    init = summary.get("init_loss")
    lines = [f"Final validation loss (last logged mean lse / largest lse) after {summary['steps']} steps; "
             f"loss at initialization {_fmt(init)}; **bold**: diverged ({summary['diverged_rule']}).", "",
             "| learning rate | " + " | ".join(_label(c) for c in coeffs) + " |",
             "|---|" + "---|" * len(coeffs)]
    for lr in lrs:
        cells = []
        for c in coeffs:
            run = by_coeff[c].get(lr)
            if run is None:
                cells.append("-")
                continue
            lse = f" ({_fmt(_last(run['series'], 'lm_lse'), '.2f')} / {_fmt(_last(run['series'], 'lm_lse_max'), '.2f')})"
            value = _fmt(run["final_validation"])
            if not run["complete"]:
                value = f"incomplete (step {run['last_step']})"
            elif run["diverged"]:
                value = f"**{value}**"
            cells.append(value + lse)
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    sens = [lr_sensitivity(by_coeff[c], init) for c in coeffs]
    lines.append("| **LR sensitivity** | " + " | ".join(_fmt(s) for s in sens) + " |")
    return "\n".join(lines) + "\n"


def report(summary, out_dir):
    """Write the three PNGs and table.md into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    by_coeff = _by_coeff(summary)
    colors = {c: f"C{i}" for i, c in enumerate(by_coeff)}
    init = summary.get("init_loss")
    cfg = summary["config"]
    subtitle = (f"{cfg['layers']}-layer GPT, hidden {cfg['hidden']}, seq {cfg['seq']}, batch {cfg['micro_batch']}, "
                f"{summary['steps']} steps, vocab {cfg['vocab']}")
    paths = {}

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for c, runs in by_coeff.items():
        done = [(lr, r) for lr, r in runs.items() if r["complete"]]
        xs = [lr for lr, _ in done]
        ys = [r["final_validation"] if _finite(r["final_validation"]) and (init is None or r["final_validation"] < init)
              else init for _, r in done]
        ax.plot(xs, ys, marker="o", color=colors[c], label=_label(c))
        for (lr, r), y in zip(done, ys):
            if r["diverged"]:
                ax.plot([lr], [y], marker="x", markersize=12, color=colors[c])
    if init is not None:
        ax.axhline(init, color="gray", linestyle=":", label="loss at initialization")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final validation loss")
    ax.set_title("LR sensitivity (x: diverged)\n" + subtitle, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["lr_sensitivity"] = os.path.join(out_dir, "lr_sensitivity.png")
    fig.savefig(paths["lr_sensitivity"], dpi=110)
    plt.close(fig)

    lrs = sorted({lr for runs in by_coeff.values() for lr in runs})
    stable = highest_stable_lr(summary)
    shown = [(stable, "highest stable LR without z-loss")] if stable is not None else []
    if lrs and lrs[-1] != stable:
        shown.append((lrs[-1], "highest LR tried"))
    fig, axes = plt.subplots(1, max(1, len(shown)), figsize=(6.5 * max(1, len(shown)), 4.5), squeeze=False)
    for ax, (lr, what) in zip(axes[0], shown):
        for c, runs in by_coeff.items():
            series = runs.get(lr, {}).get("series", {})
            for tag, style in (("lm_lse", "-"), ("lm_lse_max", "--")):
                pts = series.get(tag, [])
                ax.plot([s for s, _ in pts], [v for _, v in pts], style, color=colors[c],
                        label=f"{_label(c)}, {'mean' if tag == 'lm_lse' else 'max'}")
        ax.set_title(f"log-sum-exp of the logits, LR {lr:g} ({what})", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("log Z")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    paths["lse"] = os.path.join(out_dir, "lse.png")
    fig.savefig(paths["lse"], dpi=110)
    plt.close(fig)

    cols = min(3, max(1, len(lrs)))
    rows = max(1, math.ceil(len(lrs) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, lr in zip(axes.flat, lrs):
        for c, runs in by_coeff.items():
            series = runs.get(lr, {}).get("series", {})
            pts = series.get("lm loss", [])
            ax.plot([s for s, _ in pts], [v for _, v in pts], color=colors[c], label=_label(c), linewidth=1)
            pts = series.get("lm loss validation", [])
            ax.plot([s for s, _ in pts], [v for _, v in pts], "o", color=colors[c], markersize=4)
        if init is not None:
            ax.set_ylim(top=init + 1)
        ax.set_title(f"lm loss (dots: validation), LR {lr:g}", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(lrs):]:
        ax.axis("off")
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    paths["loss_curves"] = os.path.join(out_dir, "loss_curves.png")
    fig.savefig(paths["loss_curves"], dpi=110)
    plt.close(fig)

    paths["table"] = os.path.join(out_dir, "table.md")
    with open(paths["table"], "w") as fh:
        fh.write(table(summary))
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="the sweep's run folder (sweep.json and tb/, or summary.json alone)")
    parser.add_argument("--out", default=None, help="where the PNGs and table.md go (default RUN/report)")
    args = parser.parse_args(argv)
    if os.path.isdir(os.path.join(args.run, "tb")) and os.path.exists(os.path.join(args.run, "sweep.json")):
        summary = summarize(args.run)
    else:
        with open(os.path.join(args.run, "summary.json")) as fh:
            summary = json.load(fh)
    paths = report(summary, args.out or os.path.join(args.run, "report"))
    print(table(summary))
    print("\n".join(paths.values()))


if __name__ == "__main__":
    main()
