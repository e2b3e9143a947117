"""The fused output layer's gradients-in-forward path (``grads="forward"``), its ledger, and the fp32
accumulation both paths add their GEMMs with.

Blocks of token rows with the whole vocab slice, three GEMMs; with ``grad_scale`` (the upstream
gradient known in forward) and a weight-gradient target, ``dweight`` goes into the target during the
forward, else an fp32 ``dweight`` is kept until backward. A forward that added into its target owes
its backward: the caller's :class:`ForwardGradientLedger` raises :class:`ForwardGradientError` where
one never came.

The fp32 accumulation (:class:`Accumulator`), ``out += a @ b`` into an fp32 ``out`` from 16-bit ``a``,
``b`` without fp32 copies of the operands, serves both paths' weight gradient (added into an fp32
weight-gradient target) and fp32 ``dhidden`` sums. One way per device type and torch, chosen once
(:func:`kind_for`; ``LinearCrossEntropyOptions(accumulation=...)`` picks one by hand):

``"addmm_out_dtype"``
    CUDA with torch >= 2.8: ``torch.addmm(out, a, b, out_dtype=torch.float32, out=out)``, one
    cuBLAS GEMM with an fp32 output.
``"npu_matmul_add"``
    Ascend with MindSpeed importable: ``mindspeed.ops.npu_matmul_add.npu_matmul_add_fp32``, the op
    Megatron's own gradient-accumulation fusion calls there. Its contract
    (``mindspeed/ops/npu_matmul_add.py`` and its callers in ``mindspeed/core/``):
    ``npu_matmul_add_fp32(total_input [t, k], grad_output [t, m], grad)`` adds
    ``grad_output.T @ total_input`` into the fp32 ``grad [m, k]``, 2-D 16-bit inputs; here
    ``grad_output = a.T`` and ``total_input = b``, taken when both are contiguous (else as below).
``"triton"``
    CUDA without ``out_dtype`` (torch < 2.8): this package's kernel, the product accumulated into
    fp32 in its epilogue (``kernels/triton_matmul_accumulate.py``).
``"gemm_add"``
    Anywhere else (CPU, NPUs without MindSpeed, other devices): a 16-bit GEMM into a scratch
    buffer reused across the calls of one op, then an fp32 add (the product rounded once to 16
    bits, as the unfused layer's 16-bit weight gradient is).

fp32 operands take ``out.addmm_(a, b)``; a 16-bit ``out`` (a 16-bit weight-gradient target, as
Megatron keeps without fp32 gradient accumulation) one GEMM in its dtype, as Megatron's own
accumulation does there.
docs/weight_gradient.md says which runs where and what each costs.
"""

import functools
import importlib
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from mindspeed_cez.first_order import first_order_only
from mindspeed_cez.kernels.chunked_linear import LOGITS_BUDGET_BYTES
from mindspeed_cez.linear_options import LinearLossOptions
from mindspeed_cez.cross_entropy_zloss import VocabParallel, reduce_dhidden, start_reduce_dhidden


# ----------------------------------------------------------------------------------------------
# the fp32 accumulation: out += a @ b into fp32 from 16-bit operands
# ----------------------------------------------------------------------------------------------

KINDS = ("addmm_out_dtype", "npu_matmul_add", "triton", "gemm_add")
MINDSPEED_OP = "mindspeed.ops.npu_matmul_add"


def _addmm_has_out_dtype():
    """Whether ``torch.addmm`` takes ``out_dtype`` (a 16-bit GEMM into an fp32 output; torch 2.8 on)."""
    schemas = torch._C._jit_get_schemas_for_operator("aten::addmm")
    return any(arg.name == "out_dtype" for schema in schemas for arg in schema.arguments)


ADDMM_OUT_DTYPE = _addmm_has_out_dtype()


def _npu_matmul_add():
    """MindSpeed's ``npu_matmul_add_fp32``, or None where MindSpeed (or torch_npu under it) does not import."""
    try:
        return importlib.import_module(MINDSPEED_OP).npu_matmul_add_fp32
    except Exception:  # noqa: BLE001 - any import failure: MindSpeed is not usable here
        return None


def _triton_kernel():
    try:
        from mindspeed_cez.kernels import triton_matmul_accumulate
    except ImportError:  # no triton
        return None
    return triton_matmul_accumulate.matmul_accumulate


