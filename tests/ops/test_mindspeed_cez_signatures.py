"""The public ops' signatures: at most 10 parameters each, every value passed one way, and each removed
keyword a TypeError naming what replaced it."""

import inspect

import pytest
import torch

from mindspeed_cez import GradientPath, LinearCrossEntropyOptions, linear_cross_entropy_zloss, vocab_parallel_cross_entropy_zloss
from mindspeed_cez.linear_cross_entropy import DEFAULT_OPTIONS


def test_each_op_takes_at_most_ten_parameters_and_the_documented_keywords():
    fused = inspect.signature(linear_cross_entropy_zloss).parameters
    op = inspect.signature(vocab_parallel_cross_entropy_zloss).parameters
    assert len(fused) <= 10 and len(op) <= 10, (list(fused), list(op))
    assert list(op) == ["logits", "target", "z_loss_coeff", "label_smoothing", "ignore_index", "tp_group",
                        "logit_transform", "backend", "return_lse"]
    assert list(fused) == ["hidden", "weight", "target", "z_loss_coeff", "label_smoothing", "ignore_index", "tp_group",
                           "sequence_parallel", "options", "trainer"]
    assert all(p.kind is not p.VAR_KEYWORD for p in (*fused.values(), *op.values()))
    # one default for the gradient path: the op's options, GradientPath's and the flag's ("forward")
    assert fused["options"].default is DEFAULT_OPTIONS and DEFAULT_OPTIONS.path == GradientPath("forward")


FUSED_REMOVED = {
    "grads": "options=LinearCrossEntropyOptions(path=GradientPath(grads=",
    "block_fraction": "options=LinearCrossEntropyOptions(path=GradientPath(block_fraction=",
    "block_bytes": "options=LinearCrossEntropyOptions(path=GradientPath(block_bytes=",
    "row_block": "options=LinearCrossEntropyOptions(path=GradientPath(row_block=",
    "path": "options=LinearCrossEntropyOptions(path=GradientPath(",
    "backend": "options=LinearCrossEntropyOptions(backend=",
    "linear_backend": "options=LinearCrossEntropyOptions(linear_backend=",
    "chunk_cols": "options=LinearCrossEntropyOptions(chunk_cols=",
    "return_lse": "options=LinearCrossEntropyOptions(return_lse=",
    "logit_scale": "options=LinearCrossEntropyOptions(logit_transform=LogitTransform(",
    "logit_softcap": "options=LinearCrossEntropyOptions(logit_transform=LogitTransform(",
    "loss": "its fields as z_loss_coeff=, label_smoothing=, ignore_index= and options=",
    "token_weights": "trainer=TrainerInputs(token_weights=",
    "grad_scale": "trainer=TrainerInputs(grad_scale=",
    "weight_grad": "trainer=TrainerInputs(weight_grad=",
    "remedy": "trainer=TrainerInputs(remedy=",
    "gradient_accumulation_fusion": "trainer=TrainerInputs(weight_grad=WeightGradTarget(",
}
OP_REMOVED = {"logit_scale": "logit_transform=LogitTransform(", "logit_softcap": "logit_transform=LogitTransform(",
              "loss": "its fields as z_loss_coeff=, label_smoothing=, ignore_index= and logit_transform="}


@pytest.mark.parametrize("name", sorted(FUSED_REMOVED))
def test_a_removed_keyword_of_the_fused_layer_names_its_replacement(name):
    hidden, weight, target = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 4, -100])
    with pytest.raises(TypeError) as error:
        linear_cross_entropy_zloss(hidden, weight, target, **{name: None})
    assert str(error.value).startswith(f"linear_cross_entropy_zloss() no longer takes {name}=: pass ")
    assert FUSED_REMOVED[name] in str(error.value)


@pytest.mark.parametrize("name", sorted(OP_REMOVED))
def test_a_removed_keyword_of_the_op_names_its_replacement(name):
    with pytest.raises(TypeError) as error:
        vocab_parallel_cross_entropy_zloss(torch.randn(3, 5), torch.tensor([0, 4, -100]), **{name: None})
    assert str(error.value).startswith(f"vocab_parallel_cross_entropy_zloss() no longer takes {name}=: pass ")
    assert OP_REMOVED[name] in str(error.value)


def test_positional_arguments_past_sequence_parallel_name_the_trainer():
    hidden, weight, target = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 4, -100])
    with pytest.raises(TypeError, match="takes at most 8 positional arguments, got 9: weight_grad and token_weights"):
        linear_cross_entropy_zloss(hidden, weight, target, 0.0, 0.0, -100, None, False, None)
    with pytest.raises(TypeError, match="options must be a"):
        linear_cross_entropy_zloss(hidden, weight, target, options={"backend": "torch"})
    assert LinearCrossEntropyOptions() == DEFAULT_OPTIONS
