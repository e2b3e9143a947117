"""The mitigations in Megatron's own ``pretrain`` (``examples/pretrain_gpt.py`` through the test harness, 2
processes, gloo on the CPU), from Megatron's log and the dumped logits:

* TP=2 with sequence parallelism, tied embeddings (``--lm-z-loss-coeff`` + ``--lm-logit-softcap`` +
  ``--lm-mu-centering`` + ``--lm-mu-loss-coeff``): iteration 3's ``lm loss`` is the token-weighted CE of
  ``C tanh(x / C)`` recomputed from the dumped logits, ``lm_z_loss`` its ``c lse**2``; ``lm_mu_norm`` is
  the mean output embedding's norm at initialization in iteration 1 and about 0 from the first
  centering on (Megatron's FP32Optimizer: the weights are their own masters);
Megatron's distributed optimizer needs CUDA tensors: its centering is tested on real gloo ranks in
``tests/patches/test_mean_embedding_mitigations.py`` and on a GPU by ``bench/e2e_megatron.py`` (``lm_mu_norm``).
Run by ``.ci/leg_py312.sh`` (megatron-core 0.19.2, ``megatron.training``).
"""

import pytest
import torch

pytest.importorskip("megatron.training")

from support.megatron_launch import DUMP_ITERATION, TINY_GPT, Z_COEFF, launch, token_mean, with_args  # noqa: E402
from support.megatron_launch import recompute_from_dump  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo test; GPU machines run tests/run_gpu_checks.sh"),
]

CAP = 0.1  # bites on the tiny model's logits (|x| well under 1)
MITIGATIONS = ["--lm-z-loss-coeff", str(Z_COEFF), "--lm-logit-softcap", str(CAP), "--lm-mu-centering",
               "--lm-mu-loss-coeff", "1e-2", "--lm-z-loss-log-lse"]


def test_soft_cap_and_centering_at_tp2_with_sequence_parallelism(tmp_path):
    run = launch(tmp_path / "tp2sp", with_args(TINY_GPT, global_batch_size=4, tensor_model_parallel_size=2)
                 + ["--sequence-parallel", *MITIGATIONS])
    rows = run["rows"]
    capped = recompute_from_dump(run["dump"], transform=lambda x: CAP * torch.tanh(x / CAP))
    raw = recompute_from_dump(run["dump"])
    row = rows[DUMP_ITERATION]
    assert row["lm loss"] == pytest.approx(token_mean(capped, lambda lse, ce: ce), rel=1e-5), row
    assert abs(row["lm loss"] - token_mean(raw, lambda lse, ce: ce)) > 1e-3, "the cap must change the loss"
    assert row["lm_z_loss"] == pytest.approx(token_mean(capped, lambda lse, ce: Z_COEFF * lse**2), rel=1e-5), row
    assert row["lm_lse"] == pytest.approx(token_mean(capped, lambda lse, ce: lse), rel=1e-5), row
    assert rows[1]["lm_mu_norm"] > 1e-4, rows[1]
    assert row["lm_mu_norm"] < 1e-6 * rows[1]["lm_mu_norm"] + 1e-8, (rows[1], row)
