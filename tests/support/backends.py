"""Which (backend, device) pairs the op tests run on, and tolerances per dtype.

On a CPU-only machine: the torch reference, and the Triton kernels under TRITON_INTERPRET=1
(small sizes only: the interpreter is slow). With CUDA: both backends on the GPU as well.
"""

import os

import torch

from mindspeed_cez import kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# ||out - ref|| / ||ref|| bounds. Loss is computed in fp32 from the logits' exact values, so it
# is tight for every dtype (fp32 rounding of lse - target logit); the gradient is rounded to the logits' dtype.
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def triton_runs_on_cpu():
    """The Triton kernels take CPU tensors only under the interpreter (set by conftest without CUDA)."""
    return kernels.triton_available() and os.environ.get("TRITON_INTERPRET") == "1"


def backend_devices():
    pairs = [("torch", "cpu")]
    if triton_runs_on_cpu():
        pairs.append(("triton", "cpu"))
    if torch.cuda.is_available():
        pairs += [("torch", "cuda"), ("triton", "cuda")]
    return pairs


def backend_ids(pairs):
    return [f"{name}-{device}" for name, device in pairs]


def random_logits(shape, dtype, device, generator=None, scale=4.0):
    """Fresh random logits with a spread like a trained LM head's (never zeros)."""
    x = torch.randn(shape, dtype=torch.float32, generator=generator) * scale
    return x.to(dtype=dtype, device=device)
