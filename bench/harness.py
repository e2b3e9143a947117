"""What the benchmarks share: timing (CUDA events, L2 flushed), device time (CUDA-graph replay or the
profiler's kernel sums), peak memory, the copy-bandwidth floor, and the report: markdown + JSON under
the run's stamp (commit, device, date, versions)."""

import datetime
import functools
import gc
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import subprocess
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRE_DELAY_MS = 2.0  # GPU busy-wait before each timed region so the host queues it whole
L2_FLUSH_BYTES = 256 << 20
GEMM_KERNELS = ("gemm", "sm90", "cutlass", "xmma", "nvjet")


def free_port():
    """A TCP port free on 127.0.0.1 now (one benchmark at a time runs on a machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def capture_cuda_graph(step, warmup=2):
    """(graph, what ``step()`` returned while captured): warm-up calls on a side stream (kernels
    compiled, lazy state made), then one call captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def short(exc, limit=160):
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_oom(exc):
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def log(*args):
    print(*args, flush=True)


def cleanup(device=None):
    gc.collect()
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class Timer:
    """Per-iteration device timing: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda, self.device, self.pairs, self.sleep_cycles = device.type == "cuda", device, [], 0
        if self.cuda:
            self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
            self.sleep_cycles = self._calibrate_sleep()

    def _calibrate_sleep(self):
        """Cycles of torch.cuda._sleep that last PRE_DELAY_MS at the highest clock seen."""
        cycles = 1_000_000
        torch.cuda._sleep(50 * cycles)  # busy the GPU first so its clocks ramp up
        best = float("inf")
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            torch.cuda.synchronize()
            best = min(best, a.elapsed_time(b))
        return int(cycles * PRE_DELAY_MS / max(best, 1e-3))

    def prepare(self):
        """Untimed: push the previous data out of L2 and give the host a head start."""
        if self.cuda:
            self.flush.zero_()
            torch.cuda._sleep(self.sleep_cycles)

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, started):
        self.pairs.append((started, self.start()))

    def median_ms(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            times = [a.elapsed_time(b) for a, b in self.pairs]
        else:
            times = [(b - a) * 1e3 for a, b in self.pairs]
        self.pairs = []
        return statistics.median(times)


def timed(fn, warmup, iters):
    """Median ms of ``fn()`` between CUDA events, synchronized after each call (host included)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_and_peak(step, warmup, iters):
    """(median ms of ``step()``, peak bytes beyond what one step leaves allocated)."""
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return timed(step, warmup, iters), torch.cuda.max_memory_allocated() - base


def graph_replay_ms(step, timer, iters):
    """Device time of ``step()``: captured in a CUDA graph and replayed, L2 flushed before each
    replay (no host or launch cost). None off CUDA or where capture fails."""
    if not timer.cuda:
        return None
    try:
        graph, _ = capture_cuda_graph(step, warmup=2)
    except RuntimeError as exc:  # not capturable here: the event timings still stand
        log(f"CUDA graph capture failed: {exc}")
        return None
    for _ in range(iters):
        timer.prepare()
        started = timer.start()
        graph.replay()
        timer.stop(started)
    return timer.median_ms()


def kernel_table(step, steps=3):
    """Per kernel name: (calls per step, device ms per step), from the torch profiler over ``steps``."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    table = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            calls, us = table.get(e.name, (0, 0.0))
            table[e.name] = (calls + 1, us + e.device_time)
    return {name: (calls / steps, us / 1e3 / steps) for name, (calls, us) in table.items()}


def kernel_ms(step, steps=3):
    """Device time per ``step()`` from the torch profiler (sum of kernel durations): (GEMM ms,
    other ms, kernels per step)."""
    table = kernel_table(step, steps)
    gemm = sum(ms for name, (_, ms) in table.items() if any(k in name.lower() for k in GEMM_KERNELS))
    other = sum(ms for _, ms in table.values()) - gemm
    return gemm, other, sum(calls for calls, _ in table.values())


def step_timeline(step, steps=5):
    """Where a synchronized ``step()``'s time goes, from the torch profiler (CPU and CUDA), median over
    ``steps``: ``kernels`` (sum of kernel durations), ``lead`` (from the step's start on the host to its
    first kernel on the GPU: host work the GPU waits for), ``gaps`` (idle time between its first and last
    kernel), ``host`` (the host's time in the call), all ms; and the profiler's table of host self time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            with record_function(f"cez_step_{i}"):
                step()
            torch.cuda.synchronize()
    events, cuda = prof.events(), torch.autograd.DeviceType.CUDA
    starts = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.name.startswith("cez_step_") and e.device_type != cuda)
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events  # not the steps' GPU annotations
                     if e.device_type == cuda and e.device_time > 0 and not e.name.startswith("cez_step_"))
    rows = []
    for i, (begin, end) in enumerate(starts):
        until = starts[i + 1][0] if i + 1 < len(starts) else float("inf")
        mine = [k for k in kernels if begin <= k[0] < until]
        if not mine:
            continue
        busy, reach = 0.0, mine[0][0]  # union of kernel intervals (overlapping streams counted once)
        for a, b in mine:
            busy += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        rows.append({"kernels": sum(b - a for a, b in mine) / 1e3, "lead": (mine[0][0] - begin) / 1e3,
                     "gaps": (reach - mine[0][0] - busy) / 1e3, "host": (end - begin) / 1e3, "count": len(mine)})
    summary = {key: statistics.median(r[key] for r in rows) for key in rows[0]} if rows else {}
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)
    return summary, table


