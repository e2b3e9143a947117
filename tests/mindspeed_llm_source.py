"""Load MindSpeed-LLM's real source on a CPU machine without Ascend, for ``test_mindspeed_llm_source.py``.

:func:`load` puts the three source trees first on ``sys.path`` and stubs the packages that only
exist on Ascend machines (``torch_npu``, ``torchair``, ``acl``) and the Hugging Face packages that
MindSpeed-LLM imports for tokenizers and checkpoints but not for a model's forward
(``transformers``, ``safetensors``, ``datasets``). A stub answers every attribute with a stub
class (so imports, subclasses and type hints work), except :data:`ABSENT` (probes that must fail
on a CPU) and :data:`VALUES` (calls whose result is used). ``torch.npu`` becomes such a stub too.
MindSpeed-LLM's adaptor then runs unchanged: it applies its real feature list to Megatron.

Seen working on 2026-11-24 with Megatron-LM core_v0.12.1 (a845aa7e) and MindSpeed-LLM v26.0.0
(57c33296) on MindSpeed 26.0.0_core_r0.12.1 (3c44c134), and MindSpeed-LLM master (c77308a1) on
MindSpeed 26.1.0_core_r0.12.1 (57a33053); their other imports need ``six regex einops pyyaml tqdm
scipy`` installed (``peft``, imported by master's LoRA feature, is stubbed).
"""

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("torch_npu", "torchair", "acl", "transformers", "safetensors", "datasets", "peft")
ABSENT = {"hccl_config"}  # MindSpeed adds HCCL options to a group when torch_npu has them: not on gloo
VALUES = {"torch_npu.utils.collect_env.get_cann_version": lambda: "8.3.RC1"}  # compared as a string


class _StubType(type):
    def __getattr__(cls, name):
        if name.startswith("__") or name in ABSENT:
            raise AttributeError(name)
        return _stub(f"{cls.__qualname__}.{name}")


def _stub(name):
    if name in VALUES:
        return VALUES[name]
    return _StubType(name.rsplit(".", 1)[-1], (), {
        "__qualname__": name, "__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None,
    })


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") or name in ABSENT:
            raise AttributeError(name)
        return _stub(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__file__ = f"/nonexistent/{spec.name.replace('.', '/')}/__init__.py"  # MindSpeed reads it
        return module

    def exec_module(self, module):
        pass


def load(megatron_src, mindspeed_src, mindspeed_llm_src):
    """Make ``mindspeed_llm``, ``mindspeed`` and ``megatron`` (with ``megatron.training``) importable."""
    import torch

    sys.path[:0] = [mindspeed_llm_src, mindspeed_src, megatron_src]
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
    torch.npu = _StubModule("torch.npu")


def pretrain_gpt(mindspeed_llm_src):
    """MindSpeed-LLM's ``pretrain_gpt.py`` as the module ``pretrain_gpt``, loaded from its tree by path
    (``examples/pretrain_gpt.py`` has the same name and may come first on ``sys.path`` in a test)."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(mindspeed_llm_src, "pretrain_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["pretrain_gpt"] = module
    spec.loader.exec_module(module)
    return module


class CudaTensorsOnCpu(types.ModuleType):
    """``torch`` for a module that makes small tensors with ``device='cuda'`` (MindSpeed-LLM's
    ``training_log``, Megatron's schedules; ``torch_npu.contrib.transfer_to_npu`` maps that to the
    NPU): here, the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        import torch

        return torch.tensor(*args, device="cpu" if device == "cuda" else device, **kwargs)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        import torch

        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)
