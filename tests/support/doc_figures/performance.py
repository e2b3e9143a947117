"""Where each figure quoted in docs/performance.md and bench/README.md comes from: rows as in __init__.py.

A row needing a second results file beside its source reads it with ``load``. Rounding is half up on the
printed digits (``half_up``).
"""
import re
import statistics

from .results_files import half_up, load

R = "bench/results/"
PERF, BENCH = "docs/performance.md", "bench/README.md"
LONG_CONTEXT = R + "2026-12-06_h100_long_context/long_context.json"
THROUGHPUT = R + "2026-12-06_h100_long_context/throughput.json"
LAYER = R + "2026-11-28_2xh200/defer_layer_tp2/layer.md"
LAYER_TP2 = R + "2026-11-28_2xh200/defer_layer_tp2/layer_tp2.md"
BREAKDOWN = R + "2026-11-28_4xh200/final/breakdown.md"
PROFILE = R + "2026-11-28_4xh200/call1_profile/breakdown.md"  # the GEMMs alone, before the last block's deferral
TP1, TP1_REP3 = R + "2026-11-26_h100_tp12/tp1/e2e/e2e_busy.json", R + "2026-11-26_h100_tp12/tp1/e2e_rep3/e2e_busy.json"
TP2, TP2_REP3 = (R + "2026-11-26_h100_tp12/tp2/e2e/e2e_busy_tp2.json",
                 R + "2026-11-26_h100_tp12/tp2/e2e_rep3/e2e_busy_tp2.json")
TP4, TP4_M2 = (R + "2026-11-26_4xh100/e2e_busy_tp4/machine1/e2e_busy_tp4_tp4.json",
               R + "2026-11-26_4xh100/e2e_busy_tp4/machine2/e2e_busy_tp4_tp4.json")
AB = R + "2026-11-28_2xh200/e2e_ab_tp1/"
BUSY = R + "2026-11-24_h100/e2e_busy/"
TRANSFORMS = R + "2026-11-25_h100/fused_layer/e2e_transforms/e2e_busy_rep{}.json"
SHAPES5 = ["8192x4096x151936", "8192x4096x37984", "32768x4096x151936", "16384x4096x75968", "8192x7168x16160"]


def _s(x, places=0):  # signed
    return ("+" if x >= 0 else "") + half_up(x, places)


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(text):
    """Every Markdown table in ``text``: a list of rows, each a dict by header."""
    lines, tables = text.splitlines(), []
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.match(r"\|\s*-{3}", lines[i + 1]) and not re.match(r"\|\s*-{3}", line):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(_cells(line), _cells(row))))
            tables.append(rows)
    return tables


def _table(text, column):
    return next(t for t in _tables(text) if t and column in t[0])


def _rows(table, **match):
    return [r for r in table if all(r.get(k) == v for k, v in match.items())]


def _shape(s):
    return s.replace("x", " x ")


def _arg(args, flag):  # the last value given to a Megatron flag (later flags override)
    tokens = args.split() if isinstance(args, str) else args
    return tokens[len(tokens) - 1 - tokens[::-1].index(flag) + 1]


# --- the 2026-12-06 long-context runs ---

def _step36(row):  # throughput.json: the median of iterations 3-6
    return statistics.median(ms for i, ms in row["step_ms"].items() if int(i) >= 3)


def _setting(d, variant, micro_batch, recompute):
    return next(r for r in d["rows"] if (r["variant"], r["micro_batch"], r["recompute"]) ==
                (variant, micro_batch, recompute))


def _long_config(d):
    a = d["megatron_args"]
    return {"date": d["date"], "mcore": d["stack"].split("megatron-core ")[1].split(",")[0],
            "layers": _arg(a, "--num-layers"), "hidden": _arg(a, "--hidden-size"), "experts": _arg(a, "--num-experts"),
            "topk": _arg(a, "--moe-router-topk"), "ffn": _arg(a, "--moe-ffn-hidden-size"),
            "vocab": _arg(a, "--vocab-size")} if "H100 80GB" in d["device"] and "--bf16" in a else {}


def _long_steps(d):
    """Every memory row at micro-batch 1, full recompute; 4 logged iterations below the size from which 2."""
    rows = [r for r in d["rows"] if r["rc"] == 0]
    two = min(r["tokens_per_micro_batch"] for r in rows if len(r["step_ms"]) == 2)
    ok = all((len(r["step_ms"]) == 4) == (r["tokens_per_micro_batch"] < two) for r in rows) and all(
        (r["micro_batch"], r["recompute"]) == (1, "full") for r in d["rows"])
    resolution = {s["resolution"] for s in d["search"].values() if s["resolution"]}  # None: bracketed by hand
    return {"two": two, "res": resolution.pop()} if ok and len(resolution) == 1 else {}


