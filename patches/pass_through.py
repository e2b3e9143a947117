"""The one shape of every patched function: the original while the adaptor is inactive."""

import functools

from mindspeed_cez.patches import settings as _settings


def while_active(fn, active, inactive=None):
    """The replacement of ``fn``: ``active(settings, *args, **kwargs)`` while
    :data:`mindspeed_cez.patches.settings.ACTIVE` is set, else ``inactive(*args, **kwargs)``
    (default ``fn``, unchanged). ``inactive`` serves a name Megatron binds to None (e.g.
    ``te_parallel_cross_entropy`` without Transformer Engine). ``__cez_wraps__`` holds ``fn``, for
    the patch manager to restore it."""
    inactive = fn if inactive is None else inactive

    def replacement(*args, **kwargs):
        settings = _settings.ACTIVE
        if settings is None:
            return inactive(*args, **kwargs)
        return active(settings, *args, **kwargs)

    if fn is not None:
        functools.update_wrapper(replacement, fn)
    else:
        replacement.__name__ = replacement.__qualname__ = active.__name__
    replacement.__cez_wraps__ = fn
    return replacement
