"""Rows of the figure registry (__init__.py) for the mitigations study: README.md's "Choosing a mitigation" and
docs/mitigations.md, from bench/results/2026-12-07_h200_mitigations/ (the sweep's summary and
examples/mitigation_study.py's report of it)."""

import statistics

FOLDER = "bench/results/2026-12-07_h200_mitigations/"
REPORT = FOLDER + "report/mitigations.json"
SUMMARY = FOLDER + "study_summary.json"
ARMS = {"c = 0": "c0", "`--lm-z-loss-coeff 1e-4`": "z-loss 1e-4", "`--lm-logit-softcap 30`": "softcap",
        "`--lm-mu-centering`": "mu_centering", "`--lm-mu-loss-coeff 1e-4`": "mu_loss"}


def _cell(report, arm):
    return report["0.3"][arm]


def _p(value):
    return "-" if value is None else f"{value:.3g}"


def _table_row(report, arm):
    cell = _cell(report, arm)
    steps = sorted(cell["diverged"].values())
    return {"n": len(steps), "of": cell["decided"], "lo": steps[0], "hi": steps[-1],
            "p0": _p(cell.get("p_vs_c0")), "pz": _p(cell.get("p_vs_z-loss 1e-4"))}


def _points(run):
    return [dict(zip(run["series"]["columns"], row)) for row in run["series"]["rows"]]


def _runs(summary, mitigation):
    return [r for r in summary["runs"] if r.get("mitigation") == mitigation]


def _softcap(summary):
    """Per soft-capped run: its best loss, its highest after iteration 500, its mean over iterations 1100-1200."""
    best, high, tail = [], [], []
    for run in _runs(summary, "softcap"):
        points = _points(run)
        best.append(min(p["loss"] for p in points))
        high.append(max(p["loss"] for p in points if p["step"] > 500))
        tail.append(statistics.mean(p["loss"] for p in points if 1100 < p["step"] <= 1200))
        assert all(p["loss"] < run["init_loss"] for p in points if p["step"] > 1)  # never above its initial loss
    gap = [t - b for t, b in zip(tail, best)]
    return dict(b_lo=min(best), b_hi=max(best), h_lo=min(high), h_hi=max(high), t_lo=min(tail), t_hi=max(tail),
                g_lo=min(gap), g_hi=max(gap))


def _mu_norms(summary, mitigation):
    norms = [p["mu_norm"] for r in _runs(summary, mitigation) for p in _points(r) if p["step"] > 1]
    return min(norms), max(norms)


def _earlier(summary):
    """How many iterations earlier each mu-loss run diverged than c = 0 of its seed."""
    at = {(r.get("mitigation"), r["coeff"], r["seed"]): r["verdict"]["step"] for r in summary["runs"] if r.get("verdict")}
    return [at[(None, 0.0, s)] - at[("mu_loss", 0.0, s)] for s in range(1, 6)]


def _all_five(report, *arms):
    return {} if all(len(_cell(report, a)["diverged"]) == _cell(report, a)["decided"] == 5 for a in arms) else {
        "missing": True}


ROWS = [
    *[("docs/mitigations.md", f"| {label} | {{n}} / {{of}} ({{lo}}-{{hi}}" + ("" if arm == "softcap" else ")"),
       REPORT, lambda r, a=arm: _table_row(r, a)) for label, arm in ARMS.items()],
    *[("docs/mitigations.md", f"| {label} | {{n}} / {{of}} ({{lo}}-{{hi}}{tail} | {{p0}} / {{pz}} |", REPORT,
       lambda r, a=arm: _table_row(r, a))
      for label, arm, tail in [("`--lm-mu-centering`", "mu_centering", ")"), ("`--lm-mu-loss-coeff 1e-4`", "mu_loss", ")"),
                               ("`--lm-logit-softcap 30`", "softcap", "; the spike rule, still open at 1200)")]],
    ("docs/mitigations.md", "mu-centering held `lm_mu_norm` at {lo:.0e} to {hi:.0e}", SUMMARY,
     lambda s: dict(zip(("lo", "hi"), _mu_norms(s, "mu_centering")))),
    ("docs/mitigations.md", "mu-loss at 1e-4 left `||mu||` between {lo:.2f} and {hi:.0f} and diverged {e_lo} to {e_hi} "
     "iterations earlier than c = 0, seed by seed", SUMMARY,
     lambda s: dict(zip(("lo", "hi"), _mu_norms(s, "mu_loss")), e_lo=min(_earlier(s)), e_hi=max(_earlier(s)))),
    ("docs/mitigations.md", "their loss rose from a best of {b_lo:.2f}-{b_hi:.2f} to {h_lo:.1f}-{h_hi:.1f} around iterations",
     SUMMARY, _softcap),
    ("docs/mitigations.md", "sat at {t_lo:.2f}-{t_hi:.2f} over iterations 1100-1200", SUMMARY, _softcap),
    ("docs/mitigations.md", "3 / 5 against 5 / 5 is no evidence (p = {p:.2f})", REPORT,
     lambda r: {"p": _cell(r, "softcap")["p_vs_c0"]} if len(_cell(r, "softcap")["diverged"]) == 3 else {}),
    ("README.md", "the z-loss, mu-centering and mu-loss all diverged 5 of 5, like c = 0", REPORT,
     lambda r: _all_five(r, "c0", "z-loss 1e-4", "mu_centering", "mu_loss")),
    ("README.md", "left it stalled {g_lo:.1f}-{g_hi:.1f} nats above its best", SUMMARY, _softcap),
    ("README.md", "3 of 5 still count as diverged (p = {p:.2f})", REPORT,
     lambda r: {"p": _cell(r, "softcap")["p_vs_c0"]} if len(_cell(r, "softcap")["diverged"]) == 3 else {}),
]
