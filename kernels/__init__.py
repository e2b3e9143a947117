"""The kernels' interface: what every backend takes, and which backend runs.

In reading order: the loss (:class:`LogitTransform`, :class:`LossSpec`, :class:`VocabShard`), the
partials layout (what one rank's vocab slice contributes to a row's loss), the row layout every kernel
takes (:func:`as_rows`), and the backends (:func:`backend_for`, :func:`linear_backend_for`,
:func:`whole_loss_backend`). This module imports without Triton; the backends import it and are
loaded by name on first use. Nothing in ``kernels/`` reads the environment.
"""

import dataclasses
import functools
import importlib
import math
import numbers
from dataclasses import InitVar, dataclass
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional

import torch

# =========================================================================== the loss

# The kernels' TRANSFORM constexpr: the loss of x itself, of z = scale * x, of z = cap * tanh(scale * x / cap).
NO_TRANSFORM, SCALE, SOFTCAP = 0, 1, 2
KIND_NAMES = {NO_TRANSFORM: "none", SCALE: "scale", SOFTCAP: "softcap"}
# tanh(u) for |u| < TANH_SERIES_BELOW: u + u**3 (c3 + u**2 (c5 + u**2 (c7 + u**2 c9))), Taylor's coefficients
# (the kernels' ``triton_cross_entropy.tanh_and_slope`` has the same numbers).
TANH_SERIES_BELOW = 0.25
TANH_SERIES = (-1.0 / 3.0, 2.0 / 15.0, -17.0 / 315.0, 62.0 / 2835.0)


def _number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _finite(value):
    return _number(value) and math.isfinite(value)


@dataclass(frozen=True)
class LogitTransform:
    """The element-wise transform of the logits that the loss is computed on: ``z = cap * tanh(scale * x / cap)``
    (``cap > 0``), ``z = scale * x`` (``cap == 0``): a multiplier on the output logits, then a soft cap, as
    MindSpeed-LLM's GPT model applies them. :data:`IDENTITY` is the loss of ``x`` itself.

    The ops take one as their ``logit_transform`` (the fused layer: in its options) and put it into the loss's
    :class:`LossSpec`; the Triton kernels get its two fp32 numbers and the ``TRANSFORM`` constexpr :attr:`kind`
    from ``LossSpec.kernel_args``, the torch reference calls :meth:`apply` / :meth:`apply_with_slope`. A new
    transform touches this class, the kernels' ``transform_logits`` / ``transform_logits_with_slope``
    (``triton_cross_entropy``), ``tests/support/kernel_variants.py``'s compiled list and the tests
    (``tests/ops/test_cross_entropy_zloss.py``'s transforms, ``tests/kernels/test_kernels_logit_transform.py``).

    Args:
        scale: ``s > 0``, finite: the logit scale (MindSpeed-LLM's ``output_multiplier_scale``).
        cap: ``C >= 0``, finite: the soft cap; 0 (default): no cap.
    """

    scale: float = 1.0
    cap: float = 0.0

    def __post_init__(self):
        if not (_finite(self.scale) and self.scale > 0):
            raise ValueError(f"logit_scale must be a finite number > 0 (LogitTransform.scale), got {self.scale!r}")
        if not (_finite(self.cap) and self.cap >= 0):
            raise ValueError(f"logit_softcap must be a finite number >= 0 (0: no cap) (LogitTransform.cap), got {self.cap!r}")
        object.__setattr__(self, "scale", float(self.scale))
        object.__setattr__(self, "cap", float(self.cap))

    @property
    def kind(self):
        """The kernels' ``TRANSFORM`` constexpr (an int): ``NO_TRANSFORM`` compiles the kernels without one."""
        return SOFTCAP if self.cap else (SCALE if self.scale != 1.0 else NO_TRANSFORM)

    @property
    def is_identity(self):
        return self.kind == NO_TRANSFORM

    def apply(self, x):
        """z of a (fp32) tensor ``x``."""
        return self.apply_with_slope(x)[0]

    def apply_with_slope(self, x):
        """``(z, dz/dx)`` of a (fp32) tensor ``x``, as the Triton kernels compute them: with a cap,
        from ``e = exp(-2|u|)``, ``u = scale * x / cap``: ``tanh(u) = sign(u) (1 - e) / (1 + e)`` and
        ``1 - tanh(u)**2 = 4e / (1 + e)**2``, which has no cancellation where ``tanh`` nears +-1; below
        ``|u| < TANH_SERIES_BELOW``, where ``1 - e`` cancels, tanh is its series through ``u**9``."""
        if self.cap:
            u = x * (self.scale / self.cap)
            e = torch.exp(-2.0 * u.abs())
            r = 1.0 / (1.0 + e)
            t = (1.0 - e) * r
            u2 = u * u
            c3, c5, c7, c9 = TANH_SERIES
            series = u + u * u2 * (c3 + u2 * (c5 + u2 * (c7 + u2 * c9)))
            t = torch.where(u.abs() < TANH_SERIES_BELOW, series, torch.where(u < 0, -t, t))
            return self.cap * t, self.scale * 4.0 * e * r * r
        if self.scale != 1.0:
            return x * self.scale, self.scale
        return x, 1.0


