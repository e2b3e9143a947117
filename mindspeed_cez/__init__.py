"""mindspeed_cez: fused vocab-parallel cross entropy + z-loss for Megatron-Core / MindSpeed."""

import importlib.util as _util
import os as _os


def _check_not_a_bare_source_tree():
    """kernels/ and patches/ sit beside this folder in a checkout and become ``mindspeed_cez.kernels`` /
    ``.patches`` only through an install's mapping (pyproject's ``package-dir``). Imported from a checkout
    without that mapping (the checkout root is the working directory and the install is not editable, or
    there is none), say so in one line instead of failing later on a missing submodule."""
    checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    beside = _os.path.isfile(_os.path.join(checkout, "kernels", "__init__.py")) and _os.path.isfile(
        _os.path.join(checkout, "pyproject.toml"))
    if beside and _util.find_spec(__name__ + ".kernels") is None:
        raise ImportError(
            f"mindspeed_cez: you are importing the source tree at {checkout}, not the installed package (its "
            "kernels/ and patches/ are mapped into the package only by an install): install it with "
            "`pip install -e .`, or run from another directory", name=__name__, path=__file__)


_check_not_a_bare_source_tree()

from mindspeed_cez._requirements import check_torch as _check_torch  # noqa: E402

_check_torch()

from mindspeed_cez.cross_entropy_zloss import vocab_parallel_cross_entropy_zloss  # noqa: E402
from mindspeed_cez.kernels import LogitTransform  # noqa: E402
from mindspeed_cez.linear_cross_entropy import (ForwardGradientLedger, GradientPath,  # noqa: E402
                                               LinearCrossEntropyOptions, TrainerInputs, WeightGradTarget,
                                               linear_cross_entropy_zloss)

__version__ = "0.1.0"
__all__ = ["vocab_parallel_cross_entropy_zloss", "linear_cross_entropy_zloss", "LogitTransform", "GradientPath",
           "LinearCrossEntropyOptions", "TrainerInputs", "WeightGradTarget", "ForwardGradientLedger", "__version__"]
