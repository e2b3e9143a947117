"""Launch a ``@triton.jit`` kernel without Triton's per-call argument specialization.

Triton's ``kernel[grid](*args)`` binds the arguments, specializes each one (dtype, 16-byte
alignment, value 1, integer width), builds a cache key and looks the compiled kernel up on
every call: tens of microseconds of host time per launch. A training step launches the same
kernels with arguments of the same kinds every time, so ``Launcher`` keys the compiled kernel
by a cheaper tuple of the same properties and, from the second call on, launches it through
the compiled kernel's own launcher, as Triton's launch does once it has found the kernel.

The key holds, per argument, what Triton specializes on (Triton's ``specialize_impl`` and
``BaseBackend.get_*_specialization``): a tensor's dtype and whether its address is a multiple
of 16; an integer's value when it is 1, whether it is a multiple of 16 and its width class
(i32 / i64 / u64); constexprs by value; plus the device and the launch options. So two calls
with equal keys get the same compiled kernel from Triton too (``tests/kernels/test_triton_cross_entropy_launcher.py`` checks
this against Triton's own binder). The direct launch runs on CUDA with Triton's launch
convention of Triton 3.4 to 3.6 (``triton.knobs``; ``CompiledKernel.run(grid, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``; checked on GPUs with 3.6) while
no launch hook (a profiler's) is set; everything else goes through ``kernel[grid]`` as before, with
one warning on CUDA where this Triton is outside those versions (torch 2.7.1 brings Triton 3.3.1).
"""

import functools
import inspect
import re
import warnings

import torch
import triton

try:
    from triton import knobs as _knobs
    from triton.compiler import CompiledKernel as _CompiledKernel
except ImportError:  # Triton before 3.4 (triton-ascend 3.2): Triton's own launch path
    _knobs = _CompiledKernel = None

_INT32 = (-(2**31), 2**31 - 1)
_UINT64_START = 2**63


DIRECT_LAUNCH_TRITON = ((3, 4), (3, 6))  # the Triton releases whose launch convention __call__ follows


def direct_launch_supported(version=triton.__version__) -> bool:
    """Triton ``version`` within :data:`DIRECT_LAUNCH_TRITON`, with ``knobs`` and a
    ``CompiledKernel.run`` property (what ``Launcher.__call__`` uses)."""
    release = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    in_range = DIRECT_LAUNCH_TRITON[0] <= release <= DIRECT_LAUNCH_TRITON[1]
    return in_range and _knobs is not None and isinstance(getattr(_CompiledKernel, "run", None), property)


@functools.lru_cache(maxsize=None)  # a cache: the warning given once per Triton version (one per process)
def warn_triton_launch(version=triton.__version__):
    """Once per process: the CUDA launches go through Triton's own path with this Triton."""
    low, high = (".".join(map(str, v)) for v in DIRECT_LAUNCH_TRITON)
    warnings.warn(f"mindspeed_cez: Triton {version} is outside {low}-{high}, the versions its direct kernel "
                  "launcher follows; kernels launch through Triton's own path (same results, some tens of "
                  "microseconds more host time per launch)", stacklevel=3)


def _tensor_key(value):
    return value.dtype, value.data_ptr() % 16 == 0


def _int_key(value):
    width = 0 if _INT32[0] <= value <= _INT32[1] else (2 if value >= _UINT64_START else 1)
    return value == 1, value % 16 == 0, width


def _arg_key(value):
    """What Triton specializes a runtime argument on."""
    by_type = _KEY_BY_TYPE.get(type(value))
    if by_type is not None:
        return by_type(value)
    if isinstance(value, torch.Tensor):
        return _tensor_key(value)
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        return _int_key(value)
    if isinstance(value, float):
        return float
    return type(value), value


_KEY_BY_TYPE = {torch.Tensor: _tensor_key, int: _int_key, float: lambda _: float, bool: lambda _: bool}


def _hooks_set():
    """Launch hooks (profilers): Triton 3.6+ keeps them in a ``HookChain`` (``calls``), earlier
    versions as a callable or None."""
    for hook in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class Launcher:
    """``Launcher(kernel)(grid, args, options)``: ``kernel[grid](*args, **dict(options))``, with
    the compiled kernel reused for arguments of the same kinds. ``args`` holds every parameter
    of the kernel in order, constexprs included (``bind`` makes it from names); ``options`` is a tuple of (name, value) launch
    options (``num_warps``, ...). ``direct=False`` (an instance's choice: A/B timing, debugging):
    always Triton's own launch path."""

    def __init__(self, kernel, direct=True):
        self.kernel = kernel
        self.direct = direct
        self.params = tuple(inspect.signature(kernel.fn).parameters)  # the kernel's, in order
        self._param_set = frozenset(self.params)
        constexprs = set(getattr(kernel, "constexprs", ()))  # none under the interpreter
        self.runtime = [i not in constexprs for i in range(len(getattr(kernel, "arg_names", ())))]
        self.compiled = {}
        self.current_stream = None  # Triton's driver's, once a kernel has launched

    def bind(self, shared=None, /, **named):
        """The kernel's arguments in parameter order, by name: every parameter from ``named``, or else
        from ``shared`` (a mapping several kernels draw on, e.g. a loss's kernel arguments; names the
        kernel lacks are left out). A parameter in neither, or a name in ``named`` the kernel lacks, raises."""
        if not named.keys() <= self._param_set:
            raise TypeError(f"{self.kernel.fn.__name__} has no parameter {sorted(named.keys() - self._param_set)}")
        if shared:
            named = {**shared, **named}
        try:
            return tuple([named[p] for p in self.params])  # a list first: faster than a generator
        except KeyError as missing:
            raise TypeError(f"{self.kernel.fn.__name__}: no value for parameter {missing}") from None

    def key(self, device, args, options):
        return (device.index, options, *[_arg_key(v) if r else v for r, v in zip(self.runtime, args)])

    def __call__(self, grid, args, options):
        device = args[0].device
        if not (self.direct and device.type == "cuda" and _DIRECT):
            if device.type == "cuda" and not _DIRECT:
                warn_triton_launch()
            self.kernel[grid](*args, **dict(options))
            return
        key = self.key(device, args, options)
        compiled = self.compiled.get(key)
        if compiled is None or _hooks_set():
            compiled = self.kernel[grid](*args, **dict(options))  # compiles, or finds it in Triton's cache
            if isinstance(compiled, _CompiledKernel):
                compiled.run  # noqa: B018 - loads the module and makes its launcher now
                self.compiled[key] = compiled
                self.current_stream = triton.runtime.driver.active.get_current_stream
            return
        # What Triton's own launch does once it has found the kernel, without hooks to call.
        compiled.run(
            grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            self.current_stream(device.index), compiled.function, compiled.packed_metadata, None, None, None, *args,
        )


_DIRECT = direct_launch_supported()
