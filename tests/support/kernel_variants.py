"""Every compiled variant of the Triton kernels, for ahead-of-time compiles without a device.

A variant is what one launch compiles: the kernel, its argument types and its compile-time
constants under one ``LAUNCH_CONFIG`` setting, logits dtype and vocab width. Used by
``tests/support/kernel_resources.py`` (sm_90, through Triton's CUDA backend) and
``tests/support/ascend_lowering.py`` (Ascend, through triton-ascend's front end and adapter).

A variant's argument types come from the kernel's own parameter list (what
``triton_cross_entropy.Launcher.params`` holds): its constexprs are the parameters annotated
``tl.constexpr`` (plus any runtime parameter a variant pins to a value), every other parameter
gets its type from its name (:func:`param_type`), so a new kernel parameter is typed here or
refused by name.
"""

import inspect
from dataclasses import dataclass, field

import triton
import triton.language as tl

from mindspeed_cez.kernels import KIND_NAMES, SCALE, SOFTCAP
from mindspeed_cez.kernels import triton_cross_entropy as tce
from mindspeed_cez.kernels import triton_linear_cross_entropy as tlce
from mindspeed_cez.kernels import triton_matmul_accumulate as tma

# The logit transforms compiled besides none, by name: the kernels' TRANSFORM constexpr.
TRANSFORMS = {KIND_NAMES[k]: k for k in (SCALE, SOFTCAP)}

# The type rule of the kernels' runtime parameters, by name. Pointers: to the inputs' dtype (logits,
# hidden, weight, their gradient), or to a fixed one; the loss's constants and the partials' width
# words: fp32; strides, counts and indices: i32 (the launcher passes int64 ones where they need it).
INPUT_POINTERS = ("logits_ptr", "grad_ptr", "x_ptr", "w_ptr", "a_ptr", "b_ptr")
FIXED_POINTERS = {"target_ptr": "*i64", "out_ptr": "*fp32", "lse_ptr": "*fp32", "grad_loss_ptr": "*fp32",
                  "partials_ptr": "*fp32", "groups_ptr": "*fp32", "c_ptr": "*fp32"}
FP32 = ("z_loss_coeff", "target_weight", "smoothing_per_col", "logit_scale", "logit_softcap", "width_hi", "width_lo")
I32 = ("n_rows", "n_cols", "rows_per_program", "vocab_start", "global_vocab", "ignore_index", "h", "n_ranks",
       "n_groups", "m", "n", "k")


def param_type(name, dtype):
    """The Triton type of runtime parameter ``name`` for ``dtype`` inputs (``"bf16"``, ``"fp16"``, ``"fp32"``)."""
    if name in INPUT_POINTERS:
        return f"*{dtype}"
    if name in FIXED_POINTERS:
        return FIXED_POINTERS[name]
    if name in FP32:
        return "fp32"
    if name in I32 or "stride" in name:
        return "i32"
    raise KeyError(f"kernel parameter {name!r} has no Triton type: name it in tests/support/kernel_variants.py's type rule")


def is_constexpr(parameter):
    """A parameter annotated ``tl.constexpr`` (an object, or a string under postponed annotations)."""
    return parameter.annotation is tl.constexpr or "constexpr" in str(parameter.annotation)


def signature(fn, dtype, pinned=()):
    """``{name: Triton type}`` of the runtime parameters of the ``@triton.jit`` function ``fn`` in
    its order, those named in ``pinned`` (compiled as constants) left out."""
    params = inspect.signature(fn.fn).parameters.values()
    return {p.name: param_type(p.name, dtype) for p in params if not (is_constexpr(p) or p.name in pinned)}


# Arguments that Triton's launcher finds divisible by 16 in real use (it specializes on that at
# run time): every pointer, the row strides, and the vocab width (a multiple of 128 in Megatron).
DIVISIBLE = ("row_stride", "logits_row_stride", "grad_row_stride", "n_cols", "x_row_stride", "w_row_stride", "h",
             "c_stride_m", "n")


@dataclass(frozen=True)
class Variant:
    name: str
    fn: object  # the @triton.jit function
    dtype: str  # of the inputs (logits, hidden, weight): "bf16", "fp16", "fp32"
    constexprs: dict  # constexpr name -> value (a runtime parameter named here is compiled as a constant)
    num_warps: int
    cuda_only: bool = False  # launched on CUDA only (the others also on Ascend)
    options: dict = field(default_factory=dict)  # compile options beyond num_warps

    @property
    def signature(self):
        """Argument name -> Triton type, constexprs left out (:func:`signature`)."""
        return signature(self.fn, self.dtype, self.constexprs)

    def divisible_args(self):
        return [k for k, v in self.signature.items() if v.startswith("*") or k in DIVISIBLE]


def _named(transform):
    return f" transform={transform}" if transform else ""


