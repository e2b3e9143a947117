"""``tests/support/kernel_variants.py`` types every kernel's runtime parameters from the kernel's own parameter
list and one name rule: every parameter of every kernel gets a type, each variant's signature and
constexprs cover the kernel's parameters exactly once, and the derived signatures are the ones
the ahead-of-time compiles (tests/support/kernel_resources.py, tests/support/ascend_lowering.py) were written with."""

import inspect

import pytest

from mindspeed_cez import kernels

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="needs Triton")

if kernels.triton_available():
    from mindspeed_cez.kernels import triton_cross_entropy as tce
    from mindspeed_cez.kernels import triton_linear_cross_entropy as tlce
    from mindspeed_cez.kernels import triton_matmul_accumulate as tma
    from support import kernel_variants as v

DTYPES = ("bf16", "fp16", "fp32")

# The signatures as variants.py wrote them out by hand, per kernel ("D": the inputs' dtype).
_INTS = ("n_rows", "n_cols", "rows_per_program", "vocab_start", "global_vocab", "ignore_index")
_LOSS = ("z_loss_coeff", "target_weight", "smoothing_per_col", "logit_scale", "logit_softcap")
WRITTEN = {
    "triton_cross_entropy._forward_kernel": {
        "logits_ptr": "*D", "row_stride": "i32", "target_ptr": "*i64", "out_ptr": "*fp32",
        **dict.fromkeys(_INTS, "i32"), **dict.fromkeys(_LOSS, "fp32"), "width_hi": "fp32", "width_lo": "fp32"},
    "triton_cross_entropy._grad_kernel": {
        "logits_ptr": "*D", "logits_row_stride": "i32", "grad_ptr": "*D", "grad_row_stride": "i32",
        "target_ptr": "*i64", "lse_ptr": "*fp32", "grad_loss_ptr": "*fp32", "grad_loss_stride": "i32", "n_rows": "i32",
        "n_cols": "i32", "rows_per_program": "i32", "vocab_start": "i32", "ignore_index": "i32",
        **dict.fromkeys(_LOSS, "fp32")},
    "triton_cross_entropy._loss_from_partials_kernel": {
        "partials_ptr": "*fp32", "rank_stride": "i32", "n_ranks": "i32", "target_ptr": "*i64", "out_ptr": "*fp32",
        "out_stride": "i32", "n_rows": "i32", "ignore_index": "i32", "z_loss_coeff": "fp32"},
    "triton_linear_cross_entropy._partials_kernel": {
        "x_ptr": "*D", "x_row_stride": "i32", "w_ptr": "*D", "w_row_stride": "i32", "target_ptr": "*i64",
        "out_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32", "h": "i32", "vocab_start": "i32", "global_vocab": "i32",
        "ignore_index": "i32", **dict.fromkeys(_LOSS[1:], "fp32")},
    "triton_linear_cross_entropy._grad_kernel": {
        "x_ptr": "*D", "x_row_stride": "i32", "w_ptr": "*D", "w_row_stride": "i32", "grad_ptr": "*D",
        "grad_row_stride": "i32", "target_ptr": "*i64", "lse_ptr": "*fp32", "grad_loss_ptr": "*fp32",
        "grad_loss_stride": "i32", "n_rows": "i32", "n_cols": "i32", "h": "i32", "vocab_start": "i32",
        "ignore_index": "i32", **dict.fromkeys(_LOSS, "fp32")},
    "triton_linear_cross_entropy._merge_kernel": {
        "groups_ptr": "*fp32", "out_ptr": "*fp32", "n_rows": "i32", "n_groups": "i32", "width_hi": "fp32",
        "width_lo": "fp32"},
    "triton_matmul_accumulate._accumulate_kernel": {  # a_stride_m, b_stride_n: pinned to 1 by the variants
        "a_ptr": "*D", "a_stride_k": "i32", "b_ptr": "*D", "b_stride_k": "i32", "c_ptr": "*fp32",
        "c_stride_m": "i32", "m": "i32", "n": "i32", "k": "i32"},
}


def _kernel_name(fn):
    return f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.fn.__name__}"


def _all_variants():
    out = []
    for dtype in DTYPES:
        for device_type in ("cuda", "npu", "cpu"):
            for n_cols in (151936, 16160, 2000):
                out += v.variants(tce.launch_settings(device_type, n_cols), dtype, n_cols)
            out += v.linear_variants(device_type, dtype)
    return out


def test_every_runtime_parameter_of_every_kernel_has_a_type():
    launchers = tce.LAUNCHERS + tlce.LAUNCHERS + tma.LAUNCHERS
    assert {_kernel_name(launcher.kernel) for launcher in launchers} == set(WRITTEN)
    for launcher in launchers:
        params = inspect.signature(launcher.kernel.fn).parameters
        assert tuple(params) == launcher.params
        for dtype in DTYPES:
            sig = v.signature(launcher.kernel, dtype)
            runtime = [p for p in launcher.params if not v.is_constexpr(params[p])]
            assert list(sig) == runtime and runtime, launcher.params
            assert all(t in ("i32", "fp32", "*fp32", "*i64", f"*{dtype}") for t in sig.values()), sig


def test_derived_signatures_are_the_written_ones():
    seen = set()
    for variant in _all_variants():
        name = _kernel_name(variant.fn)
        expected = {k: t.replace("D", variant.dtype) for k, t in WRITTEN[name].items()}
        assert list(variant.signature.items()) == list(expected.items()), (variant.name, variant.dtype)
        seen.add(name)
    assert seen == set(WRITTEN)


def test_each_parameter_is_a_signature_entry_or_a_constexpr():
    for variant in _all_variants():
        params = tuple(inspect.signature(variant.fn.fn).parameters)
        assert set(variant.signature).isdisjoint(variant.constexprs), variant.name
        assert sorted(variant.signature.keys() | variant.constexprs.keys()) == sorted(params), variant.name


def test_an_untyped_parameter_is_refused_by_name():
    with pytest.raises(KeyError, match="'row_scale'.*variants.py"):
        v.param_type("row_scale", "bf16")
    assert v.param_type("logits_ptr", "fp16") == "*fp16" and v.param_type("x_row_stride", "bf16") == "i32"
