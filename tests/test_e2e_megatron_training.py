"""End to end through Megatron's own training loop (megatron.training, megatron-core >= 0.19).

A tiny MoE GPT is pretrained by ``examples/pretrain_gpt_cez.py`` (Megatron's ``pretrain``,
``torchrun --nproc-per-node 2``, TP=2 with sequence parallelism, mock data). Without a GPU the
ranks talk over gloo and the CPU shims of ``examples/`` steer Megatron's CUDA calls to the CPU.
The real log output is parsed:

* with ``--lm-z-loss-coeff``, every logged iteration has a finite positive ``lm_z_loss`` next to
  ``lm loss`` and ``load_balancing_loss``, equal to ``c * mean(lse**2)`` recomputed here from the
  logits that the entry script's forward hook dumped (both TP shards, float64), and ``lm loss``
  is ``mean(CE + c * lse**2)`` over the same logits;
* without the flag ``lm loss`` is Megatron's own cross entropy: identical, line for line, to the
  run that opts out (``--no-lm-fused-ce``), equal to the CE recomputed from the dumped logits,
  and equal at iteration 1 (same weights) to the z-loss run's ``lm loss - lm_z_loss``;
* the fused kernel without z-loss (``--lm-fused-ce``) reproduces Megatron's ``lm loss``.

Bad flag values fail in ``megatron.training``'s real parser + ``validate_args`` (both the 0.19
``parse_and_validate_args`` flow and the classic ``parse_args`` + ``validate_args`` flow).

Skipped where ``megatron.training`` is absent (the Python 3.11 / megatron-core 0.16.1 CI leg);
run by ``.ci/leg_py312.sh``.
"""

import json
import math
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("megatron.training")
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "examples" / "pretrain_gpt_cez.py"
ITERS = 3
# Megatron 0.19 prints iteration 1 without resetting its running sums, so the line of iteration 2
# averages iterations 1 and 2 (for lm loss and lm_z_loss alike); iteration 3's line is iteration 3
# alone: check there, after two optimizer steps.
DUMP_ITERATION = 3
Z_COEFF = 1e-2

pytestmark = pytest.mark.slow

TINY_MOE_GPT = [
    "--tensor-model-parallel-size", "2", "--sequence-parallel",
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "511",  # padded to 512
    "--micro-batch-size", "2", "--global-batch-size", "2",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
    "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--train-iters", str(ITERS), "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "1234",
    "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--transformer-impl", "local", "--attention-backend", "unfused",
    "--no-gradient-accumulation-fusion", "--use-cpu-initialization", "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
]

ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|(.*)")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_log(text):
    """{iteration: {metric: float}} from Megatron's training log lines."""
    rows = {}
    for line in text.splitlines():
        m = ITERATION_LINE.search(line)
        if not m:
            continue
        values = {}
        for field in m.group(3).split("|"):
            if ":" in field:
                key, _, value = field.partition(":")
                try:
                    values[key.strip()] = float(value.strip())
                except ValueError:
                    pass
        rows[int(m.group(1))] = values
    return rows


_MOE_BEGIN, _MOE_END = TINY_MOE_GPT.index("--num-experts"), TINY_MOE_GPT.index("--disable-bias-linear")
TINY_DENSE_GPT = TINY_MOE_GPT[:_MOE_BEGIN] + TINY_MOE_GPT[_MOE_END:]  # the same model without experts


def _launch(tmp_path_factory, name, extra_args, model_args=TINY_MOE_GPT):
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs, or none (CPU + gloo)")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    out = tmp_path_factory.mktemp(name)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1",
               CEZ_DUMP_LOGITS_DIR=str(out / "dump"), CEZ_DUMP_ITERATION=str(DUMP_ITERATION))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(ENTRY), *model_args, "--distributed-backend", backend, *extra_args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + "\n" + proc.stderr
    (out / "train.log").write_text(log)
    assert proc.returncode == 0, f"{name}: pretraining failed (rc {proc.returncode}); log tail:\n{log[-6000:]}"
    rows = parse_log(proc.stdout)
    assert sorted(rows) == list(range(1, ITERS + 1)), f"{name}: logged iterations {sorted(rows)}\n{log[-4000:]}"
    return {"rows": rows, "log": log, "dump": out / "dump"}


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
    return _launch(tmp_path_factory, "fused_ce", ["--lm-fused-ce"])


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    return _launch(tmp_path_factory, "dense_z_loss", ["--lm-z-loss-coeff", str(Z_COEFF)], TINY_DENSE_GPT)