@functools.lru_cache(maxsize=None)
def _chosen(device_type):
    if device_type == "cuda":
        if ADDMM_OUT_DTYPE:
            return "addmm_out_dtype"
        return "triton" if _triton_kernel() is not None else "gemm_add"
    if device_type == "npu" and _npu_matmul_add() is not None:
        return "npu_matmul_add"
    return "gemm_add"


def check_accumulation(kind, name="accumulation"):
    """``kind`` is None (automatic) or one of :data:`KINDS` this process can run, else a ``ValueError`` naming
    what it needs."""
    if kind is None:
        return
    if kind not in KINDS:
        raise ValueError(f"{name} must be None (automatic) or one of {KINDS}, got {kind!r}")
    if kind == "addmm_out_dtype" and not ADDMM_OUT_DTYPE:
        raise ValueError(f"{name}='addmm_out_dtype' needs torch >= 2.8 (torch.addmm's out_dtype)")
    if kind == "npu_matmul_add" and _npu_matmul_add() is None:
        raise ValueError(f"{name}='npu_matmul_add' needs MindSpeed ({MINDSPEED_OP}) importable")
    if kind == "triton" and _triton_kernel() is None:
        raise ValueError(f"{name}='triton' needs triton")


def kind_for(device, kind=None):
    """The accumulation for ``device`` (a ``torch.device`` or anything with ``.type``): ``kind`` where given
    (checked by :func:`check_accumulation`), else chosen once per device type in this process."""
    return kind or _chosen(device.type)


def chosen_cache_clear():
    """Choose again (after MindSpeed became importable, in tests)."""
    _chosen.cache_clear()


class Accumulator:
    """``acc(out, a, b)``: ``out += a @ b`` the way :func:`kind_for` chose for ``device`` (``kind``: one of
    :data:`KINDS` by hand, None: automatic). One per op call: ``"gemm_add"`` keeps its 16-bit scratch buffer
    (the largest product so far) across calls."""

    def __init__(self, device, kind=None):
        self.kind = kind_for(device, kind)
        self._scratch = None

    def _product(self, a, b):
        numel = a.shape[0] * b.shape[1]
        if self._scratch is None or self._scratch.numel() < numel or self._scratch.dtype != a.dtype:
            self._scratch = torch.empty(numel, dtype=a.dtype, device=a.device)
        return torch.matmul(a, b, out=self._scratch[:numel].view(a.shape[0], b.shape[1]))

    def __call__(self, out, a, b):
        if out.dtype != torch.float32:
            out.addmm_(a.to(out.dtype), b.to(out.dtype))
        elif a.dtype == torch.float32:
            out.addmm_(a, b.float())
        elif self.kind == "addmm_out_dtype":
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        elif self.kind == "triton" and out.stride(-1) == 1:
            _triton_kernel()(out, a, b)
        elif self.kind == "npu_matmul_add" and a.t().is_contiguous() and b.is_contiguous():
            if a.numel() and b.numel():
                _npu_matmul_add()(b, a.t(), out)
        else:
            out.add_(self._product(a, b))
        return out


# ----------------------------------------------------------------------------------------------
# the gradients-in-forward path and its ledger
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class ForwardGradsOptions(LinearLossOptions):
    """:class:`LinearCrossEntropyZLossForwardGrads`'s options: the token rows per block."""

    row_block: Optional[int] = None
    block_fraction: Optional[float] = None
    block_bytes: Optional[int] = None
    remedy: str = "GradientPath('recompute')"  # the fix that errors raised after the forward name
    ledger: Optional["ForwardGradientLedger"] = None  # where a forward that adds into the target owes its backward


RECOMPUTE_FIX = ForwardGradsOptions.remedy


class ForwardGradientError(RuntimeError):
    """A weight gradient added into its target during a forward whose backward never came."""


class _OwedBackward:
    """Made by a forward that added ``weight``'s gradient into its target; its backward marks it
    paid. Held by the autograd graph only: freed unpaid means the graph went without a backward."""

    __slots__ = ("what", "paid", "ledger", "__weakref__")

    def __init__(self, what, ledger):
        self.what, self.paid, self.ledger = what, False, ledger
        ledger.owed.add(self)

    def __del__(self):
        if not self.paid:
            self.ledger.dropped.append(self.what)


