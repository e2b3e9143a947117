"""What ``python -m mindspeed_cez.selfcheck`` runs on a device: the backends of each op there
(and why the others have no rows) and the sizes."""

import os

from mindspeed_cez import kernels
from mindspeed_cez.kernels import cann
from mindspeed_cez.kernels.chunked_linear import ChunkedLinear

REAL_VOCAB = 151936


def _triton_runs_on(device):
    if not kernels.triton_available():
        return False
    return device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1"


def ce_backends(device, world_size, chosen=None):
    """[(name, what a run uses)] for ``vocab_parallel_cross_entropy_zloss`` here: the automatic pick, or
    ``chosen["backend"]`` (MINDSPEED_CEZ_BACKEND) where set."""
    auto = (chosen or {}).get("backend") or (
        "torch" if kernels.backend_for(device) is kernels.get_backend("torch") else "triton")
    names = ["triton"] if _triton_runs_on(device) else []
    names.append("torch")
    if device.type == "npu" and world_size == 1 and cann.available():
        names.append(cann.NAME)
    return [(n, n == auto) for n in names]


def absent_backends(device, world_size):
    """{backend: why it has no rows here} for the backends ``ce_backends`` leaves out."""
    out = {}
    if not kernels.triton_available():
        out["triton"] = "Triton is not installed (triton; triton-ascend on Ascend NPUs)"
    elif not _triton_runs_on(device):
        out["triton"] = ("no GPU/NPU here: the kernels run on accelerators (TRITON_INTERPRET=1 runs them on the "
                         "CPU in Triton's interpreter, at the small size)")
    if device.type != "npu":
        out[cann.NAME] = "Ascend NPUs only"
    elif world_size > 1:
        out[cann.NAME] = "tensor-parallel size 1 only"
    elif not cann.available():
        out[cann.NAME] = "this torch_npu has no npu_cross_entropy_loss"
    return out


def linear_variants(device, world_size, chosen=None):
    """[(linear_backend, grads, cross-entropy backend, picked automatically)] for
    ``linear_cross_entropy_zloss`` here (``chosen``: as for :func:`ce_backends`): the GEMM projection with each cross-entropy backend that
    takes vocab partials (not ``cann``), the Triton projection, and ``grads="forward"``."""
    auto = (chosen or {}).get("linear_backend") or (
        "gemm" if isinstance(kernels.linear_backend_for(device), ChunkedLinear) else "triton")
    auto_ce = ([name for name, picked in ce_backends(device, world_size, chosen) if picked] or [None])[0]
    out = [("gemm", "recompute", ce, auto == "gemm" and ce == auto_ce)
           for ce, _ in ce_backends(device, world_size) if ce != cann.NAME]
    if _triton_runs_on(device):
        out.append(("triton", "recompute", None, auto == "triton"))
    out.append((None, "forward", None, False))  # the adaptor's default for the fused output layer
    return out


def sizes(device, args):
    """(name, rows, vocab, hidden): the small size, and the real vocab unless skipped."""
    out = [("small", args.small_rows, 1000, 64)]
    if not args.skip_real:
        rows = args.real_rows or (2048 if device.type != "cpu" else 8)
        # hidden of the fused layer: its float64 reference runs on the CPU for NPUs (128 keeps it seconds)
        out.append(("real", rows, REAL_VOCAB, {"cuda": 512, "npu": 128}.get(device.type, 64)))
    return out
