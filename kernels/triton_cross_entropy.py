"""Triton kernels of the cross entropy + z-loss: softmax statistics and loss (forward), the in-place
gradient (backward); and what every Triton kernel of the package shares (``triton_linear_cross_entropy``
and ``triton_matmul_accumulate`` import it from here): the device's launch plan, the :class:`Launcher`
and the loss's ``@triton.jit`` steps. Sections, in reading order: device and launch plan; the
Launcher; the shared jit steps; the kernels; the host functions.

One source for NVIDIA (``triton``) and Ascend (``triton-ascend``). The two streaming kernels
launch a persistent grid (:func:`num_programs`): program ``p`` takes the contiguous
rows ``[p*rows_per_program, (p+1)*rows_per_program)`` and walks each row's vocab slice in tiles
of ``BLOCK_V`` columns, asking for the next tile (across row ends too) before working on the
current one (on CUDA the many programs sharing an SM hide the rest of the load latency).
Row offsets are int64 (N*V may pass 2**31). Nothing here reads tensor values
on the host, so forward + backward capture in a CUDA graph.

Forward reads the logits once. A tile is viewed as ``[SLOTS, SLOT_WIDTH]``; each slot keeps
its own running max and sum-exp (online softmax), so the tile loop has no cross-thread
reduction: the slots are merged once per row. On CUDA a slot is 16 contiguous values held
by one thread; on Ascend there is one slot per tile (whole-tile vector reductions). The target
logit is a single load issued one row ahead, so no dependent load sits at the end of a row.
With one rank the same kernel finishes the loss; with several it writes this slice's partials
(its lse, target term and width: the layout in ``kernels/__init__.py``), which the op all-gathers;
one small kernel then combines every rank's into the loss and checks that the widths agree. On CUDA
the forward also asserts each row's target is in range (a device-side assert, no host sync);
elsewhere an out-of-range target gives a NaN loss.

Backward reads the logits once more and writes the gradient, in place when the caller passes
the logits' own buffer as ``grad``; each row's lse, upstream gradient and target are loaded
one row ahead.

A logit scale or soft cap is a ``TRANSFORM`` constexpr (``LogitTransform.kind``; ``NO_TRANSFORM``
compiles to the kernels without one): forward transforms each fp32 tile in registers before the
online softmax, the smoothing sum and the target logit (the soft cap's padding columns put back to
-inf); backward recomputes z from x per element and multiplies by its slope.

Launches go through :class:`Launcher` (the compiled kernel reused without Triton's per-call
specialization) with each shape's grid and settings computed once (:func:`_plan`).
"""

import functools
import inspect
import re
import warnings
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from .. import kernels  # this package's interface: the loss and the partials layout
from . import torch_reference


# =========================================================================== device and launch plan
# How many programs a persistent grid launches: Triton's driver reports the core count
# (``multiprocessor_count`` on CUDA, ``num_vectorcore`` or ``num_aicore`` on Ascend through
# triton-ascend), read once per device; and each kernel's settings per device type.

_FALLBACK_CORES = 16  # interpreter on CPU, or a driver that reports nothing


def launch_type(device: torch.device) -> str:
    """The device type whose launch settings (``LAUNCH_CONFIG`` entries, eviction, dot precision) a kernel
    on ``device`` uses: its own. Every kernel asks here, through this module (a test runs the NPU's
    settings on CPU tensors under the interpreter by replacing it: ``tests/support/npu_launch.py``)."""
    return device.type


@functools.lru_cache(maxsize=None)
def core_count(device_type: str, device_index: int) -> int:
    if device_type == "cpu":
        return _FALLBACK_CORES
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    except Exception:  # noqa: BLE001 - any driver without the query falls back
        props = {}
    for key in ("multiprocessor_count", "num_vectorcore", "num_aicore"):
        if props.get(key):
            return int(props[key])
    if device_type == "cuda":
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    return _FALLBACK_CORES


def num_programs(device: torch.device, n_rows: int, programs_per_core: int) -> int:
    """A persistent grid: ``programs_per_core`` programs per core (Ascend: 1, each taking a
    contiguous chunk of rows; CUDA: several CTAs share an SM), never more than the rows."""
    index = device.index if device.index is not None else 0
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device()
    cores = core_count(device.type, index)
    return max(1, min(n_rows, cores * programs_per_core))