class ForwardGradientLedger:
    """The forwards of one training loop that added a weight gradient into its target and owe a backward:
    ``owed``, those whose graph is alive and backward not yet run; ``dropped``, those whose graph was freed
    without one. The loop keeps one (the adaptor: its runtime's), hands it to every call
    (``TrainerInputs(ledger=...)``) and calls :meth:`check` before the gradients are used."""

    __slots__ = ("owed", "dropped")

    def __init__(self):
        self.owed, self.dropped = weakref.WeakSet(), []

    def owe(self, what):
        """A forward's debt (held by its graph, paid by its backward)."""
        return _OwedBackward(what, self)

    def check(self, backward_pending_ok=False):
        """Raise :class:`ForwardGradientError` where a forward of ``grads="forward"`` added a weight
        gradient into its target whose backward never came: its graph freed without one (an extra
        forward with autograd on, output discarded), or, unless ``backward_pending_ok``, not run yet.
        The op's forwards call it (pending backwards are fine there: pipelined micro-batches), and the
        training loop before its gradient sync, so such a gradient never reaches the optimizer. No
        device work."""
        dropped = list(self.dropped)
        pending = [] if backward_pending_ok else [t.what for t in self.owed if not t.paid]
        self.dropped.clear()
        if dropped:
            raise ForwardGradientError(
                f"linear_cross_entropy_zloss(GradientPath('forward')) added the weight gradient of {dropped[0]} into "
                f"its target during a forward ({len(dropped)} such forward(s)) whose output was freed without a "
                "backward: the target now holds a gradient no loss asked for. An extra forward with autograd on (e.g. "
                "a metric computed in training mode) must run under torch.no_grad(); or run with " + RECOMPUTE_FIX +
                ", which adds nothing in forward.")
        if pending:
            for token in list(self.owed):
                token.paid = True  # reported once
            raise ForwardGradientError(
                f"linear_cross_entropy_zloss(GradientPath('forward')) added the weight gradient of {pending[0]} into "
                f"its target during a forward whose backward has not run ({len(pending)} such forward(s)) before the "
                "gradients are used (the gradient sync): every training forward of the loss needs its backward. Run "
                "other forwards under torch.no_grad(), or run with " + RECOMPUTE_FIX + ".")

    def forget(self):
        """Every forward counted as paid, none as dropped: for a training loop that throws the step away and
        zeroes the target itself (an in-process restart after a fault). No device work."""
        for token in list(self.owed):
            token.paid = True
        self.dropped.clear()


ROW_BLOCK_MIN = 1024
ROW_ALIGN = 128  # rows per block: a multiple of the GEMMs' tile
LEAN_BLOCK_FRACTION = 0.125  # the fraction dial's lean setting: an eighth of the tokens per block