IDENTITY = LogitTransform()
INT64 = (-(2**63), 2**63 - 1)  # the targets' dtype: where ignore_index must lie


@dataclass(frozen=True)
class LossSpec:
    """What the loss is, as one frozen value from the flag to the kernel: per token
    ``loss = lse - (1-a)*z[target] - a*mean(z) + c*lse**2`` of ``z = logit_transform.apply(logits)``, 0 where
    ``target == ignore_index``. Each field is checked and cast here, once, where the user's value enters (an op
    argument, the adaptor's settings, a flag). ``names``: the caller's name per field for errors (e.g.
    ``{"z_loss_coeff": "my_config.zloss"}``); by default the ops' argument names. Every backend takes the spec
    whole; the Triton kernels get :meth:`kernel_args`, their loss arguments by parameter name."""

    ignore_index: int = -100
    z_loss_coeff: float = 0.0
    label_smoothing: float = 0.0
    logit_transform: LogitTransform = IDENTITY
    names: InitVar[Optional[Mapping[str, str]]] = None

    def __post_init__(self, names):
        name = (lambda field: names.get(field, field)) if names else (lambda field: field)
        value = self.ignore_index
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"{name('ignore_index')} must be an int (the target value of tokens to ignore, e.g. "
                            f"-100), got {value!r}")
        if not INT64[0] <= value <= INT64[1]:
            raise ValueError(f"{name('ignore_index')} must fit in int64 (the targets' dtype), got {value}")
        value = self.z_loss_coeff
        if not (_finite(value) and value >= 0):
            raise ValueError(f"{name('z_loss_coeff')} must be a finite number >= 0, got {value!r}")
        value = self.label_smoothing
        if not (_number(value) and 0.0 <= value < 1.0):
            raise ValueError(f"{name('label_smoothing')} must be in [0, 1), got {value!r}")
        if not isinstance(self.logit_transform, LogitTransform):
            raise TypeError(f"{name('logit_transform')} must be a LogitTransform, got {self.logit_transform!r}")
        object.__setattr__(self, "ignore_index", int(self.ignore_index))
        object.__setattr__(self, "z_loss_coeff", float(self.z_loss_coeff))
        object.__setattr__(self, "label_smoothing", float(self.label_smoothing))
        object.__setattr__(self, "_kernel_args", {})  # per global vocab; not a field (no part of ==)
        object.__setattr__(self, "_replaced", {})  # per set of changes (replace)

    def __getstate__(self):  # copies and pickles start without the made mappings
        return {**self.__dict__, "_kernel_args": {}, "_replaced": {}}

    def replace(self, **changes):
        """This spec with the fields in ``changes`` (checked as the constructor checks them): itself where
        nothing changes, else one object per set of changes, kept by this spec, so a caller that derives
        the loss of each call from one spec (a label smoothing per vocab size, no z-loss for a head)
        makes no object per call."""
        if all(getattr(self, field) == value and type(getattr(self, field)) is type(value)
               for field, value in changes.items()):
            return self
        key = tuple(sorted(changes.items()))
        try:
            made = self._replaced.get(key)
        except TypeError:  # an unhashable value: the constructor says what is wrong
            return dataclasses.replace(self, **changes)
        if made is None:
            made = self._replaced[key] = dataclasses.replace(self, **changes)
        return made

    def kernel_args(self, global_vocab=None):
        """The Triton kernels' loss arguments by parameter name (read-only, made once per global
        vocab): ``ignore_index``, ``z_loss_coeff``, ``logit_scale``, ``logit_softcap``, the constexpr
        ``TRANSFORM``, and for a ``global_vocab`` also ``global_vocab``, ``target_weight = 1-a``,
        ``smoothing_per_col = a/V`` and the constexpr ``WITH_LOGIT_SUM`` (``a > 0``); ``None``: a
        kernel that merges partials, which took those into account already."""
        made = self._kernel_args.get(global_vocab)
        if made is None:
            a, transform = self.label_smoothing, self.logit_transform
            args = {"ignore_index": self.ignore_index, "z_loss_coeff": self.z_loss_coeff,
                    "logit_scale": transform.scale, "logit_softcap": transform.cap, "TRANSFORM": transform.kind}
            if global_vocab is not None:
                args.update(global_vocab=global_vocab, target_weight=1.0 - a, smoothing_per_col=a / global_vocab,
                            WITH_LOGIT_SUM=a > 0)
            made = self._kernel_args[global_vocab] = MappingProxyType(args)
        return made


