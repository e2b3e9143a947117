"""End to end through Megatron's own training loop (``megatron.training``).

A tiny MoE GPT is pretrained by ``examples/pretrain_gpt.py`` (Megatron's ``pretrain``, launched with ``-m mindspeed_cez.launch``,
``torchrun --nproc-per-node 2``, TP=2 with sequence parallelism, mock data, two micro-batches per
iteration whose loss masks keep different numbers of tokens). Without a GPU the ranks talk over
gloo and the package's CPU mode (``mindspeed_cez.patches.cpu_mode``) steers Megatron's CUDA calls to
the CPU. The real log output is parsed and checked against the logits that the test harness's forward hook dumped
(``tests/support/megatron_pretrain_harness.py``; both TP shards, every micro-batch, float64):

* with ``--lm-z-loss-coeff``, every logged iteration has ``lm_z_loss`` next to ``lm loss``,
  equal to ``sum(c*lse^2*mask) / sum(mask)`` over the iteration's micro-batches; ``lm loss``
  is the plain CE (Megatron's convention for auxiliary losses) and equals the flag-off run's at
  iteration 1 (same weights); the validation ``lm loss`` and its PPL are CE too;
* without the flag ``lm loss`` is Megatron's own cross entropy: identical, line for line, to the
  run that opts out (``--no-lm-fused-ce``), and equal to the CE recomputed from the dumped logits;
* the fused kernel without z-loss (``--lm-fused-ce``) reproduces Megatron's ``lm loss``; with
  ``--lm-z-loss-log-lse`` it logs ``lm_lse`` (token-weighted mean) and ``lm_lse_max`` (the largest
  lse of the counted tokens of both micro-batches), as recomputed from the dumped logits;
* a dense model logs ``lm_z_loss`` too.

Bad flag values fail in ``megatron.training``'s real parser + ``validate_args`` (the 0.19
``parse_and_validate_args`` flow where it exists, and the classic ``parse_args`` + ``validate_args``).

Skipped where ``megatron.training`` is absent (CI leg 1); run by ``.ci/leg_py312.sh`` on
megatron-core 0.19.2. The same file runs against a Megatron-LM source tree of another line
(``PYTHONPATH=<Megatron-LM checkout> pytest tests/environments/megatron_loop/test_e2e_megatron_training.py``), which is how
the classic flow of the 0.12.1 line was run (README).
"""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.training")

from support.megatron_launch import (  # noqa: E402
    DUMP_ITERATION, ITERATION_LINE, ITERS, MOE, REPO, TINY_GPT, Z_COEFF, assert_lse_metrics, ce_mean, launch,
    per_micro_batch_z_mean, recompute_from_dump, with_args, z_loss_mean,
)

pytestmark = pytest.mark.slow

TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
TINY_DENSE_GPT = TP2 + with_args(TINY_GPT, global_batch_size=4)  # two micro-batches per iteration
TINY_MOE_GPT = TINY_DENSE_GPT + MOE


def _launch(tmp_path_factory, name, extra_args, model_args=TINY_MOE_GPT):
    return launch(tmp_path_factory.mktemp(name), [*model_args, *extra_args])


@pytest.fixture(scope="module")
def z_run(tmp_path_factory):
    return _launch(tmp_path_factory, "z_loss", ["--lm-z-loss-coeff", str(Z_COEFF)])


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    return _launch(tmp_path_factory, "no_flag", [])


@pytest.fixture(scope="module")
def opt_out_run(tmp_path_factory):
    return _launch(tmp_path_factory, "opt_out", ["--no-lm-fused-ce"])


@pytest.fixture(scope="module")
def fused_ce_run(tmp_path_factory):
    return _launch(tmp_path_factory, "fused_ce", ["--lm-fused-ce", "--lm-z-loss-log-lse"])


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    return _launch(tmp_path_factory, "dense_z_loss", ["--lm-z-loss-coeff", str(Z_COEFF)], TINY_DENSE_GPT)


def test_every_iteration_logs_lm_z_loss(z_run, plain_run):
    moe_names = [k for k in ("load_balancing_loss",) if k in plain_run["rows"][1]]  # as Megatron prints them
    for it, row in z_run["rows"].items():
        for key in ("lm loss", "lm_z_loss", *moe_names):
            assert key in row, f"iteration {it}: no {key!r} in the log line: {row}"
        assert math.isfinite(row["lm_z_loss"]) and row["lm_z_loss"] > 0, row
        assert math.isfinite(row["lm loss"]), row
    line = next(ln for ln in z_run["log"].splitlines() if ITERATION_LINE.search(ln))
    assert line.index("lm loss") < line.index("lm_z_loss"), line


