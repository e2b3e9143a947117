"""The oldest versions this package is tested with (CI's oldest leg), checked at import."""

import re

import torch

TORCH_MIN = (2, 7, 1)


def _release(version):
    """``"2.7.1+cpu"`` -> ``(2, 7, 1)``; pre-releases and local builds count as their release."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def check_torch(version=None):
    """Raise ``ImportError`` naming the torch needed when the installed one is older."""
    version = torch.__version__ if version is None else version
    if _release(str(version)) < TORCH_MIN:
        need = ".".join(map(str, TORCH_MIN))
        raise ImportError(f"mindspeed_cez needs torch >= {need} (the oldest version it is tested with); "
                          f"found torch {version}. Upgrade torch, e.g. pip install 'torch>={need}'")
