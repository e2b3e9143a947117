"""mindspeed_cez: fused vocab-parallel cross entropy + z-loss for Megatron-Core / MindSpeed."""

import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
_checkout = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "kernels")) and _os.path.isfile(
        _os.path.join(_checkout, "kernels", "__init__.py")):
    # Imported from a source checkout, where kernels/ and patches/ sit beside this folder (they
    # install as mindspeed_cez.kernels / .patches): find them there, as an installed copy would.
    __path__.append(_checkout)

from mindspeed_cez._requirements import check_torch as _check_torch  # noqa: E402

_check_torch()

from mindspeed_cez.cross_entropy_zloss import vocab_parallel_cross_entropy_zloss  # noqa: E402
from mindspeed_cez.linear_cross_entropy import linear_cross_entropy_zloss  # noqa: E402

__version__ = "0.1.0"
__all__ = ["vocab_parallel_cross_entropy_zloss", "linear_cross_entropy_zloss", "__version__"]
