"""The adaptor inside MindSpeed-LLM's real code (opt-in: ``CEZ_MINDSPEED_LLM_SOURCES``).

``CEZ_MINDSPEED_LLM_SOURCES=<Megatron-LM core_v0.12.1>:<MindSpeed 26.0.0_core_r0.12.1>:<MindSpeed-LLM>``
(source trees; ``tests/mindspeed_llm_source.py`` stubs what needs Ascend). In real gloo processes,
with ``import mindspeed_cez.megatron_adaptor`` before or after MindSpeed-LLM's adaptor (which runs
its real feature list), through Megatron's parser as MindSpeed-LLM wraps it, a model from
MindSpeed-LLM's ``pretrain_gpt.model_provider`` and its ``loss_func``:

* the model is MindSpeed-LLM's ``GPTModel``, run by Megatron's schedule (``get_forward_backward_func``)
  with its ``loss_func`` and a loss scale; per-token loss = CE of its logits, their gradient that of
  CE + c*lse^2 for the gradient the schedule sends, at TP=1 x DP=2 and TP=2 with sequence
  parallelism (float64 references);
* its MTP head (``--mtp-num-layers 1``) gets plain CE and its gradient;
* with ``--output-multiplier-scale`` / ``--output-logit-softcapping`` its forward's torch ops on the
  logits are recorded, not run, and the kernels compute them: CE and gradient (with respect to the
  logits before the transform) against float64 of its transform; with ``--lm-fused-output-layer``
  too, where the gradient checked is the hidden states' (no logits are made);
* MindSpeed-LLM's own ``training_log`` (MoE and dense) prints ``lm_z_loss`` = sum(c*lse^2*mask)/sum(mask) over the
  micro-batches and DP ranks, and writes it to TensorBoard;
* ``--loss-compute-mode chunk`` at TP=1 fails at validation naming both flags; at TP=2 it is served.

Not in CI (MindSpeed-LLM, MindSpeed and Megatron-LM's ``megatron.training`` 0.12 are not on PyPI);
CI runs the same contract against ``tests/stand_ins`` (``test_mindspeed_llm_stand_in.py``).
"""

import contextlib
import io
import os
import re
import sys

import pytest
import torch

SOURCES = os.environ.get("CEZ_MINDSPEED_LLM_SOURCES")
TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SOURCES, reason="set CEZ_MINDSPEED_LLM_SOURCES to Megatron-LM:MindSpeed:MindSpeed-LLM"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo test"),
]

COEFF, VOCAB, SEQ, BATCH = 3e-2, 256, 16, 2
LOSS_SCALE = 4.0  # config.grad_scale_func: the gradient the schedule sends is scaled by it
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(BATCH),
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
        "--make-vocab-size-divisible-by", "1", "--use-mcore-models", "--transformer-impl", "local",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-swiglu-fusion", "--no-rope-fusion", "--disable-bias-linear", "--use-cpu-initialization",
        "--distributed-backend", "gloo", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--position-embedding-type", "rope", "--lr", "1e-4", "--train-iters", "1", "--log-interval", "1",
        "--lm-z-loss-coeff", str(COEFF)]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2",
       "--moe-token-dispatcher-type", "allgather"]


def _has_chunk_mode():
    """MindSpeed-LLM has --loss-compute-mode from 26.0.0 on (feature-detected by its file)."""
    llm = SOURCES.split(os.pathsep)[2]
    return os.path.exists(os.path.join(llm, "mindspeed_llm", "core", "models", "common", "chunk_loss.py"))


