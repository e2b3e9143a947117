"""The language-model loss in progress: what a model's forward with labels hands its own loss.

A model's forward (``GPTModel._postprocess`` and the others of :mod:`.megatron_core`'s
``loss_context_paths``) opens a :class:`LossContext` on the model object itself; Megatron then calls
``self.compute_language_model_loss`` on that same object, whose patched version reads it (the labels
tell the main head from an MTP head, the loss mask weights ``lm_z_loss``). The context lives on the
model for the forward's duration (a nested forward of the same model restores the outer one after),
so no module-level state carries it.
"""

import contextlib

# The model's attribute holding its open context (a plain object: nn.Module keeps it in __dict__).
ATTRIBUTE = "_mindspeed_cez_loss_context"


class LossContext:
    """``labels`` and ``loss_mask`` the forward received (``[b, s]``, either may be None) and
    ``main_head_call`` (:class:`.output_layer.MainHeadCall`, or None: its output layer runs as is)."""

    __slots__ = ("labels", "loss_mask", "main_head_call")

    def __init__(self, labels, loss_mask, main_head_call):
        self.labels, self.loss_mask, self.main_head_call = labels, loss_mask, main_head_call


@contextlib.contextmanager
def attached(owner, attribute, value):
    """``owner.<attribute>`` is ``value`` while the block runs, then what it was (nested blocks of one
    owner restore the outer value). Kept in ``owner``'s ``__dict__``: nn.Module's own attribute hooks
    are not involved."""
    state = vars(owner)
    previous = state.get(attribute)
    state[attribute] = value
    try:
        yield value
    finally:
        if previous is None:
            state.pop(attribute, None)
        else:
            state[attribute] = previous


def opened(model, context):
    """``context`` is ``model``'s while the block runs."""
    return attached(model, ATTRIBUTE, context)


def of(model):
    """The :class:`LossContext` open on ``model``, or None (no forward with labels of this model around)."""
    return getattr(model, "__dict__", {}).get(ATTRIBUTE)
