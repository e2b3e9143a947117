"""Load MindSpeed-LLM's real source on a CPU machine without Ascend, for ``test_mindspeed_llm_source.py``.

:func:`load` puts the three source trees first on ``sys.path`` and stubs the packages that only
exist on Ascend machines (``torch_npu``, ``torchair``, ``acl``) and the Hugging Face packages that
MindSpeed-LLM imports for tokenizers and checkpoints but not for a model's forward
(``transformers``, ``safetensors``, ``datasets``). A stub answers every attribute with a stub
class (so imports, subclasses and type hints work), except :data:`ABSENT` (probes that must fail
on a CPU) and :data:`VALUES` (calls whose result is used). ``torch.npu`` becomes such a stub too.
MindSpeed-LLM's adaptor then runs unchanged: it applies its real feature list to Megatron.

:func:`sources` finds the trees (unpacking ``../shared/third_party``'s archives); :func:`probe` is
what a process looks like in each import order. Seen working with Megatron-LM core_v0.12.1 (a845aa7e)
and MindSpeed-LLM v26.0.0 (57c33296) on MindSpeed 26.0.0_core_r0.12.1 (3c44c134), MindSpeed-LLM master
(c77308a1) on MindSpeed master (028de58c), and (the import-order probes) v2.2.0 (53f3639c) on 2.2.0_core_r0.12.1
(2026-11-27, the archives); their other imports need ``six regex einops pyyaml tqdm
scipy`` installed (``peft``, imported by master's LoRA feature, is stubbed).
"""

import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import tarfile
import tempfile
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


# The triples MindSpeed-LLM's install guides pair (archives in ../shared/third_party, see its README).
TRIPLES = {
    "v26.0.0": ("megatron-lm-core_v0.12.1", "mindspeed-26.0.0_core_r0.12.1", "mindspeed-llm-v26.0.0"),
    "master": ("megatron-lm-core_v0.12.1", "mindspeed-master", "mindspeed-llm-master"),
    "v2.2.0": ("megatron-lm-core_v0.12.1", "mindspeed-2.2.0_core_r0.12.1", "mindspeed-llm-v2.2.0"),
}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _third_party():
    """``CEZ_THIRD_PARTY``, else ``shared/third_party`` beside the checkout, or, for a clone of a local
    checkout made elsewhere (``git clone . $(mktemp -d)``), beside the checkout it was cloned from."""
    if os.environ.get("CEZ_THIRD_PARTY"):
        return os.environ["CEZ_THIRD_PARTY"]
    beside = os.path.join(os.path.dirname(REPO), "shared", "third_party")
    try:
        origin = subprocess.run(["git", "-C", REPO, "config", "--get", "remote.origin.url"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        origin = ""
    origin = origin[len("file://"):] if origin.startswith("file://") else origin
    if not os.path.isdir(beside) and origin and os.path.isdir(origin):
        return os.path.join(os.path.dirname(os.path.abspath(origin)), "shared", "third_party")
    return beside


THIRD_PARTY = _third_party()


def sources(triple=None):
    """``(megatron, mindspeed, mindspeed_llm)`` source folders, or None where there are none here.

    ``CEZ_MINDSPEED_LLM_SOURCES=<Megatron-LM>:<MindSpeed>:<MindSpeed-LLM>`` names unpacked trees;
    else the archives of ``triple`` (``CEZ_MINDSPEED_LLM_TRIPLE``, default v26.0.0) in
    ``CEZ_THIRD_PARTY`` (default ``../shared/third_party`` beside the checkout, or beside the local
    checkout it was cloned from) are unpacked once
    into the temporary folder. In CI (``CI=true``) missing archives are an error, not a skip."""
    given = os.environ.get("CEZ_MINDSPEED_LLM_SOURCES")
    if given:
        return tuple(given.split(os.pathsep))
    triple = triple or os.environ.get("CEZ_MINDSPEED_LLM_TRIPLE", "v26.0.0")
    archives = [os.path.join(THIRD_PARTY, f"{name}.tar.gz") for name in TRIPLES[triple]]
    missing = [a for a in archives if not os.path.isfile(a)]
    if missing:
        if os.environ.get("CI") == "true":
            raise FileNotFoundError(f"MindSpeed-LLM {triple}: missing source archives {missing} "
                                    "(set CEZ_THIRD_PARTY to the folder that holds them)")
        return None
    return tuple(_unpacked(a) for a in archives)


def _unpacked(archive):
    """``archive`` unpacked under the temporary folder (once; a finished copy is renamed into place)."""
    root = os.path.join(tempfile.gettempdir(), "mindspeed_cez_third_party")
    name = os.path.basename(archive)[:-len(".tar.gz")]
    stat = os.stat(archive)
    target = os.path.join(root, f"{name}-{stat.st_size}-{int(stat.st_mtime)}")
    if not os.path.isdir(target):
        os.makedirs(root, exist_ok=True)
        work = tempfile.mkdtemp(dir=root, prefix=f".{name}-")
        with tarfile.open(archive) as tar:
            tar.extractall(work, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        try:
            os.rename(work, target)
        except OSError:  # another process finished first
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    return target


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


def _megatron_modules():
    return sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))


def _compiled_megatron_functions():
    """Megatron's module-level functions that ``torch.compile`` / ``torch.jit.script`` turned into
    compiled ones (MindSpeed replaces both with a no-op before Megatron is imported)."""
    import torch

    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "megatron" or name.startswith("megatron.")):
            continue
        for attr, value in list(vars(module).items()):
            if hasattr(value, "_torchdynamo_orig_callable") or isinstance(value, torch.jit.ScriptFunction):
                found.append(f"{name}.{attr}")
    return sorted(found)


