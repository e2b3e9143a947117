"""Read a torch-profiler chrome trace of training steps: where the GPU time goes, and when it idles.

For the steps the trace holds (the span of its ``ProfilerStep#`` annotations):

* ``gpu_busy_share``: union of kernel intervals / wall time;
* ``lm_head_share``: kernels of the output layer and the LM loss / wall time -- kernels launched
  inside a CPU op with the vocab size among its input dims (the output-layer GEMMs, Megatron's CE,
  a z-loss by hand; needs the trace's shapes: Megatron's ``--pytorch-profiler-collect-shapes``) and
  this package's Triton kernels (by name);
* ``top_kernels``: the kernels with the most time; ``gaps``: the longest stretches without a
  kernel, with the CPU ops that were running on the launching thread when they began.

    python bench/step_profile.py TRACE.json[.gz] --vocab 151936
"""

import argparse
import bisect
import gzip
import json
import os
from collections import defaultdict

OUR_KERNELS = ("_forward_kernel", "_grad_kernel", "_rescale_kernel", "_loss_from_partials_kernel")


def load_events(path):
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as fh:
        return json.load(fh)["traceEvents"]


def find_trace(directory):
    """The newest ``*.json`` / ``*.json.gz`` below ``directory``, or None."""
    paths = [os.path.join(root, f) for root, _, files in os.walk(directory) for f in files
             if f.endswith((".json", ".json.gz"))]
    return max(paths, key=os.path.getmtime) if paths else None


def _union(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _inside(merged, starts, t):
    i = bisect.bisect_right(starts, t) - 1
    return i >= 0 and t <= merged[i][1]


def summarize(events, vocab=None, n_gaps=8, n_kernels=8):
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and "dur" in e]
    if not steps:
        return None
    start, end = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    window = end - start
    kernels = [e for e in events if e.get("cat") == "kernel" and e["ts"] < end and e["ts"] + e["dur"] > start]
    busy = _union([(max(e["ts"], start), min(e["ts"] + e["dur"], end)) for e in kernels])
    out = {"steps": len({e["name"] for e in steps}), "window_ms": window / 1e3,
           "gpu_busy_share": sum(b - a for a, b in busy) / window}

    # kernel -> the thread and time of its launch (runtime events share the kernel's correlation id)
    launches = {e["args"]["correlation"]: (e["tid"], e["ts"]) for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    vocab_ops = defaultdict(list)
    if vocab:
        for e in cpu_ops:
            if any(vocab in dims for dims in e.get("args", {}).get("Input Dims", []) if isinstance(dims, list)):
                vocab_ops[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    vocab_ops = {tid: _union(v) for tid, v in vocab_ops.items()}
    vocab_starts = {tid: [a for a, _ in v] for tid, v in vocab_ops.items()}

    head, per_name = [], defaultdict(float)
    for k in kernels:
        per_name[k["name"][:80]] += k["dur"]
        launch = launches.get(k.get("args", {}).get("correlation"))
        ours = k["name"].startswith(OUR_KERNELS)
        in_vocab_op = launch is not None and launch[0] in vocab_ops and _inside(vocab_ops[launch[0]], vocab_starts[launch[0]], launch[1])
        if ours or in_vocab_op:
            head.append((max(k["ts"], start), min(k["ts"] + k["dur"], end)))
    out["lm_head_share"] = sum(b - a for a, b in _union(head)) / window if vocab else None
    out["top_kernels"] = [(name, ms / 1e3) for name, ms in sorted(per_name.items(), key=lambda x: -x[1])[:n_kernels]]

    # the longest idle stretches, and what the host was doing when each began
    gaps = [(b0, a1) for (_, b0), (a1, _) in zip(busy, busy[1:])]
    if busy:
        gaps = [(start, busy[0][0])] + gaps + [(busy[-1][1], end)]
    gaps = sorted((g for g in gaps if g[1] > g[0]), key=lambda g: g[0] - g[1])[:n_gaps]
    out["idle_ms_total"] = (window - sum(b - a for a, b in busy)) / 1e3
    out["gaps"] = []
    for a, b in gaps:
        running = sorted((e for e in cpu_ops if e["ts"] <= a <= e["ts"] + e["dur"]), key=lambda e: -e["dur"])
        names = [e["name"][:60] for e in running]
        out["gaps"].append({"ms": (b - a) / 1e3, "at_ms": (a - start) / 1e3,
                            "cpu_ops": names[:2] + names[2:][-2:]})  # outermost two, innermost two
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a chrome trace, or a folder holding one")
    parser.add_argument("--vocab", type=int, default=None)
    args = parser.parse_args(argv)
    path = find_trace(args.trace) if os.path.isdir(args.trace) else args.trace
    print(json.dumps(summarize(load_events(path), args.vocab), indent=1))


if __name__ == "__main__":
    main()
