"""``LossSpec``: the loss's settings checked and cast once where a value enters (op argument, the
adaptor's settings, a flag), each error naming the caller's name; its kernel arguments against a
float64 computation of the loss; the ops' one vocab prologue."""

import argparse
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from mindspeed_cez import linear_cross_entropy_zloss, vocab_parallel_cross_entropy_zloss
from mindspeed_cez import GradientPath, LinearCrossEntropyOptions, TrainerInputs
from mindspeed_cez.kernels import SOFTCAP, LogitTransform, LossSpec, VocabShard, loss_spec
from mindspeed_cez.patches import arguments
from mindspeed_cez.patches.settings import Settings
from mindspeed_cez.cross_entropy_zloss import vocab_shard

BAD = [("z_loss_coeff", -1e-4, ValueError, "must be a finite number >= 0"),
       ("z_loss_coeff", float("nan"), ValueError, "must be a finite number >= 0"),
       ("label_smoothing", 1.0, ValueError, r"must be in \[0, 1\)"),
       ("ignore_index", 2.5, TypeError, "must be an int"),
       ("ignore_index", 2**63, ValueError, "must fit in int64")]


@pytest.mark.parametrize("field, value, error, message", BAD)
def test_a_bad_value_names_the_callers_name_for_it(field, value, error, message):
    with pytest.raises(error, match=f"^{field} {message}"):
        LossSpec(**{field: value})
    with pytest.raises(error, match=f"^--my-{field} {message}"):
        LossSpec(**{field: value}, names={field: f"--my-{field}"})
    logits, target = torch.randn(3, 5), torch.tensor([0, 4, -100])
    with pytest.raises(error, match=f"^{field} {message}"):  # the op's keyword
        vocab_parallel_cross_entropy_zloss(logits, target, **{field: value})
    with pytest.raises(error, match=f"^{field} {message}"):
        linear_cross_entropy_zloss(torch.randn(3, 4), torch.randn(5, 4), target, **{field: value})


def test_settings_and_flags_name_their_own_fields():
    with pytest.raises(ValueError, match="^z_loss_coeff must be a finite number >= 0"):
        Settings(z_loss_coeff=-1.0)
    with pytest.raises(ValueError, match=r"^label_smoothing must be in \[0, 1\)"):
        Settings(label_smoothing=1.5)
    with pytest.raises(ValueError, match="^block_fraction takes"):
        Settings(block_fraction=2.0)
    with pytest.raises(ValueError, match="^grads must be one of"):
        Settings(grads="sideways")
    parser = arguments.add_lm_z_loss_args(argparse.ArgumentParser(allow_abbrev=False))
    for argv, message in ((["--lm-z-loss-coeff", "-1"], "^--lm-z-loss-coeff must be a finite number >= 0"),
                          (["--lm-fused-output-layer", "--lm-fused-output-layer-block-fraction", "0"],
                           "^--lm-fused-output-layer-block-fraction takes")):
        with pytest.raises(ValueError, match=message):
            arguments.validate(parser.parse_args(argv))


