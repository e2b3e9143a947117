"""Test configuration shared by every suite.

The suite mirrors the tree: kernels/, ops/ (mindspeed_cez/), patches/, examples/ and bench/ hold each module's
tests in ``test_<module>*.py`` (a package's own: ``test_<package>_*.py``); package/ the whole-package checks;
environments/ the tests of one stack each (mindspeed_stack/, megatron_loop/, gpu/). Their folders hold test files
only (tests/package/test_test_layout.py checks it); what the groups share is the package ``support``
(tests/support/). pytest puts this folder, tests/, on
``sys.path`` (``pythonpath`` in pyproject.toml), so ``from support import ...`` works in every test file
without a path edit of its own; scripts run on their own add tests/ once. A folder
here must not take the name of a package the tests import (``megatron``, ``mindspeed``, ``mindspeed_llm``):
on ``sys.path`` it would answer as that package where the package is absent.

Without a CUDA device the Triton kernels run under Triton's CPU interpreter. The variable must
be set before Triton compiles (decorates) any kernel, so it is set here, at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
