"""Peak memory against tokens per micro-batch, one line per variant, from long-context results files.

    python bench/plot_long_context.py [RESULTS.json ...] [--peers CALL.json ...] [--out docs/images/long_context_memory.png]
    python bench/plot_long_context.py [RESULTS.json ...] --table     # docs/performance.md's table, in Markdown

Each file has the schema of bench/results/2026-12-06_h100_long_context_baseline/long_context.json:
device, date, project_commit, stack, megatron_args, variants, rows[{tokens_per_micro_batch, variant, rc,
out_of_memory, peak_allocated_bytes, step_ms}]. Variants: `native` (Megatron's CE), `cez` (the op),
`cez_fol` (the fused output layer, default blocks) drawn as lines; `cez_fol_<F>` (block fraction F by
hand) as points labelled with F. An X marks the size at which a variant ran out of memory. ``--peers``: the
peers' calls (bench/results/2026-12-07_h100_peers/peers_call*.json, rows ``variant:tokens:micro-batch:recompute:
iterations``), their runs at micro-batch 1 with full recompute drawn the same way (Megatron's fused CE, Liger's
patch, the z-loss by hand). The dashed line: the card's memory, nvidia-smi's ``memory.total`` in the ``env.txt``
beside the first results file.
"""
import argparse
import glob
import json
import os
import re
import statistics
import textwrap

DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "2026-12-06_h100_long_context", "long_context.json")
LINES = {"native": ("Megatron's CE", "tab:red"), "cez": ("--lm-z-loss-coeff 1e-4", "tab:blue"),
         "cez_fol": ("+ --lm-fused-output-layer", "tab:green")}
PEERS = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "2026-12-07_h100_peers",
                                      "peers_call*.json")))
PEER_LINES = {"fused": ("Megatron's fused CE (--cross-entropy-loss-fusion)", "tab:orange"),
              "liger": ("Liger 0.8.5's Megatron patch", "tab:purple"),
              "z_by_hand": ("Megatron's CE + z-loss in torch", "tab:brown")}
PEERS_STAMP = "NVIDIA H100 80GB HBM3, 2026-12-07, commit 5e8c50b"  # 2026-12-07_h100_peers/README.md
GIB = 2 ** 30


def load(paths):
    docs = [json.load(open(p)) for p in paths]
    rows = [r for d in docs for r in d["rows"]]
    return docs, rows


def peer_rows(paths):
    """The peers' calls as rows of the results schema, with their micro-batch and recompute."""
    rows = []
    for path in paths:
        for r in json.load(open(path)):
            variant, tokens, micro_batch, recompute, _ = r["run"].split(":")
            rows.append({"variant": variant, "tokens_per_micro_batch": int(tokens), "micro_batch": int(micro_batch),
                         "recompute": recompute, "rc": r["rc"], "out_of_memory": r["oom"],
                         "peak_allocated_bytes": None if r["oom"] else r["peak_bytes"]})
    return rows


def gpu_memory_gib(results_path):
    """The card's memory: nvidia-smi's memory.total (MiB) in the env.txt beside the results file."""
    with open(os.path.join(os.path.dirname(os.path.abspath(results_path)), "env.txt")) as fh:
        return int(re.search(r"(\d+) MiB", fh.read()).group(1)) / 1024


