"""The figures docs/z_loss_training.md and the README quote about the divergence pilot and study, recomputed
from the raw summaries (every run's log lines) and printed as JSON.

    python examples/zloss_claims.py > bench/results/2026-11-28_zloss_study_4xh200/claims.json

Reads bench/results/2026-11-28_zloss_pilot_4xh200/pilot_summary.json and
bench/results/2026-11-28_zloss_study_4xh200/study_summary.json (pooled as the report pools them: the study's run
replaces the pilot's of the same setting and seed) and uses the report's own rules (examples/zloss_divergence.py).
"""
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import zloss_divergence as zd  # noqa: E402
import zloss_sweep_report as report  # noqa: E402

RESULTS = os.path.join(HERE, "..", "bench", "results")
PILOT = os.path.join(RESULTS, "2026-11-28_zloss_pilot_4xh200", "pilot_summary.json")
STUDY = os.path.join(RESULTS, "2026-11-28_zloss_study_4xh200", "study_summary.json")


def smoothed(points):
    out, window = [], []
    for p in points:
        window = (window + [p.get("loss", float("nan"))])[-zd.SMOOTH:]
        if len(window) == zd.SMOOTH:
            out.append((p["step"], sum(window) / zd.SMOOTH))
    return out


def passed_initial(run):
    """The first logged step (after 100) whose smoothed loss is above the run's initial loss, warmup or not."""
    for step, loss in smoothed(run["points"]):
        if step > 100 and loss > run["init_loss"]:
            return step
    return None


def lead_summary(leads):
    got = [x for x in leads if x is not None]
    return {"warned": len(got), "of": len(leads), "median": statistics.median(got) if got else None,
            "min": min(got) if got else None, "max": max(got) if got else None}


