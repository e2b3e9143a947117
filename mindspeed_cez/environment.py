"""The ``MINDSPEED_CEZ_*`` variables: read and checked here only, the same on every route.

The launcher and the adaptor's import (:func:`mindspeed_cez.patches.arguments.check_launch`),
``mindspeed_cez.patches.apply()`` and the self-check (``python -m mindspeed_cez.selfcheck``) each call
:func:`read_backends`; a bad variable is a :class:`ValueError` of one line naming it and the fix:

* an unknown ``MINDSPEED_CEZ_*`` name (the closest known one suggested);
* a value that names no backend;
* a backend that cannot run here: ``cann`` without torch_npu's op, ``triton`` where Triton does not
  import or has no device to run on (no CUDA or NPU device, and not Triton's CPU interpreter,
  ``TRITON_INTERPRET=1``).
"""

import difflib
import importlib
import os

from mindspeed_cez import kernels
from mindspeed_cez.kernels import cann

PREFIX = "MINDSPEED_CEZ_"
BACKEND_ENV = "MINDSPEED_CEZ_BACKEND"
LINEAR_BACKEND_ENV = "MINDSPEED_CEZ_LINEAR_BACKEND"
VARIABLES = (BACKEND_ENV, LINEAR_BACKEND_ENV)


def _unknown_variable(environ):
    for variable in sorted(environ):
        if variable.startswith(PREFIX) and variable not in VARIABLES:
            match = difflib.get_close_matches(variable, list(VARIABLES), n=1, cutoff=0.6)
            hint = f"did you mean {match[0]}?" if match else "the variables: " + ", ".join(VARIABLES)
            return f"unknown environment variable {variable}: {hint}"
    return None


def _accelerator_present():
    """A CUDA device, or an Ascend NPU (torch_npu installed and a device present)."""
    import torch

    if torch.cuda.is_available():
        return True
    try:
        importlib.import_module("torch_npu")
        return bool(torch.npu.is_available())
    except (ImportError, AttributeError):
        return False


def triton_cannot_run(environ):
    """Why Triton's kernels cannot run in this process, or None."""
    if not kernels.triton_available():
        return "Triton does not import here (pip install triton; triton-ascend on Ascend NPUs)"
    if environ.get("TRITON_INTERPRET") == "1" or _accelerator_present():
        return None
    return "no GPU or NPU is present for Triton (its CPU interpreter needs TRITON_INTERPRET=1)"


def read_backends(environ=None):
    """``{"backend": ..., "linear_backend": ...}`` from the environment (unset or empty: None, automatic),
    every ``MINDSPEED_CEZ_*`` variable checked; a bad one is a ``ValueError`` of one line naming it."""
    environ = os.environ if environ is None else environ
    unknown = _unknown_variable(environ)
    if unknown:
        raise ValueError(unknown)
    chosen = {}
    for field, variable, names in (("backend", BACKEND_ENV, kernels.BACKENDS),
                                   ("linear_backend", LINEAR_BACKEND_ENV, tuple(kernels.LINEAR_BACKENDS))):
        value = environ.get(variable) or None
        if value not in (None, *names):
            raise ValueError(f"{variable}={value!r}: choose one of {names} (or leave it unset: automatic)")
        if value == "triton":
            why = triton_cannot_run(environ)
            if why:
                raise ValueError(f"{variable}=triton cannot run here: {why}; unset it (automatic) or choose "
                                 f"{'torch' if field == 'backend' else 'gemm'}")
        chosen[field] = value
    if chosen["backend"] == cann.NAME and not cann.available():
        raise ValueError(f"{BACKEND_ENV}=cann needs torch_npu with npu_cross_entropy_loss (Ascend NPUs, CANN), which "
                         "does not import here: unset it (automatic) or choose triton or torch")
    return chosen