def probe(order, sources_=None):
    """What a MindSpeed-LLM process looks like with the adaptor imported in ``order`` ("cez first",
    "cez last", "launched": this script run by ``python -m mindspeed_cez.launch``, "apply first":
    ``mindspeed_cez.patches.apply()`` first): a dict, printed as JSON by ``python THIS ORDER``."""
    out = {"megatron_before": _megatron_modules()}
    load(*(sources_ or sources()))
    if order in ("cez first", "apply first"):
        if order == "cez first":
            import mindspeed_cez.megatron_adaptor  # noqa: F401
        else:
            from mindspeed_cez import patches

            patches.apply(z_loss_coeff=1e-3)
        out["megatron_after_register"] = _megatron_modules()
        out["mindspeed_after_register"] = sorted(m for m in sys.modules if m.split(".")[0] == "mindspeed")
        from mindspeed_llm import megatron_adaptor  # noqa: F401
    else:
        if order == "launched":
            out["megatron_after_register"] = _megatron_modules()  # the launcher imported the adaptor
        from mindspeed_llm import megatron_adaptor  # noqa: F401

        import mindspeed_cez.megatron_adaptor  # noqa: F401
    from megatron.core import jit
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from mindspeed.patch_utils import MindSpeedPatchesManager

    from mindspeed_cez import megatron_adaptor
    from mindspeed_cez import patches

    out["mode"] = megatron_adaptor.MODE
    out["jit_fuser"] = f"{jit.jit_fuser.__module__}.{jit.jit_fuser.__qualname__}"
    out["compiled"] = _compiled_megatron_functions()
    out["ours_in_mindspeed"] = sorted(
        path for path, patch in MindSpeedPatchesManager.patches_info.items()
        if any(getattr(w, "__module__", "").startswith("mindspeed_cez") for w in patch.wrappers) and patch.is_applied)
    out["direct"] = patches.installed_targets()
    out["loss_patched"] = getattr(LanguageModule.compute_language_model_loss, "__cez_wraps__", None) is not None
    return out


if __name__ == "__main__":  # python tests/support/mindspeed_llm_source.py ORDER [MEGATRON MINDSPEED MINDSPEED_LLM]
    import json

    print("PROBE " + json.dumps(probe(sys.argv[1], sys.argv[2:5] or None)), flush=True)
