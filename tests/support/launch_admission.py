"""When the GPU scripts (tests/support/gpu_layouts.py, tests/support/gpu_megatron_features.py) start a launch, and how long
it may run, by the host's and the GPUs' load, so that each script ends by its deadline with every launch it
could fit, and names the others with the reason.

* A launch starts when the host has the CPU cores for its ranks beside those running
  (:data:`RANK_CPUS` each; the 1-minute load average counts work that is not ours) and each of its GPUs
  the free memory for a rank (:data:`RANK_GPU_MIB`, read with ``nvidia-smi``); else it waits.
* Its timeout is the script's per-launch one scaled by the load (:func:`load_factor`), re-read while it
  runs (a checkpoint save slows down when others start), and never past the script's deadline.
* A launch starts only where :data:`FIT` of its timeout at the load of the moment ends before the deadline
  (a timeout is twice or more a launch's usual time); one that could not, even on a host running nothing
  else, is listed as not run, with what it waited for.
"""

import os
import subprocess
from dataclasses import dataclass, field

RANK_CPUS = 1.5  # cores one rank of these small launches keeps busy (its Python, NCCL's and the loader's threads)
FIT = 0.6  # the share of its timeout a launch must have before the deadline to start
# GPU memory a GPU must have free to take one more rank: an allowance, not a measurement (these tiny models'
# ranks were not measured); it keeps launches off a GPU that other work fills.
RANK_GPU_MIB = 8 * 1024


def gpu_free_mib():
    """``{gpu index: free MiB}`` from ``nvidia-smi`` (no CUDA context in this process); ``{}`` without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return {int(i): float(free) for i, free in (line.split(",") for line in out.strip().splitlines())}
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}


@dataclass
class Load:
    """The host and GPUs at one moment: ``ranks`` of this script's launches are running."""

    cpus: int
    ranks: int = 0
    load1: float = 0.0  # the 1-minute load average (every process on the host)
    free_mib: dict = field(default_factory=dict)  # GPU -> free MiB; empty: unknown (not checked)

    @classmethod
    def now(cls, ranks, gpus=True):
        return cls(cpus=os.cpu_count() or 1, ranks=ranks, load1=os.getloadavg()[0],
                   free_mib=gpu_free_mib() if gpus else {})


def load_factor(load, rank_cpus=RANK_CPUS):
    """How much slower than on an idle host a launch runs now: the busier of our ranks' share of the
    cores and the load average's, at least 1."""
    ours = load.ranks * rank_cpus / load.cpus
    return max(1.0, ours, load.load1 / load.cpus)


@dataclass
class Admission:
    """Admission and timeouts for one script: ``deadline`` is a ``time.time()``, ``timeout_s`` the
    per-launch timeout on an idle host."""

    deadline: float
    timeout_s: float
    rank_cpus: float = RANK_CPUS
    rank_gpu_mib: float = RANK_GPU_MIB
    fit: float = FIT
    waited: dict = field(default_factory=dict)  # launch name -> the last reason it waited

    def timeout(self, load):
        return self.timeout_s * load_factor(load, self.rank_cpus)

    def decide(self, name, ranks, devices, load, now):
        """``"start"``, ``"wait"`` (the reason kept in :attr:`waited`), or ``"not run: <why>"`` (final: even
        on a host running nothing else its timeout would end after the deadline)."""
        if now + self.fit * self.timeout(Load(load.cpus, ranks)) > self.deadline:
            why = f"its timeout would end after the deadline ({self.deadline - now:.0f} s left)"
            if name in self.waited:
                why += f"; it waited for {self.waited[name]}"
            return f"not run: {why}"
        reason = None
        if load.ranks and (load.ranks + ranks) * self.rank_cpus > load.cpus:
            reason = f"CPU cores ({load.ranks} ranks running, {load.cpus} cores)"
        short = [gpu for gpu in devices or () if gpu in load.free_mib and load.free_mib[gpu] < self.rank_gpu_mib]
        if reason is None and short:
            reason = "GPU memory (" + ", ".join(f"GPU {g}: {load.free_mib[g]:.0f} MiB free" for g in short) + ")"
        at_load = self.timeout(Load(load.cpus, load.ranks + ranks, load.load1))
        if reason is None and now + self.fit * at_load > self.deadline:
            reason = f"the load to fall (its timeout at this load: {at_load:.0f} s)"
        if reason is None:
            return "start"
        self.waited[name] = reason
        return "wait"

    def run_deadline(self, start, load):
        """A running launch's deadline: its timeout at the load now, and never past the script's."""
        return min(start + self.timeout(load), self.deadline)


def not_run_lines(not_run):
    """The closing list: ``not run: NAME: why`` per launch (or layout), or one line saying all ran."""
    if not not_run:
        return ["every launch ran"]
    return [f"not run: {name}: {why}" for name, why in not_run.items()]
