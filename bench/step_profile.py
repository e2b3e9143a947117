"""Read a torch-profiler chrome trace of training steps: where the GPU time goes, and when it idles.

For the steps the trace holds (the span of its ``ProfilerStep#`` annotations):

* ``gpu_busy_share``: union of kernel intervals / wall time;
* ``lm_head_share``: kernels of the output layer and the LM loss / wall time -- kernels launched
  inside a CPU op with the vocab size among its input dims (the output-layer GEMMs, Megatron's CE,
  a z-loss by hand; needs the trace's shapes: Megatron's ``--pytorch-profiler-collect-shapes``),
  inside this package's autograd Functions (the fused output layer's vocab chunks), and this
  package's Triton kernels (by name);
* ``top_kernels``: the kernels with the most time; ``gaps``: the longest stretches without a
  kernel, with the CPU ops that were running on the launching thread when they began;
* ``idle_by_gap_length``: idle time and gap count per gap length (many short gaps: the host
  launches too slowly; a few long ones: host syncs, allocator, the optimizer step);
  ``idle_by_launching_op``: idle time per innermost CPU op that launched the kernel ending a gap;
  ``syncs``: host-blocking runtime calls (synchronize, blocking copies) in the window.

    python bench/step_profile.py TRACE.json[.gz] --vocab 151936
"""

import argparse
import bisect
import gzip
import json
import os
from collections import defaultdict

OUR_KERNELS = ("_forward_kernel", "_grad_kernel", "_rescale_kernel", "_loss_from_partials_kernel", "_partials_kernel",
               "_merge_kernel")
# this package's autograd Functions: the fused output layer's GEMMs work on vocab chunks, not the vocab
OUR_FUNCTIONS = ("VocabParallelCrossEntropyZLoss", "LinearCrossEntropyZLoss")


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
            if any(vocab in dims for dims in e.get("args", {}).get("Input Dims", []) if isinstance(dims, list)) or any(
                    f in e["name"] for f in OUR_FUNCTIONS):
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
    out.update(_idle_breakdown(events, busy, kernels, launches, cpu_ops, start, end))
    return out


GAP_BUCKETS_MS = (0.02, 0.1, 1.0, 10.0)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


def _innermost(ops_by_tid, starts_by_tid, tid, t):
    """Name of the innermost CPU op of thread ``tid`` running at ``t`` (ops nest: the latest start)."""
    ops, starts = ops_by_tid.get(tid, []), starts_by_tid.get(tid, [])
    i = bisect.bisect_right(starts, t) - 1
    for j in range(i, max(i - 200, -1), -1):
        if ops[j]["ts"] + ops[j]["dur"] >= t:
            return ops[j]["name"][:60]
    return "(no CPU op)"


def _idle_breakdown(events, busy, kernels, launches, cpu_ops, start, end):
    """Idle time by gap length and by the CPU op that launched the kernel ending each gap; syncs."""
    buckets = defaultdict(lambda: [0.0, 0])
    by_op = defaultdict(float)
    ops_by_tid = defaultdict(list)
    for e in sorted(cpu_ops, key=lambda e: e["ts"]):
        ops_by_tid[e["tid"]].append(e)
    starts_by_tid = {tid: [e["ts"] for e in ops] for tid, ops in ops_by_tid.items()}
    first_kernel_at = {}
    for k in kernels:
        key = k["ts"]
        if key not in first_kernel_at:
            first_kernel_at[key] = k
    kernel_starts = sorted(first_kernel_at)
    for (_, a), (b, _) in zip(busy, busy[1:]):
        ms = (b - a) / 1e3
        label = next((f"<{lim} ms" for lim in GAP_BUCKETS_MS if ms < lim), f">={GAP_BUCKETS_MS[-1]} ms")
        buckets[label][0] += ms
        buckets[label][1] += 1
        i = bisect.bisect_left(kernel_starts, b)
        kernel = first_kernel_at[kernel_starts[i]] if i < len(kernel_starts) else None
        launch = launches.get(kernel.get("args", {}).get("correlation")) if kernel else None
        if launch is None:
            by_op["(launch not in trace)"] += ms
        elif launch[1] <= a:
            by_op["(launched before the gap: waited on the device)"] += ms
        else:
            by_op[_innermost(ops_by_tid, starts_by_tid, launch[0], launch[1])] += ms
    syncs = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name", "").startswith(SYNC_CALLS) \
                and start <= e["ts"] < end and "dur" in e:
            syncs[e["name"]][0] += 1
            syncs[e["name"]][1] += e["dur"] / 1e3
    return {
        "idle_by_gap_length": {k: {"ms": round(v[0], 1), "gaps": v[1]} for k, v in sorted(buckets.items())},
        "idle_by_launching_op": sorted(((n, round(ms, 1)) for n, ms in by_op.items()), key=lambda x: -x[1])[:12],
        "syncs": {n: {"calls": c, "ms": round(ms, 1)} for n, (c, ms) in syncs.items()},
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a chrome trace, or a folder holding one")
    parser.add_argument("--vocab", type=int, default=None)
    args = parser.parse_args(argv)
    path = find_trace(args.trace) if os.path.isdir(args.trace) else args.trace
    print(json.dumps(summarize(load_events(path), args.vocab), indent=1))


if __name__ == "__main__":
    main()
