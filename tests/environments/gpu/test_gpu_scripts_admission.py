"""The features script's launch loop (tests/support/gpu_megatron_features.py) on a fake 4-GPU host with a fake
clock: launches start as the cores allow, every one runs where the deadline leaves room, and those it
does not are named with the reason; no GPU, no Megatron (each launch is a fake of known duration)."""

import types

from support import gpu_megatron_features as features
from support import launch_admission
import torch
from support.gpu_layouts import Checks

DURATION_S = 100.0


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def _run_features(monkeypatch, tmp_path, capsys, launches, deadline_s, cpus=16):
    clock = FakeClock()
    monkeypatch.setattr(features, "time", types.SimpleNamespace(time=clock.time, sleep=clock.sleep))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(launch_admission.Load, "now", classmethod(
        lambda cls, ranks, gpus=True: cls(cpus=cpus, ranks=ranks, load1=0.0, free_mib={g: 80_000.0 for g in range(4)})))
    specs = [features.Spec(f"graph-{i}", "graphs", "z", [], 4) for i in range(launches)]
    monkeypatch.setattr(features, "specs", lambda cpu, work: list(specs))
    running, peak, timeouts = [], [0], []

    def start_run(run, args, nproc, devices, timeout_s, env=None):
        run.start, run.deadline = clock.now, clock.now + timeout_s
        running.append(run)
        timeouts.append(timeout_s)
        peak[0] = max(peak[0], 4 * len(running))

    def poll(run):
        if run.rc is None and clock.now - run.start >= DURATION_S:
            run.rc, run.wall_s = 0, clock.now - run.start
            running.remove(run)
        return run.rc is not None

    monkeypatch.setattr(features, "start_run", start_run)
    monkeypatch.setattr(features, "poll", poll)
    monkeypatch.setattr(features, "CHECKERS", {"graphs": lambda runs, specs: Checks("graphs")})
    rc = features.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                        "--deadline-s", str(deadline_s)])
    return rc, peak[0], timeouts, capsys.readouterr().out


def test_every_launch_runs_where_the_deadline_leaves_room(monkeypatch, tmp_path, capsys):
    rc, peak, timeouts, out = _run_features(monkeypatch, tmp_path, capsys, launches=6, deadline_s=540)
    assert rc == 0 and "every launch ran" in out, out
    assert len(timeouts) == 6 and peak * launch_admission.RANK_CPUS <= 16  # 2 launches of 4 ranks at once
    assert all(t == features.LAUNCH_TIMEOUT_S["gpu"] for t in timeouts)  # an idle fake host: unscaled


def test_launches_that_cannot_end_by_the_deadline_are_named(monkeypatch, tmp_path, capsys):
    rc, _, timeouts, out = _run_features(monkeypatch, tmp_path, capsys, launches=6, deadline_s=250)
    assert rc == 1 and len(timeouts) == 4, out  # waves at 0 and 100 s; at 200 s, 120 s no longer fit in 50
    lines = [line for line in out.splitlines() if line.startswith("not run: ")]
    assert len(lines) == 2 and all("its timeout would end after the deadline" in line
                                   and "it waited for CPU cores" in line for line in lines), out
