"""Where each figure quoted in docs/weight_gradient.md, docs/fused_linear_cross_entropy.md and docs/op.md comes from:
rows as in __init__.py."""
import re
import statistics

from .results_files import half_up, load

H200_ACC = "bench/results/2026-11-26_h200/accumulations.md"
H200_TUNE = "bench/results/2026-11-26_h200/tune_accumulate.md"
H200_BREAKDOWN = "bench/results/2026-11-28_4xh200/call1_profile/breakdown.json"
LONG_CONTEXT = "bench/results/2026-12-06_h100_long_context/long_context.json"
H100_SOFTCAP = "bench/results/2026-11-25_h100/softcap/"
H100_TRITON_LCE = "bench/results/2026-11-24_h100/linear_ce_triton.md"
AB_TP1 = "bench/results/2026-11-28_2xh200/e2e_ab_tp1/"
GPU_CHECKS = "bench/results/2026-12-06_h100_gpu_checks/"
DEFAULT = "default path (fraction 0.5), "  # accumulations.md's rows of the default path, by accumulation
FIVE = ["8192x4096x151936", "8192x4096x37984", "32768x4096x151936", "16384x4096x75968", "8192x7168x16160"]


def _table(text):
    """A markdown file's table rows (every table), as lists of cells; separator rows left out."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|---")]


def _shape(s):
    return s.replace("x", " x ")


def _acc(text, shape, impl):
    """accumulations.md: ms of one implementation at one shape."""
    return next(r[3] for r in _table(text) if len(r) == 7 and r[0] == shape and r[1] == impl)


def _breakdown(d, shape):
    """call1_profile: (one more block's dweight excess, the unfused layer's device ms) at one shape."""
    gemms = next(r for r in d["tables"][1] if r["N x h x V"] == shape)
    unfused = next(r for r in d["tables"][0] if r["N x h x V"] == shape and r["path"] == "unfused into main_grad")
    return float(gemms["extra per block"]), float(unfused["device ms"])


def _share(d, shape):
    extra, layer = _breakdown(d, shape)
    return 100 * extra / layer


def _megatron_arg(d, name):
    return int(d["megatron_args"].split(f"--{name} ")[1].split()[0])


def _step_s(d, tokens, variant="cez_fol"):
    """long_context.json: the step as the plot script takes it (median after the first two, else the last), in s."""
    row = next(r for r in d["rows"] if r["tokens_per_micro_batch"] == tokens and r["variant"] == variant)
    steps = [ms for _, ms in sorted(row["step_ms"].items(), key=lambda kv: int(kv[0]))]
    return (statistics.median(steps[2:]) if len(steps) > 2 else steps[-1]) / 1000


def _passes(tokens, vocab):
    """Extra passes over main_grad at the default blocks: the package's own block rule."""
    from mindspeed_cez.linear_forward_grads import default_row_block
    return -(-tokens // default_row_block(tokens, vocab)) - 1


def _copy_tbs(text):
    """bench/device_time.py's measured copy bandwidth (read + write), TB/s."""
    return float(re.search(r"copy bandwidth ([\d.]+) TB/s", text).group(1))


def _graph_replay(text, mode):
    """bench/device_time.py: graph-replay ms of one mode (fwd / fwd+bwd)."""
    return float(next(r[3] for r in _table(text) if len(r) == 6 and r[1] == mode).split()[0])


def _ab_mean(text):
    """e2e_megatron.py --alternate: fused / op - 1 per A B B A block, mean and 2 standard errors (%)."""
    m = re.search(r"mean ([+-][\d.]+)% \+- ([\d.]+)% \(2 standard errors\)", text)
    return float(m.group(1)), float(m.group(2))


def _forward_ms(text, which):
    """call4_softcap_timing.txt: the forward ms of each `new` / `old` run (bench/op.py's first time column)."""
    return [float(m) for m in re.findall(rf"^{which} \d: \| [^|]+\| mindspeed_cez \| ([\d.]+) \|", text, re.M)]


def _errors(text):
    """linear_ce_*.md: (dhidden, dweight) relative error vs float64 per implementation."""
    return {r[0]: (float(r[1]), float(r[2])) for r in _table(text) if len(r) == 3 and r[1] != "dhidden rel. error"}


def _third(text):
    err = _errors(text)
    ratios = [t / o for name, o in err.items() if name.startswith(("unfused", "cez fused, cuBLAS", "cez fused, grads"))
              for t, o in zip(err["cez fused, Triton tl.dot"], o)]
    return {} if len(ratios) == 6 and all(abs(r - 1 / 3) < 0.05 for r in ratios) else {"missing": True}


ROWS = [
    # docs/weight_gradient.md, which accumulation runs where: the Triton kernel (its chosen tiles) and the path
    ("docs/weight_gradient.md", "the kernel is {lo}-{hi}x cuBLAS's `addmm(out_dtype)` on an H200", H200_TUNE,
     lambda t: (lambda r: {"lo": half_up(min(r), 2), "hi": half_up(max(r), 2)} if "NVIDIA H200" in t else {})(
         [float(r[3]) for r in _table(t) if r[1:2] == ["128, 128, 64, 8, 8, 4, 1, True"]])),
    ("docs/weight_gradient.md", "the whole default path {lo:.2f}-{hi:.2f}x the torch >= 2.8 path", H200_ACC,
     lambda t: (lambda r: {"lo": min(r), "hi": max(r)})(
         [float(_acc(t, s, DEFAULT + "triton")) / float(_acc(t, s, DEFAULT + "addmm_out_dtype")) for s in FIVE])),
    # weight_gradient.md, the accumulations measured: every row of the table
    *[("docs/weight_gradient.md", "| {shape} | {unfused} | {addmm_out_dtype} | {triton} | {gemm_add} |", H200_ACC,
       lambda t, s=s: {"shape": _shape(s), "unfused": half_up(_acc(t, s, "unfused: cuBLAS + cez op"), 1),
                       **{k: half_up(_acc(t, s, DEFAULT + k), 1) for k in ("addmm_out_dtype", "triton", "gemm_add")}}
       if "NVIDIA H200" in t else {}) for s in FIVE],
    # weight_gradient.md, the dial: one more block's pass over main_grad (the GEMMs alone) and its share of the layer
    ("docs/weight_gradient.md", "every further block adds one pass: {lo}-{hi} ms at the five benchmark shapes on an "
     "H200", H200_BREAKDOWN, lambda d: (lambda x: {"lo": half_up(min(x), 1), "hi": half_up(max(x), 1)}
                                         if "H200" in d["run"]["device"] else {})([_breakdown(d, s)[0] for s in FIVE])),
    ("docs/weight_gradient.md", "{lo:.1f}-{hi:.1f} % at 8192 tokens, {n16:.2f} % at 16384, {n32:.2f} % at 32768",
     H200_BREAKDOWN, lambda d: (lambda s8: {"lo": min(s8), "hi": max(s8), "n16": _share(d, FIVE[3]),
                                             "n32": _share(d, FIVE[2])})(
         [_share(d, s) for s in FIVE if s.startswith("8192x")])),
    ("docs/weight_gradient.md", "At 8192 x 4096 x 151936 ({logits:.2f} GB of logits) F = 0.5 saves {half:.2f} GB for "
     "one pass of {pass_:.2f} GB ({ms:.2f} ms, {pct:.0f} % of the layer on an H200); at 8192 x 7168 x 16160 "
     "({logits2:.0f} MB) it would save {half2:.0f} MB for {ms2:.2f} ms ({pct2:.1f} %)", H200_BREAKDOWN,
     lambda d: dict(logits=8192 * 151936 * 2 / 1e9, half=8192 * 151936 / 1e9, pass_=8 * 151936 * 4096 / 1e9,
                    ms=_breakdown(d, FIVE[0])[0], pct=_share(d, FIVE[0]), logits2=8192 * 16160 * 2 / 1e6,
                    half2=8192 * 16160 / 1e6, ms2=_breakdown(d, FIVE[4])[0], pct2=_share(d, FIVE[4]))),
    # weight_gradient.md, the 4 GiB default at long context: the config, passes (the package's block rule), steps
    ("docs/weight_gradient.md", "at V = {V} and h = {h} ({gb:.1f} GB a pass,", LONG_CONTEXT,
     lambda d: {"V": _megatron_arg(d, "vocab-size"), "h": _megatron_arg(d, "hidden-size"),
                "gb": 8 * _megatron_arg(d, "vocab-size") * _megatron_arg(d, "hidden-size") / 1e9}),
    # the pass's time: its bytes at the H100's copy bandwidth as bench/device_time.py measured it
    ("docs/weight_gradient.md", "(2.5 GB a pass, about {ms:.1f} ms on an H100)", H100_SOFTCAP + "dt_base_1.md",
     lambda t: {"ms": 8 * 151936 * 2048 / (_copy_tbs(t) * 1e12) * 1e3} if "H100" in t else {}),
    ("docs/weight_gradient.md", "an H100), {p1} passes at 32768 tokens, {p2} at 262144, {p3} at 524288, against steps "
     "of {s1:.1f} s, {s2:.0f} s and {s3:.0f} s", LONG_CONTEXT,
     lambda d: dict(p1=_passes(32768, 151936), p2=_passes(262144, 151936), p3=_passes(524288, 151936),
                    s1=_step_s(d, 32768), s2=_step_s(d, 262144), s3=_step_s(d, 524288))
     if "H100" in d["device"] and _megatron_arg(d, "vocab-size") == 151936 else {}),
    # docs/fused_linear_cross_entropy.md: all three GEMMs in forward ("main") against the last block's in backward
    # ("defer"), each alternated with the op in one pretrain run (both GPUs; the second file read beside the first)
    ("docs/fused_linear_cross_entropy.md", "with them in forward the step was {lo:.0f}-{hi:.0f} % longer than the op's",
     AB_TP1 + "r1_main_gpu1.txt", lambda t: (lambda m: {"lo": min(m), "hi": max(m)})(
         [_ab_mean(x)[0] for x in (t, load(AB_TP1 + "r2_main_gpu0.txt")) if _ab_mean(x)[0] > _ab_mean(x)[1]])),
    *[("docs/fused_linear_cross_entropy.md", "in backward it is within noise of it", AB_TP1 + f,
       lambda t: {} if abs(_ab_mean(t)[0]) < _ab_mean(t)[1] else {"missing": True})
      for f in ("r1_defer_gpu0.txt", "r2_defer_gpu1.txt")],
    ("docs/fused_linear_cross_entropy.md", "Its logits are never rounded to 16 bits: a third of the other paths' error "
     "against float64", H100_TRITON_LCE, _third),
    # docs/op.md: the fp32 tanh series' cost on bf16 logits (call 4: this code against the commit before it)
    ("docs/op.md", "the series cost bf16's forward {pct:.0f} % on an H100", GPU_CHECKS + "call4_softcap_timing.txt",
     lambda t: {"pct": 100 * (statistics.median(_forward_ms(t, "new")) / statistics.median(_forward_ms(t, "old"))
                              - 1)}),
    # op.md: the cap's cost, graph replay, the capped run against the same code uncapped (read beside it)
    ("docs/op.md", "Cost with the cap, one H100, 2026-11-25, 8192 x 151936 bf16: forward {fwd:.2f}x, forward+backward "
     "{both:.2f}x the uncapped op", H100_SOFTCAP + "dt_cap_1.md",
     lambda t: (lambda u: {"fwd": _graph_replay(t, "fwd") / _graph_replay(u, "fwd"),
                           "both": _graph_replay(t, "fwd+bwd") / _graph_replay(u, "fwd+bwd")}
                if all(k in t for k in ("H100", "2026-11-25", "8192 x 151936", "logit_softcap=30.0"))
                and "logit_softcap=0.0" in u else {})(load(H100_SOFTCAP + "dt_new_1.md"))),
]
