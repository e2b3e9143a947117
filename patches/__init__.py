"""Patch Megatron-Core so its language-model loss is the fused cross entropy + z-loss.

For scripts built on megatron-core alone::

    import mindspeed_cez.patches
    mindspeed_cez.patches.apply(z_loss_coeff=1e-4)   # before or after building the model
    ...
    mindspeed_cez.patches.report(iteration, num_microbatches, num_layers)  # once per iteration: lm_z_loss
    ...
    mindspeed_cez.patches.remove()                   # Megatron's own functions again

Both are idempotent; calling ``apply`` again only changes the settings. Neither imports Megatron:
each wrapper attaches when its module is first imported (:mod:`.import_hook`), so ``apply`` may come
before or after ``import megatron``. In a MindSpeed process the same wrappers are attached by
MindSpeed's patch manager instead. Scripts launched with flags import ``mindspeed_cez.megatron_adaptor``.

This folder holds everything about Megatron / MindSpeed / MindSpeed-LLM, one job per module:

* :mod:`.import_hook`: the generic post-import hook that attaches a patch point;
* :mod:`.patch_points`: the table of every patch point of every framework (data only);
* :mod:`.loss_wrappers`: the wrappers of Megatron's LM loss and cross entropies;
* :mod:`.model_context`: the model's loss context and its main head's output layer call;
* :mod:`.reporting`: the metrics, Megatron's ``training_log`` and MoE report;
* :mod:`.runtime`: the one :class:`~.runtime.Runtime`, everything the adaptor holds while it is on;
* :mod:`.activation`: ``apply()``, the flags' route, the one ``enable()`` they call, the adaptor's
  registration (MindSpeed's feature);
* :mod:`.arguments`: the flags and their one validation; :mod:`.settings`: the settings they build;
* :mod:`.megatron_state`: every read of Megatron's process-wide state (groups, micro-batches, arguments);
* :mod:`.cpu_mode`, :mod:`.local_gpt`: Megatron on a CPU and megatron-core's local GPT, for the demo and
  the tests: used only when called (no patch point; ``apply()`` and the flags never turn them on).

It builds on the ops of :mod:`mindspeed_cez`, never the other way round.
"""

from mindspeed_cez.linear_forward_grads import ForwardGradientLedger
from mindspeed_cez.patches import patch_points, runtime
from mindspeed_cez.patches.activation import activate, active_settings, apply, remove
from mindspeed_cez.patches.import_hook import PatchRegistry, PatchTargetError
from mindspeed_cez.patches.reporting import IterationMetrics, report
from mindspeed_cez.patches.settings import Settings

if runtime.current() is None:  # the process's runtime, off: its patch registry holds the one table
    runtime.replace(runtime.Runtime(PatchRegistry(patch_points.TARGETS), IterationMetrics(), ForwardGradientLedger()))

__all__ = ["apply", "activate", "remove", "active_settings", "report", "installed_targets", "patch_targets",
           "Settings", "PatchTargetError"]


def installed_targets():
    """The patch points currently installed directly (not through MindSpeed's patch manager)."""
    return runtime.current().patches.installed()


def patch_targets():
    """``[(dotted path, wrapper)]`` for this megatron-core (and MindSpeed-LLM, once imported), for
    MindSpeed's patch manager; imports the target modules."""
    return runtime.current().patches.patch_targets()