@functools.lru_cache(maxsize=64, typed=True)  # typed: True is not 1 (a bool is refused)
def _made(ignore_index, z_loss_coeff, label_smoothing, logit_transform):
    return LossSpec(ignore_index, z_loss_coeff, label_smoothing, logit_transform)


def loss_spec(ignore_index=-100, z_loss_coeff=0.0, label_smoothing=0.0, logit_transform=IDENTITY):
    """``LossSpec`` of the ops' arguments, one object per set of values (the ops call this per call,
    checked once). Bad values raise as the constructor does, naming the ops' arguments."""
    try:
        return _made(ignore_index, z_loss_coeff, label_smoothing, logit_transform)
    except TypeError as error:
        if "unhashable" not in str(error):
            raise
        return LossSpec(ignore_index, z_loss_coeff, label_smoothing, logit_transform)


class VocabShard(NamedTuple):
    """One call's vocab layout: this rank's ``[vocab_start, vocab_start + v_local)`` of ``global_vocab`` ids
    (``rank`` of ``world_size``), made by the ops' one prologue (``mindspeed_cez.cross_entropy_zloss.vocab_shard``)."""

    vocab_start: int
    v_local: int
    global_vocab: int
    rank: int = 0
    world_size: int = 1

    @classmethod
    def whole(cls, vocab):
        """One rank holding all ``vocab`` ids."""
        return cls(0, vocab, vocab)

    def chunk(self, offset, width):
        """Columns ``[offset, offset + width)`` of this slice, as a slice of their own."""
        return self._replace(vocab_start=self.vocab_start + offset, v_local=width)


# =========================================================================== the partials layout
# A flat fp32 tensor of ``partials_numel(n)`` elements for ``n`` token rows, written by every backend's
# ``shard_partials`` / ``linear_partials``, all-gathered over the tensor-parallel ranks in one collective and
# finished by the backend's ``loss_from_partials`` (``mindspeed_cez.cross_entropy_zloss.VocabParallel.merged_loss``):
#
# ``[LOCAL_LSE * n, +n)``    this slice's log-sum-exp per row: ``m + log(sum exp(z - m))``, -inf for a
#                            row that is -inf across the slice (such a slice adds nothing to the row)
# ``[TARGET_TERM * n, +n)``  ``(1-a)*z[target] + (a/V)*sum(z)`` (the z[target] part 0 where another rank
#                            owns the target, NaN for an out-of-range target); summed over ranks
# ``[WIDTH * n, +2)``        the slice's width in columns as two exact fp32 words, ``width >> 12`` and
#                            ``width & 4095``: ranks compare them to find unequal shards in the same collective
#
# Over ranks the row's lse is the log-sum-exp of the slices' lse and its target term their sum.

LOCAL_LSE, TARGET_TERM = 0, 1
PARTIAL_ROWS = 2  # rows of n values before the width words
WIDTH = PARTIAL_ROWS  # the width words start at WIDTH * n
WIDTH_WORDS = 2
WIDTH_SHIFT = 12
# The device-side assert's message where the width words differ (CUDA takes under 255 characters).
UNEQUAL_WIDTHS = "vocab shards of unequal width across tensor-parallel ranks: pad the vocab to a multiple of the TP size"


def partials_numel(n_rows):
    return PARTIAL_ROWS * n_rows + WIDTH_WORDS


def rows_of(numel):
    """The token rows of a partials tensor of ``numel`` elements."""
    return (numel - WIDTH_WORDS) // PARTIAL_ROWS


def row(partials, index, n_rows):
    """Row ``index`` (``LOCAL_LSE``, ``TARGET_TERM``) of partials, ``[..., n_rows]`` (a view)."""
    return partials[..., index * n_rows:(index + 1) * n_rows]


def width_words(width):
    """A slice's width as the two fp32-exact numbers the partials carry."""
    return float(width >> WIDTH_SHIFT), float(width & ((1 << WIDTH_SHIFT) - 1))


def widths(gathered):
    """Each rank's slice width from all-gathered ``[ranks, numel]`` partials (host values: reads the tensor)."""
    start = WIDTH * rows_of(gathered.shape[-1])
    words = gathered[:, start:start + WIDTH_WORDS].tolist()
    return [(int(hi) << WIDTH_SHIFT) + int(lo) for hi, lo in words]


# =========================================================================== rows


def as_rows(t):
    """``[..., k]`` -> ``[n, k]`` with unit last-dim stride (a view whenever the layout allows): the row
    layout every kernel takes."""
    rows = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# =========================================================================== the backends
