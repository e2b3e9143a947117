"""Long context on one GPU, in Megatron's own ``pretrain`` (``e2e_megatron.py``'s worker, config ``long``).

``memory``: per variant, peak memory, step time and out-of-memory per tokens per micro-batch: from
``--start`` doubling until a run fails, then bisected between the last fit and the first failure to
``--resolution`` tokens. ``throughput``: per variant at ``--tokens``, its fastest setting that fits
(micro-batch 1 / 2, recompute none / selective / full), every variant searched the same way.
Both write ``long_context.json`` / ``throughput.json`` under ``--out`` (rows in one schema,
``bench/results/2026-12-06_h100_long_context/README.md``) and print what each launch gave.
``--config deep`` (16 layers): memory runs micro-batches of sequences of ``SEQUENCE`` tokens, one micro-batch a
step (memory per token is the same as one long sequence with SDPA attention; the step's time is not
quadratic); ``--start estimate`` starts each variant at ``estimate_memory.py``'s longest micro-batch and
steps by ``--resolution`` up or down to the first fit / failure (``--max-launches`` each).
``--known FILE``: rows of an earlier run (same schema) for ``--cite`` variants are taken from it,
not run again; ``memory --at TOKENS ...`` runs only those sizes beside them and brackets the failure
from every row (a bisection step per device call). Method: bench/README.md."""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from e2e_megatron import COMMON, CONFIGS, CONFIG_ENV, launch  # noqa: E402
from estimate_memory import Model, longest_tokens  # noqa: E402
from harness import run_info  # noqa: E402

CONFIG = "long"  # e2e_megatron's; --config busy: the GPU-bound model at 8192 tokens (throughput)
RECOMPUTE = {  # Megatron's recompute settings, least work first
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
}
VARIANT_NAMES = {"native": "Megatron's CE, no z-loss",
                 "fused": "Megatron's --cross-entropy-loss-fusion --cross-entropy-fusion-impl native, no z-loss",
                 "liger": "liger-kernel's apply_liger_kernel_to_megatron(rms_norm=False, cross_entropy=True), no z-loss",
                 "z_by_hand": "Megatron's CE + 1e-4 * logsumexp(logits.float())**2 in torch",
                 "cez": "--lm-z-loss-coeff 1e-4",
                 "cez_fol": "+ --lm-fused-output-layer (default blocks)"}
SEQUENCE = {"deep": 8192}  # memory: tokens per micro-batch as micro-batches of this sequence, one a step


def megatron_args(tokens, micro_batch=1, recompute="full", one_micro_batch=False):
    """The config's arguments for ``tokens`` per micro-batch: ``micro_batch`` sequences of ``tokens / micro_batch``;
    ``one_micro_batch``: the step's global batch is that one micro-batch."""
    seq = tokens // micro_batch
    return ["--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(micro_batch),
            *RECOMPUTE[recompute], *(["--global-batch-size", str(micro_batch)] if one_micro_batch else [])]