def test_lm_z_loss_is_token_weighted_over_micro_batches(z_run):
    micro_batches = recompute_from_dump(z_run["dump"])
    counts = [float(mask.sum()) for _, _, mask in micro_batches]
    assert len(counts) == 2 and counts[0] != counts[1], f"the test needs two unequal masks, got {counts}"
    row = z_run["rows"][DUMP_ITERATION]
    expected_z = z_loss_mean(micro_batches)
    assert row["lm_z_loss"] == pytest.approx(expected_z, rel=1e-5), (row, expected_z)
    assert abs(per_micro_batch_z_mean(micro_batches) - expected_z) > 1e-5 * expected_z, "the weighting must matter here"


def test_lm_loss_with_the_flag_is_cross_entropy(z_run, plain_run):
    """Megatron's convention for auxiliary losses: the z-loss is trained on, not logged in lm loss."""
    micro_batches = recompute_from_dump(z_run["dump"])
    row = z_run["rows"][DUMP_ITERATION]
    assert row["lm loss"] == pytest.approx(ce_mean(micro_batches), rel=1e-5), row
    # iteration 1 runs on the same initial weights: the same lm loss with and without the flag
    assert z_run["rows"][1]["lm loss"] == pytest.approx(plain_run["rows"][1]["lm loss"], rel=1e-5)
    # ... and the flag did train on the z-loss: the runs part from iteration 2 on
    assert z_run["rows"][ITERS]["lm loss"] != plain_run["rows"][ITERS]["lm loss"]


def test_validation_loss_and_ppl_are_cross_entropy(z_run):
    micro_batches = recompute_from_dump(z_run["dump"], "eval")
    expected = ce_mean(micro_batches)
    z = z_loss_mean(micro_batches)
    assert z > 1e-3 * expected  # CE + z would be told apart
    val = z_run["validation"]
    assert val["lm loss value"] == pytest.approx(expected, rel=1e-5), (val, expected)
    assert val["lm loss PPL"] == pytest.approx(math.exp(val["lm loss value"]), rel=1e-5), val
    assert "lm_z_loss value" not in val, val


def test_without_flag_lm_loss_is_megatrons_cross_entropy(plain_run, opt_out_run):
    for it in range(1, ITERS + 1):
        assert "lm_z_loss" not in plain_run["rows"][it]
        assert plain_run["rows"][it]["lm loss"] == opt_out_run["rows"][it]["lm loss"], it
        for key in ("load_balancing_loss",):
            assert plain_run["rows"][it].get(key) == opt_out_run["rows"][it].get(key), it
    micro_batches = recompute_from_dump(plain_run["dump"])
    expected = ce_mean(micro_batches)
    assert plain_run["rows"][DUMP_ITERATION]["lm loss"] == pytest.approx(expected, rel=1e-5)
    assert plain_run["validation"] == opt_out_run["validation"]


def test_fused_kernel_without_z_loss_matches_megatron(fused_ce_run, plain_run):
    for it in range(1, ITERS + 1):
        assert fused_ce_run["rows"][it]["lm loss"] == pytest.approx(plain_run["rows"][it]["lm loss"], rel=1e-5), it
        assert "lm_z_loss" not in fused_ce_run["rows"][it]
        assert {"lm_lse", "lm_lse_max"} <= set(fused_ce_run["rows"][it]), fused_ce_run["rows"][it]
    assert_lse_metrics(fused_ce_run["rows"][DUMP_ITERATION], recompute_from_dump(fused_ce_run["dump"]), "c=0, TP=2")
    assert fused_ce_run["validation"]["lm loss value"] == pytest.approx(plain_run["validation"]["lm loss value"], rel=1e-5)


def test_dense_model_logs_lm_z_loss(dense_run):
    """No experts: Megatron prints no MoE metrics, yet lm_z_loss is in the log line."""
    for it, row in dense_run["rows"].items():
        assert "load_balancing_loss" not in row, row
        assert math.isfinite(row["lm_z_loss"]) and row["lm_z_loss"] > 0, (it, row)
    micro_batches = recompute_from_dump(dense_run["dump"])
    expected_z = z_loss_mean(micro_batches)
    assert dense_run["rows"][DUMP_ITERATION]["lm_z_loss"] == pytest.approx(expected_z, rel=1e-5)
    assert dense_run["rows"][DUMP_ITERATION]["lm loss"] == pytest.approx(ce_mean(micro_batches), rel=1e-5)


