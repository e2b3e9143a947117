"""The package as a user gets it: every public module imports, one op call, the adaptor import.

``--installed``: run from a folder outside the checkout; the package must come from site-packages.
(From the checkout root a plain ``python`` finds the source folder ``mindspeed_cez/`` first, whose
``kernels`` / ``patches`` subpackages only an editable install maps: ``tests/package/test_layering.py``.)
"""

import importlib
import os
import sys

import torch
import torch.nn.functional as F

where = sys.argv[1]
assert where == "--installed", where

import mindspeed_cez  # noqa: E402

MODULES = [
    "mindspeed_cez.patches.arguments", "mindspeed_cez.cross_entropy_zloss", "mindspeed_cez.launch",
    "mindspeed_cez.linear_cross_entropy", "mindspeed_cez.patches.reporting", "mindspeed_cez.patches.activation",
    "mindspeed_cez.kernels", "mindspeed_cez.kernels.torch_reference", "mindspeed_cez.kernels.triton_cross_entropy",
    "mindspeed_cez.kernels.triton_linear_cross_entropy", "mindspeed_cez.kernels.chunked_linear",
    "mindspeed_cez.patches", "mindspeed_cez.patches.loss_wrappers", "mindspeed_cez.patches.model_context",
    "mindspeed_cez.patches.patch_points", "mindspeed_cez.patches.import_hook",
]
MODULES += ["mindspeed_cez.selfcheck", "mindspeed_cez.kernels.cann"]  # the self-check users run, the vendor backend
MODULES += ["mindspeed_cez.patches.cpu_mode", "mindspeed_cez.patches.local_gpt"]  # what the demo imports
for name in MODULES:
    importlib.import_module(name)

package_dir = os.path.dirname(mindspeed_cez.__file__)
assert "site-packages" in package_dir, f"mindspeed_cez came from {package_dir}, not the installed wheel"
assert "site-packages" in mindspeed_cez.kernels.__file__, mindspeed_cez.kernels.__file__
assert mindspeed_cez.__path__ == [package_dir], mindspeed_cez.__path__  # nothing added at import

gen = torch.Generator().manual_seed(0)
logits = torch.randn(8, 100, generator=gen, requires_grad=True)
target = torch.randint(0, 100, (8,), generator=gen)
loss, z_loss = mindspeed_cez.vocab_parallel_cross_entropy_zloss(logits, target, z_loss_coeff=1e-3)
lse = torch.logsumexp(logits.detach(), -1)
expected = F.cross_entropy(logits.detach(), target, reduction="none") + 1e-3 * lse**2
torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-5)
loss.sum().backward()
assert logits.grad is not None and torch.isfinite(logits.grad).all()

sys.argv = ["wheel_check", "--lm-z-loss-coeff", "1e-4"]
import mindspeed_cez.megatron_adaptor as adaptor  # noqa: E402

assert adaptor.MODE in ("megatron.core", "megatron.training", "mindspeed"), adaptor.MODE
print(f"wheel check {where}: {len(MODULES) + 1} modules from {package_dir}, op and adaptor ({adaptor.MODE}) ok")
