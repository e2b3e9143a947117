"""mindspeed_cez: fused vocab-parallel cross entropy + z-loss for Megatron-Core / MindSpeed."""

from mindspeed_cez._requirements import check_torch as _check_torch

_check_torch()

from mindspeed_cez.cross_entropy_zloss import vocab_parallel_cross_entropy_zloss  # noqa: E402
from mindspeed_cez.linear_cross_entropy import linear_cross_entropy_zloss  # noqa: E402

__version__ = "0.1.0"
__all__ = ["vocab_parallel_cross_entropy_zloss", "linear_cross_entropy_zloss", "__version__"]