def _start(tp, order, extra):
    """Load the sources, import both adaptors in ``order``, parse and validate Megatron's arguments."""
    import mindspeed_llm_source as source

    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron's check for TP > 1
    source.load(*SOURCES.split(os.pathsep))
    world = torch.distributed.get_world_size()
    dense = "dense" in extra
    extra = [a for a in extra if a != "dense"] + ([] if dense else MOE)
    if "--loss-compute-mode" in extra and not _has_chunk_mode():
        extra = [a for a in extra if a not in ("--loss-compute-mode", "chunk")]
    sys.argv = ["pretrain_gpt.py", *ARGV, "--tensor-model-parallel-size", str(tp),
                "--global-batch-size", str(2 * BATCH * world // tp), *extra] + (["--sequence-parallel"] if tp > 1 else [])
    if order == "cez first":
        import mindspeed_cez.megatron_adaptor as adaptor
        from mindspeed_llm import megatron_adaptor  # noqa: F401
    else:
        from mindspeed_llm import megatron_adaptor  # noqa: F401
        import mindspeed_cez.megatron_adaptor as adaptor
    assert adaptor.MODE == "mindspeed", adaptor.MODE
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args()
    return validate_args(args, {})


def _worker(rank, world_size, tp, order, extra):
    args = _start(tp, order, extra)  # first: megatron must come from the source tree
    import test_adaptor_gpt as gpt
    import test_mindspeed_llm_stand_in as stand_in
    from megatron.core import parallel_state as ps
    from megatron.training import global_vars

    import mindspeed_llm_source as source
    from mindspeed_cez.patches.logit_transform import TransformedLogits
    from mindspeed_cez.patches.output_layer import DeferredLogits

    args.padded_vocab_size = VOCAB  # what the tokenizer would set
    global_vars.set_global_variables(args, build_tokenizer=False)
    gpt.shims.apply(force=True)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    import mindspeed_llm.core.models.gpt.gpt_model as llm_gpt

    pretrain_gpt = source.pretrain_gpt(SOURCES.split(os.pathsep)[2])

    torch.manual_seed(1234)
    model = pretrain_gpt.model_provider(pre_process=True, post_process=True)
    assert type(model) is llm_gpt.GPTModel
    model.train()
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    dp_group = ps.get_data_parallel_group()
    batches = gpt._micro_batches(ps.get_data_parallel_rank())
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = gpt.shims.causal_attention_mask(SEQ)

    calls = []  # every compute_language_model_loss call: MTP head(s) first, then the main head
    loss_method = model.compute_language_model_loss

    def spy(labels, logits):
        loss = loss_method(labels, logits)
        transformed = isinstance(logits, TransformedLogits)  # the scale / soft cap left to the kernels
        logits = logits.logits if transformed else logits
        call = {"labels": labels, "logits": logits, "loss": loss, "transformed": transformed}
        if isinstance(logits, DeferredLogits):  # --lm-fused-output-layer (TP=1): no logits, its inputs
            call["values"] = logits.hidden.detach().double() @ logits.weight.detach().double().t()
            call["weight"] = logits.weight.detach().double()
            logits.hidden.register_hook(lambda g: call.__setitem__("dhidden", g.detach().clone()))
        else:  # the values now: backward writes the gradient into the logits' buffer
            call["values"] = logits.detach().clone()
            logits.register_hook(lambda g: call.__setitem__("grad", g.detach().clone()))
        calls.append(call)
        return loss

    model.compute_language_model_loss = spy
    sums = torch.zeros(4, dtype=torch.float64)  # sum(c*lse^2*m), sum(ce*m), sum(m), loss_func's lm loss sum
    identity = lambda x: x  # noqa: E731
    transform = stand_in._transform(args)  # MindSpeed-LLM's scale and soft cap, in float64
    transforms = bool(args.output_multiplier_scale or args.output_logit_softcapping)
    # Megatron's schedule, as MindSpeed-LLM's train_step runs it: its loss_func's sum over the
    # micro-batch's token count and the number of micro-batches, times the loss scale (what the
    # fused output layer's default path is told in forward and checks in backward)
    import functools
    import inspect

    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from support import recorded_grad_scales

    assert get_num_microbatches() == len(batches)
    forward_backward = get_forward_backward_func()
    sys.modules[inspect.unwrap(forward_backward).__module__].torch = source.CudaTensorsOnCpu()
    model.config.grad_scale_func = lambda loss: loss * LOSS_SCALE  # as Megatron's optimizer sets it
    forwards = []

    def forward_step(data_iterator, model):
        tokens, labels, loss_mask = next(data_iterator)
        calls.clear()
        out = model(tokens, position_ids, mask, labels=labels, loss_mask=loss_mask)
        forwards.append((calls[-1], calls[:-1], out.detach().clone(), labels, loss_mask))
        return out, functools.partial(pretrain_gpt.loss_func, loss_mask)  # MindSpeed-LLM's own

    with recorded_grad_scales() as scales:  # the fused output layer's default path: known in forward
        reports = forward_backward(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                                   num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=BATCH,
                                   forward_only=False)
    assert len(forwards) == len(reports) == len(batches)
    if "--lm-fused-output-layer" in extra:
        assert len(scales) == len(batches) and all(s is not None for s in scales), scales
    for (main, mtp_calls, out, labels, loss_mask), reported in zip(forwards, reports):
        assert main["labels"] is labels and torch.equal(main["loss"].detach(), out)
        assert main["transformed"] == transforms  # its torch ops did not run: the kernels computed them
        assert len(mtp_calls) == (args.mtp_num_layers or 0)
        weight = loss_mask.t().double() * LOSS_SCALE / (loss_mask.sum() * len(batches))
        ce, lse, grad = stand_in._reference(main["values"], labels, tp_group, tp_rank, transform, COEFF, weight)
        torch.testing.assert_close(out.detach().double(), ce, rtol=1e-5, atol=1e-5)  # the value is CE
        if "weight" in main:  # the fused output layer: d(hidden) = d(logits) @ weight
            torch.testing.assert_close(main["dhidden"].double(), grad @ main["weight"], rtol=1e-4, atol=1e-7)
        else:
            torch.testing.assert_close(main["grad"].double(), grad, rtol=1e-4, atol=1e-7)  # the gradient has the z-loss
        m = loss_mask.double()
        sums += torch.stack([(COEFF * lse**2 * m).sum(), (ce * m).sum(), m.sum(), reported["lm loss"][0].double()])
    # in fp32: MindSpeed's torch.distributed.all_reduce wrapper reduces a float64 tensor into a copy
    # and drops it (mindspeed/core/megatron_basic/requirements_basic.py, 26.0.0_core_r0.12.1)
    reduced = sums[:3].float()
    torch.distributed.all_reduce(reduced, group=dp_group)
    sums[:3] = reduced.double()
    assert float(sums[3]) == pytest.approx(float(sums[1]), rel=1e-5), (float(sums[3]), float(sums[1]))  # loss_func's lm loss is CE

    # MindSpeed-LLM's own training_log, as its train() calls it after a step
    from mindspeed_llm.training import training as llm_training

    # the module whose training_log runs (MindSpeed-LLM's own from 2.3.0; 2.2.0 re-exports Megatron's)
    sys.modules[inspect.unwrap(llm_training.training_log).__module__].torch = source.CudaTensorsOnCpu()
    torch.cuda.synchronize = lambda *a, **k: None  # Megatron's timers synchronize the device
    global_vars.get_timers()("interval-time", log_level=0).start(barrier=True)  # as its train() does
    writer = stand_in._Writer()
    global_vars._GLOBAL_TENSORBOARD_WRITER = writer
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        llm_training.training_log({"lm loss": sums[1].float() / sums[2].float()}, {}, 1e-4, None, 1, 1.0,
                                  False, 0, None, None, None)
    if rank == world_size - 1:  # print_rank_last
        line = next(ln for ln in printed.getvalue().splitlines() if "lm loss" in ln)
        logged = {k.strip(): float(v) for k, v in re.findall(r"\| ([\w ]+): ([0-9.E+-]+)", line)}
        expected = float(sums[0] / sums[2])
        assert logged["lm_z_loss"] == pytest.approx(expected, rel=1e-5), line
        assert logged["lm loss"] == pytest.approx(float(sums[1] / sums[2]), rel=1e-5), line
        assert (logged.get("load_balancing_loss", 0) > 0) == bool(args.num_experts), line
    assert writer.scalars["lm_z_loss"] == pytest.approx(float(sums[0] / sums[2]), rel=1e-5)
    if args.mtp_num_layers:  # one more forward: the MTP head's loss alone, plain CE in value and gradient
        calls.clear()
        tokens, labels, loss_mask = batches[0]
        model(tokens, position_ids, mask, labels=labels, loss_mask=loss_mask)
        mtp = calls[0]
        ones = torch.ones(SEQ, BATCH, dtype=torch.float64)
        mtp_ce, _, mtp_grad = stand_in._reference(mtp["values"], mtp["labels"], tp_group, tp_rank, identity, 0.0, ones)
        torch.testing.assert_close(mtp["loss"].detach().double(), mtp_ce, rtol=1e-5, atol=1e-5)
        (g,) = torch.autograd.grad(mtp["loss"].sum(), mtp["logits"])
        torch.testing.assert_close(g.double(), mtp_grad, rtol=1e-4, atol=1e-7)


CASES = {  # a dense model: no MoE report, so the training_log wrapper alone carries lm_z_loss
    "tp1-dp2, cez imported after MindSpeed-LLM's adaptor": (1, "cez last", []),
    "tp1-dp2, dense, cez first": (1, "cez first", ["dense"]),
    "tp1-dp2, cez imported first, MTP": (1, "cez first", ["--mtp-num-layers", "1"]),
    "tp2sp, cez first, chunk mode (falls back at TP=2)": (2, "cez first", ["--loss-compute-mode", "chunk"]),
    # Grok-1's multiplier, and a soft cap small enough to bend these logits (Gemma-2 uses 30)
    "tp2sp, cez first, scaled and soft-capped logits": (
        2, "cez first", ["--output-multiplier-scale", "0.5773502691896257", "--output-logit-softcapping", "2"]),
    "tp1-dp2, cez last, soft-capped, fused output layer": (
        1, "cez last", ["--output-logit-softcapping", "2", "--lm-fused-output-layer"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mindspeed_llm_real_model_loss_and_log(case):
    from support import run_on_ranks

    run_on_ranks(2, _worker, *CASES[case], timeout=900)


def _refusal_worker(rank, world_size, order):
    with pytest.raises(ValueError, match="--lm-z-loss-coeff.*--loss-compute-mode chunk"):
        _start(1, order, ["--loss-compute-mode", "chunk"])
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args

    sys.argv = [a for a in sys.argv if a not in ("--loss-compute-mode", "chunk")]
    global_vars.set_args(validate_args(parse_args(), {}))  # MindSpeed-LLM's barrier reads the args


@pytest.mark.parametrize("order", ["cez first", "cez last"])
def test_mindspeed_llm_real_chunk_mode_refused_at_tp1(order):
    from support import run_on_ranks

    if not _has_chunk_mode():
        pytest.skip("this MindSpeed-LLM has no --loss-compute-mode")
    run_on_ranks(1, _refusal_worker, order, timeout=600)
