"""Launch ``examples/pretrain_gpt.py`` (through ``tests/support/megatron_pretrain_harness.py``) as a user does,
``torchrun ... -m mindspeed_cez.launch SCRIPT ARGS``, and read what Megatron printed and dumped.

Shared by the end-to-end tests of Megatron's own training loop. Without a GPU the ranks talk
over gloo and the package's CPU mode steers Megatron's CUDA calls to the CPU. The harness's
hooks dump the output layer's logits (every micro-batch of ``DUMP_ITERATION`` and of the first
evaluation) and mask a data-dependent tail of every micro-batch, so micro-batches and
data-parallel ranks count different numbers of tokens.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import free_port

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "tests" / "support" / "megatron_pretrain_harness.py"
ITERS = 3
# Megatron 0.19 prints iteration 1 without resetting its running sums, so the line of iteration 2
# averages iterations 1 and 2 (for lm loss and lm_z_loss alike); iteration 3's line is iteration 3
# alone: check there, after two optimizer steps.
DUMP_ITERATION = 3
Z_COEFF = 1e-2
VOCAB = 4096  # the 0.12 line's mock data holds token ids up to 4096

TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", str(VOCAB),
    "--micro-batch-size", "2",
    "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--train-iters", str(ITERS), "--log-interval", "1", "--eval-iters", "1", "--eval-interval", str(ITERS),
    "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "1234",
    "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--transformer-impl", "local", "--attention-backend", "unfused",
    "--no-gradient-accumulation-fusion", "--use-cpu-initialization", "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
]
MOE = [
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
]

ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|(.*)")


def with_args(args, **values):
    """``args`` with ``--name value`` pairs replaced or added (``name_like_this`` -> ``--name-like-this``)."""
    args = list(args)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if flag in args:
            args[args.index(flag) + 1] = str(value)
        else:
            args += [flag, str(value)]
    return args


# What a rank prints when C++ code (a communication or loader thread) aborts the process.
CPP_ABORT = "terminate called without an active exception"


def _fields(text):
    values = {}
    for field in text.split("|"):
        if ":" in field:
            key, _, value = field.partition(":")
            try:
                values[key.strip()] = float(value.strip())
            except ValueError:
                pass
    return values


def parse_log(text):
    """{iteration: {metric: float}} from Megatron's training log lines."""
    return {int(m.group(1)): _fields(m.group(3)) for m in map(ITERATION_LINE.search, text.splitlines()) if m}


def first_validation(text):
    """{metric: float} of the first ``validation loss at ...`` line (empty without one)."""
    line = next((ln for ln in text.splitlines() if "validation loss at" in ln), "")
    return _fields(line.partition("|")[2])