# ------------------------------------------------------------------ argument validation (real parser)
_VALIDATION_SCRIPT = textwrap.dedent(
    """
    import json, sys, traceback
    import mindspeed_cez.megatron_adaptor  # noqa: F401
    import torch
    if not torch.cuda.is_available():  # validate_args asks torch.cuda for the device arch (TP > 1)
        from mindspeed_cez.patches import cpu_mode
        cpu_mode.apply(training_loop=True)
    from megatron.training import arguments as ma
    from mindspeed_cez import patches

    base = json.loads(sys.argv[1])
    cases = json.loads(sys.argv[2])
    flow = sys.argv[3]
    results = []
    for extra in cases:
        sys.argv = ["pretrain_gpt.py", *base, *extra]
        try:
            if flow == "new":
                args = ma.parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
            else:  # classic Megatron-LM: initialize_megatron's parse_args + validate_args
                args = ma.parse_args()
                ma.validate_args(args, {"tokenizer_type": "NullTokenizer"})
            s = patches.active_settings()
            results.append({"ok": True, "coeff": args.lm_z_loss_coeff,
                            "active_coeff": None if s is None else s.z_loss_coeff})
        except BaseException as e:  # noqa: BLE001
            frames = [f.name for f in traceback.extract_tb(e.__traceback__)]
            results.append({"ok": False, "type": type(e).__name__, "msg": str(e), "frames": frames})
    print("RESULTS=" + json.dumps(results))
    """
)

BAD_CASES = [
    (["--lm-z-loss-coeff=-0.5"], "--lm-z-loss-coeff"),
    (["--lm-z-loss-coeff", "nan"], "--lm-z-loss-coeff"),
    (["--lm-z-loss-coeff", "inf"], "--lm-z-loss-coeff"),
    (["--lm-z-loss-coeff", "1e-3", "--no-lm-fused-ce"], "--no-lm-fused-ce"),
]


@pytest.mark.parametrize("flow", ["new", "classic"])
def test_bad_flag_values_fail_in_megatron_validation(flow):
    from megatron.training import arguments

    if flow == "new" and not hasattr(arguments, "parse_and_validate_args"):
        pytest.skip("this Megatron line has only the classic flow")
    base = [a for a in TINY_MOE_GPT if a != "--sequence-parallel"] + ["--sequence-parallel", "--distributed-backend", "gloo"]
    cases = [c for c, _ in BAD_CASES] + [["--lm-z-loss-coeff", "0.01"]]  # the good case last
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    proc = subprocess.run([sys.executable, "-c", _VALIDATION_SCRIPT, json.dumps(base), json.dumps(cases), flow],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    results = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS="))[len("RESULTS="):])
    for (case, flag), res in zip(BAD_CASES, results):
        assert not res["ok"], f"{case} was accepted"
        assert res["type"] == "FlagValueError" and flag in res["msg"], (case, res)  # exit status 2 uncaught
        assert "validate_args" in res["frames"], (case, res["frames"])  # raised in Megatron's validation
    good = results[-1]
    assert good["ok"], good
    assert good["coeff"] == 0.01 and good["active_coeff"] == 0.01, good


def test_the_plain_example_needs_the_launcher_for_the_flag():
    """``examples/pretrain_gpt.py`` has no line of this package: run as ``python SCRIPT`` (no
    ``-m mindspeed_cez.launch``), Megatron's own parser refuses the flag instead of ignoring it."""
    cmd = [sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), *TINY_GPT, "--lm-z-loss-coeff", "1e-2",
           "--distributed-backend", "gloo"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0"))
    assert proc.returncode != 0 and "unrecognized arguments: --lm-z-loss-coeff" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("extra,env,line", [
    (["--lm-z-loss-coeff", "-1"], {}, "--lm-z-loss-coeff must be a finite number >= 0, got -1.0"),
    (["--lm-z-loss-coeff", "abc"], {}, "--lm-z-loss-coeff must be a finite number >= 0, got 'abc'"),
    (["--lm-fused-ce"], {"MINDSPEED_CEZ_BACKEND": "cuda"}, "MINDSPEED_CEZ_BACKEND='cuda': choose one of ('torch', "
                                                          "'triton', 'cann') (or leave it unset: automatic)"),
], ids=["negative", "unparsable", "environment"])
def test_a_bad_flag_value_is_an_argument_error(extra, env, line):
    """``python -m mindspeed_cez.launch examples/pretrain_gpt.py ... --lm-z-loss-coeff -1`` (or ``abc``, or
    a bad ``MINDSPEED_CEZ_BACKEND``): exit status 2 and one line naming the flag or the variable, as
    argparse's own errors; no traceback, no usage dump of Megatron's parser."""
    cmd = [sys.executable, "-m", "mindspeed_cez.launch", str(REPO / "examples" / "pretrain_gpt.py"), *TINY_GPT,
           *extra, "--distributed-backend", "gloo"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", **env,
                                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])))
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert errors == [f"pretrain_gpt.py: error: {line}"] or (
        len(errors) == 1 and errors[0].endswith(f"error: {line}")), proc.stderr
