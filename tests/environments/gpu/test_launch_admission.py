"""Admission and timeouts of the GPU scripts' launches (tests/support/launch_admission.py) on fake loads: a launch
starts when the cores and its GPUs' memory allow, waits otherwise, is named as not run (with what it
waited for) when its timeout would end after the deadline, and a running launch's timeout follows the load."""

import math

from support.launch_admission import FIT, RANK_CPUS, RANK_GPU_MIB, Admission, Load, load_factor, not_run_lines

FREE = {g: 70_000.0 for g in range(4)}


def test_the_load_factor():
    assert load_factor(Load(cpus=64)) == 1.0  # idle
    assert load_factor(Load(cpus=64, ranks=32)) == 1.0  # 48 of 64 cores
    assert math.isclose(load_factor(Load(cpus=64, ranks=64)), 64 * RANK_CPUS / 64)
    assert load_factor(Load(cpus=16, load1=48.0)) == 3.0  # others' work counts too


def test_a_launch_starts_when_cores_and_gpu_memory_allow():
    adm = Admission(deadline=1000.0, timeout_s=200.0)
    assert adm.decide("a", 4, [0, 1, 2, 3], Load(cpus=64, free_mib=FREE), now=0.0) == "start"
    assert adm.decide("b", 4, [0, 1, 2, 3], Load(cpus=64, ranks=38, free_mib=FREE), now=0.0) == "start"  # 63 cores
    busy = Load(cpus=64, ranks=44, free_mib=FREE)  # 44 + 4 ranks need 72 cores
    assert adm.decide("c", 4, [0, 1, 2, 3], busy, now=0.0) == "wait"
    assert adm.waited["c"] == "CPU cores (44 ranks running, 64 cores)"
    full = {**FREE, 2: RANK_GPU_MIB - 1.0}
    assert adm.decide("d", 4, [0, 1, 2, 3], Load(cpus=64, ranks=4, free_mib=full), now=0.0) == "wait"
    assert adm.waited["d"].startswith("GPU memory (GPU 2: ")
    assert adm.decide("e", 2, [0, 1], Load(cpus=64, ranks=4, free_mib=full), now=0.0) == "start"  # not on GPU 2
    assert adm.decide("f", 4, [0, 1, 2, 3], Load(cpus=64, ranks=4), now=0.0) == "start"  # memory unknown: not held


def test_the_first_launch_starts_on_a_small_host():
    """A host with fewer cores than one launch's ranks need still runs launches, one at a time."""
    adm = Admission(deadline=1000.0, timeout_s=200.0)
    assert adm.decide("a", 4, None, Load(cpus=2), now=0.0) == "start"
    assert adm.decide("b", 4, None, Load(cpus=2, ranks=4), now=0.0) == "wait"


def test_a_launch_that_cannot_end_by_the_deadline_is_not_run_and_says_why():
    adm = Admission(deadline=500.0, timeout_s=200.0, fit=1.0)  # the whole timeout must fit
    assert adm.decide("a", 4, [0, 1, 2, 3], Load(cpus=64, ranks=44), now=100.0) == "wait"
    assert adm.decide("a", 4, [0, 1, 2, 3], Load(cpus=64, ranks=44), now=290.0) == "wait"  # 200 s fit in 210
    verdict = adm.decide("a", 4, [0, 1, 2, 3], Load(cpus=64, ranks=44), now=310.0)
    assert verdict == ("not run: its timeout would end after the deadline (190 s left); it waited for "
                       "CPU cores (44 ranks running, 64 cores)")
    loaded = Load(cpus=16, load1=32.0)  # twice as slow: a 400 s timeout, 350 s left
    assert adm.decide("b", 4, None, loaded, now=150.0) == "wait"
    assert adm.waited["b"] == "the load to fall (its timeout at this load: 400 s)"
    assert adm.decide("b", 4, None, Load(cpus=16), now=150.0) == "start"
    assert adm.decide("b", 4, None, loaded, now=301.0).endswith("it waited for the load to fall (its timeout at this "
                                                                "load: 400 s)")


def test_timeouts_scale_with_the_load_and_stop_at_the_deadline():
    adm = Admission(deadline=600.0, timeout_s=200.0)
    assert adm.timeout(Load(cpus=64)) == 200.0
    assert adm.timeout(Load(cpus=16, load1=32.0)) == 400.0
    assert adm.run_deadline(100.0, Load(cpus=64)) == 300.0
    assert adm.run_deadline(100.0, Load(cpus=16, load1=32.0)) == 500.0  # the load rose while it ran
    assert adm.run_deadline(300.0, Load(cpus=16, load1=32.0)) == 600.0  # never past the script's deadline


def test_the_closing_list():
    assert not_run_lines({}) == ["every launch ran"]
    assert not_run_lines({"x": "needs 8 GPUs, 4 present"}) == ["not run: x: needs 8 GPUs, 4 present"]


def test_a_share_of_the_timeout_must_fit():
    adm = Admission(deadline=500.0, timeout_s=200.0)
    assert adm.decide("a", 4, None, Load(cpus=64), now=500.0 - FIT * 200.0) == "start"
    assert adm.decide("b", 4, None, Load(cpus=64), now=501.0 - FIT * 200.0).startswith("not run: ")
    assert adm.run_deadline(500.0 - FIT * 200.0, Load(cpus=64)) == 500.0  # it runs until the deadline at most