def copy_bandwidth(device, nbytes=2 << 30, iters=20):
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    nbytes = nbytes if device.type == "cuda" else 64 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    timer = Timer(device)
    for _ in range(3):
        dst.copy_(src)
    for _ in range(iters):
        started = timer.start()
        dst.copy_(src)
        timer.stop(started)
    ms = timer.median_ms()
    del src, dst, timer
    cleanup(device)
    return 2 * nbytes / (ms * 1e-3)


# --------------------------------------------------------------------------- the report


def version(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def commit():
    """``CEZ_BENCH_COMMIT`` where set (a copied tree: ``git archive``'s export has no git), else ``git
    rev-parse --short HEAD`` of this checkout (``+dirty`` with uncommitted changes), or why not (a tree
    inside another checkout does not take that checkout's commit)."""
    if os.environ.get("CEZ_BENCH_COMMIT"):
        return os.environ["CEZ_BENCH_COMMIT"]

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        if os.path.realpath(git("rev-parse", "--show-toplevel")) != os.path.realpath(REPO):
            return "unknown (a copied tree inside another checkout; set CEZ_BENCH_COMMIT)"
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "-uno") else "")
    except Exception:  # noqa: BLE001 - no git, or not a checkout (a copied working tree)
        return "unknown (no git checkout)"


@functools.lru_cache(maxsize=None)
def run_info():
    """Commit, device, date, package versions and the benchmark's environment (once per process)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        device = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    else:
        device = f"CPU ({platform.processor() or platform.machine()})"
    try:
        import mindspeed_cez

        cez = f"{mindspeed_cez.__version__} from {os.path.dirname(mindspeed_cez.__file__)}"
    except Exception as exc:  # noqa: BLE001
        cez = short(exc)
    return {"commit": commit(), "device": device,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "torch": torch.__version__, "triton": version("triton"),
            "megatron-core": version("megatron-core"), "liger-kernel": version("liger-kernel"), "mindspeed_cez": cez,
            "env": {k: os.environ.get(k, "") for k in ("TRITON_INTERPRET", "MINDSPEED_CEZ_BACKEND", "NCCL_NVLS_ENABLE")}}


def run_stamp():
    """One line: commit, device, date and package versions of this run."""
    i = run_info()
    return (f"Run: commit {i['commit']}; {i['device']}; {i['date']}; python {i['python']}, torch {i['torch']}, "
            f"triton {i['triton']}, megatron-core {i['megatron-core']}, liger-kernel {i['liger-kernel']}; "
            f"mindspeed_cez {i['mindspeed_cez']}; env {i['env']}")


def tables(lines):
    """The markdown tables in ``lines`` as lists of ``{column: cell}`` rows (separator rows left out)."""
    found, header = [], None
    for line in "\n".join(lines).splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            found.append([])
        elif not all(set(c) <= set("-: ") for c in cells):
            found[-1].append(dict(zip(header, cells)))
    return found


def write_report(path, lines):
    """The report's text under the run's stamp; with ``path``, also written there, and its tables
    with the run's details to ``path`` with a ``.json`` suffix."""
    text = run_stamp() + "\n\n" + "\n".join(lines) + "\n"
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
        with open(os.path.splitext(path)[0] + ".json", "w") as fh:
            json.dump({"run": run_info(), "tables": tables(lines)}, fh, indent=1)
    return text