# Launch settings per device type, as (narrowest vocab slice they apply to, settings), widest
# first. Settings of the forward (fwd_*) and the backward (bwd_*) kernel: columns per tile,
# columns per slot of the forward (None: one slot per tile), warps, and programs per core of the
# persistent grid. Ascend wants about one program per vector core, and a program's working set
# (current and prefetched tile plus a few fp32 temporaries) well inside the ~192 KiB unified
# buffer: 4096 columns use about 64 KiB. On CUDA many short programs share each SM (how the values
# were chosen: docs/performance.md). CUDA-only settings live here, not in the kernel bodies.
LAUNCH_CONFIG = {
    "cuda": [
        (65536, {"fwd_block_v": 8192, "slot_width": 16, "fwd_warps": 4, "fwd_per_core": 64,
                 "bwd_block_v": 16384, "bwd_warps": 32, "bwd_per_core": 64}),
        # Narrow slices: up to 128 programs per SM, and 4096-column forward tiles (56 registers).
        (0, {"fwd_block_v": 4096, "slot_width": 8, "fwd_warps": 4, "fwd_per_core": 128,
             "bwd_block_v": 16384, "bwd_warps": 4, "bwd_per_core": 128}),
    ],
    "npu": [
        (0, {"fwd_block_v": 4096, "slot_width": None, "fwd_warps": 4, "fwd_per_core": 1,
             "bwd_block_v": 4096, "bwd_warps": 4, "bwd_per_core": 1}),
    ],
    "cpu": [  # the interpreter
        (0, {"fwd_block_v": 4096, "slot_width": 8, "fwd_warps": 4, "fwd_per_core": 1,
             "bwd_block_v": 4096, "bwd_warps": 4, "bwd_per_core": 1}),
    ],
}
EVICTION = {"cuda": "evict_first", "npu": "evict_first", "cpu": ""}


def launch_settings(device_type, n_cols):
    """The LAUNCH_CONFIG settings for a vocab slice of ``n_cols`` columns on this device type."""
    for narrowest, settings in LAUNCH_CONFIG.get(device_type, LAUNCH_CONFIG["npu"]):
        if n_cols >= narrowest:
            return settings
    raise ValueError(f"no launch settings for {n_cols} columns on {device_type}")


