"""When a run has diverged, decided from its Megatron log lines alone, and the statistics of counting it.

The definition is fixed before the runs (the sweep stops a run as soon as it is met, the report
counts with the same function). Inputs are the log lines as Megatron prints them every
``--log-interval`` iterations (``lm loss``, ``lm_z_loss``, ``lm_lse``, ``lm_lse_max``, ``grad norm``,
``number of nan iterations``: each the interval's value as the line shows it). A run has diverged
at the first logged iteration where one of these holds:

* ``nan``: a non-finite logged value, or Megatron counted a NaN / skipped iteration (its logged
  ``lm loss`` leaves NaN iterations out, so the count is the signal);
* ``above_init``: after warmup, the training loss (the mean of the last ``SMOOTH`` log lines)
  is above the first logged loss (the loss at initialization): the run lost all it learned;
* ``spike``: the smoothed loss rises ``SPIKE_NATS`` above the lowest smoothed loss so far and does
  not come back below lowest + ``RECOVER_NATS`` within ``RECOVER_STEPS`` iterations; the
  divergence step is where it rose. A spike still unresolved when the run ends counts (the run
  ended diverged) and is flagged ``unresolved``.
"""

import math
import re

SMOOTH = 5              # log lines averaged (50 iterations at --log-interval 10)
SPIKE_NATS = 1.0
RECOVER_NATS = 0.5
RECOVER_STEPS = 1000

LINE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
FIELD = re.compile(r"\s*([A-Za-z_][\w \-()]*?):\s*([-+\w.]+)\s*$")
KEYS = {"lm loss": "loss", "lm_z_loss": "z_loss", "lm_lse": "lse", "lm_lse_max": "lse_max", "grad norm": "grad_norm",
        "learning rate": "lr", "elapsed time per iteration (ms)": "ms", "number of nan iterations": "nan_iters",
        "number of skipped iterations": "skipped_iters", "lm_mu_norm": "mu_norm"}
COLUMNS = ("step", "loss", "z_loss", "lse", "lse_max", "grad_norm", "lr", "ms", "nan_iters", "skipped_iters",
           "mu_norm")


def parse_line(line):
    """One Megatron training log line -> ``{"step", "loss", ...}`` (None for other lines)."""
    m = LINE.search(line)
    if not m:
        return None
    point = {"step": int(m.group(1)), "steps": int(m.group(2))}
    for part in m.group(3).split("|"):
        f = FIELD.match(part)
        if f and f.group(1).strip() in KEYS:
            try:
                point[KEYS[f.group(1).strip()]] = float(f.group(2))
            except ValueError:
                point[KEYS[f.group(1).strip()]] = float("nan")
    return point if "loss" in point or "nan_iters" in point else None


def parse_log(text):
    return [p for p in map(parse_line, text.splitlines()) if p]


class Divergence:
    """The rule, fed one log point at a time (the sweep's monitor and the report share it).
    ``warmup``: the warmup's iterations (``above_init`` applies after them)."""

    def __init__(self, warmup):
        self.warmup = warmup
        self.init = None
        self.window = []
        self.lowest = math.inf
        self.spike = None       # step where the smoothed loss rose SPIKE_NATS above the lowest
        self.verdict = None     # {"rule", "step", "confirmed_at"}
        self.last_step = 0

    def add(self, point):
        """Feed a point; returns the verdict once it exists (then unchanged)."""
        if self.verdict:
            return self.verdict
        step = point["step"]
        self.last_step = step
        loss = point.get("loss", float("nan"))
        values = [point.get(k) for k in ("loss", "lse", "lse_max", "z_loss", "grad_norm") if point.get(k) is not None]
        if any(not math.isfinite(v) for v in values) or point.get("nan_iters", 0) > 0 or \
                point.get("skipped_iters", 0) > 0:
            self.verdict = {"rule": "nan", "step": step, "confirmed_at": step}
            return self.verdict
        if self.init is None:
            self.init = loss
        self.window = (self.window + [loss])[-SMOOTH:]
        smooth = sum(self.window) / len(self.window)
        if step > self.warmup and len(self.window) == SMOOTH and smooth > self.init:
            self.verdict = {"rule": "above_init", "step": step, "confirmed_at": step}
            return self.verdict
        if self.spike is not None:
            if smooth < self.lowest + RECOVER_NATS:
                self.spike = None
            elif step - self.spike >= RECOVER_STEPS:
                self.verdict = {"rule": "spike", "step": self.spike, "confirmed_at": step}
                return self.verdict
        elif len(self.window) == SMOOTH and smooth > self.lowest + SPIKE_NATS:
            self.spike = step
        if len(self.window) == SMOOTH and self.spike is None:
            self.lowest = min(self.lowest, smooth)
        return None

    def final(self):
        """The verdict at the end of the run: an open spike counts (``unresolved``)."""
        if self.verdict:
            return self.verdict
        if self.spike is not None:
            return {"rule": "spike", "step": self.spike, "confirmed_at": None, "unresolved": True}
        return None


def divergence(points, warmup):
    """The verdict of a whole series (None: not diverged)."""
    rule = Divergence(warmup)
    for p in points:
        if rule.add(p):
            break
    return rule.final()