def launch_command(out, args, nproc=2, env=None, backend=None):
    """``(cmd, env)`` that run the example (its test harness) under torchrun on ``nproc`` ranks,
    dumping into ``out/dump``; ``backend``: nccl with CUDA, else gloo."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONUNBUFFERED": "1",
           "CEZ_DUMP_LOGITS_DIR": str(out / "dump"), "CEZ_DUMP_ITERATION": str(DUMP_ITERATION),
           "CEZ_TEST_MASK_TAIL": "1", **(env or {})}  # env overrides (CEZ_DUMP_LOGITS_DIR="": no dump)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "mindspeed_cez.launch", str(ENTRY), *args, "--distributed-backend", backend]
    return cmd, env


def launch(out, args, nproc=2, iters=ITERS, env=None):
    """Run the example (its test harness) under torchrun; returns ``{"rows", "log", "dump", "validation"}``."""
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs, or none (CPU + gloo)")
    out = Path(out)
    cmd, env = launch_command(out, args, nproc, env)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + "\n" + proc.stderr
    if proc.returncode != 0 and CPP_ABORT in log:
        # Seen once in 2026-11-23's CI (a rank aborted in C++ during iteration 1 of a flag-off run,
        # not reproduced in 12 launches after): launch once more, on a fresh port, keeping the log.
        (out / "train_aborted.log").write_text(log)
        cmd[cmd.index("--master-port") + 1] = str(free_port())
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        log = proc.stdout + "\n" + proc.stderr
    (out / "train.log").write_text(log)
    assert proc.returncode == 0, f"{out.name}: pretraining failed (rc {proc.returncode}); log tail:\n{log[-6000:]}"
    rows = parse_log(proc.stdout)
    assert max(rows, default=0) == iters, f"{out.name}: logged iterations {sorted(rows)}\n{log[-4000:]}"
    return {"rows": rows, "log": log, "dump": out / "dump", "validation": first_validation(proc.stdout)}


def recompute_from_dump(dump_dir, name=f"iter{DUMP_ITERATION}", transform=None):
    """Per (data-parallel rank, context-parallel rank, micro-batch): lse and CE over the full vocab
    (every TP shard, float64) and the loss mask, from the logits the harness dumped (``transform``:
    of ``transform(logits)``, e.g. a soft cap)."""
    pattern = re.compile(rf"logits_{name}_dp(\d+)_cp(\d+)_mb(\d+)_tp(\d+)\.pt")
    files = {}
    for path in Path(dump_dir).glob(f"logits_{name}_*.pt"):
        dp, cp, mb, tp = map(int, pattern.fullmatch(path.name).groups())
        files.setdefault((dp, cp, mb), {})[tp] = path
    micro_batches = []
    for key in sorted(files):
        shards = [torch.load(files[key][r]) for r in sorted(files[key])]
        assert [s["tp_rank"] for s in shards] == list(range(shards[0]["tp_size"])), key
        logits = torch.cat([s["logits"].double() for s in shards], dim=-1).transpose(0, 1)  # [b, s, V]
        labels, mask = shards[0]["labels"], shards[0]["loss_mask"].double()
        assert all(torch.equal(labels, s["labels"]) for s in shards) and logits.shape[:2] == labels.shape
        assert logits.shape[-1] >= VOCAB
        if transform is not None:
            logits = transform(logits)
        lse = torch.logsumexp(logits, dim=-1)
        ce = lse - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        micro_batches.append((lse, ce, mask))
    assert micro_batches, f"nothing dumped for {name} in {dump_dir}"
    return micro_batches


def dumped_flags(dump_dir, key, name=f"iter{DUMP_ITERATION}"):
    """Per dumped micro-batch and rank, the harness's flag ``key`` (False where not recorded):
    ``deferred`` (the output layer made no logits: ``--lm-fused-output-layer``), ``grad_scale_known``
    (the adaptor knew Megatron's upstream gradient in forward: the fused layer's default path),
    ``into_main_grad`` (the deferred layer's weight had Megatron's DDP ``main_grad``)."""
    flags = [torch.load(path).get(key, False) for path in sorted(Path(dump_dir).glob(f"logits_{name}_*.pt"))]
    assert flags, f"nothing dumped for {name} in {dump_dir}"
    return flags


def grad_scale_known(dump_dir, name=f"iter{DUMP_ITERATION}"):
    return dumped_flags(dump_dir, "grad_scale_known", name)


def deferred_output_layer(dump_dir, name=f"iter{DUMP_ITERATION}"):
    return dumped_flags(dump_dir, "deferred", name)


def token_mean(micro_batches, per_token):
    """sum of per_token * mask over micro-batches (and ranks) / sum of the masks: lm loss's weighting."""
    num = sum(float((per_token(lse, ce) * mask).sum()) for lse, ce, mask in micro_batches)
    return num / sum(float(mask.sum()) for _, _, mask in micro_batches)


def z_loss_mean(micro_batches, coeff=Z_COEFF):
    return token_mean(micro_batches, lambda lse, ce: coeff * lse**2)


def ce_mean(micro_batches):
    return token_mean(micro_batches, lambda lse, ce: ce)


def lse_max(micro_batches):
    """The largest lse among the counted tokens (mask > 0) of every micro-batch: ``lm_lse_max``."""
    return max(float(lse[mask > 0].max()) for lse, _, mask in micro_batches if (mask > 0).any())


def assert_lse_metrics(row, micro_batches, what):
    """``lm_lse`` and ``lm_lse_max`` of a log line against the lse recomputed from the dumped logits."""
    assert row["lm_lse"] == pytest.approx(token_mean(micro_batches, lambda lse, ce: lse), rel=1e-5), (what, row)
    largest = lse_max(micro_batches)
    assert row["lm_lse_max"] == pytest.approx(largest, rel=1e-5), (what, row, largest)


def per_micro_batch_z_mean(micro_batches, coeff=Z_COEFF):
    """The weighting ``lm_z_loss`` must not have: a plain mean of per-micro-batch means (of those
    with a token counted)."""
    means = [coeff * float((lse**2 * m).sum() / m.sum()) for lse, _, m in micro_batches if m.sum() > 0]
    return sum(means) / len(means)