def default_row_block(n_rows, v_local, block_fraction=None, itemsize=2, block_bytes=None):
    """Token rows per block of the gradients-in-forward path. A block's logits (then their gradient)
    are the path's working memory, and each block beyond the first costs one more read-modify-write
    of the fp32 weight gradient: ``8 V h`` bytes, 0.84 ms at V = 151936, h = 4096 on
    an H200 (docs/weight_gradient.md).

    By default (``block_fraction`` and ``block_bytes`` None) a block's logits (``rows x v_local x
    itemsize`` bytes) take at most ``LOGITS_BUDGET_BYTES`` (4 GiB) whatever the token count, so the
    output layer's memory is bounded at any sequence length, micro-batch or TP; logits within it are
    one block, the unfused layer's work exactly. ``block_bytes``: that bound set by hand.
    ``block_fraction``: the share of the tokens per block instead, so the working memory is
    ``block_fraction`` x the logits. Either way the tokens are shared by ``ceil(n_rows / rows)``
    blocks of equal rows (a multiple of ``ROW_ALIGN``, within the bound), at least ``ROW_BLOCK_MIN``
    rows each (1024: GEMMs of fewer rows lose speed) and at most the tokens."""
    if n_rows <= 0:
        return 1  # no tokens: no blocks
    if block_fraction is not None:
        largest = max(ROW_BLOCK_MIN, int(n_rows * block_fraction))
    else:
        budget = LOGITS_BUDGET_BYTES if block_bytes is None else block_bytes
        largest = max(ROW_BLOCK_MIN, budget // (max(v_local, 1) * itemsize) // ROW_ALIGN * ROW_ALIGN)
    blocks = -(-n_rows // largest)
    rows = -(-n_rows // blocks)  # the tokens shared evenly: no short last block paying a whole pass
    return min(n_rows, -(-rows // ROW_ALIGN) * ROW_ALIGN)  # within the bound: largest is a multiple of ROW_ALIGN


class LinearCrossEntropyZLossForwardGrads(torch.autograd.Function):
    """Gradients made during the forward, three GEMMs in all (no recomputation): blocks of token
    rows with their whole vocab slice, each turned into its gradient in place.

    With ``grad_scale`` the upstream gradient is known in forward: ``grad_scale * token_weights``
    (Megatron's loss scale over its token count); each block's gradient is made for it in forward,
    ``dhidden`` in the input's dtype exactly as the unfused path makes it and ``dweight`` added
    straight into the weight-gradient target (else an fp32 buffer until backward), except the last block's two GEMMs: they run in backward, as the unfused layer's do
    (one block: all of them), with ``dhidden``'s reduction over the TP ranks beside the
    weight-gradient GEMM as ``ColumnParallelLinear`` overlaps it. Backward checks on the device that
    the gradient that came is the one the blocks were made for.

    Without it, the upstream gradient must be ``k * token_weights`` with one unknown scalar ``k``:
    blocks are made for a unit gradient, ``dhidden`` kept in fp32 and scaled per token in backward,
    ``dweight`` summed in fp32 with ``token_weights`` and scaled by
    ``k = sum(g*w) / sum(w*w)`` in backward.

    Either way anything else trips a device-side assert in backward (no host sync), never a silent
    number; and a forward that adds into the target must be followed by its backward (checked:
    its ledger). Under ``torch.no_grad()`` the op takes the recompute path's
    forward instead: the loss alone, nothing into the target."""

    @staticmethod
    def forward(ctx, hidden, weight, target, token_weights, grad_scale, options):
        backend, spec = options.backend, options.spec
        ignore_index = spec.ignore_index
        tp_group, sequence_parallel = options.tp_group, options.sequence_parallel
        vp = VocabParallel(tp_group, weight.shape[0], spec, backend, shard_name="weight")
        shard, tp_size = vp.shard, vp.tp_size
        full = vp.gather_sequence(hidden, sequence_parallel)
        rows = vp.rows(full)
        flat_target = target.reshape(-1)
        weights = torch.where(flat_target == ignore_index, 0.0, token_weights.reshape(-1).float())
        n, v_local = rows.shape[0], weight.shape[0]
        upstream_known = grad_scale is not None  # the upstream gradient is grad_scale * weights
        upstream = weights * grad_scale if upstream_known else torch.ones(n, dtype=torch.float32, device=rows.device)
        into_target = upstream_known and options.weight_grad is not None
        if options.ledger is not None:
            options.ledger.check(backward_pending_ok=True)
        out = torch.empty((3, n), dtype=torch.float32, device=rows.device)
        drows = torch.empty(rows.shape, dtype=rows.dtype if upstream_known else torch.float32, device=rows.device)
        dweight = options.weight_grad.into if into_target else torch.zeros(weight.shape, dtype=torch.float32,
                                                                      device=rows.device)
        step = options.row_block or default_row_block(n, v_local, options.block_fraction, rows.element_size(),
                                                      options.block_bytes)
        block = rows.new_empty((min(step, n), v_local))  # one block's logits, then their gradient
        accumulate = Accumulator(rows.device, options.accumulation)
        deferred = None  # the last block's gradient and rows: its two GEMMs run in backward
        for r in range(0, n, step):
            x, t = rows[r:r + step], flat_target[r:r + step]
            logits = block[:x.shape[0]]
            torch.matmul(x, weight.t(), out=logits)
            stats = backend.shard_partials(logits, t, spec, shard)
            vp.merged_loss(stats, t, out[:, r:r + step])
            if r == 0:  # after the first collective (see the op's forward), before anything is written
                vp.check_targets(flat_target)
            backend.write_grad(logits, logits, t, out[2, r:r + step], upstream[r:r + step], spec, shard)
            if upstream_known and r + step >= n:
                # The last block's dhidden and weight-gradient GEMMs wait for backward, as the unfused layer's
                # do: Megatron syncs on each micro-batch's loss, and a backward that starts with them queued
                # keeps the GPU busy while the host enqueues the rest (its block is held no longer than that).
                deferred = (logits, r, x)
            elif upstream_known:  # the unfused path's dhidden: dlogits @ W in the input's dtype
                torch.matmul(logits, weight, out=drows[r:r + step])
                accumulate(dweight, logits.t(), x)
            else:
                drows[r:r + step] = 0
                accumulate(drows[r:r + step], logits, weight)
                accumulate(dweight, logits.t(), x * weights[r:r + step, None].to(x.dtype))
        loss, z_loss, lse = out.view(3, *target.shape).unbind(0)
        ctx.save_for_backward(drows, None if into_target else dweight, weights, upstream, weight,
                              flat_target != ignore_index)
        ctx.deferred = deferred
        ctx.options, ctx.tp_size, ctx.upstream_known, ctx.into_target = options, tp_size, upstream_known, into_target
        ctx.full_shape, ctx.input_dtype = full.shape, hidden.dtype
        # owed: a block before the last added its weight gradient into the target during this forward
        ctx.owed = options.ledger.owe(f"weight {tuple(weight.shape)}") if into_target and step < n else None
        ctx.backward_done = False
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(z_loss, lse)
        return loss, z_loss, lse

    @staticmethod
    @first_order_only("linear_cross_entropy_zloss")
    def backward(ctx, grad_loss, _grad_z_loss, _grad_lse):
        if ctx.backward_done:
            raise RuntimeError(
                "linear_cross_entropy_zloss(GradientPath('forward')) made its gradients during the forward for one backward: "
                "a second backward through the same graph (retain_graph=True) is not served; run the forward again, "
                "or use " + ctx.options.remedy)
        ctx.backward_done = True
        if ctx.owed is not None:
            ctx.owed.paid = True
            if grad_loss is None:
                raise ForwardGradientError(
                    "linear_cross_entropy_zloss(GradientPath('forward')): the loss got no gradient, but its forward added the "
                    "weight gradient into its target for grad_scale * token_weights: backpropagate the loss, or run "
                    "with " + ctx.options.remedy + ".")
        no_grads = (None,) * 4  # target, token_weights, grad_scale, options
        if grad_loss is None:
            return None, None, *no_grads
        drows, dweight_sum, weights, upstream, weight, counted = ctx.saved_tensors
        options = ctx.options
        g = grad_loss.reshape(-1).float()
        if ctx.upstream_known:
            expected = upstream
            message = ("linear_cross_entropy_zloss(trainer=TrainerInputs(grad_scale=s)): the upstream gradient must be s * token_weights "
                       "as the forward assumed; the loss was weighted otherwise. For custom loss weighting run with "
                       + ctx.options.remedy)
        else:
            k = (g * weights).sum() / (weights * weights).sum().clamp_min(torch.finfo(torch.float32).tiny)
            expected = k * weights
            message = ("linear_cross_entropy_zloss(trainer=TrainerInputs(token_weights=w)): the upstream gradient must be k * w (one "
                       "scalar k) as the forward assumed; the loss was weighted otherwise. For custom loss weighting "
                       "run with " + ctx.options.remedy)
        matches = ((g - expected).abs() <= 1e-3 * expected.abs() + 1e-30) | ~counted  # ignored: any g
        # (CUDA takes assert messages under 255 characters: tests/ops/test_linear_cross_entropy.py checks)
        torch._assert_async(matches.all(), message)
        if ctx.deferred is not None:  # the last block's two GEMMs; dhidden's collective beside the second
            dlogits, r, x = ctx.deferred
            ctx.deferred = None
            torch.matmul(dlogits, weight, out=drows[r:])
            reduction = start_reduce_dhidden(drows.view(ctx.full_shape), options.tp_group, ctx.tp_size,
                                             options.sequence_parallel)
            into = options.weight_grad.into if ctx.into_target else dweight_sum
            Accumulator(dlogits.device, options.accumulation)(into, dlogits.t(), x)
            del dlogits, x, drows
            # held only by what is returned, dhidden becomes the input's gradient without a copy by autograd
            dhidden = reduction.wait()
            del reduction
        else:
            if not ctx.upstream_known:
                drows = drows * g[:, None]
            drows = drows.to(ctx.input_dtype).view(ctx.full_shape)
            dhidden = reduce_dhidden(drows, options.tp_group, ctx.tp_size, options.sequence_parallel)
        if ctx.into_target:
            return dhidden, options.weight_grad.finish(), *no_grads
        if not ctx.upstream_known:
            dweight_sum.mul_(k)
        if options.weight_grad is not None:
            options.weight_grad.into.add_(dweight_sum)
            dweight = options.weight_grad.finish()
        else:
            dweight = dweight_sum.to(weight.dtype)
        return dhidden, dweight, *no_grads
