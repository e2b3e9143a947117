"""The mitigations study's tables from the sweep's summaries: per learning rate and arm (c = 0, the z-loss,
the soft cap, mu-centering, mu-loss), the seeds that diverged by the horizon (``zloss_divergence``'s rule,
fixed before the runs), Fisher's exact test of each arm against c = 0 and against the z-loss, and the
training loss at the horizon of the runs that did not diverge, paired by seed against c = 0.

    python examples/mitigation_study.py SUMMARY.json [SUMMARY.json ...] --out DIR   # DIR/mitigations.{json,md}
"""

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zloss_divergence import fisher_exact, horizon_of, run_points, tail_loss  # noqa: E402

Z_COEFF = 1e-4
ARMS = ("c0", "z-loss 1e-4", "softcap", "mu_centering", "mu_loss")
# Student's t, two-sided 95 %, by degrees of freedom (the pairs are few)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def arm_of(run):
    """The arm's name of a study run, or None for runs of other arms."""
    if run.get("mitigation"):
        return run["mitigation"] if run["coeff"] == 0 else None
    return {0.0: "c0", Z_COEFF: "z-loss 1e-4"}.get(run["coeff"])


def judged(run):
    """``"diverged"`` (by its horizon), ``"complete"`` (reached it without) or ``"undecided"``."""
    if run.get("verdict") and run["verdict"]["step"] <= horizon_of(run):
        return "diverged"
    return "complete" if run.get("last_step", 0) >= horizon_of(run) else "undecided"


def paired_difference(arm, base):
    """Mean and 95 % half-width of ``arm - base`` over the seeds both have (``{seed: value}``)."""
    seeds = sorted(set(arm) & set(base))
    diffs = [arm[s] - base[s] for s in seeds]
    if len(diffs) < 2:
        return {"seeds": seeds, "mean": diffs[0] if diffs else None, "half_width": None}
    return {"seeds": seeds, "mean": statistics.mean(diffs),
            "half_width": T95[len(diffs) - 1] * statistics.stdev(diffs) / math.sqrt(len(diffs))}


def tables(runs):
    """``{lr: {arm: {...}}}`` with the counts, the tests and the paired losses."""
    out = {}
    for run in runs:
        arm = arm_of(run)
        if arm is None or run.get("not_started"):
            continue
        cell = out.setdefault(run["lr"], {}).setdefault(arm, {"diverged": {}, "complete": [], "undecided": [],
                                                              "loss": {}, "mu_norm": {}})
        verdict = judged(run)
        if verdict == "diverged":
            cell["diverged"][run["seed"]] = run["verdict"]["step"]
        else:
            cell[verdict].append(run["seed"])
        if verdict == "complete":
            points = run_points(run)
            cell["loss"][run["seed"]] = tail_loss(points, at=horizon_of(run))
            mus = [p["mu_norm"] for p in points if p.get("mu_norm") is not None]
            if mus:
                cell["mu_norm"][run["seed"]] = mus[-1]
    for by_arm in out.values():
        for cell in by_arm.values():
            cell["decided"] = len(cell["diverged"]) + len(cell["complete"])
        for name, cell in by_arm.items():
            decided = cell["decided"]
            for base_name in ("c0", "z-loss 1e-4"):
                base = by_arm.get(base_name)
                if base is None or name == base_name:
                    continue
                a, c = len(cell["diverged"]), len(base["diverged"])
                cell[f"p_vs_{base_name}"] = fisher_exact(a, decided - a, c, base["decided"] - c) \
                    if decided and base["decided"] else None
            if name != "c0" and "c0" in by_arm:
                cell["loss_vs_c0"] = paired_difference(cell["loss"], by_arm["c0"]["loss"])
    return out


def markdown(result, horizon):
    lines = [f"Diverged by iteration {horizon} / decided seeds (iterations where the rule dated it); Fisher's exact "
             "test (two-sided) against c = 0 and against the z-loss; training loss over the 100 iterations up to "
             "the horizon of the runs that did not diverge, paired by seed against c = 0 (95 % interval).", "",
             "| learning rate | arm | diverged | p vs c = 0 | p vs z-loss | loss at the horizon | vs c = 0 |",
             "|---|---|---|---|---|---|---|"]
    for lr in sorted(result, reverse=True):
        for arm in ARMS:
            cell = result[lr].get(arm)
            if cell is None:
                continue
            steps = sorted(cell["diverged"].values())
            where = f" ({steps[0]}-{steps[-1]})" if steps else ""
            losses = list(cell["loss"].values())
            loss = f"{statistics.mean(losses):.3f}" if losses else "-"
            pair = cell.get("loss_vs_c0") or {}
            vs = "-" if pair.get("mean") is None else (
                f"{pair['mean']:+.3f}" + (f" ± {pair['half_width']:.3f}" if pair.get("half_width") else "")
                + f" ({len(pair['seeds'])} pairs)")

            def p(key):
                return "-" if cell.get(key) is None else f"{cell[key]:.3g}"

            undecided = f", {len(cell['undecided'])} undecided" if cell["undecided"] else ""
            lines.append(f"| {lr:g} | {arm} | {len(cell['diverged'])} / {cell['decided']}{where}{undecided} | "
                         f"{p('p_vs_c0')} | {p('p_vs_z-loss 1e-4')} | {loss} | {vs} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summaries", nargs="+", help="the sweep's summary.json files (one per device call)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    runs, horizons = [], set()
    for path in args.summaries:
        with open(path) as fh:
            summary = json.load(fh)
        runs += summary["runs"]
        horizons.update(horizon_of(r) for r in summary["runs"])
    result = tables(runs)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mitigations.json"), "w") as fh:
        json.dump({str(lr): cells for lr, cells in result.items()}, fh, indent=1, sort_keys=True)
    text = markdown(result, "/".join(str(h) for h in sorted(horizons)))
    with open(os.path.join(args.out, "mitigations.md"), "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
