"""How many project files one forward of the LM loss enters: every function called while Megatron's
``compute_language_model_loss`` runs, down to the kernel launches and the metric record (Triton backend, its
interpreter on the CPU; ``sys.setprofile`` on a tiny megatron-core GPT at TP=2 with sequence parallelism). A
steady-state forward: one forward runs first, so imports and one-time choices are not counted. At most 6 files for
the op, 8 with the fused output layer (docs/architecture.md lists them)."""

import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("triton")

from support import run_on_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
BOUNDS = {False: 6, True: 8}  # (the op, the fused output layer)


def _files_entered(rank, world_size, fused, out):
    import mindspeed_cez.patches as patches
    from mindspeed_cez.patches import local_gpt
    from support.tiny_gpt import BATCH, SEQ, build, micro_batches

    model = build(2)
    model.train()
    patches.apply(z_loss_coeff=1e-4, fused_output_layer=fused, backend="triton")
    tokens, labels, loss_mask = micro_batches(0)[0]
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)

    def forward():
        return model(tokens, position_ids, local_gpt.causal_attention_mask(SEQ), labels=labels, loss_mask=loss_mask)

    (forward() * loss_mask).sum().backward()  # the first step: imports, compiled kernels, one-time choices
    entered, depth = [], [0]

    def profile(frame, event, arg):
        loss_call = frame.f_code.co_name == "compute_language_model_loss"
        if event == "return" and loss_call and depth[0]:
            depth[0] -= 1
        if event != "call":
            return
        if loss_call:
            depth[0] += 1
        name = frame.f_code.co_filename
        if depth[0] and name.startswith(ROOT) and f"{os.sep}.venv" not in name and "site-packages" not in name \
                and name not in entered:
            entered.append(name)

    sys.setprofile(profile)
    try:
        forward()
    finally:
        sys.setprofile(None)
    patches.remove()
    if rank == 0:
        with open(out, "w") as fh:
            fh.write("\n".join(os.path.relpath(f, ROOT) for f in entered))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo test (the Triton interpreter)")
@pytest.mark.parametrize("fused", [False, True], ids=["op", "fused-output-layer"])
def test_one_forward_enters_at_most_the_bound(fused, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "files.txt"
    run_on_ranks(2, _files_entered, fused, str(out), timeout=300)
    files = out.read_text().split()
    assert any(f.startswith("kernels" + os.sep + "triton_") for f in files), files  # it reached a Triton launch
    assert len(files) <= BOUNDS[fused], f"{len(files)} files entered (bound {BOUNDS[fused]}): {files}"