def variants(settings, dtype="bf16", n_cols=151936):
    """The variants one ``LAUNCH_CONFIG`` entry compiles for ``dtype`` logits ``n_cols`` wide."""
    fwd_block = min(settings["fwd_block_v"], triton.next_power_of_2(n_cols))
    slot = min(settings["slot_width"] or fwd_block, fwd_block)
    out = []
    # CUDA launches the forward with its target assert (CHECK_TARGETS, a debug compile), other
    # devices without; the smoothing sum does not interact with it, so it is compiled once. The
    # transforms: with the smoothing sum (the most they add to), the soft cap also with the assert.
    forwards = [(f, s, False, None) for f in (True, False) for s in (False, True)] + [
        (True, False, True, None), (False, False, True, None), (True, True, False, "scale"),
        (True, True, False, "softcap"), (False, True, False, "softcap"), (True, True, True, "softcap")]
    for finish, logit_sum, check, transform in forwards:
        out.append(Variant(
            f"forward finish={finish} logit_sum={logit_sum}" + (" check_targets" if check else "") + _named(transform),
            tce._forward_kernel, dtype,
            {"SLOTS": fwd_block // slot, "SLOT_WIDTH": slot, "FINISH": finish, "WITH_LOGIT_SUM": logit_sum,
             "CHECK_TARGETS": check, "EVICT": "evict_first", "TRANSFORM": TRANSFORMS.get(transform, 0)},
            settings["fwd_warps"], cuda_only=check, options=dict(tce.ASSERT_OPTIONS if check else ())))
    bwd_block = min(settings["bwd_block_v"], triton.next_power_of_2(n_cols))
    for transform in (None, *TRANSFORMS):
        out.append(Variant("grad" + _named(transform), tce._grad_kernel, dtype,
                           {"BLOCK_V": bwd_block, "EVICT": "evict_first", "TRANSFORM": TRANSFORMS.get(transform, 0)},
                           settings["bwd_warps"]))
    # CUDA asserts that the ranks' widths agree (CHECK_WIDTHS, a debug compile), other devices not.
    for check in (False, True):
        out.append(Variant("loss from partials" + (" check_widths" if check else ""), tce._loss_from_partials_kernel,
                           dtype, {"BLOCK": tce.VECTOR_BLOCK, "CHECK_WIDTHS": check}, 4, cuda_only=check,
                           options=dict(tce.ASSERT_OPTIONS if check else ())))
    return out


def linear_variants(device_type, dtype="bf16"):
    """The variants of the fused output projection's kernels (``triton_linear_cross_entropy``)
    under ``device_type``'s tile settings for ``dtype`` inputs."""
    c = tlce.launch_settings(device_type)
    precision = "ieee" if dtype == "fp32" else ""
    tiles = {"BLOCK_M": c["block_m"], "BLOCK_N": c["block_n"],
             "BLOCK_K": max(16, c["block_k"] // 4) if dtype == "fp32" else c["block_k"]}
    options = {"num_stages": c["stages"]} if device_type == "cuda" else {}
    partials = [(False, None), (True, None), (True, "scale"), (True, "softcap")]
    out = [Variant(f"linear partials logit_sum={s}" + _named(t), tlce._partials_kernel, dtype,
                   {**tiles, "GROUP_N": c["group_n"], "SWIZZLE_M": c["swizzle_m"], "WITH_LOGIT_SUM": s,
                    "PRECISION": precision, "TRANSFORM": TRANSFORMS.get(t, 0)}, c["warps"], options=options)
           for s, t in partials]
    out += [Variant("linear grad" + _named(t), tlce._grad_kernel, dtype,
                    {**tiles, "SWIZZLE_M": c["swizzle_m"], "PRECISION": precision, "TRANSFORM": TRANSFORMS.get(t, 0)},
                    c["warps"], options=options) for t in (None, *TRANSFORMS)]
    out.append(Variant("linear merge", tlce._merge_kernel, dtype, {"BLOCK": tlce.MERGE_BLOCK}, 4))
    out += accumulate_variants(device_type, dtype)
    return out


def accumulate_variants(device_type, dtype="bf16"):
    """The fp32 weight-gradient accumulation kernel (``triton_matmul_accumulate``) under
    ``device_type``'s tiles, for 16-bit ``dtype`` (fp32 operands take torch's GEMM): the weight
    gradient's layout (``a = dlogits.T``: unit stride along m), with and without a k tail."""
    if dtype == "fp32":
        return []
    c = tma.launch_settings(device_type)
    options = {"num_stages": c["stages"]} if device_type == "cuda" else {}
    return [Variant(f"fp32 accumulation even_k={even_k}", tma._accumulate_kernel, dtype,
                    {"a_stride_m": 1, "b_stride_n": 1, "BLOCK_M": c["block_m"], "BLOCK_N": c["block_n"],
                     "BLOCK_K": c["block_k"], "GROUP_M": c["group_m"], "EVEN_K": even_k, "WIDEN": False,
                     "PRELOAD_C": c["preload_c"]}, c["warps"], options=options)
            for even_k in (True, False)]