class Runs:
    """The launches of one benchmark: each (variant, tokens, micro-batch, recompute) run once, rows kept
    in the results' schema; rows of ``known`` for the ``cite`` variants answer without a launch."""

    def __init__(self, out, iters, budget_s, timeout_s, known=None, cite=(), config=CONFIG, one_micro_batch=False):
        self.out, self.iters, self.timeout_s, self.config = out, iters, timeout_s, config
        self.one_micro_batch = one_micro_batch
        self.deadline = time.time() + budget_s
        self.rows, self.cited = [], {}
        for row in (known or {}).get("rows", []):
            if row["variant"] in cite:
                key = (row["variant"], row["tokens_per_micro_batch"], row.get("micro_batch", 1),
                       row.get("recompute", "full"))
                self.cited[key] = dict(row, source=f"{known.get('device')}, {known.get('date')}, "
                                                   f"commit {known.get('project_commit')}")

    def left_s(self):
        return self.deadline - time.time()

    def __call__(self, variant, tokens, micro_batch=1, recompute="full", iters=None):
        """The row of this run (a cited one, or a launch); None once the budget is spent."""
        key = (variant, tokens, micro_batch, recompute)
        for row in self.rows:
            if (row["variant"], row["tokens_per_micro_batch"], row["micro_batch"], row["recompute"]) == key:
                return row
        if key in self.cited:
            row = dict(self.cited[key], micro_batch=micro_batch, recompute=recompute)
            print(f"{variant} {tokens} tokens (mbs {micro_batch}, recompute {recompute}): cited from {row['source']}",
                  flush=True)
            self.rows.append(row)
            return row
        if self.left_s() < 60:
            print(f"budget spent: {variant} at {tokens} tokens not run", flush=True)
            return None
        iters = iters or self.iters(tokens)
        name = f"{variant}_{tokens}_mbs{micro_batch}_{recompute}"
        run = launch(variant, self.config, iters, os.path.join(self.out, name + ".log"),
                     timeout_s=min(self.timeout_s, self.left_s()), extra_args=megatron_args(tokens, micro_batch, recompute, self.one_micro_batch))
        row = {"tokens_per_micro_batch": tokens, "variant": variant, "micro_batch": micro_batch, "recompute": recompute,
               "rc": run["rc"], "out_of_memory": run["out_of_memory"],
               "peak_allocated_bytes": None if run["out_of_memory"] else run["peak_bytes"],
               "step_ms": {str(i): ms for i, ms in sorted(run["steps_ms"].items())}, "wall_s": round(run["wall_s"], 1)}
        self.rows.append(row)
        steps = ", ".join(f"{ms:.0f}" for ms in row["step_ms"].values())
        peak = f"{row['peak_allocated_bytes'] / 2**30:.1f} GiB" if row["peak_allocated_bytes"] else "-"
        print(f"{variant} {tokens} tokens (mbs {micro_batch}, recompute {recompute}): rc {run['rc']}"
              f"{' OUT OF MEMORY' if run['out_of_memory'] else ''}, peak {peak}, steps (ms) [{steps}], "
              f"{run['wall_s']:.0f} s", flush=True)
        return row


def fits(row):
    return row is not None and row["rc"] == 0 and not row["out_of_memory"]


def steady_ms(row, skip=2):
    """The median step after the first ``skip`` (warm-up); with fewer steps, the last."""
    steps = [ms for i, ms in sorted(row["step_ms"].items(), key=lambda kv: int(kv[0]))]
    return statistics.median(steps[skip:]) if len(steps) > skip else (steps[-1] if steps else None)


def search_memory(runs, variant, start, resolution, max_tokens, micro_batch=lambda tokens: 1):
    """``(largest that fits, smallest that failed)`` for ``variant``: doubling from ``start``, then
    bisection to ``resolution`` tokens; a run stopped for time, not memory, ends the search there.
    ``micro_batch(tokens)``: the sequences the tokens are split into."""
    fit, fail, tokens = None, None, start
    while tokens <= max_tokens:
        row = runs(variant, tokens, micro_batch(tokens))
        if row is None or (not fits(row) and not row["out_of_memory"]):
            return fit, fail  # budget or deadline: no verdict on this size
        if not fits(row):
            fail = tokens
            break
        fit, tokens = tokens, tokens * 2
    while fit is not None and fail is not None and fail - fit > resolution:
        mid = (fit + fail) // 2 // resolution * resolution
        row = runs(variant, mid, micro_batch(mid))
        if row is None or (not fits(row) and not row["out_of_memory"]):
            break
        fit, fail = (mid, fail) if fits(row) else (fit, mid)
    return fit, fail


def search_near(runs, variant, start, resolution, max_tokens, max_launches, micro_batch=lambda tokens: 1):
    """``(largest that fits, smallest that failed)`` for ``variant`` from ``start`` (an estimate): up by
    ``resolution`` while it fits, down while it fails, until one of each or ``max_launches`` runs."""
    fit, fail, tokens = None, None, start
    for _ in range(max_launches):
        if not resolution <= tokens <= max_tokens:
            break
        row = runs(variant, tokens, micro_batch(tokens))
        if row is None or (not fits(row) and not row["out_of_memory"]):
            break  # budget or deadline: no verdict on this size
        if fits(row):
            fit, tokens = tokens, tokens + resolution
        else:
            fail, tokens = tokens, tokens - resolution
        if fit is not None and fail is not None:
            break
    return fit, fail


