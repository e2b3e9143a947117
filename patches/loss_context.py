"""The language-model losses in progress: one entry per model forward with labels, innermost last.

A model's forward (``GPTModel._postprocess`` and the others of :mod:`.megatron_core`'s
``loss_context_paths``) opens one; what runs inside it reads it: the patched
``compute_language_model_loss`` (the labels tell the main head from an MTP head, the loss mask
weights ``lm_z_loss``) and the patched ``ColumnParallelLinear.forward`` (the main head's output
layer call to defer or wrap, :mod:`.output_layer`).
"""

import contextlib


class LossContext:
    """``labels`` and ``loss_mask`` the forward received (``[b, s]``, either may be None) and
    ``main_head_call`` (:class:`.output_layer.MainHeadCall`, or None: its output layer runs as is)."""

    __slots__ = ("labels", "loss_mask", "main_head_call")

    def __init__(self, labels, loss_mask, main_head_call):
        self.labels, self.loss_mask, self.main_head_call = labels, loss_mask, main_head_call


_OPEN = []  # innermost last


@contextlib.contextmanager
def opened(context):
    """``context`` is the innermost while the block runs."""
    _OPEN.append(context)
    try:
        yield context
    finally:
        _OPEN.pop()


def innermost():
    """The innermost open :class:`LossContext`, or None (no model forward with labels around)."""
    return _OPEN[-1] if _OPEN else None