def plot(paths, out, peers=()):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs, rows = load(paths)
    gpu_gib = gpu_memory_gib(paths[0])
    rows = rows + [r for r in peer_rows(peers) if r["micro_batch"] == 1 and r["recompute"] == "full"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for variant, (label, color) in {**LINES, **PEER_LINES}.items():
        ok = sorted((r["tokens_per_micro_batch"], r["peak_allocated_bytes"] / GIB) for r in rows
                    if r["variant"] == variant and r["rc"] == 0 and r["peak_allocated_bytes"])
        if ok:
            ax.plot([t for t, _ in ok], [m for _, m in ok], "o-", color=color, label=label)
        failed = [r["tokens_per_micro_batch"] for r in rows if r["variant"] == variant and r["out_of_memory"]]
        for t in failed:
            ax.plot(t, gpu_gib, "x", color=color, markersize=12, mew=3, label=None if ok or t != failed[0] else label)
    hand = [r for r in rows if r["variant"].startswith("cez_fol_") and r["rc"] == 0 and r["peak_allocated_bytes"]]
    for i, r in enumerate(sorted(hand, key=lambda r: r["tokens_per_micro_batch"])):
        t, m = r["tokens_per_micro_batch"], r["peak_allocated_bytes"] / GIB
        ax.plot(t, m, "s", color="tab:olive", label="fused layer, block fraction F by hand" if i == 0 else None)
        ax.annotate("F=" + r["variant"][len("cez_fol_"):], (t, m), textcoords="offset points", xytext=(6, -12))
    ax.axhline(gpu_gib, color="gray", linestyle="--", linewidth=1)
    ax.text(min(r["tokens_per_micro_batch"] for r in rows), gpu_gib + 4,
            f"{gpu_gib:.1f} GiB (the GPU's memory); X: out of memory", color="gray", fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per micro-batch")
    ax.set_ylabel("peak allocated memory (GiB)")
    ax.set_ylim(0, gpu_gib + 12)
    sizes = sorted({t for t in (r["tokens_per_micro_batch"] for r in rows) if t & (t - 1) == 0})
    ax.set_xticks(sizes, [f"{t // 1024}k" for t in sizes])  # powers of two: the bisected sizes lie between
    title = "; ".join(sorted({f"{d['device'].split(' (')[0]}, {d['date']}, commit {d['project_commit']}" for d in docs}))
    if peers:
        title += "; peers (fused CE, Liger, z-loss by hand): " + PEERS_STAMP
    ax.set_title("Peak memory in Megatron's pretrain\n" + "\n".join(textwrap.wrap(title, 110)), fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def step_ms(row):
    """The median step after the first two (warm-up); with two steps or fewer, the last."""
    steps = [ms for _, ms in sorted(row["step_ms"].items(), key=lambda kv: int(kv[0]))]
    return statistics.median(steps[2:]) if len(steps) > 2 else steps[-1]


def _cell(row):
    if row is None:
        return ""
    cited = "*" if "baseline" in row.get("source", "") else ""  # a row cited from an earlier run
    if row["out_of_memory"]:
        return "out of memory" + cited
    step = step_ms(row)
    step = f"{step / 1000:.1f} s" if step >= 10000 else f"{step:.0f} ms"
    return f"{row['peak_allocated_bytes'] / GIB:.1f} GiB, {step}{cited}"


def table(paths):
    """Markdown: per tokens per micro-batch, each variant's peak allocated memory and its median step after
    the first two (``step_ms``); * marks a row cited from an earlier run (its ``source``)."""
    _, rows = load(paths)
    at = {(r["tokens_per_micro_batch"], r["variant"]): r for r in rows if r.get("micro_batch", 1) == 1}
    lines = ["| tokens per micro-batch | Megatron's CE | `--lm-z-loss-coeff 1e-4` (the op) | "
             "`+ --lm-fused-output-layer` |", "|---|---|---|---|"]
    for tokens in sorted({t for t, v in at if v in LINES}):
        lines.append(f"| {tokens} | " + " | ".join(_cell(at.get((tokens, v))) for v in LINES) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", default=[DEFAULT], help="long_context.json files (same schema)")
    parser.add_argument("--peers", nargs="*", default=PEERS, help="the peers' calls (default: 2026-12-07_h100_peers)")
    parser.add_argument("--out", default="docs/images/long_context_memory.png")
    parser.add_argument("--table", action="store_true", help="print the Markdown table instead of drawing")
    args = parser.parse_args(argv)
    print(table(args.results) if args.table else plot(args.results, args.out, args.peers))


if __name__ == "__main__":
    main()
