"""bench/estimate_memory.py against every measured run on an 80 GB H100: each peak within 10 %, each
out-of-memory run predicted at or above 90 % of what fits, each searched longest micro-batch within 10 %.

The runs: every ``long_context*.json`` / ``throughput*.json`` under bench/results/ (the model read from its
``megatron_args``; a new config's results folder joins by itself) and the peers' calls, less SUPERSEDED."""
import glob
import importlib.util
import os

import pytest

from support.doc_figures.results_files import ROOT, load

RESULTS = os.path.join(ROOT, "bench", "results")
H100_80GB = 81559 * 2 ** 20  # nvidia-smi's memory.total (2026-12-07_h100_peers/env.txt)
SUPERSEDED = {  # results files whose rows a later file replaces
    "2026-12-06_h100_long_context_baseline/long_context.json":
        "its fused-layer rows are of an earlier implementation; its other rows are cited in 2026-12-06_h100_long_context",
}
PEERS = ("2026-12-07_h100_peers", "long")  # the peers' calls: the long config, rows as 'variant:tokens:mbs:recompute:iters'


def _estimator():
    spec = importlib.util.spec_from_file_location("estimate_memory", os.path.join(ROOT, "bench", "estimate_memory.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


est = _estimator()


def _long_args():
    text = load("bench/results/2026-12-06_h100_long_context/long_context.json")["megatron_args"]
    assert "--num-layers 4 " in text
    return text


def measured():
    """``(file, model, row)`` per run; row: variant, tokens, recompute, peak (None: out of memory)."""
    out = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "*", "long_context*.json"))
                       + glob.glob(os.path.join(RESULTS, "*", "throughput*.json"))):
        name = os.path.relpath(path, RESULTS)
        if name in SUPERSEDED:
            continue
        data = load(os.path.relpath(path, ROOT))
        if "H100 80GB" not in data["device"]:
            continue
        model = est.Model.from_megatron_args(data["megatron_args"].split(" + ")[0])
        for r in data["rows"]:
            out.append((name, model, {"variant": r["variant"], "tokens": r["tokens_per_micro_batch"],
                                      "recompute": r.get("recompute", "full"), "oom": r["out_of_memory"],
                                      "peak": r["peak_allocated_bytes"] if r["rc"] == 0 else None}))
    folder, config = PEERS
    model = est.Model.from_megatron_args(_long_args())
    for path in sorted(glob.glob(os.path.join(RESULTS, folder, "peers_call*.json"))):
        for r in load(os.path.relpath(path, ROOT)):
            variant, tokens, _, recompute, _ = r["run"].split(":")
            out.append((os.path.relpath(path, RESULTS), model, {"variant": variant, "tokens": int(tokens),
                        "recompute": recompute, "oom": r["oom"], "peak": None if r["oom"] else r["peak_bytes"]}))
    return [(f, m, r) for f, m, r in out if r["variant"] in est.LOGIT_BYTES]


def _recompute(row):
    return "full" if row["recompute"] == "full" else "none"  # selective: SDPA keeps no scores to drop


ROWS = measured()


def test_every_variant_is_checked():
    trained = {r["variant"] for _, _, r in ROWS if r["peak"]}
    assert trained == set(est.LOGIT_BYTES) - {"z_by_hand"}  # the z-loss by hand never trained at 32768 tokens
    assert len([r for _, _, r in ROWS if r["peak"]]) >= 20


@pytest.mark.parametrize("name,model,row", [x for x in ROWS if x[2]["peak"]],
                         ids=[f"{f}:{r['variant']}:{r['tokens']}:{r['recompute']}" for f, _, r in ROWS if r["peak"]])
def test_peak_within_ten_percent(name, model, row):
    predicted = est.peak_bytes(model, row["variant"], row["tokens"], _recompute(row))
    assert abs(predicted / row["peak"] - 1) <= 0.10, (predicted / 2 ** 30, row["peak"] / 2 ** 30)


@pytest.mark.parametrize("name,model,row", [x for x in ROWS if x[2]["oom"]],
                         ids=[f"{f}:{r['variant']}:{r['tokens']}:{r['recompute']}" for f, _, r in ROWS if r["oom"]])
def test_out_of_memory_predicted(name, model, row):
    predicted = est.peak_bytes(model, row["variant"], row["tokens"], _recompute(row))
    assert predicted >= 0.9 * est.USABLE * H100_80GB, predicted / 2 ** 30


def _searches():
    for path in sorted(glob.glob(os.path.join(RESULTS, "*", "long_context*.json"))):
        name = os.path.relpath(path, RESULTS)
        data = load(os.path.relpath(path, ROOT))
        if name in SUPERSEDED or "H100 80GB" not in data["device"]:
            continue
        model = est.Model.from_megatron_args(data["megatron_args"].split(" + ")[0])
        for variant, s in data.get("search", {}).items():
            if variant in est.LOGIT_BYTES and s["largest_fit"]:
                yield name, model, variant, s["largest_fit"], s["smallest_failure"]


@pytest.mark.parametrize("name,model,variant,fit,fail", list(_searches()),
                         ids=[f"{s[0]}:{s[2]}" for s in _searches()])
def test_longest_within_ten_percent(name, model, variant, fit, fail):
    longest = est.longest_tokens(model, variant, H100_80GB)
    assert 0.9 * fit <= longest and (fail is None or longest <= 1.1 * fail), (longest, fit, fail)


def test_fused_layer_block_is_bounded():
    """The fused layer's logits never pass 4 GiB: at a million tokens its peak grows by activations only."""
    model = est.Model.from_megatron_args(_long_args())
    grow = est.peak_bytes(model, "cez_fol", 1 << 20) - est.peak_bytes(model, "cez_fol", 1 << 19)
    assert grow == pytest.approx((1 << 19) * (model.kept_bytes() + model.recompute_bytes()), rel=1e-9)
    assert est.logits_block_bytes(1 << 20, 151936) <= est.BLOCK


def test_command_prints_every_variant(capsys):
    est.main(["--hidden", "2048", "--layers", "16", "--experts", "8", "--moe-ffn", "768", "--tokens", "65536"])
    out = capsys.readouterr().out
    assert all(f"| {v} |" in out for v in est.LOGIT_BYTES)