def claims(summaries):
    runs = [r for r in report.pooled_long_runs(summaries) if r["points"]]
    div = [r for r in runs if r.get("verdict")]
    quiet = [r for r in runs if not r.get("verdict")]
    out = {"runs": len(runs), "diverged": len(div), "not_diverged": len(quiet),
           "verdict_rules": {rule: sum(1 for r in div if r["verdict"]["rule"] == rule)
                             for rule in sorted({r["verdict"]["rule"] for r in div})}}

    def rule_leads(key, threshold, date):
        leads = []
        for r in div:
            at = zd.first_crossing([p for p in zd.with_loss_rise(r["points"]) if p["step"] > 100], key, threshold,
                                   until=date(r) + 1)
            leads.append(None if at is None else date(r) - at)
        alarms = sum(1 for r in quiet if zd.first_crossing([p for p in zd.with_loss_rise(r["points"])
                                                               if p["step"] > 100], key, threshold) is not None)
        return dict(lead_summary(leads), false_alarms=alarms, quiet=len(quiet))

    by_rule = lambda r: r["verdict"]["step"]  # noqa: E731

    def redated(r):
        if r["lr"] == 1.0 and r["verdict"]["rule"] == "above_init":
            return passed_initial(r) or r["verdict"]["step"]
        return r["verdict"]["step"]

    lr1 = [r for r in div if r["lr"] == 1.0 and r["verdict"]["rule"] == "above_init"]
    out["lr1_above_init"] = {"runs": len(lr1), "dated_by_rule": sorted({r["verdict"]["step"] for r in lr1}),
                             "loss_passed_initial": sorted(passed_initial(r) for r in lr1 if passed_initial(r))}
    out["lse_18"] = {"as_dated_by_rule": rule_leads("lse", 18, by_rule),
                     "lr1_dated_when_loss_passed_initial": rule_leads("lse", 18, redated)}
    out["loss_rise_1"] = rule_leads("loss_rise", 1.0, by_rule)
    out["quiet_runs_max_lr"] = max(r["lr"] for r in quiet)
    out["quiet_runs_iterations"] = [min(r["last_step"] for r in quiet), max(r["last_step"] for r in quiet)]
    out["initial_loss_range"] = [min(r["init_loss"] for r in runs), max(r["init_loss"] for r in runs)]
    dec = [r for r in runs if r["wd_mode"] == "decoupled" and r["lr"] == 0.3]
    out["decoupled_wd_lr0.3"] = []
    for r in dec:
        sm = smoothed(r["points"])
        low_step, low = min(sm, key=lambda x: x[1])
        rise = [s for s, v in sm if s > low_step and v > low + zd.SPIKE_NATS]
        out["decoupled_wd_lr0.3"].append({"seed": r["seed"], "verdict": r["verdict"], "lowest_smoothed_loss_step": low_step,
                                          "lowest": round(low, 3), "first_step_1_nat_above_lowest": rise[0] if rise else None,
                                          "largest_jump_between_log_lines_at": max(
                                              zip(r["points"][1:], r["points"]),
                                              key=lambda ab: ab[0]["loss"] - ab[1]["loss"])[0]["step"],
                                          "smoothed_loss_300_to_2150": [round(min(v for s, v in sm if 300 <= s <= 2150), 2),
                                                                        round(max(v for s, v in sm if 300 <= s <= 2150), 2)],
                                          "last_step": r["last_step"]})
    lse4000 = {}
    for r in runs:
        if r["lr"] == 0.2 and r["phase"] == "study":
            pts = [p["lse"] for p in r["points"] if 3900 < p["step"] <= 4000 and p.get("lse") is not None]
            if len(pts) == 10:  # the 100 iterations up to 4000 (10 log lines)
                lse4000.setdefault(str(r["coeff"]), []).append(sum(pts) / len(pts))
    out["lm_lse_iters_3901_4000_lr0.2"] = {c: {"min": round(min(v), 2), "max": round(max(v), 2),
                                              "median": round(statistics.median(v), 2), "seeds": len(v)}
                                          for c, v in sorted(lse4000.items())}
    # learning rate 0.1: the lines where the mean log Z went below 0 lack `lm_lse` (Megatron prints a metric only
    # when its interval mean is >= 0); the mean is over the lines present
    lse01, missing = {}, {}
    for r in runs:
        if r["lr"] == 0.1 and r["phase"] == "study":
            pts = [p["lse"] for p in r["points"] if 3900 < p["step"] <= 4000 and p.get("lse") is not None]
            lse01.setdefault(str(r["coeff"]), []).append(sum(pts) / len(pts))
            m = missing.setdefault(str(r["coeff"]), {"lines": 0, "without_lse": 0})
            m["lines"] += len(r["points"])
            m["without_lse"] += sum(1 for p in r["points"] if p.get("lse") is None)
    out["lm_lse_iters_3901_4000_lr0.1"] = {c: {"min": round(min(v), 2), "max": round(max(v), 2), "seeds": len(v)}
                                          for c, v in sorted(lse01.items())}
    out["log_lines_without_lm_lse_lr0.1"] = dict(sorted(missing.items()))
    lse_max = {}
    for r in runs:
        if r["lr"] == 0.2 and r["phase"] == "study":
            lse_max.setdefault(str(r["coeff"]), []).append(
                max(p["lse_max"] for p in r["points"] if p["step"] <= 4000 and p.get("lse_max") is not None))
    out["lm_lse_max_to_4000_lr0.2"] = {c: {"min": min(v), "max": max(v), "seeds": len(v)}
                                      for c, v in sorted(lse_max.items())}
    first = [r["points"][0].get("lse") for r in runs if r["points"] and r["points"][0].get("lse") is not None]
    out["lm_lse_first_log_line"] = [round(min(first), 2), round(max(first), 2)]
    out["valid_tokens"] = {s.get("phase"): s.get("valid_tokens") for s in summaries}
    return out


def main():
    summaries = [json.load(open(p)) for p in (PILOT, STUDY)]
    print(json.dumps(claims(summaries), indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
