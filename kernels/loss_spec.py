"""What the loss is, as one frozen value from the flag to the kernel, and where one call's vocab slice lies.

``LossSpec(ignore_index, z_loss_coeff, label_smoothing, logit_transform)``: per token
``loss = lse - (1-a)*z[target] - a*mean(z) + c*lse**2`` of ``z = logit_transform.apply(logits)``, 0 where
``target == ignore_index``. Each field is checked and cast here, once, where the user's value enters
(an op argument, the adaptor's settings, a flag); ``names`` maps a field to the caller's name for it,
which the error then names. Every backend takes the spec whole; the Triton kernels get
:meth:`LossSpec.kernel_args`, their loss arguments by parameter name.

``VocabShard``: one call's vocab layout, this rank's ``[vocab_start, vocab_start + v_local)`` of
``global_vocab`` ids (``rank`` of ``world_size``), made by the ops' one prologue
(``mindspeed_cez.cross_entropy_zloss.vocab_shard``); :meth:`VocabShard.chunk` is a chunk of it.
"""

import dataclasses
import functools
import math
import numbers
from dataclasses import InitVar, dataclass
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional

from .logit_transform import IDENTITY, LogitTransform

INT64 = (-(2**63), 2**63 - 1)


def _number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class LossSpec:
    """The loss's settings, checked and cast once. ``names``: the caller's name per field for errors
    (e.g. ``{"z_loss_coeff": "my_config.zloss"}``); by default the ops' argument names."""

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
        if not (_number(value) and math.isfinite(value) and value >= 0):
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
    """This rank's vocab slice ``[vocab_start, vocab_start + v_local)`` of ``global_vocab`` ids."""

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
