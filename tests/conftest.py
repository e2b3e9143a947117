"""Test configuration shared by every suite.

Without a CUDA device the Triton kernels run under Triton's CPU interpreter. The variable must
be set before Triton compiles (decorates) any kernel, so it is set here, at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