def _longest(d):
    s = d["search"]
    fol = next(r for r in d["rows"] if r["variant"] == "cez_fol" and r["tokens_per_micro_batch"] ==
               s["cez_fol"]["largest_fit"])
    step_s = sorted(fol["step_ms"].items())[-1][1] / 1000
    return {"native": s["native"]["largest_fit"], "cez": s["cez"]["largest_fit"], "fol": s["cez_fol"]["largest_fit"],
            "rc": f"{s['cez']['largest_fit'] / s['native']['largest_fit']:g}",
            "rf": f"{s['cez_fol']['largest_fit'] / s['native']['largest_fit']:g}",
            "fail": s["cez_fol"]["smallest_failure"], "over": int(step_s // 10 * 10)} \
        if s["cez_fol"]["smallest_failure"] and s["cez_fol"]["resolution"] is None else {}


PEERS = R + "2026-12-07_h100_peers/peers_call1.json"
PEER_NAMES = {"native": "Megatron's CE",
              "fused": "Megatron's fused CE (`--cross-entropy-loss-fusion --cross-entropy-fusion-impl native`)",
              "liger": "Liger 0.8.5, `apply_liger_kernel_to_megatron(rms_norm=False, cross_entropy=True)`",
              "cez": "`--lm-z-loss-coeff 1e-4`", "cez_fol": "`+ --lm-fused-output-layer`"}


def _peer(runs, variant):
    """The peers' call at 32768 tokens, micro-batch 1, no recompute: upper median of steps 3-6, peak, tokens/s."""
    r = next(r for r in runs if r["run"] == f"{variant}:32768:1:none:6")
    step = statistics.median_high(r["steps_ms"][str(i)] for i in range(3, 7))  # as the call computed it
    assert r["tokens_per_s"] == round(2 * 32768 / step * 1e3)
    return {"name": PEER_NAMES[variant], "step": f"{step:.1f}", "peak": half_up(r["peak_bytes"] / 2 ** 30, 1),
            "tps": r["tokens_per_s"]}


def _peer_ratios(runs):
    tps = {v: _peer(runs, v)["tps"] for v in ("fused", "liger", "cez")}
    return {"liger": half_up(tps["cez"] / tps["liger"], 2), "fused": half_up(tps["cez"] / tps["fused"], 2)}


def _estimates(m):
    """estimate_memory.py's longest micro-batch on an H100 80GB for the long and deep configs."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(m.__file__)))
    from e2e_megatron import COMMON, CONFIGS

    card = 81559 * 2 ** 20
    out = {"p": m.WORKSPACE // 2 ** 30, "usable": round(m.USABLE * 100), **{k: v for k, v in m.LOGIT_BYTES.items()}}
    for config in ("long", "deep"):
        model = m.Model.from_megatron_args(COMMON + CONFIGS[config])
        out.update({f"{config}_{v}": m.longest_tokens(model, v, card) for v in ("native", "cez", "cez_fol")})
        out[config + "_params"] = f"{model.parameters_per_rank() / 1e9:.2f}"
    out.update(r_cez=f"{out['deep_cez'] / out['deep_native']:.1f}", r_fol=f"{out['deep_cez_fol'] / out['deep_native']:.1f}")
    return out


def _per_token(d):
    """The fused layer's peak grows by the transformer's activations: its slope between the two longest sizes."""
    (t1, m1), (t2, m2) = sorted((r["tokens_per_micro_batch"], r["peak_allocated_bytes"]) for r in d["rows"]
                                if r["variant"] == "cez_fol" and r["rc"] == 0)[-2:]
    return {"kib": half_up((m2 - m1) / (t2 - t1) / 1024)}


def _fol_vs_op(m):
    """Where both ran, the fused layer's step over the op's, as the plot script reads the steps."""
    _, rows = m.load([m.DEFAULT])
    at = {(r["tokens_per_micro_batch"], r["variant"]): r for r in rows if r["rc"] == 0}
    both = sorted(t for t, v in at if v == "cez" and (t, "cez_fol") in at)
    diff = {t: (m.step_ms(at[t, "cez_fol"]) / m.step_ms(at[t, "cez"]) - 1) * 100 for t in both}
    same = [t for t in both if at[t, "cez"]["source"] == at[t, "cez_fol"]["source"]]
    earlier = [t for t in both if "baseline" in at[t, "cez"]["source"]]
    if len(same) != 2 or len(earlier) != 1:
        return {}
    return {"within": half_up(max(abs(x) for x in diff.values()), 1), "t1": same[0], "d1": _s(diff[same[0]], 1),
            "t2": same[1], "d2": _s(diff[same[1]], 1), "t3": earlier[0], "d3": _s(diff[earlier[0]], 1)}


def _throughput_native(d):
    best = d["best"]["native"]
    mb2 = [_setting(d, "native", 2, rc) for rc in ("none", "selective", "full")]
    if not (mb2[0]["out_of_memory"] and mb2[1]["out_of_memory"] and mb2[2]["rc"] == 0 and best["recompute"] == "none"):
        return {}
    return {"mb": best["micro_batch"], "mb2": half_up(_step36(mb2[2])),
            "step": half_up(2 * d["tokens_per_sequence"] / best["tokens_per_s"] * 1e3), "tps": f"{best['tokens_per_s']:,.0f}"}


def _throughput_fol(d):
    best, ref = d["best"]["cez_fol"], d["best"]["native"]["tokens_per_s"]
    return {"mb": best["micro_batch"], "mb1": half_up(_step36(_setting(d, "cez_fol", 1, "none"))),
            "step": half_up(d["global_batch"] * d["tokens_per_sequence"] / best["tokens_per_s"] * 1e3),
            "tps": f"{best['tokens_per_s']:,.0f}", "ratio": half_up(best["tokens_per_s"] / ref, 2)}


def _throughput_gain(d):
    op, ce = d["best"]["cez"], d["best"]["native"]
    if (op["micro_batch"], op["recompute"]) != (ce["micro_batch"], ce["recompute"]) or _throughput_native(d) == {}:
        return {}
    ms = lambda b: d["global_batch"] * d["tokens_per_sequence"] / b["tokens_per_s"] * 1e3  # noqa: E731
    return {"more": half_up((op["tokens_per_s"] / ce["tokens_per_s"] - 1) * 100),
            "shorter": half_up((1 - ms(op) / ms(ce)) * 100), "op": half_up(ms(op)), "ce": half_up(ms(ce))}


# --- the op ---

def _graph_replay(text, mode):
    rows = _rows(_table(text, "graph replay ms (/ floor)"), mode=mode)
    ratios = [float(re.search(r"\(([\d.]+)\)", r["graph replay ms (/ floor)"]).group(1)) for r in rows]
    return {"lo": half_up(min(ratios), 2), "hi": half_up(max(ratios), 2), "date": re.search(r"(\d{4}-\d\d-\d\d) \d\d:\d\d UTC",
            text).group(1), "shapes": ", ".join(r["N x V"] for r in rows)}


def _bytes_per_token(text):
    rows = _table(text, "held after fwd B/token")
    values = {float(r[k]) for r in rows for k in ("held after fwd B/token", "peak fwd+bwd B/token")}
    return {"b": f"{values.pop():g}"} if len(values) == 1 else {}


def _op_tp(text):
    slowest = {}
    for tp, ms, ratio in re.findall(r"The op at TP=(\d), fwd\+bwd, slowest rank: ([\d.]+) ms = ([\d.]+)x", text):
        slowest.setdefault(tp, (ms, ratio))  # the first of each: the --align host rerun comes after
    gathers = [float(x) for x in re.findall(r"all-gather kernel ([\d.]+) ms", text) if float(x) > 0]
    return {"t1": slowest["1"][0], "t2": slowest["2"][0], "t4": slowest["4"][0], "r1": slowest["1"][1],
            "r2": slowest["2"][1], "r4": slowest["4"][1], "lo": half_up(min(gathers), 2), "hi": half_up(max(gathers), 2)}


def _host(tp2):
    tp1 = load(R + "2026-11-26_h100_tp12/final_checks/two_gpus/bench_tp1.json")
    op1 = [r for r in tp1["tables"][0] if r["what"] == "op, TP=1"]
    op2 = [r for r in tp2["tables"][0] if r["what"].startswith("op, TP=2")]
    rng = lambda rows, k: f"{half_up(min(float(r[k]) for r in rows), 2)}-{half_up(max(float(r[k]) for r in rows), 2)}"  # noqa
    return {"f1": half_up(op1[0]["fwd host ms"], 2), "fb1": half_up(op1[0]["fwd+bwd host ms"], 2),
            "f2": rng(op2, "fwd host ms"), "fb2": rng(op2, "fwd+bwd host ms"),
            "d1": half_up(max(float(r["fwd+bwd ms"]) for r in op1), 1), "d2": half_up(max(float(r["fwd+bwd ms"]) for r in op2), 1)}


def _peers(text):
    sections = {s.split("\n")[0]: s for s in text.split("\n## ")}
    evening = next(s for k, s in sections.items() if k.startswith("2026-11-23 (evening)"))
    all_impls = next(s for k, s in sections.items() if k.startswith("2026-11-22"))
    x_logits = lambda r: float(re.search(r"\(([\d.]+)x\)", r["peak fwd+bwd GiB (x logits)"]).group(1))  # noqa
    liger = _rows(_table(evening, "fwd+bwd / floor"), impl="liger-kernel CE(z)")
    mega = [r for r in _table(all_impls, "fwd+bwd / floor") if r["impl"].startswith("megatron")]
    mem, mmem = {x_logits(r) for r in liger}, {x_logits(r) for r in mega}
    if len(mem) != 1 or len(mmem) != 1 or len(mega) != 8:
        return {}
    ratios = lambda rows: [float(r["fwd+bwd / floor"]) for r in rows]  # noqa: E731
    return {"ver": re.search(r"liger-kernel ([\d.]+)", evening).group(1), "lo": half_up(min(ratios(liger)), 1),
            "hi": half_up(max(ratios(liger)), 1), "mem": f"{mem.pop():g}", "mlo": half_up(min(ratios(mega))),
            "mhi": half_up(max(ratios(mega))), "mmem": f"{mmem.pop():g}"}


def _softcap(text):
    replay = lambda t: _rows(_table(t, "graph replay ms (/ floor)"), mode="fwd+bwd")[0][  # noqa: E731
        "graph replay ms (/ floor)"].split()[0]
    return {"cap": half_up(replay(text), 2), "base": half_up(replay(load(R + "2026-11-25_h100/softcap/dt_new_1.md")), 2)}


# --- the fused output layer ---

def _layer(text):
    return [r for r in _table(text, "loss vs fp32") if r["N x h x V"] in SHAPES5]


def _layer_row(text, shape):
    rows = {r["implementation"].split(" (")[0].split(",")[0]: r for r in _layer(text) if r["N x h x V"] == shape}
    ref, fused = rows["unfused into fp32 main_grad"], rows["fused layer"]
    return {"shape": _shape(shape), "ref": f"{float(ref['device ms']):.4g}",
            "fused": _dev(fused),
            "blocks": round(1 / float(fused["peak extra (x logits)"])), "c16": _dev(rows["unfused: cuBLAS + cez op"]),
            "liger": _dev(rows["Liger 0.8.5 FLCE"]), "cce": half_up(_dev(rows["cut-cross-entropy 25.1.1"]), 2),
            "pf": fused["peak extra (x logits)"], "pl": rows["Liger 0.8.5 FLCE"]["peak extra (x logits)"]}


def _dev(row):  # the device-time ratio (layer.md's second "/ unfused into main_grad" column)
    return row["_dev"]


def _layer_ratios(text, implementation):
    rows = [r for r in _layer(text) if r["implementation"].startswith(implementation)]
    dev, ev = [float(r["_dev"]) for r in rows], [float(r["_ev"]) for r in rows]
    return {"dlo": half_up(min(dev), 2), "dhi": half_up(max(dev), 2), "elo": half_up(min(ev), 2), "ehi": half_up(max(ev), 2)}


def _layer_text(text):
    """layer.md with its two "/ unfused into main_grad" columns told apart (events, then device)."""
    head = "| N x h x V | implementation | events ms | / unfused into main_grad | device ms | / unfused into main_grad |"
    return text.replace(head, "| N x h x V | implementation | events ms | _ev | device ms | _dev |")


def _loss_error(text):
    worst = max(float(r["loss vs fp32"]) for r in _layer(text) if r["implementation"].startswith("fused"))
    return {"err": f"{worst:.1e}".replace("e-0", "e-")}


def _quiet_host(text):
    rows = _layer(_layer_text(text))
    c16 = [float(r["_dev"]) for r in rows if r["implementation"].startswith("unfused: cuBLAS + cez op")]
    ref = [r for r in rows if r["implementation"].startswith("unfused into fp32 main_grad")]
    under = sum(float(r["events ms"]) < float(r["device ms"]) for r in ref)
    return {"lo": half_up(min(c16), 2), "hi": half_up(max(c16), 2), "n": ["no", "one", "two", "three", "four", "five"][under]}


def _breakdown(text):
    return {r["path"]: r for r in _table(text, "kernels") if r["N x h x V"] == "8192x4096x151936"}


def _one_block_overhead(text):
    rows = _table(text, "kernels")
    one = [r for r in rows if r["path"] == "fused default" and r["blocks"] == "1"]
    extra = {int(r["kernels"]) - int(_rows(rows, path="unfused into main_grad", **{"N x h x V": r["N x h x V"]})[0][
        "kernels"]) for r in one}
    torch_ms = [float(r["torch ms"]) for r in one]
    return {"n": extra.pop(), "lo": half_up(min(torch_ms), 2), "hi": half_up(max(torch_ms), 2)} if len(extra) == 1 else {}


def _identical_work(text):
    rows = _table(text, "kernels")
    gaps = []
    for shape in {r["N x h x V"] for r in rows}:
        at = {r["path"]: r for r in rows if r["N x h x V"] == shape}
        if at["fused default"]["blocks"] == at["fused, fraction 1.0"]["blocks"] == "1":
            a, b = float(at["fused default"]["device ms"]), float(at["fused, fraction 1.0"]["device ms"])
            gaps.append((max(a, b) / min(a, b) - 1) * 100)
    return {"pct": half_up(max(gaps), 1)}


def _gemms(text):
    return {r["N x h x V"]: r for r in _table(text, "extra per block")}


def _unfused_device(text):
    return {r["N x h x V"]: float(r["device ms"]) for r in _table(text, "kernels") if r["path"] == "unfused into main_grad"}


def _second_block(final):
    """At 32768 x 4096 x 151936, one more block's dweight excess in both runs and its share of the unfused layer."""
    shape, runs = "32768x4096x151936", [load(PROFILE), final]
    ms = [float(_gemms(t)[shape]["extra per block"]) for t in runs]
    pct = [m / _unfused_device(t)[shape] * 100 for m, t in zip(ms, runs)]
    return {"lo": half_up(min(ms), 1), "hi": half_up(max(ms), 1), "plo": half_up(min(pct), 1), "phi": half_up(max(pct), 1)}


def _per_block(text):
    gemms, unfused = _gemms(text), _unfused_device(text)
    extra = [float(gemms[s]["extra per block"]) for s in SHAPES5]
    pct = [e / unfused[s] * 100 for e, s in zip(extra, SHAPES5)]
    floor = [float(gemms[s]["floor into main_grad"]) / unfused[s] for s in SHAPES5]
    return {"ms": " / ".join(half_up(e, 2) for e in extra), "lo": half_up(min(pct), 1), "hi": half_up(max(pct), 1),
            "flo": half_up(min(floor), 2), "fhi": half_up(max(floor), 2)}


def _tp2_row(text, shape, first):
    rows = {r["implementation"]: r for r in _table(text, "rows per block") if r["N x h x V"] == shape}
    fused, half = rows["fused layer, default"], rows["fused layer, fraction 0.5"]
    blocks = int(shape.split("x")[0]) // int(fused["rows per block"])
    return {"shape": _shape(shape), "ref": rows["unfused into fp32 main_grad (Megatron)"]["ms"],
            "fused": fused["/ unfused into main_grad"] + (" (two blocks)" if blocks == 2 else ""),
            "half": half["/ unfused into main_grad"] + (
                f" (peak {half['peak extra (x this rank' + chr(39) + 's logits)']}x the logits)" if first else ""),
            "c16": rows["unfused: cuBLAS + cez op (16-bit dweight)"]["/ unfused into main_grad"]} if blocks in (1, 2) else {}


def _recompute(text):
    errors = _table(text, "dhidden rel. error")
    cublas = [r for r in errors if r["implementation"] in ("unfused: cuBLAS + cez op", "cez fused, cuBLAS chunks",
                                                           "cez fused, grads in forward")]
    errs = [float(v) for r in cublas for k, v in r.items() if "error" in k]
    rows = [r for r in _table(text, "/ 3-GEMM floor") if r["implementation"] == "cez fused, cuBLAS chunks"]
    ratio, peak = [float(r["/ 3-GEMM floor"]) for r in rows], [float(r["peak extra (x logits)"]) for r in rows]
    return {"lo": half_up(min(ratio), 1), "hi": half_up(max(ratio), 1), "mlo": f"{min(peak):g}", "mhi": half_up(max(peak), 1),
            "elo": f"{min(errs) * 1e3:.2f}", "ehi": f"{max(errs) * 1e3:.2f}"}


# --- end to end ---

def _run_medians(d):
    """Per run, (variant, median step after ``skip``; a profiled run without iterations iters-5 to iters-2, the
    profiler's); {} unless they give the file's own summary back."""
    skip, iters, out = d["args"]["skip"], d["args"]["iters"], []
    for run in d["runs"]:
        steps = [ms for i, ms in run["steps_ms"].items() if int(i) > skip and not (
            run.get("profile") and iters - 5 <= int(i) <= iters - 2)]
        out.append((run["variant"], statistics.median(steps)))
    for v, s in d["summary"].items():
        m = [x for w, x in out if w == v]
        if (statistics.median(m), min(m), max(m)) != (s["median_ms"], s["min_ms"], s["max_ms"]):
            return []
    return out


def _e2e_row(d, others, variant, reference=None):
    medians = [m for f in [d] + [load(p) for p in others] for v, m in _run_medians(f) if v == variant]
    s = d["summary"][variant]
    row = {"med": half_up(statistics.median(medians)), "lo": half_up(min(medians)), "hi": half_up(max(medians)), "runs": len(medians),
           "peak": half_up(s["peak_gb"], 1), "busy": half_up((1 - s["gpu_idle_share_traced"]) * 100),
           "busy_all": half_up((1 - s["gpu_idle_share"]) * 100), "head": half_up(s["lm_head_share"] * 100, 1)}
    if reference:
        ref = [m for f in [d] + [load(p) for p in others] for v, m in _run_medians(f) if v == reference]
        row["vs"] = _s((statistics.median(medians) / statistics.median(ref) - 1) * 100, 1)
    return row


def _busy_config(d):
    c, tp4 = d["command"], load(TP4)["command"]
    return {"layers": _arg(c, "--num-layers"), "hidden": _arg(c, "--hidden-size"), "experts": _arg(c, "--num-experts"),
            "topk": _arg(c, "--moe-router-topk"), "seq": _arg(c, "--seq-length"),
            "mbs": int(_arg(c, "--global-batch-size")) // int(_arg(c, "--micro-batch-size")),
            "mb": _arg(c, "--micro-batch-size"), "h4": _arg(tp4, "--hidden-size"), "s4": _arg(tp4, "--seq-length"),
            "mbs4": int(_arg(tp4, "--global-batch-size")) // int(_arg(tp4, "--micro-batch-size")),
            "iters": d["args"]["iters"], "first": d["args"]["skip"] + 1, "reps": _reps([d, load(TP1_REP3)])}


def _reps(files):  # runs per variant over the calls, the same for each
    runs = [v for f in files for v, _ in _run_medians(f)]
    counts = {runs.count(v) for v in runs}
    return counts.pop() if len(counts) == 1 else None


def _alternated(text):
    blocks = re.search(r"per A B B A block \((\d+) blocks\): median ([+-][\d.]+)% \(quartiles ([+-][\d.]+)% to "
                       r"([+-][\d.]+)%\); mean ([+-][\d.]+)% \+- ([\d.]+)%", text).groups()
    rows = {r["variant"]: r for r in _table(text, "step median (ms)")}
    op, fol = rows["cez"], rows["cez_fol"]
    return dict(zip(("blocks", "med", "q1", "q3", "mean", "se"), blocks), nop=op["steps"], nfol=fol["steps"],
                op=op["step median (ms)"], fol=fol["step median (ms)"],
                po=op["peak allocated in its steps (GB)"], pf=fol["peak allocated in its steps (GB)"])


def _alt_row(tp, gpu):
    return lambda t: dict(_alternated(t), tp=tp, gpu=gpu)


def _noise(tp2):
    runs = [_alternated(t) for t in (tp2, load(AB + "r1_defer_gpu0.txt"), load(AB + "r2_defer_gpu1.txt"))]
    if any(abs(float(r["mean"])) >= float(r["se"]) for r in runs):
        return {}
    less = [float(r["po"]) - float(r["pf"]) for r in runs]
    return {"lo": half_up(min(less), 2), "hi": half_up(max(less), 2)}


def _earlier_pairs(tp1):
    """Fused layer over op per pair of runs: the i-th cez_fol run against the i-th cez run of each call."""
    out, spreads = {}, []
    for name, files in (("tp1", [tp1, load(TP1_REP3)]), ("tp2", [load(TP2), load(TP2_REP3)]),
                        ("tp4", [load(TP4), load(TP4_M2)])):
        pairs = []
        for f in files:
            m = _run_medians(f)
            op, fol = [x for v, x in m if v == "cez"], [x for v, x in m if v == "cez_fol"]
            pairs += [(b / a - 1) * 100 for a, b in zip(op, fol)]
        out[name] = ", ".join(_s(p, 2) for p in pairs)
        spreads.append(max(pairs) - min(pairs))
    return dict(out, lo=half_up(min(spreads), 1), hi=half_up(max(spreads), 1))


def _busy_row(d, variant):
    s, ref = d["summary"][variant], d["summary"]["native"]["median_ms"]
    longest = load(BUSY + "longest_busy.json")["longest"]
    longest.update(load(R + "2026-11-25_h100/longest_busy_fused_z_by_hand.json")["longest"])
    return {"med": half_up(s["median_ms"]), "lo": half_up(s["min_ms"]), "hi": half_up(s["max_ms"]), "peak": half_up(s["peak_gb"], 1),
            "vs": _s((s["median_ms"] / ref - 1) * 100, 1), "longest": longest[variant]["longest"]}


def _transforms(rep1):
    reps = [rep1, load(TRANSFORMS.format(2)), load(TRANSFORMS.format(3))]
    med = lambda v: statistics.median(r["summary"][v]["median_ms"] for r in reps)  # noqa: E731
    peak = lambda v: half_up(max(r["summary"][v]["peak_gb"] for r in reps), 1)  # noqa: E731
    out = {}
    for k in ("grok", "softcap"):
        out.update({k: half_up(med(f"cez_{k}")), k + "_t": half_up(med(f"cez_{k}_torch")),
                    k + "_p": _s((med(f"cez_{k}") / med(f"cez_{k}_torch") - 1) * 100, 1),
                    k + "_m": peak(f"cez_{k}"), k + "_mt": peak(f"cez_{k}_torch")})
    return out


def _longest_fol(d):
    t = d["longest"]["cez_fol"]["trials"]
    return {"L": d["longest"]["cez_fol"]["longest"],
            "mb": half_up((t["16384"]["peak_gb"] - t["8192"]["peak_gb"]) * 1e3 / 8192, 2)}


ROWS = [
    # docs/performance.md, "Long context": the config, how the table's steps were taken, what it shows
    (PERF, "One H100 80GB, {date}, Megatron {mcore}'s `pretrain` (`python bench/long_context.py memory` and `... "
     "throughput`): {layers} layers, hidden {hidden}, {experts} experts top-{topk} of ffn {ffn}, vocabulary {vocab}, "
     "bf16", LONG_CONTEXT, _long_config),
    (PERF, "step = median of iterations 3-4, iteration 2 from {two} tokens; one run each; sizes bisected to {res} "
     "tokens", LONG_CONTEXT, _long_steps),
    (PERF, "Megatron's CE trains up to {native} tokens per micro-batch, the op {cez} ({rc}x), the fused output layer "
     "{fol} ({rf}x) on its defaults and ran out of memory at {fail}; the sizes between were not run (a step there "
     "takes over {over} s)", LONG_CONTEXT, _longest),
    (PERF, "the transformer's own activations, about {kib} KiB per token here", LONG_CONTEXT, _per_token),
    (PERF, "Where the op fits too its step is the op's within {within} % ({t1}: {d1} %, {t2}: {d2} %, same call; "
     "{t3}: {d3} % against the earlier run)", "plot_long_context", _fol_vs_op),
    (PERF, "({tokens} tokens per sequence, {seqs} sequences a step; each variant searched the same way: micro-batch 2 "
     "then 1, recompute none, selective, full, stopping at the first that fits, since more recompute only adds work; "
     "{iters} iterations, step = median of iterations 3-{iters}, one run per setting)", THROUGHPUT,
     lambda d: {"tokens": d["tokens_per_sequence"], "seqs": d["global_batch"],
                "iters": max(int(i) for r in d["rows"] if r["rc"] == 0 for i in r["step_ms"])}),
    (PERF, "| Megatron's CE | micro-batch {mb}, no recompute (micro-batch 2 fits only with full recompute: {mb2} ms) | "
     "{step} ms | {tps} | 1.00x |", THROUGHPUT, _throughput_native),
    (PERF, "| `--lm-z-loss-coeff 1e-4` | micro-batch 1, no recompute (micro-batch 2: {ms} ms) |", THROUGHPUT,
     lambda d: {"ms": half_up(_step36(_setting(d, "cez", 2, "none")))}),
    (PERF, "| `+ --lm-fused-output-layer` | micro-batch {mb}, no recompute (micro-batch 1: {mb1} ms) | {step} ms | "
     "{tps} | {ratio}x |", THROUGHPUT, _throughput_fol),
    (PERF, "With the z-loss on, {more} % more tokens per second than Megatron's CE without it; at the same setting "
     "(micro-batch 1, no recompute) the op's step is {shorter} % shorter ({op} against {ce} ms), and Megatron's CE fits "
     "two sequences per micro-batch only with full recompute.", THROUGHPUT, _throughput_gain),
    # docs/performance.md, "Long context": beside the other options (the peers' call)
    *[(PERF, "| {name} | {step} ms | {peak} GiB | {tps} |", PEERS, lambda runs, v=v: _peer(runs, v))
      for v in PEER_NAMES],
    (PERF, "the flag gives {liger}x the tokens per second with the z-loss on; against Megatron's fused CE {fused}x",
     PEERS, _peer_ratios),
    # docs/performance.md, "What it buys for your model": estimate_memory.py's terms and predictions
    (PERF, "Adam's two moments) + {p} GiB; * per token, the logits (V per rank): Megatron's CE {native} V bytes", "estimate_memory",
     _estimates),
    (PERF, "its fused CE {fused} V, Liger's patch {liger} V (its fp32 exponentials), the z-loss by hand {z_by_hand} V",
     "estimate_memory", _estimates),
    (PERF, "op {cez} V + 12 (the bf16 logits, the gradient in place)", "estimate_memory", _estimates),
    (PERF, "out of memory above {usable} % of the card", "estimate_memory", _estimates),
    (PERF, "it predicts {long_native} / {long_cez} / {long_cez_fol} tokens for Megatron's CE / the op / the fused layer",
     "estimate_memory", _estimates),
    (PERF, "of `bench/long_context.py`, {deep_params}B parameters) it predicts {deep_native} / {deep_cez} / {deep_cez_fol}: "
     "the op {r_cez}x Megatron's CE instead of 3.25x, the fused layer {r_fol}x instead of 8x", "estimate_memory", _estimates),
    # docs/performance.md, "The op"
    (PERF, "four shapes ({shapes} tokens x vocab) | {lo}-{hi}x the 3-pass floor (CUDA-graph replay, L2 flushed) | "
     "H100, {date}: `2026-11-24_h100/device_time_h100_2026-11-24.md`", R + "2026-11-24_h100/device_time_h100_2026-11-24.md",
     lambda t: _graph_replay(t, "fwd+bwd")),
    (PERF, "| forward, same shapes | {lo}-{hi}x the 1-pass floor | H200, {date}: `2026-11-23_h200/device_time_h200_"
     "2026-11-23c.md` |", R + "2026-11-23_h200/device_time_h200_2026-11-23c.md", lambda t: _graph_replay(t, "fwd")),
    (PERF, "| memory beyond the inputs | {b} bytes per token (fp32 loss, z-loss, lse)",
     R + "2026-11-23_h200/device_time_h200_2026-11-23c.md", _bytes_per_token),
    (PERF, "| {t1} / {t2} / {t4} ms = {r1} / {r2} / {r4}x three passes over the shard; the one all-gather {lo}-{hi} ms | "
     "4x H100, 2026-11-26: `2026-11-26_4xh100/op_tp/` |", R + "2026-11-26_4xh100/op_tp/printed.txt", _op_tp),
    (PERF, "| TP=1: {f1} ms forward, {fb1} ms forward+backward; TP=2: {f2} / {fb2} ms; below the device time ({d1} / "
     "{d2} ms)", R + "2026-11-26_h100_tp12/final_checks/two_gpus/bench_tp2.json", _host),
    (PERF, "| Liger-Kernel {ver}'s CE with its z-loss {lo}-{hi}x the floor with {mem}x the logits in extra memory; "
     "Megatron's native / fused CE + a torch z-loss {mlo}-{mhi}x the floor with {mmem}x the logits |",
     R + "RESULTS.md", _peers),
    (PERF, "| `LogitTransform(cap=30)`, 8192 x 151936 | {cap} ms forward+backward against {base} ms without (CUDA-graph "
     "replay) |", R + "2026-11-25_h100/softcap/dt_cap_1.md", _softcap),
    # docs/performance.md, "Fused output layer": the one-GPU table (device time) and what it shows
    (PERF, "`bench/linear_cross_entropy.py --peers --iters {ev}`", LAYER,
     lambda t: {"ev": re.search(r"events: median of (\d+) rounds", t).group(1)}),
    (PERF, "device time = the torch profiler's kernel sums (median of {n} rounds)", LAYER,
     lambda t: {"n": re.search(r"profiler kernel sums, median of (\d+) rounds", t).group(1)}),
    *[(PERF, "| {shape} | {ref} | {fused} ({blocks}) | {c16} | {liger} | {cce} | {pf} / {pl} |", LAYER,
       lambda t, s=s: _layer_row(_layer_text(t), s)) for s in SHAPES5],
    (PERF, "By device time the fused layer took {dlo}-{dhi}x the unfused layer into `main_grad`, by events {elo}-{ehi}x",
     LAYER, lambda t: _layer_ratios(_layer_text(t), "fused layer, default")),
    (PERF, "Every loss within {err} of fp32", LAYER, _loss_error),
    (PERF, "the unfused layer with a 16-bit weight gradient (the fused layer's kernels less the fp32 pass) came out at "
     "{lo}-{hi} of the reference, and the reference's events under its own kernel sum at {n} shapes", LAYER, _quiet_host),
    (PERF, "`2026-11-28_4xh200/final/breakdown.md`) measured identical work (one block, default and `GradientPath(block_fraction=1.0)`) "
     "{pct} % apart between rounds", BREAKDOWN, _identical_work),
    # the breakdown: final/ (kernels, Triton passes) and call1_profile/ (the GEMMs alone)
    (PERF, "At one block it runs the unfused layer's kernels plus ~{n} small ones ({lo}-{hi} ms)", BREAKDOWN,
     _one_block_overhead),
    (PERF, "plus ~{n} small kernels on `[tokens]` vectors (the upstream gradient and its check in backward, the loss "
     "from the partials: {lo}-{hi} ms in all)", BREAKDOWN, _one_block_overhead),
    (PERF, "(loss, then the gradient in place: {ms} ms at 8192 x 4096 x 151936)", BREAKDOWN,
     lambda t: {"ms": half_up(_breakdown(t)["fused default"]["Triton ms"], 1)}),
    (PERF, "at 32768 x 4096 x 151936 the default's second block adds one pass over `main_grad` ({lo}-{hi} ms, "
     "{plo}-{phi} %)", BREAKDOWN, _second_block),
    (PERF, "measured on the GEMMs alone {ms} ms at the five shapes, {lo}-{hi} % of the layer", PROFILE, _per_block),
    (PERF, "The 3-GEMM floor into `main_grad` (the GEMMs alone, events) is {flo}-{fhi}x the unfused layer", PROFILE,
     _per_block),
    # the TP=2 + SP table
    (PERF, "rank 0, events in turn per round, median of {n}", LAYER_TP2,
     lambda t: {"n": re.search(r"median of (\d+) rounds", t).group(1)}),
    *[(PERF, "| {shape} | {ref} | {fused} | {half} | {c16} |", LAYER_TP2, lambda t, s=s, i=i: _tp2_row(t, s, i == 0))
      for i, s in enumerate(SHAPES5)],
    (PERF, "The unfused layer with a 16-bit weight gradient sits at {lo}-{hi} of the reference here too", LAYER_TP2,
     lambda t: (lambda v: {"lo": min(v), "hi": max(v)})(sorted(
         r["/ unfused into main_grad"] for r in _table(t, "rows per block")
         if r["implementation"] == "unfused: cuBLAS + cez op (16-bit dweight)"))),
    (PERF, "{lo}-{hi}x the 3-GEMM floor, {mlo}-{mhi}x the logits' memory (H100, 2026-11-24: `2026-11-24_h100/"
     "linear_ce_triton.md`). Errors against float64 (512 x 512 x 8192 with z-loss): {elo}-{ehi}e-3 for every cuBLAS "
     "path", R + "2026-11-24_h100/linear_ce_triton.md",
     _recompute),
    # docs/performance.md, "End to end": the 2026-11-26 table (run medians of two calls per TP)
    (PERF, "Megatron 0.19.2's `pretrain`, H100 80GB, bf16, MoE, vocabulary 151936, {iters} iterations per run, step = "
     "median of iterations {first}-{iters}, range over {reps} runs per variant", TP1, _busy_config),
    (PERF, "`busy` ({layers} layers, hidden {hidden}, {experts} experts top-{topk}, sequence {seq}, {mbs} micro-batches "
     "of {mb}; `2026-11-26_h100_tp12/`); TP=4 + SP: `busy_tp4` (hidden {h4}, sequence {s4}, {mbs4} micro-batches",
     TP1, _busy_config),
    (PERF, "| 1 | Megatron's CE, no z-loss | {med} ({lo}-{hi}) | | {peak} GB | {busy} % ({busy_all} %) | {head} % |",
     TP1, lambda d: _e2e_row(d, [TP1_REP3], "native")),
    (PERF, "| 1 | `--lm-z-loss-coeff 1e-4` | {med} ({lo}-{hi}) | {vs} % | {peak} GB | {busy} % ({busy_all} %) | "
     "{head} % |", TP1, lambda d: _e2e_row(d, [TP1_REP3], "cez", "native")),
    (PERF, "| 2 + SP | Megatron's CE, no z-loss | {med} ({lo}-{hi}) | | {peak} GB | {busy} % ({busy_all} %) | {head} % |",
     TP2, lambda d: _e2e_row(d, [TP2_REP3], "native")),
    (PERF, "| 2 + SP | `--lm-z-loss-coeff 1e-4` | {med} ({lo}-{hi}) | {vs} % | {peak} GB | {busy} % ({busy_all} %) | "
     "{head} % |", TP2, lambda d: _e2e_row(d, [TP2_REP3], "cez", "native")),
    (PERF, "| 4 + SP | `--lm-z-loss-coeff 1e-4` | {med} ({lo}-{hi}), {runs} runs | | {peak} GB | {busy} % ({busy_all} %) "
     "| {head} % |", TP4, lambda d: _e2e_row(d, [TP4_M2], "cez")),
    # the fused layer against the op, alternated step by step (2x H200, 2026-11-28)
    *[(PERF, "| {tp} | {gpu} | {nop} / {nfol} | {op} | {fol} | {med} % ({q1} to {q3} %), {blocks} blocks | {mean} +- "
       "{se} % | {pf} against {po} GB |", src, _alt_row(tp, gpu))
      for tp, gpu, src in (("1", "0", AB + "r1_defer_gpu0.txt"), ("1", "1", AB + "r2_defer_gpu1.txt"),
                           ("2 + SP", "0-1", R + "2026-11-28_2xh200/defer_layer_tp2/e2e_tp2.txt"))],
    (PERF, "(none of the three differs from zero by two standard errors), for {lo}-{hi} GB less per GPU",
     R + "2026-11-28_2xh200/defer_layer_tp2/e2e_tp2.txt", _noise),
    # the unfused layer's two gradient GEMMs at the busy config's shape (N = 8192, h = 3072, V = 151936)
    (PERF, "starts the backward with its two gradient GEMMs queued (~{ms} ms at TP=1", PROFILE,
     lambda t: (lambda g: {"ms": half_up(float(g["dhidden"]) + float(g["dweight into fp32, 1 block"]))})(
         _gemms(t)["8192x3072x151936"])),
    (PERF, "that code (GEMMs in forward) measured {a} +- {b} % and {c} +- {d} % (GPUs 1 and 0", AB + "r1_main_gpu1.txt",
     lambda t: (lambda x, y: {"a": x["mean"], "b": x["se"], "c": y["mean"], "d": y["se"]})(
         _alternated(t), _alternated(load(AB + "r2_main_gpu0.txt")))),
    (PERF, "block fraction 0.5): TP=1 {tp1} %; TP=2 + SP {tp2} %; TP=4 + SP {tp4} %; the spread between such pairs "
     "({lo}-{hi} points)", TP1, _earlier_pairs),
    # the 2026-11-24 busy table, its longest sequences (2026-11-24; fused and z_by_hand 2026-11-25)
    (PERF, "iterations {first}-{iters}, {runs} alternated runs", BUSY + "e2e_busy.json",
     lambda d: {"first": d["args"]["skip"] + 1, "iters": d["args"]["iters"],
                "runs": min(s["runs"] for s in d["summary"].values())}),
    *[(PERF, "| " + label + " | {med} ({lo}-{hi}) | " + ("" if v == "native" else "{vs} %") + " | {peak} GB | {longest} |",
       BUSY + "e2e_busy.json", lambda d, v=v: _busy_row(d, v))
      for label, v in (("Megatron's CE, no z-loss", "native"), ("Megatron's fused CE, no z-loss", "fused"),
                       ("Megatron's CE + z-loss in torch", "z_by_hand"), ("this package, z-loss on", "cez"))],
    (PERF, "the longest sequence at micro-batch 1 was {L} (one H100, 2026-11-25, `2026-11-25_h100/fused_layer/longest/`); "
     "beyond it the transformer's own activations fill the GPU at this config ({mb} MB per token)",
     R + "2026-11-25_h100/fused_layer/longest/longest_busy.json", _longest_fol),
    (PERF, "Grok-1's scale 0.577 {grok} ms against {grok_t} ms ({grok_p} %), peak {grok_m} against {grok_mt} GB; "
     "Gemma-2's soft cap 30 {softcap} against {softcap_t} ms ({softcap_p} %), {softcap_m} against {softcap_mt} GB",
     TRANSFORMS.format(1), _transforms),
    # bench/README.md: busy_tp4's size, the device steps' durations
    (BENCH, "4 micro-batches of one sequence, ~{b}B parameters)", R + "2026-11-26_4xh100/e2e_busy_tp4/machine1/"
     "busy_tp4_tp4_cez_1.log", lambda t: {"b": half_up(re.search(r"parameters in billions: ([\d.]+)", t).group(1), 1)}),
    (BENCH, "WHEELS=DIR bash bench/run_device.sh env final # 4 GPUs, ~{m} minutes", R + "2026-11-28_4xh200/final/README.md",
     lambda t: (lambda a, b, c, d: {"m": (int(c) * 60 + int(d)) - (int(a) * 60 + int(b))})(
         *re.search(r"(\d\d):(\d\d)-(\d\d):(\d\d) UTC", t).groups())),
    (BENCH, 'E2E_ARGS="--config busy_tp4 --tp 4 --variants cez cez_fol --pairs {p} --iters {i} --profile --budget-s {b}" '
     "\\ bash bench/run_device.sh e2e # 4 GPUs, ~{m} minutes", TP4,
     lambda d: {"p": d["args"]["pairs"], "i": d["args"]["iters"], "b": f"{d['args']['budget_s']:g}",
                "m": half_up(sum(r["wall_s"] for r in d["runs"]) / 60)}),
]