def estimated_start(config, variant, resolution, capacity_bytes):
    """``estimate_memory.py``'s longest micro-batch for ``variant`` on this card, down to ``resolution``
    (at least one ``resolution``)."""
    model = Model.from_megatron_args(COMMON + CONFIGS[config])
    return max(resolution, longest_tokens(model, variant, capacity_bytes) // resolution * resolution)


def bracket(rows, variant):
    """``(largest that fits, smallest that ran out of memory)`` among ``variant``'s rows, cited ones included."""
    sizes = [(r["tokens_per_micro_batch"], fits(r), r["out_of_memory"]) for r in rows if r["variant"] == variant]
    fit = max((t for t, ok, _ in sizes if ok), default=None)
    fail = min((t for t, _, oom in sizes if oom and (fit is None or t > fit)), default=None)
    return fit, fail


def global_batch(config):
    """Sequences per step: the last ``--global-batch-size`` of the config's arguments (Megatron takes the last)."""
    args = COMMON + CONFIGS[config]
    return int([args[i + 1] for i, a in enumerate(args) if a == "--global-batch-size"][-1])


def search_throughput(runs, variant, tokens):
    """The settings tried for ``variant`` at ``tokens`` per micro-batch and its fastest that fits: per
    micro-batch size (2, 1), recompute from none to full, stopping at the first that fits (more
    recompute only adds work). Tokens per second per GPU: the global batch's tokens over the median
    steady step."""
    tried = []
    for micro_batch in (2, 1):
        for recompute in RECOMPUTE:
            row = runs(variant, tokens * micro_batch, micro_batch, recompute)
            if row is None:
                break
            tried.append(row)
            if fits(row):
                break
    best = None
    for row in tried:
        step = steady_ms(row) if fits(row) else None
        if step:
            row["tokens_per_s"] = global_batch(runs.config) * tokens / (step / 1e3)
            if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
                best = row
    return tried, best


def header(kind, config):
    info = run_info()
    return {"benchmark": kind, "device": info["device"], "date": info["date"][:10], "run": info,
            "project_commit": info["commit"],
            "stack": f"megatron-core {info['megatron-core']}, torch {info['torch']}, triton {info['triton']}, "
                     f"Python {info['python']}",
            "config": config, "sequence": SEQUENCE.get(config),
            "megatron_args": " ".join(COMMON + CONFIGS[config]) + " + bench/long_context.py megatron_args(); env "
                             + " ".join(f"{k}={v}" for k, v in CONFIG_ENV[config].items()),
            "variants": {v: VARIANT_NAMES[v] for v in VARIANT_NAMES}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("memory", "throughput"))
    parser.add_argument("--variants", nargs="+", default=list(VARIANT_NAMES), choices=list(VARIANT_NAMES))
    parser.add_argument("--start", default="32768",
                        help="memory: the first tokens per micro-batch, or 'estimate' (estimate_memory.py's longest, "
                             "then steps of --resolution)")
    parser.add_argument("--max-launches", type=int, default=3, help="memory --start estimate: launches per variant")
    parser.add_argument("--gpu-gib", type=float, default=None,
                        help="--start estimate: the card's memory (default: the first GPU's, which --plan needs)")
    parser.add_argument("--plan", action="store_true", help="print each variant's first size and launch nothing")
    parser.add_argument("--resolution", type=int, default=16384, help="memory: bisect to this many tokens")
    parser.add_argument("--max-tokens", type=int, default=1 << 20, help="memory: no run above this")
    parser.add_argument("--at", type=int, nargs="+", default=None,
                        help="memory: run these tokens per micro-batch only (a bisection step taken by hand across "
                             "device calls, beside --known rows), and bracket the failure from every row")
    parser.add_argument("--tokens", type=int, default=32768, help="throughput: tokens per sequence")
    parser.add_argument("--config", default=CONFIG, choices=("long", "busy", "deep"),
                        help="e2e_megatron's model: long (default), deep (16 layers of long's width; memory in "
                             "micro-batches of 8192-token sequences) or busy (8 layers, hidden 3072, 8 sequences a step)")
    parser.add_argument("--iters", type=int, default=None,
                        help="iterations per launch (default: memory 4, 2 from 262144 tokens, where a step takes over "
                             "20 s and the peak comes in the first; throughput 6)")
    parser.add_argument("--budget-s", type=float, default=540, help="no launch after this many seconds")
    parser.add_argument("--timeout-s", type=float, default=420, help="one launch at most")
    parser.add_argument("--known", default=None, help="an earlier long_context.json whose rows --cite takes")
    parser.add_argument("--cite", nargs="*", default=(), choices=list(VARIANT_NAMES),
                        help="variants whose rows in --known are taken, not run again")
    parser.add_argument("--out", default="out/long_context")
    args = parser.parse_args(argv)
    sequence = SEQUENCE.get(args.config)
    micro_batch = (lambda tokens: tokens // sequence) if sequence else (lambda tokens: 1)
    if sequence and args.mode == "memory" and args.resolution % sequence:
        parser.error(f"--config {args.config}: --resolution a multiple of its sequence, {sequence}")
    starts = {}
    if args.mode == "memory" and not args.at:
        if args.start == "estimate":
            if args.gpu_gib is None:
                import torch

                capacity = torch.cuda.get_device_properties(0).total_memory
            else:
                capacity = args.gpu_gib * 2 ** 30
            starts = {v: estimated_start(args.config, v, args.resolution, capacity) for v in args.variants}
        else:
            starts = dict.fromkeys(args.variants, int(args.start))
    if args.plan:
        for v, tokens in starts.items():
            print(f"{v}: first {tokens} tokens per micro-batch ({micro_batch(tokens)} x {tokens // micro_batch(tokens)})")
        return
    os.makedirs(args.out, exist_ok=True)
    known = None
    if args.known:
        with open(args.known) as fh:
            known = json.load(fh)
    if args.iters:
        iters = lambda tokens: args.iters  # noqa: E731
    elif args.mode == "memory":
        iters = lambda tokens: 2 if tokens >= 262144 else 4  # noqa: E731
    else:
        iters = lambda tokens: 6  # noqa: E731
    runs = Runs(args.out, iters, args.budget_s, args.timeout_s, known, args.cite, args.config,
                one_micro_batch=bool(sequence) and args.mode == "memory")
    data = header(args.mode, args.config)
    name = "long_context" if args.mode == "memory" else "throughput"
    path = os.path.join(args.out, f"{name}.json" if args.config == CONFIG else f"{name}_{args.config}.json")
    if args.mode == "memory":
        data["search"] = {}
        for variant in args.variants:
            if args.at:
                for tokens in args.at:
                    runs(variant, tokens, micro_batch(tokens))
                for key in runs.cited:  # the cited rows of this variant count in the bracket
                    if key[0] == variant:
                        runs(*key)
                fit, fail = bracket(runs.rows, variant)
            elif args.start == "estimate":
                fit, fail = search_near(runs, variant, starts[variant], args.resolution, args.max_tokens,
                                        args.max_launches, micro_batch)
            else:
                fit, fail = search_memory(runs, variant, starts[variant], args.resolution, args.max_tokens, micro_batch)
            data["search"][variant] = {"largest_fit": fit, "smallest_failure": fail,
                                       "resolution": None if args.at else args.resolution}  # None: a bracket
            if starts:
                data["search"][variant]["start"] = starts[variant]
            print(f"{variant}: trains {fit} tokens per micro-batch; {fail or 'no failure up to the last run'}"
                  f"{' fails' if fail else ''}", flush=True)
    else:
        data["tokens_per_sequence"], data["global_batch"], data["best"] = args.tokens, global_batch(args.config), {}
        for variant in args.variants:
            tried, best = search_throughput(runs, variant, args.tokens)
            data["best"][variant] = best and {k: best[k] for k in ("micro_batch", "recompute", "tokens_per_s")}
            print(f"{variant}: best " + (f"mbs {best['micro_batch']}, recompute {best['recompute']}: "
                                         f"{best['tokens_per_s']:.0f} tokens/s" if best else "none fits"), flush=True)
    data["rows"] = runs.rows
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
