"""The self-check's time column: warm-up calls outside the timed region (a cold first call, slow
compilations or allocations, never shows as a row's time), and a CPU footnote that says only what holds."""

import time

import torch
import torch.distributed as dist

from mindspeed_cez import selfcheck
from support import run_on_ranks


def _slow_start(cold_calls, cold_s, warm_s):
    calls = []

    def fn():
        calls.append(None)
        time.sleep(cold_s if len(calls) <= cold_calls else warm_s)

    return fn, calls


def test_cold_calls_stay_out_of_the_timed_median():
    for cold_calls in (1, 2, 3):
        fn, calls = _slow_start(cold_calls, 0.3, 0.01)
        ms = selfcheck._time_ms(fn, torch.device("cpu"), reps=3)
        assert ms < 150, (cold_calls, ms)  # the warm calls' 10 ms (and a loaded machine), never the 300 ms
        assert len(calls) >= 3 + selfcheck.WARMUP_MIN


def test_warm_up_is_bounded(monkeypatch):
    times = iter([2.0 ** k for k in range(20)])  # never settles: each call twice the last
    monkeypatch.setattr(selfcheck, "_call_ms", lambda fn, device: next(times))
    ms = selfcheck._time_ms(None, torch.device("cpu"), reps=1)
    assert ms == 2.0 ** selfcheck.WARMUP_MAX  # the warm-ups, then the one timed call


def test_warm_up_stops_once_two_calls_agree(monkeypatch):
    times = iter([900.0, 120.0, 100.0, 101.0, 99.0, 100.0])
    monkeypatch.setattr(selfcheck, "_call_ms", lambda fn, device: next(times))
    assert selfcheck._time_ms(None, torch.device("cpu"), reps=3) == 100.0  # 101, 99, 100 timed


def test_stalls_in_the_timed_calls_do_not_make_the_median(monkeypatch):
    """A machine that stalls the process now and then (seconds, on a shared host): more calls join while
    the median sits over twice the fastest, up to 3 x reps in all."""
    times = iter([50.0, 50.0] + [10.0, 3000.0, 2500.0, 3100.0, 10.0] + [10.0] * 10)
    monkeypatch.setattr(selfcheck, "_call_ms", lambda fn, device: next(times))
    assert selfcheck._time_ms(None, torch.device("cpu"), reps=5) == 10.0  # 3 stalls of 5: two more calls
    assert len(list(times)) == 8
    always = iter([50.0, 50.0] + [1.0] + [100.0] * 40)  # never settles: stops at 3 x reps
    monkeypatch.setattr(selfcheck, "_call_ms", lambda fn, device: next(always))
    assert selfcheck._time_ms(None, torch.device("cpu"), reps=5) == 100.0
    assert len(list(always)) == 41 - 15


def _ranks_that_disagree(rank, world_size):
    """Rank 0's warm-up never settles and its timed calls stall; rank 1's calls agree at once: each call runs a collective, as the
    op's forward does at TP > 1, so a rank that stopped before the other would hang it."""
    calls = [0]
    times = iter([2.0 ** k for k in range(8)] + [1.0] + [3000.0] * 40 if rank == 0 else [10.0] * 60)
    selfcheck._call_ms = lambda fn, device: (fn(), next(times))[1]

    def collective():
        calls[0] += 1
        dist.all_reduce(torch.ones(1))

    selfcheck._time_ms(collective, torch.device("cpu"), reps=3, group=dist.group.WORLD)
    counts = torch.tensor([calls[0]])
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    assert calls[0] == counts.item() == selfcheck.WARMUP_MAX + 3 * 3, (rank, calls[0], counts.item())


def test_ranks_time_the_same_number_of_calls():
    """At TP = 2 the timed call runs the op's all-gather: warm-up and extra calls go on while any rank
    would, so every rank makes the same calls (the run hung on GPUs when ranks decided alone)."""
    run_on_ranks(2, _ranks_that_disagree, timeout=120)


def _footnote(monkeypatch, capsys, rows):
    monkeypatch.setattr(selfcheck, "run", lambda args, device, group=None, chosen=None: rows)
    monkeypatch.setattr(selfcheck, "environment", lambda device: {
        "device": "cpu", "device_name": "x", "torch": "t", "triton": "-", "triton-ascend": None, "torch_npu": None})
    monkeypatch.setattr(selfcheck, "table", lambda results: "")
    monkeypatch.setattr(selfcheck, "absent_backends", lambda device, world: {})
    assert selfcheck.main([]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("ms on the CPU")]


def test_the_cpu_footnote_names_triton_only_where_a_timed_row_is_triton(monkeypatch, capsys):
    row = {"status": "ok", "backend": "torch", "ce_backend": None, "ms": 1.0}
    (line,) = _footnote(monkeypatch, capsys, [row])
    assert "Triton" not in line and "other work on the machine" in line
    (line,) = _footnote(monkeypatch, capsys, [row, dict(row, backend="triton")])
    assert "the Triton rows run in its interpreter" in line