def test_gradient_path_is_checked_once_where_it_enters():
    """The fused layer's grads / block_fraction: one GradientPath, made by the caller (its options) or by the
    adaptor's settings (naming the flag); the op takes it as is, in its options, and no other way."""
    from mindspeed_cez.linear_cross_entropy import GradientPath

    with pytest.raises(ValueError, match="^--my-block takes"):
        GradientPath("forward", 1.5, names={"block_fraction": "--my-block"})
    with pytest.raises(ValueError, match="^block_fraction takes"):  # the options' path
        linear_cross_entropy_zloss(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 4, -100]),
                                   options=LinearCrossEntropyOptions(path=GradientPath("forward", block_fraction=0)),
                                   trainer=TrainerInputs(token_weights=torch.ones(3)))
    settings = Settings(fused_output_layer=True, grads="forward", block_fraction=1)
    assert settings.gradient_path == GradientPath("forward", 1.0)
    assert type(settings.block_fraction) is float and type(settings.gradient_path.block_fraction) is float
    hidden, weight = torch.randn(6, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    target = torch.tensor([0, 4, -100, 2, 1, 3])
    by_path = linear_cross_entropy_zloss(hidden, weight, target,
                                         options=LinearCrossEntropyOptions(path=settings.gradient_path),
                                         trainer=TrainerInputs(token_weights=torch.ones(6)))[0]
    loose = linear_cross_entropy_zloss(hidden, weight, target,
                                       options=LinearCrossEntropyOptions(path=GradientPath("forward", block_fraction=1.0)),
                                       trainer=TrainerInputs(token_weights=torch.ones(6)))[0]
    torch.testing.assert_close(by_path, loose, rtol=0, atol=0)
    with pytest.raises(TypeError, match="no longer takes block_fraction=: pass "
                                        "options=LinearCrossEntropyOptions\\(path=GradientPath\\(block_fraction"):
        linear_cross_entropy_zloss(hidden, weight, target, options=LinearCrossEntropyOptions(path=settings.gradient_path),
                                   block_fraction=1.0)
    with pytest.raises(TypeError, match="path must be"):
        linear_cross_entropy_zloss(hidden, weight, target, options=LinearCrossEntropyOptions(path="forward"))
    assert GradientPath() == settings.replace(block_fraction=None).gradient_path == GradientPath("forward")


def test_values_are_cast_once_and_one_spec_serves_equal_values():
    spec = LossSpec(torch.tensor(7).item(), 1, 0)  # ints in: an int, floats out
    assert (type(spec.ignore_index), type(spec.z_loss_coeff), type(spec.label_smoothing)) == (int, float, float)
    transform = LogitTransform(2.0, 30.0)
    assert loss_spec(-100, 1e-3, 0.1, transform) is loss_spec(-100, 1e-3, 0.1, LogitTransform(2.0, 30.0))
    assert loss_spec(-100, 1e-3, 0.1, transform) == LossSpec(-100, 1e-3, 0.1, LogitTransform(2.0, 30.0))
    with pytest.raises(ValueError, match="^z_loss_coeff"):
        loss_spec(z_loss_coeff=[1.0])  # unhashable: the constructor says what is wrong
    s = Settings(z_loss_coeff=3, label_smoothing=0)
    assert type(s.z_loss_coeff) is float and type(s.label_smoothing) is float


def test_renamed_block_fraction_flag():
    parser = arguments.add_lm_z_loss_args(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["--lm-fused-output-layer", "--lm-fused-output-layer-block-fraction", "0.25"])
    assert arguments.validate(args).block_fraction == 0.25
    _, unknown = parser.parse_known_args(["--lm-fused-output-layer-block", "0.25"])
    assert unknown == ["--lm-fused-output-layer-block", "0.25"]  # the old name is no flag (never released)


def test_kernel_args_against_a_float64_loss():
    """The kernels' formula ``lse - target_weight*z[t] - smoothing_per_col*sum(z) + c*lse**2`` with the
    spec's mapping is torch's label-smoothed cross entropy plus the z-loss, in float64."""
    gen = torch.Generator().manual_seed(5)
    vocab, c, a = 97, 3e-3, 0.15
    spec = LossSpec(-100, c, a, LogitTransform(0.7, 20.0))
    args = spec.kernel_args(vocab)
    assert args is spec.kernel_args(vocab)  # one mapping per (spec, vocab)
    assert (args["logit_scale"], args["logit_softcap"], args["TRANSFORM"], args["WITH_LOGIT_SUM"]) == (
        0.7, 20.0, SOFTCAP, True)
    assert (args["ignore_index"], args["global_vocab"], args["z_loss_coeff"]) == (-100, vocab, c)
    z = torch.randn(16, vocab, generator=gen, dtype=torch.float64) * 4
    target = torch.randint(0, vocab, (16,), generator=gen)
    lse = torch.logsumexp(z, -1)
    kernel = lse - args["target_weight"] * z.gather(1, target[:, None])[:, 0] - args["smoothing_per_col"] * z.sum(-1)
    exact = F.cross_entropy(z, target, label_smoothing=a, reduction="none")
    assert torch.allclose(kernel + args["z_loss_coeff"] * lse**2, exact + c * lse**2, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError):
        args["z_loss_coeff"] = 0.0  # shared by every launch: read-only
    assert not LossSpec().kernel_args(vocab)["WITH_LOGIT_SUM"]
    copied = pickle.loads(pickle.dumps(spec))  # a config holding one can be copied and pickled
    assert copied == spec and hash(copied) == hash(spec) and copied.kernel_args(vocab) == args


def test_a_spec_reaches_the_op_by_its_fields_one_way_each():
    """A ``LossSpec`` (a config's, the adaptor's) goes to the op as its fields: the keywords and the
    ``logit_transform``; ``loss=`` is gone, a TypeError naming them; a transform that is not one is refused."""
    gen = torch.Generator().manual_seed(3)
    logits, target = torch.randn(6, 11, generator=gen), torch.randint(0, 11, (6,), generator=gen)
    target[0] = -1
    spec = LossSpec(-1, 1e-2, 0.1, LogitTransform(2.0, 5.0))
    by_fields = vocab_parallel_cross_entropy_zloss(logits, target, spec.z_loss_coeff, spec.label_smoothing,
                                                   spec.ignore_index, backend="torch",
                                                   logit_transform=spec.logit_transform)
    loose = vocab_parallel_cross_entropy_zloss(logits, target, 1e-2, 0.1, -1, backend="torch",
                                               logit_transform=LogitTransform(scale=2.0, cap=5.0))
    assert all(torch.equal(x, y) for x, y in zip(loose, by_fields))
    with pytest.raises(TypeError, match="no longer takes loss=: pass its fields as z_loss_coeff="):
        vocab_parallel_cross_entropy_zloss(logits, target, loss=spec)
    with pytest.raises(TypeError, match="logit_transform must be a LogitTransform"):
        vocab_parallel_cross_entropy_zloss(logits, target, logit_transform=2.0)


def test_the_vocab_prologue_and_its_chunks():
    assert vocab_shard(None, 7) == VocabShard(0, 7, 7, 0, 1) == VocabShard.whole(7)
    shard = VocabShard(300, 150, 600, 2, 4)
    assert shard.chunk(100, 50) == VocabShard(400, 50, 600, 2, 4)
    assert math.isclose(LossSpec(label_smoothing=0.3).kernel_args(shard.global_vocab)["smoothing_per_col"], 0.3 / 600)


def test_replace_derives_one_spec_per_set_of_changes():
    spec = LossSpec(-100, 1e-3, 0.0, LogitTransform(2.0, 5.0))
    assert spec.replace(z_loss_coeff=1e-3) is spec and spec.replace() is spec  # nothing changes: itself
    mtp = spec.replace(z_loss_coeff=0.0, label_smoothing=0.1)
    assert mtp == LossSpec(-100, 0.0, 0.1, LogitTransform(2.0, 5.0))
    assert spec.replace(label_smoothing=0.1, z_loss_coeff=0.0) is mtp  # kept: no object per call
    with pytest.raises(ValueError, match=r"^label_smoothing must be in \[0, 1\)"):
        spec.replace(label_smoothing=1.0)  # checked as the constructor checks
    with pytest.raises(ValueError, match="^z_loss_coeff"):
        spec.replace(z_loss_coeff=[1.0])  # unhashable: the constructor says what is wrong
    copied = pickle.loads(pickle.dumps(spec))
    assert copied == spec and copied.replace(z_loss_coeff=0.0) == spec.replace(z_loss_coeff=0.0)


def test_settings_hold_the_loss_they_made_and_the_adaptor_hands_it_on():
    from mindspeed_cez.patches import loss_wrappers

    transform = LogitTransform(0.5, 30.0)
    settings = Settings(z_loss_coeff=2e-3, label_smoothing=0.1, logit_transform=transform)
    assert settings.loss == LossSpec(-100, 2e-3, 0.1, transform)
    assert settings.loss is settings.loss and Settings(z_loss_coeff=2e-3).loss.label_smoothing == 0.0
    # each call's spec: Megatron's smoothing over the global vocab, plain CE for MTP heads, the model's transform
    main = loss_wrappers.call_loss_spec(settings.loss, 1000, 0.1, main_head=True, transform=transform)
    assert main == LossSpec(-100, 2e-3, 0.1 * 1000 / 999, transform)
    assert loss_wrappers.call_loss_spec(settings.loss, 1000, 0.1, main_head=True, transform=transform) is main
    mtp = loss_wrappers.call_loss_spec(settings.loss, 1000, 0.1, main_head=False)
    assert mtp.z_loss_coeff == 0.0 and mtp.logit_transform == LogitTransform()
    plain = Settings(z_loss_coeff=1e-3)
    assert loss_wrappers.call_loss_spec(plain.loss, 1000, 0.0) is plain.loss  # the common case: the settings' own