def _assert_options():
    """On CUDA the forward asserts on its targets: a debug compile, without the integer-overflow
    checks a debug compile adds where Triton has them (``sanitize_overflow``, Triton 3.2+)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        sanitizer = "sanitize_overflow" in CUDAOptions.__dataclass_fields__
    except Exception:  # noqa: BLE001 - no NVIDIA backend here (triton-ascend): never launched with it
        sanitizer = False
    return (("debug", True),) + ((("sanitize_overflow", False),) if sanitizer else ())


ASSERT_OPTIONS = _assert_options()


@functools.lru_cache(maxsize=256)
def _plan(device, n_rows, n_cols, kernel, kind):
    """(grid, rows per program, constexprs, launch options) of the ``"fwd"`` or ``"bwd"`` kernel for
    ``[n_rows, n_cols]`` logits on ``device``; the constexprs by the kernel's parameter names: SLOTS,
    SLOT_WIDTH, CHECK_TARGETS (the check, on CUDA, with its debug options) and EVICT for the
    forward, BLOCK_V and EVICT for the backward; ``kind``: the device type whose settings apply
    (``launch_type``). The loss's own constexprs come from ``LossSpec.kernel_args``."""
    config = launch_settings(kind, n_cols)
    programs = num_programs(device, n_rows, config[f"{kernel}_per_core"])
    block_v = min(config[f"{kernel}_block_v"], triton.next_power_of_2(n_cols))
    options = (("num_warps", config[f"{kernel}_warps"]),)
    constexprs = {"EVICT": EVICTION.get(kind, "")}
    if kernel == "bwd":
        constexprs["BLOCK_V"] = block_v
    else:
        slot_width = min(config["slot_width"] or block_v, block_v)
        check = kind == "cuda"
        constexprs.update(SLOTS=block_v // slot_width, SLOT_WIDTH=slot_width, CHECK_TARGETS=check)
        options += ASSERT_OPTIONS if check else ()
    return (programs,), triton.cdiv(n_rows, programs), MappingProxyType(constexprs), options


def launch_plans_changed():
    """Forget the plans computed so far; call after changing ``LAUNCH_CONFIG``."""
    _plan.cache_clear()


# =========================================================================== the Launcher
# Triton's ``kernel[grid](*args)`` binds, specializes (dtype, 16-byte alignment, value 1, integer width) and
# looks the compiled kernel up on every call: tens of microseconds of host time per launch. ``Launcher`` keys
# the compiled kernel by a cheaper tuple of what Triton specializes on (``specialize_impl``,
# ``BaseBackend.get_*_specialization``: a tensor's dtype and 16-byte alignment; an integer's value 1, multiple
# of 16 and width class; constexprs by value; the device and the launch options), so equal keys mean the same
# compiled kernel (``tests/kernels/test_triton_cross_entropy_launcher.py`` checks it against Triton's binder), and from the
# second call on launches it directly, as Triton does once it has found the kernel. The direct launch follows
# Triton 3.4 to 3.6's convention (``triton.knobs``; ``CompiledKernel.run(grid, stream, function,
# packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``), on CUDA, while no launch hook (a
# profiler's) is set; everything else goes through ``kernel[grid]``, with one warning on CUDA where this
# Triton is outside those versions (torch 2.7.1 brings Triton 3.3.1).

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


# =========================================================================== the shared jit steps
# The steps of the loss that every Triton kernel shares, as ``@triton.jit`` helpers (they inline: a kernel
# built from them compiles to what it would with the steps written out):
# - the logit transform: ``z`` of fp32 logits under the ``TRANSFORM`` constexpr and its slope; tanh comes
#   from ``exp2``, and from its series near zero (:func:`tanh_and_slope`): ``tl.math.tanh`` does not lower
#   on triton-ascend;
# - the online softmax: a running max and a sum of ``exp(z - max)`` per row, rescaled when a tile
#   (:func:`softmax_tile`) or another slice's lse (:func:`softmax_lse`) raises the max; exponentials are
#   ``exp2`` of log2-scaled values, and a row that is -inf so far rescales by nothing (no ``-inf - -inf``);
# - the partials: a row's target term, the store of lse and target term, the slice's width words;
# - the finish: (loss, z-loss, lse) rows from lse and target term;
# - the gradient ``g * (softmax * (1 + 2c*lse) - (1-a)*onehot - a/V)`` of a tile, times the transform's slope.
#
# Module-level values a kernel reads are ``tl.constexpr`` (Triton's compiler refuses other globals). A
# helper's arguments are computed before its body, which moves them in the compiled order (and can change
# the schedule ptxas picks): a helper takes the raw values a kernel used late (e.g. :func:`grad_tile`
# compares the columns itself, :func:`store_loss` the target). ``mask=None`` stores without a mask.

LOG2E = tl.constexpr(1.4426950408889634)

# The partials layout and the TRANSFORM constexpr (``kernels/__init__.py``).
LOCAL_LSE = tl.constexpr(kernels.LOCAL_LSE)
TARGET_TERM = tl.constexpr(kernels.TARGET_TERM)
WIDTH = tl.constexpr(kernels.WIDTH)
PARTIAL_ROWS = tl.constexpr(kernels.PARTIAL_ROWS)
NO_TRANSFORM = tl.constexpr(kernels.NO_TRANSFORM)
SCALE = tl.constexpr(kernels.SCALE)
SOFTCAP = tl.constexpr(kernels.SOFTCAP)


# --------------------------------------------------------------------------- the logit transform

# tanh's Taylor series below |u| < TANH_SERIES_BELOW, through u**9 (the next term, 1382/155925 u**11, is
# < 1e-8 of tanh there; stopping at u**7 left 3.6e-7 near 0.25): 1 - e loses u's digits when
# e = exp(-2|u|) nears 1, the series does not.
# The numbers are ``LogitTransform``'s, which the torch reference uses.
TANH_SERIES_BELOW = tl.constexpr(kernels.TANH_SERIES_BELOW)
TANH_C3 = tl.constexpr(kernels.TANH_SERIES[0])
TANH_C5 = tl.constexpr(kernels.TANH_SERIES[1])
TANH_C7 = tl.constexpr(kernels.TANH_SERIES[2])
TANH_C9 = tl.constexpr(kernels.TANH_SERIES[3])


@triton.jit
def tanh_and_slope(u, PRECISE: tl.constexpr):
    """(tanh(u), 1 - tanh(u)**2) from e = exp(-2|u|) in (0, 1]: tanh = sign(u) * (1 - e) / (1 + e)
    and 1 - tanh**2 = 4e / (1 + e)**2. exp2 never overflows, so large |u| give exactly +-1 and 0
    (NaN stays NaN); the slope has no cancellation where tanh nears +-1. Written with exp2 because
    ``tl.math.tanh`` does not lower on triton-ascend (``expm1`` is only in each backend's libdevice). With
    ``PRECISE`` (fp32 logits), below ``TANH_SERIES_BELOW`` tanh is its odd series ``u + u**3 (c3 + u**2 (c5
    + u**2 (c7 + u**2 c9)))`` (five FMAs and a select), within fp32's rounding of tanh where ``1 - e`` would cancel;
    16-bit logits skip it (the cancellation, ~6e-8 absolute, is far below their own rounding, and the
    series costs the memory-bound forward ~18 % on an H100)."""
    e = tl.exp2(tl.abs(u) * (-2.0 * LOG2E))
    r = 1.0 / (1.0 + e)
    t = (1.0 - e) * r
    t = tl.where(u < 0, -t, t)
    if PRECISE:
        u2 = u * u
        series = u + u * u2 * (TANH_C3 + u2 * (TANH_C5 + u2 * (TANH_C7 + u2 * TANH_C9)))
        t = tl.where(tl.abs(u) < TANH_SERIES_BELOW, series, t)
    return t, 4.0 * e * r * r


@triton.jit
def transform_logits(x, logit_scale, logit_softcap, TRANSFORM: tl.constexpr, PRECISE: tl.constexpr):
    """fp32 z of fp32 logits x: ``scale * x`` (SCALE), ``cap * tanh(scale * x / cap)`` (SOFTCAP), x.
    ``PRECISE``: the logits came in fp32 (:func:`tanh_and_slope`)."""
    z = x
    if TRANSFORM == SCALE:
        z = x * logit_scale
    if TRANSFORM == SOFTCAP:
        z = logit_softcap * tanh_and_slope(x * (logit_scale / logit_softcap), PRECISE)[0]
    return z


@triton.jit
def transform_logits_with_slope(x, logit_scale, logit_softcap, TRANSFORM: tl.constexpr, PRECISE: tl.constexpr):
    """(z, dz/dx): the slope is ``scale``, or ``scale * (1 - tanh**2)`` with a cap; 1 for no transform."""
    z = x
    slope = 1.0
    if TRANSFORM == SCALE:
        z = x * logit_scale
        slope = logit_scale
    if TRANSFORM == SOFTCAP:
        t, sech2 = tanh_and_slope(x * (logit_scale / logit_softcap), PRECISE)
        z = logit_softcap * t
        slope = logit_scale * sech2
    return z, slope


# --------------------------------------------------------------------------- the online softmax

@triton.jit
def softmax_tile(run_max, run_sum, z):
    """(max, sum of exp(z - max)) per row of ``z [R, C]`` (axis 1) merged into the running
    ``run_max``, ``run_sum [R]``; -inf entries (padding) add nothing."""
    new_max = tl.maximum(run_max, tl.max(z, axis=1))
    ref = tl.where(new_max == -float("inf"), 0.0, new_max) * LOG2E  # all -inf so far: no rescale
    tile_sum = tl.sum(tl.exp2(z * LOG2E - ref[:, None]), axis=1)
    return new_max, run_sum * tl.exp2(run_max * LOG2E - ref) + tile_sum


@triton.jit
def softmax_lse(run_max, run_sum, lse):
    """The running (max, sum) with one more slice's ``lse`` per row (log-sum-exp of lse values)."""
    new_max = tl.maximum(run_max, lse)
    ref = tl.where(new_max == -float("inf"), 0.0, new_max) * LOG2E  # -inf so far: no rescale
    return new_max, run_sum * tl.exp2(run_max * LOG2E - ref) + tl.exp2(lse * LOG2E - ref)


@triton.jit
def lse_of(run_max, run_sum):
    """A row's log-sum-exp from its running (max, sum); -inf for a row that is -inf throughout."""
    return run_max + tl.log(run_sum)


@triton.jit
def softmax_slots(slot_max, slot_sum):
    """A row's (max, sum) from the running (max, sum) of its slots, ``[SLOTS]`` each (axis 0)."""
    row_max = tl.max(slot_max, axis=0)
    ref = tl.where(row_max == -float("inf"), 0.0, row_max)
    return row_max, tl.sum(slot_sum * tl.exp2((slot_max - ref) * LOG2E), axis=0)


# --------------------------------------------------------------------------- the partials

@triton.jit
def target_term(picked, logit_sum, target, ignore_index, global_vocab, target_weight, smoothing_per_col,
                WITH_LOGIT_SUM: tl.constexpr, CHECK_TARGETS: tl.constexpr):
    """``(1-a)*z[target] + (a/V)*sum(z)`` of a row from its picked z and its sum of z (read only
    WITH_LOGIT_SUM); NaN for a target outside ``[0, global_vocab)`` that is not ``ignore_index``,
    and with CHECK_TARGETS a device-side assert there (a debug compile)."""
    term = target_weight * picked
    if WITH_LOGIT_SUM:
        term += smoothing_per_col * logit_sum
    invalid = (target != ignore_index) & ((target < 0) | (target >= global_vocab))
    if CHECK_TARGETS:
        tl.device_assert(~invalid, "target outside [0, vocab) and not ignore_index")
    return tl.where(invalid, float("nan"), term)


@triton.jit
def store_partials(out_ptr, n_rows, rows, lse, term, mask):
    """Rows ``rows`` of the partials' lse and target-term rows (``n_rows`` each) at ``out_ptr``."""
    tl.store(out_ptr + LOCAL_LSE * n_rows + rows, lse, mask=mask)
    tl.store(out_ptr + TARGET_TERM * n_rows + rows, term, mask=mask)


@triton.jit
def load_partials(ptr, n_rows, rows, mask):
    """(lse, target term) of ``rows`` from partials at ``ptr``; 0 where masked (finite: no NaN)."""
    lse = tl.load(ptr + LOCAL_LSE * n_rows + rows, mask=mask, other=0.0)
    term = tl.load(ptr + TARGET_TERM * n_rows + rows, mask=mask, other=0.0)
    return lse, term


@triton.jit
def load_width(ptr, n_rows):
    """A slice's width words from its partials at ``ptr``."""
    return tl.load(ptr + WIDTH * n_rows), tl.load(ptr + WIDTH * n_rows + 1)


@triton.jit
def store_width(out_ptr, n_rows, width_hi, width_lo):
    """The slice's width words (``kernels.width_words``), by program 0."""
    if tl.program_id(0) == 0:
        tl.store(out_ptr + WIDTH * n_rows, width_hi)
        tl.store(out_ptr + WIDTH * n_rows + 1, width_lo)


# --------------------------------------------------------------------------- the finish

@triton.jit
def store_loss(out_ptr, out_stride, rows, lse, term, z_loss_coeff, target, ignore_index, mask):
    """The (loss, z-loss, lse) rows, ``out_stride`` apart: ``lse - term + c*lse**2`` and
    ``c*lse**2``, both 0 where ``target == ignore_index``."""
    z_loss = z_loss_coeff * lse * lse
    ignored = target == ignore_index
    tl.store(out_ptr + rows, tl.where(ignored, 0.0, lse - term + z_loss), mask=mask)
    tl.store(out_ptr + out_stride + rows, tl.where(ignored, 0.0, z_loss), mask=mask)
    tl.store(out_ptr + 2 * out_stride + rows, lse, mask=mask)


# --------------------------------------------------------------------------- the gradient

@triton.jit
def load_grad_row_inputs(target_ptr, lse_ptr, grad_loss_ptr, grad_loss_stride, rows, live, ignore_index):
    """(target, lse, upstream gradient) of ``rows``; the gradient is 0 for ignored rows and where
    not ``live``."""
    target = tl.load(target_ptr + rows, mask=live, other=ignore_index).to(tl.int64)
    lse = tl.load(lse_ptr + rows, mask=live, other=0.0)
    g = tl.load(grad_loss_ptr + rows * grad_loss_stride, mask=live, other=0.0).to(tl.float32)
    return target, lse, tl.where(target == ignore_index, 0.0, g)


@triton.jit
def grad_coefficients(g, lse, z_loss_coeff, target_weight, smoothing_per_col):
    """Per row: (softmax factor ``g * (1 + 2c*lse)``, ``lse * log2e``, ``g * a/V``, ``g * (1-a)``)."""
    return g * (1.0 + 2.0 * z_loss_coeff * lse), lse * LOG2E, g * smoothing_per_col, g * target_weight


@triton.jit
def grad_tile(z, slope, cols, target_col, scale, lse2, smooth, onehot, TRANSFORM: tl.constexpr):
    """dx of a tile of z: ``softmax * scale - smooth``, ``- onehot`` where ``cols == target_col``, times the slope."""
    dx = tl.exp2(z * LOG2E - lse2) * scale - smooth
    dx = tl.where(cols == target_col, dx - onehot, dx)
    if TRANSFORM != NO_TRANSFORM:
        dx *= slope
    return dx


# =========================================================================== the kernels

@triton.jit
def _load_tile(logits_ptr, row_stride, row, col, n_cols, end, offs, other: tl.constexpr, EVICT: tl.constexpr):
    """Columns ``col + offs`` of ``row``: masked past the row's end, all masked when ``row >= end``."""
    limit = tl.where(row < end, n_cols - col, 0)
    return tl.load(logits_ptr + row * row_stride + col + offs, mask=offs < limit, other=other, eviction_policy=EVICT)


@triton.jit
def _load_target(target_ptr, row, end, ignore_index):
    return tl.load(target_ptr + row, mask=row < end, other=ignore_index).to(tl.int64)


@triton.jit
def _load_target_logit(logits_ptr, row_stride, row, end, local, n_cols):
    """x[row, local] when this rank owns column ``local`` of a row before ``end``, else 0."""
    owned = (row < end) & (local >= 0) & (local < n_cols)
    return tl.load(logits_ptr + row * row_stride + local, mask=owned, other=0.0).to(tl.float32)


@triton.jit
def _forward_kernel(
    logits_ptr,
    row_stride,
    target_ptr,
    out_ptr,  # fp32 [3, n_rows] (loss, z-loss, lse) when FINISH, else the partials layout
    n_rows,
    n_cols,
    rows_per_program,
    vocab_start,
    global_vocab,
    ignore_index,
    z_loss_coeff,
    target_weight,  # 1 - label_smoothing
    smoothing_per_col,  # label_smoothing / global_vocab
    logit_scale,
    logit_softcap,
    width_hi,  # this slice's width words (kernels.width_words), written when not FINISH
    width_lo,
    SLOTS: tl.constexpr,
    SLOT_WIDTH: tl.constexpr,
    FINISH: tl.constexpr,
    WITH_LOGIT_SUM: tl.constexpr,
    CHECK_TARGETS: tl.constexpr,  # a device-side assert (compiled with debug=True)
    EVICT: tl.constexpr,
    TRANSFORM: tl.constexpr,  # the loss of x (NO_TRANSFORM) or of its transform z (SCALE, SOFTCAP)
):
    BLOCK_V: tl.constexpr = SLOTS * SLOT_WIDTH
    offs = tl.arange(0, SLOTS)[:, None] * SLOT_WIDTH + tl.arange(0, SLOT_WIDTH)[None, :]
    first = tl.program_id(0).to(tl.int64) * rows_per_program  # int64 rows: int64 offsets
    end = tl.minimum(first + rows_per_program, n_rows)
    tiles = tl.cdiv(n_cols, BLOCK_V)
    if not FINISH:
        store_width(out_ptr, n_rows, width_hi, width_lo)

    x = _load_tile(logits_ptr, row_stride, first, 0, n_cols, end, offs, -float("inf"), EVICT)
    target = _load_target(target_ptr, first, end, ignore_index)
    picked = _load_target_logit(logits_ptr, row_stride, first, end, target - vocab_start, n_cols)
    next_target = _load_target(target_ptr, first + 1, end, ignore_index)
    for row in range(first, end):
        # Issued a row ahead: the next row's target logit and the target of the row after it.
        next_picked = _load_target_logit(logits_ptr, row_stride, row + 1, end, next_target - vocab_start, n_cols)
        after_target = _load_target(target_ptr, row + 2, end, ignore_index)

        slot_max = tl.full([SLOTS], -float("inf"), tl.float32)
        slot_sum = tl.zeros([SLOTS], tl.float32)  # sum of exp(x - slot_max)
        slot_logits = tl.zeros([SLOTS], tl.float32)
        for tile in range(0, tiles):
            col = tile * BLOCK_V
            row_ends = tile == tiles - 1
            x_next = _load_tile(
                logits_ptr, row_stride, tl.where(row_ends, row + 1, row), tl.where(row_ends, 0, col + BLOCK_V),
                n_cols, end, offs, -float("inf"), EVICT,
            )
            xf = transform_logits(x.to(tl.float32), logit_scale, logit_softcap, TRANSFORM,
                                  logits_ptr.dtype.element_ty == tl.float32)
            if TRANSFORM == SOFTCAP:  # the padding's -inf became -cap: keep it out of the softmax
                xf = tl.where(offs < n_cols - col, xf, -float("inf"))
            slot_max, slot_sum = softmax_tile(slot_max, slot_sum, xf)
            if WITH_LOGIT_SUM:
                slot_logits += tl.sum(tl.where(offs < n_cols - col, xf, 0.0), axis=1)
            x = x_next

        row_max, sum_exp = softmax_slots(slot_max, slot_sum)
        # z(0) = 0: a target on another rank still adds nothing
        z_picked = transform_logits(picked, logit_scale, logit_softcap, TRANSFORM,
                                    logits_ptr.dtype.element_ty == tl.float32)
        term = target_term(z_picked, tl.sum(slot_logits, axis=0),
                           target, ignore_index, global_vocab, target_weight, smoothing_per_col, WITH_LOGIT_SUM,
                           CHECK_TARGETS)
        lse = lse_of(row_max, sum_exp)  # -inf for a slice that is -inf across the row
        if FINISH:
            store_loss(out_ptr, n_rows, row, lse, term, z_loss_coeff, target, ignore_index, None)
        else:
            store_partials(out_ptr, n_rows, row, lse, term, None)
        target = next_target
        picked = next_picked
        next_target = after_target


@triton.jit
def _loss_from_partials_kernel(partials_ptr, rank_stride, n_ranks, target_ptr, out_ptr, out_stride, n_rows,
                               ignore_index, z_loss_coeff, BLOCK: tl.constexpr, CHECK_WIDTHS: tl.constexpr):
    """(loss, z-loss, lse) rows of ``out`` (row stride ``out_stride``) from ``n_ranks`` ranks' partials
    (``rank_stride`` apart): lse the log-sum-exp of their lse, target terms summed. Widths unequal
    to the first rank's: a NaN loss, and with CHECK_WIDTHS a device-side assert (a debug compile)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n_rows
    width_hi, width_lo = load_width(partials_ptr, n_rows)
    lse_max = tl.full([BLOCK], -float("inf"), tl.float32)
    sum_exp = tl.zeros([BLOCK], tl.float32)  # sum of exp(rank lse - lse_max)
    term = tl.zeros([BLOCK], tl.float32)
    unequal = tl.zeros([BLOCK], tl.float32)
    for rank in range(0, n_ranks):
        part = partials_ptr + rank * rank_stride
        local, rank_term = load_partials(part, n_rows, rows, mask)
        lse_max, sum_exp = softmax_lse(lse_max, sum_exp, local)
        term += rank_term
        rank_hi, rank_lo = load_width(part, n_rows)
        unequal += tl.abs(rank_hi - width_hi) + tl.abs(rank_lo - width_lo)
    if CHECK_WIDTHS:  # kernels.UNEQUAL_WIDTHS
        tl.device_assert(unequal == 0, "vocab shards of unequal width across tensor-parallel ranks: "
                                       "pad the vocab to a multiple of the TP size")
    target = tl.load(target_ptr + rows, mask=mask, other=ignore_index)
    store_loss(out_ptr, out_stride, rows, lse_of(lse_max, sum_exp), tl.where(unequal == 0, term, float("nan")),
               z_loss_coeff, target, ignore_index, mask)


@triton.jit
def _grad_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,  # may equal logits_ptr: every element is read before it is written, by one program
    grad_row_stride,
    target_ptr,
    lse_ptr,
    grad_loss_ptr,  # upstream gradient of the per-token loss, any float dtype, row stride grad_loss_stride
    grad_loss_stride,
    n_rows,
    n_cols,
    rows_per_program,
    vocab_start,
    ignore_index,
    z_loss_coeff,
    target_weight,  # 1 - label_smoothing
    smoothing_per_col,  # label_smoothing / global_vocab
    logit_scale,
    logit_softcap,
    BLOCK_V: tl.constexpr,
    EVICT: tl.constexpr,
    TRANSFORM: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_V)
    first = tl.program_id(0).to(tl.int64) * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    tiles = tl.cdiv(n_cols, BLOCK_V)

    x = _load_tile(logits_ptr, logits_row_stride, first, 0, n_cols, end, offs, 0.0, EVICT)
    target, lse, g = load_grad_row_inputs(target_ptr, lse_ptr, grad_loss_ptr, grad_loss_stride, first, first < end,
                                          ignore_index)
    for row in range(first, end):
        next_target, next_lse, next_g = load_grad_row_inputs(
            target_ptr, lse_ptr, grad_loss_ptr, grad_loss_stride, row + 1, row + 1 < end, ignore_index
        )
        scale, lse2, smooth, onehot = grad_coefficients(g, lse, z_loss_coeff, target_weight, smoothing_per_col)
        local = target - vocab_start
        grad_row = grad_ptr + row * grad_row_stride
        for tile in range(0, tiles):
            col = tile * BLOCK_V
            row_ends = tile == tiles - 1
            x_next = _load_tile(
                logits_ptr, logits_row_stride, tl.where(row_ends, row + 1, row), tl.where(row_ends, 0, col + BLOCK_V),
                n_cols, end, offs, 0.0, EVICT,
            )
            z, slope = transform_logits_with_slope(x.to(tl.float32), logit_scale, logit_softcap, TRANSFORM,
                                                   logits_ptr.dtype.element_ty == tl.float32)
            dx = grad_tile(z, slope, offs, local - col, scale, lse2, smooth, onehot, TRANSFORM)
            tl.store(grad_row + col + offs, dx.to(grad_ptr.dtype.element_ty), mask=offs < n_cols - col,
                     eviction_policy=EVICT)
            x = x_next
        target = next_target
        lse = next_lse
        g = next_g


# =========================================================================== the host functions

# Rows per program of the small [N] kernel (loss from partials).
VECTOR_BLOCK = 1024

_launch_forward = Launcher(_forward_kernel)
_launch_grad = Launcher(_grad_kernel)
_launch_loss_from_partials = Launcher(_loss_from_partials_kernel)
LAUNCHERS = (_launch_forward, _launch_grad, _launch_loss_from_partials)


def _forward(logits, target, out, spec, shard, finish):
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        if not finish:
            torch_reference.write_width(out, 0, n_cols)
        return out
    grid, rows_per_program, constexprs, options = _plan(logits.device, n_rows, n_cols, "fwd",
                                                        launch_type(logits.device))
    width_hi, width_lo = kernels.width_words(n_cols)
    args = _launch_forward.bind(
        spec.kernel_args(shard.global_vocab), **constexprs, logits_ptr=logits, row_stride=logits.stride(0),
        target_ptr=target, out_ptr=out, n_rows=n_rows, n_cols=n_cols, rows_per_program=rows_per_program,
        vocab_start=shard.vocab_start, width_hi=width_hi, width_lo=width_lo, FINISH=finish)
    _launch_forward(grid, args, options)
    return out


def fused_loss(logits, target, spec):
    """One rank holds the whole vocab: fp32 [3, n] rows (loss, z-loss, lse) in one pass, of the loss
    ``spec`` (a :class:`.LossSpec`)."""
    out = torch.empty(3, logits.shape[0], dtype=torch.float32, device=logits.device)
    return _forward(logits, target, out, spec, kernels.VocabShard.whole(logits.shape[1]), True)


def shard_partials(logits, target, spec, shard):
    """fp32 ``[partials_numel(n)]`` (the partials layout, ``kernels/__init__.py``) of the logits of ``shard``."""
    out = torch.empty(kernels.partials_numel(logits.shape[0]), dtype=torch.float32, device=logits.device)
    return _forward(logits, target, out, spec, shard, False)


def loss_from_partials(gathered, target, spec, out=None):
    """fp32 ``[3, n]`` (loss, z-loss, lse), into ``out`` when given (unit column stride), from
    ``[ranks, numel]`` partials; on CUDA several ranks' widths are asserted equal on the device."""
    ranks, n_rows = gathered.shape[0], kernels.rows_of(gathered.shape[1])
    if out is None:
        out = torch.empty(3, n_rows, dtype=torch.float32, device=gathered.device)
    if n_rows or ranks > 1:  # no tokens: the widths are still checked
        check = ranks > 1 and launch_type(gathered.device) == "cuda"
        args = _launch_loss_from_partials.bind(
            spec.kernel_args(), partials_ptr=gathered,
            rank_stride=gathered.stride(0), n_ranks=ranks, target_ptr=target, out_ptr=out, out_stride=out.stride(0),
            n_rows=n_rows, BLOCK=VECTOR_BLOCK, CHECK_WIDTHS=check)
        _launch_loss_from_partials((max(1, triton.cdiv(n_rows, VECTOR_BLOCK)),), args, ASSERT_OPTIONS if check else ())
    return out


def write_grad(logits, grad, target, lse, grad_loss, spec, shard):
    """Writes the gradient of the loss of ``logits`` (the slice ``shard``) into ``grad`` (may be ``logits``)."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return grad
    grid, rows_per_program, constexprs, options = _plan(logits.device, n_rows, n_cols, "bwd",
                                                        launch_type(logits.device))
    args = _launch_grad.bind(
        spec.kernel_args(shard.global_vocab), **constexprs, logits_ptr=logits, logits_row_stride=logits.stride(0),
        grad_ptr=grad, grad_row_stride=grad.stride(0), target_ptr=target, lse_ptr=lse, grad_loss_ptr=grad_loss,
        grad_loss_stride=grad_loss.stride(0), n_rows=n_rows, n_cols=n_cols, rows_per_program=rows_per_program,
        vocab_start=shard.vocab_start)
    _launch_grad(grid, args, options)
    return grad


def check_targets(target, spec, shard):
    """Nothing to launch: on CUDA the forward kernel asserts on out-of-range targets (no host
    sync); other accelerators get the NaN loss the forward kernel writes for such a target."""