# ------------------------------------------------------------------------------------- counting
def fisher_exact(a, b, c, d):
    """Two-sided p of Fisher's exact test of the table [[a, b], [c, d]] (rows: arms; columns:
    diverged, not): the sum of the probabilities of every table with these margins no more likely
    than the observed one (R's ``fisher.test`` and scipy's convention)."""
    row1, col1, n = a + b, a + c, a + b + c + d
    total = math.comb(n, col1)

    def prob(x):
        return math.comb(row1, x) * math.comb(n - row1, col1 - x) / total

    observed = prob(a)
    lo, hi = max(0, col1 - (n - row1)), min(row1, col1)
    return min(1.0, sum(p for p in map(prob, range(lo, hi + 1)) if p <= observed * (1 + 1e-7)))


# ------------------------------------------------------------------------------------- early warning
def first_crossing(points, key, threshold, until=None):
    """The first logged step whose ``key`` is at or above ``threshold`` (before ``until``), or None."""
    for p in points:
        if until is not None and p["step"] >= until:
            return None
        v = p.get(key)
        if v is not None and (not math.isfinite(v) or v >= threshold):
            return p["step"]
    return None


def with_loss_rise(points):
    """The points with ``loss_rise``: the smoothed training loss (mean of ``SMOOTH`` log lines) minus the lowest
    smoothed loss so far, the rise a user watching the loss curve sees (the baseline the logged z-loss values
    are compared with)."""
    out, window, lowest = [], [], math.inf
    for p in points:
        window = (window + [p.get("loss", math.nan)])[-SMOOTH:]
        smooth = sum(window) / len(window)
        rise = smooth - lowest if len(window) == SMOOTH and math.isfinite(lowest) else 0.0
        if len(window) == SMOOTH and math.isfinite(smooth):
            lowest = min(lowest, smooth)
        out.append(dict(p, loss_rise=rise))
    return out


def early_warning(runs, key, threshold, skip=0):
    """A threshold rule on one logged metric over ``runs`` (``{"points", "verdict"}``): for each
    diverged run the lead (divergence step - first crossing; None: no warning before it), and the
    runs that did not diverge in which it fired (false alarms). ``skip``: the first iterations
    ignored (the loss at initialization is high everywhere)."""
    leads, alarms, quiet = [], 0, 0
    for run in runs:
        pts = [p for p in run["points"] if p["step"] > skip]
        if run["verdict"]:
            at = first_crossing(pts, key, threshold, until=run["verdict"]["step"] + 1)
            leads.append(None if at is None else run["verdict"]["step"] - at)
        elif first_crossing(pts, key, threshold) is not None:
            alarms += 1
        else:
            quiet += 1
    return {"key": key, "threshold": threshold, "leads": leads,
            "warned": sum(1 for x in leads if x is not None), "diverged": len(leads),
            "false_alarms": alarms, "not_diverged": alarms + quiet}


# ------------------------------------------------------------------------------------- a summary's runs
def run_points(run):
    """A summarized run's log points (``{"step", "loss", ...}``) from its compact columns."""
    cols = run["series"]["columns"]
    return [dict(zip(cols, row)) for row in run["series"]["rows"]]


def arm_key(run):
    """The setting a run belongs to, seeds aside."""
    key = (run["hidden"], run["wd_mode"], run.get("clip", 1.0), run.get("steps"), run["lr"], run["coeff"])
    return key + (run["mitigation"],) if run.get("mitigation") else key


def tail_loss(points, n=10, at=None):
    """The mean logged training loss of the last ``n`` log lines (100 iterations at interval 10), those up to
    iteration ``at`` when given."""
    if at is not None:
        points = [p for p in points if p["step"] <= at]
    xs = [p["loss"] for p in points[-n:] if p.get("loss") is not None]
    return sum(xs) / len(xs) if xs else None


def horizon_of(run):
    """The iteration by which a run is judged (the study's ``--horizon``; else its last iteration)."""
    return run.get("horizon") or run.get("steps") or 0


def arms(runs):
    """``{arm key: {"seeds", "diverged", "complete", "undecided", "verdicts", "later"}}``: a run counts in its
    arm once it started; it is diverged when the rule dates its divergence at or before its horizon
    (``horizon_of``), complete when it reached the horizon without that (a divergence after it is listed
    in ``later``), and otherwise (stopped by the budget first) undecided: counted in neither."""
    out = {}
    for run in runs:
        if run.get("not_started"):
            continue
        arm = out.setdefault(arm_key(run), {"seeds": [], "diverged": [], "complete": [], "undecided": [],
                                            "verdicts": {}, "later": []})
        arm["seeds"].append(run["seed"])
        horizon = horizon_of(run)
        if run.get("verdict") and run["verdict"]["step"] <= horizon:
            arm["diverged"].append(run["seed"])
            arm["verdicts"][run["seed"]] = run["verdict"]
        elif run.get("last_step", 0) >= horizon:
            arm["complete"].append(run["seed"])
            if run.get("verdict"):
                arm["later"].append(run["seed"])
        else:
            arm["undecided"].append(run["seed"])
    return out


def compare_to_zero(arm_table):
    """For every arm with c > 0 whose c = 0 arm exists: diverged / decided seeds of both and Fisher's p
    (decided: diverged or complete)."""
    rows = []
    for key, arm in sorted(arm_table.items()):
        if key[-1] == 0:
            continue
        base = arm_table.get(key[:-1] + (0.0,))
        if base is None:
            continue
        a, n1 = len(arm["diverged"]), len(arm["diverged"]) + len(arm["complete"])
        c, n0 = len(base["diverged"]), len(base["diverged"]) + len(base["complete"])
        rows.append({"arm": key, "diverged": a, "decided": n1, "diverged_c0": c, "decided_c0": n0,
                     "p": fisher_exact(a, n1 - a, c, n0 - c) if n1 and n0 else None})
    return rows
