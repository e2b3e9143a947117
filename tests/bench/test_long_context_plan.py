"""bench/long_context.py without a GPU: the estimate-started search brackets a failure in few launches, the deep
config runs micro-batches of its sequence one a step, every peer is a variant of both benchmarks."""
import importlib.util
import os
import sys

from support.doc_figures.results_files import ROOT

BENCH = os.path.join(ROOT, "bench")


def _module(name):
    sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lc = _module("long_context")


class FakeRuns:
    """Fits up to ``limit`` tokens; records each launch."""

    def __init__(self, limit):
        self.limit, self.launched = limit, []

    def __call__(self, variant, tokens, micro_batch=1, recompute="full"):
        self.launched.append((tokens, micro_batch))
        ok = tokens <= self.limit
        return {"rc": 0 if ok else 1, "out_of_memory": not ok}


def test_search_near_steps_up_from_a_fit_and_down_from_a_failure():
    up = FakeRuns(100000)
    assert lc.search_near(up, "cez", 65536, 32768, 1 << 20, 3) == (98304, 131072)
    assert [t for t, _ in up.launched] == [65536, 98304, 131072]
    down = FakeRuns(40000)
    assert lc.search_near(down, "cez", 98304, 32768, 1 << 20, 3) == (32768, 65536)
    assert len(down.launched) == 3


def test_search_near_stops_at_its_launches():
    runs = FakeRuns(1 << 20)
    assert lc.search_near(runs, "cez_fol", 32768, 32768, 1 << 22, 2) == (65536, None)
    assert len(runs.launched) == 2


def test_deep_memory_runs_micro_batches_of_its_sequence_one_a_step(capsys):
    lc.main(["memory", "--config", "deep", "--start", "estimate", "--resolution", "32768", "--gpu-gib", "79.647",
             "--plan"])
    firsts = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [f[0] for f in firsts] == [v + ":" for v in lc.VARIANT_NAMES]
    for f in firsts:
        tokens = int(f[2])
        assert tokens % 32768 == 0 and f[6] == f"({tokens // 8192}" and f[8] == "8192)"
    args = lc.megatron_args(65536, 8, "full", one_micro_batch=True)
    assert args[args.index("--seq-length") + 1] == "8192" and args[-2:] == ["--global-batch-size", "8"]


def test_every_peer_is_a_variant_of_both_benchmarks():
    e2e = _module("e2e_megatron")
    for variant in ("native", "fused", "liger", "z_by_hand", "cez", "cez_fol"):
        assert variant in lc.VARIANT_NAMES and variant in e2e.VARIANTS
    assert e2e.VARIANTS["liger"][1] == {"CEZ_BENCH_LIGER": "1"}
    assert "deep" in e2e.CONFIGS and e2e.CONFIG_ENV["deep"] == e2e.CONFIG_ENV["long"]