# Cross-entropy backends (:class:`.backends.CrossEntropyBackend`, the loss of logits that exist): ``"triton"``
# (``triton_cross_entropy``) runs on CUDA, on Ascend through triton-ascend, and on the CPU under
# ``TRITON_INTERPRET=1``; ``"torch"`` (``torch_reference``) runs anywhere. Whole-loss backends
# (:class:`.backends.WholeLossBackend`, a vendor's op with its own autograd, one rank holding the whole vocab):
# ``"cann"`` (torch_npu's ``npu_cross_entropy_loss``). Linear backends (:class:`.backends.LinearBackend`, the loss
# of ``rows @ weight.T`` without its logits): ``"triton"`` (``triton_linear_cross_entropy``, ``tl.dot`` tiles) and
# ``"gemm"`` (``chunked_linear.ChunkedLinear``: GEMMs on vocab chunks reduced by a cross-entropy backend).
# Each is a module of this package, loaded by name on first use (each imports this module).

CROSS_ENTROPY_BACKENDS = {"torch": ".torch_reference", "triton": ".triton_cross_entropy"}
WHOLE_LOSS_BACKENDS = {"cann": ".cann"}
BACKENDS = (*CROSS_ENTROPY_BACKENDS, *WHOLE_LOSS_BACKENDS)
LINEAR_BACKENDS = {"gemm": ".chunked_linear", "triton": ".triton_linear_cross_entropy"}


@functools.lru_cache(maxsize=None)  # one import per module name
def _module(relative):
    """This package's module ``relative`` (``".torch_reference"``), imported on first use."""
    return importlib.import_module(relative, __name__)


@functools.lru_cache(maxsize=None)  # the import tried once per process
def _triton_import():
    """``(module, None)``, or ``(None, the ImportError)`` where triton (or triton-ascend) is not installed."""
    try:
        return _module(CROSS_ENTROPY_BACKENDS["triton"]), None
    except ImportError as exc:
        return None, exc


def _load_triton():
    return _triton_import()[0]


def triton_available() -> bool:
    return _load_triton() is not None


def get_backend(name: str):
    """The cross-entropy backend module called ``name`` (``"torch"`` or ``"triton"``)."""
    if name == "torch":
        return _module(CROSS_ENTROPY_BACKENDS[name])
    if name == "triton":
        module = _load_triton()
        if module is None:
            raise RuntimeError(f"backend='triton' but Triton failed to import: {_triton_import()[1]}")
        return module
    if name in WHOLE_LOSS_BACKENDS:
        raise ValueError(f"backend={name!r} (a vendor's whole op) serves "
                         "vocab_parallel_cross_entropy_zloss at tensor-parallel size 1 only; the fused output layer "
                         "(linear_cross_entropy_zloss) and the vocab-sharded steps need backend='triton' or 'torch' "
                         "(or None: automatic)")
    raise ValueError(f"unknown backend {name!r}; backend must be one of {BACKENDS} or None (automatic)")


def whole_loss_backend(name):
    """The :class:`.backends.WholeLossBackend` module called ``name`` (``"cann"``), None for another name."""
    module = WHOLE_LOSS_BACKENDS.get(name) if isinstance(name, str) else None
    return None if module is None else _module(module)


def backend_for(device, name=None):
    """The backend ``name``; for None, Triton on accelerators where it imports, else the torch reference."""
    if name is not None:
        return get_backend(name)
    if device.type != "cpu" and triton_available():
        return _load_triton()
    return get_backend("torch")


def linear_backend_for(device, name=None, backend=None, chunk_cols=None):
    """The fused output projection's :class:`.backends.LinearBackend`: ``"triton"``
    (``triton_linear_cross_entropy``: ``tl.dot`` tiles, no logits in memory) or ``"gemm"``
    (``chunked_linear.ChunkedLinear`` of the cross-entropy backend ``backend_for(device, backend)``
    and ``chunk_cols``). ``name=None``: GEMMs on CUDA (cuBLAS is the faster of the two there, see
    docs/performance.md) and where the cross-entropy backend is the torch reference; Triton on other
    accelerators (Ascend: the cube unit)."""
    if name is not None and name not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {name!r}; linear_backend must be one of "
                         f"{tuple(LINEAR_BACKENDS)} or None (automatic)")
    ce_backend = backend_for(device, backend)
    if name is None:
        name = "triton" if device.type != "cuda" and ce_backend is not get_backend("torch") else "gemm"
    if name == "triton":
        return _module(LINEAR_BACKENDS[name])
    return _module(LINEAR_BACKENDS[name]).ChunkedLinear(ce_backend, chunk_cols)