def recompute_from_dump(dump_dir):
    """Per-token lse and CE over the full vocab (both TP shards, float64), and the loss mask."""
    shards = [torch.load(dump_dir / f"logits_iter{DUMP_ITERATION}_tp{r}.pt") for r in range(2)]
    assert [s["tp_rank"] for s in shards] == [0, 1] and all(s["tp_size"] == 2 for s in shards)
    logits = torch.cat([s["logits"].double() for s in shards], dim=-1)  # [s, b, V]
    logits = logits.transpose(0, 1)  # [b, s, V]
    labels, mask = shards[0]["labels"], shards[0]["loss_mask"].double()
    assert torch.equal(labels, shards[1]["labels"])
    assert logits.shape[:2] == labels.shape and logits.shape[-1] == 512
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return lse, ce, mask


def masked_mean(x, mask):
    return float((x * mask).sum() / mask.sum())


def test_every_iteration_logs_lm_z_loss(z_run):
    for it, row in z_run["rows"].items():
        for key in ("lm loss", "load_balancing_loss", "lm_z_loss"):
            assert key in row, f"iteration {it}: no {key!r} in the log line: {row}"
        assert math.isfinite(row["lm_z_loss"]) and row["lm_z_loss"] > 0, row
        assert math.isfinite(row["lm loss"]) and math.isfinite(row["load_balancing_loss"]), row
    line = next(ln for ln in z_run["log"].splitlines() if ITERATION_LINE.search(ln))
    assert line.index("lm loss") < line.index("lm_z_loss"), line


def test_lm_z_loss_is_c_times_mean_lse_squared(z_run):
    lse, ce, mask = recompute_from_dump(z_run["dump"])
    row = z_run["rows"][DUMP_ITERATION]
    expected_z = Z_COEFF * masked_mean(lse**2, mask)
    assert row["lm_z_loss"] == pytest.approx(expected_z, rel=2e-5), (row, expected_z)
    # and the LM loss that is trained on is CE + c * lse**2 per token
    expected_loss = masked_mean(ce + Z_COEFF * lse**2, mask)
    assert row["lm loss"] == pytest.approx(expected_loss, rel=2e-5), (row, expected_loss)


def test_without_flag_lm_loss_is_megatrons_cross_entropy(plain_run, opt_out_run, z_run):
    for it in range(1, ITERS + 1):
        assert "lm_z_loss" not in plain_run["rows"][it]
        assert plain_run["rows"][it]["lm loss"] == opt_out_run["rows"][it]["lm loss"], it
        assert plain_run["rows"][it]["load_balancing_loss"] == opt_out_run["rows"][it]["load_balancing_loss"], it
    _, ce, mask = recompute_from_dump(plain_run["dump"])
    assert plain_run["rows"][DUMP_ITERATION]["lm loss"] == pytest.approx(masked_mean(ce, mask), rel=2e-5)
    # iteration 1 runs on the same initial weights: the z-loss run's CE part is Megatron's CE
    z1 = z_run["rows"][1]
    assert z1["lm loss"] - z1["lm_z_loss"] == pytest.approx(plain_run["rows"][1]["lm loss"], rel=2e-5)


def test_fused_kernel_without_z_loss_matches_megatron(fused_ce_run, plain_run):
    for it in range(1, ITERS + 1):
        assert fused_ce_run["rows"][it]["lm loss"] == pytest.approx(plain_run["rows"][it]["lm loss"], rel=2e-5), it
        assert "lm_z_loss" not in fused_ce_run["rows"][it] or fused_ce_run["rows"][it]["lm_z_loss"] == 0.0


def test_dense_model_logs_lm_z_loss(dense_run):
    """No experts: Megatron prints no MoE metrics, yet lm_z_loss is in the log line."""
    for it, row in dense_run["rows"].items():
        assert "load_balancing_loss" not in row, row
        assert math.isfinite(row["lm_z_loss"]) and row["lm_z_loss"] > 0, (it, row)
    lse, _, mask = recompute_from_dump(dense_run["dump"])
    expected_z = Z_COEFF * masked_mean(lse**2, mask)
    assert dense_run["rows"][DUMP_ITERATION]["lm_z_loss"] == pytest.approx(expected_z, rel=2e-5)


# ------------------------------------------------------------------ argument validation (real parser)
_VALIDATION_SCRIPT = textwrap.dedent(
    """
    import json, sys, traceback
    import mindspeed_cez.megatron_adaptor  # noqa: F401
    import torch
    if not torch.cuda.is_available():  # validate_args asks torch.cuda for the device arch (TP > 1)
        sys.path.insert(0, "examples")
        import megatron_training_cpu_shims
        megatron_training_cpu_shims.apply()
    from megatron.training import arguments as ma
    from mindspeed_cez import patches

    base = json.loads(sys.argv[1])
    cases = json.loads(sys.argv[2])
    flow = sys.argv[3]
    results = []
    for extra in cases:
        sys.argv = ["pretrain_gpt_cez.py", *base, *extra]
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
        assert res["type"] == "ValueError" and flag in res["msg"], (case, res)
        assert "validate_args" in res["frames"], (case, res["frames"])  # raised in Megatron's validation
    good = results[-1]
    assert good["ok"], good
    assert good["coeff"] == 0.01 and good["active_coeff"] == 0.01, good
