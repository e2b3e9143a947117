"""``import mindspeed_cez.megatron_adaptor`` at the top of a pretraining script (MindSpeed style).

The import registers the adaptor (:func:`mindspeed_cez.patches.activation.register_adaptor`) and
imports nothing of Megatron or MindSpeed, so it may come before or after ``from mindspeed_llm import
megatron_adaptor`` (or MindSpeed's): MindSpeed's adaptor still runs before anything imports Megatron.
Each patch attaches when its module is first imported; the flags are checked when Megatron validates
its arguments (and, on the command line, at this import: a bad value ends the run with one line, exit
status 2), and a patch that could not attach is an error there.

The flags (``--lm-z-loss-coeff``, ``--lm-fused-ce``, ``--no-lm-fused-ce``, ``--lm-z-loss-log-lse``,
``--lm-fused-output-layer``, ``--lm-fused-output-layer-block-fraction``) are described in
:mod:`mindspeed_cez.patches.arguments`. ``MODE``: ``"mindspeed"``, ``"megatron.training"`` or
``"megatron.core"``, where the flags are read from.
"""

from mindspeed_cez.patches import activation


def __getattr__(name):
    if name == "MODE":  # read when asked: MindSpeed may load after this import
        return activation.mode()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


activation.register_adaptor()
