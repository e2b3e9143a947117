"""The adaptor inside MindSpeed-LLM's real code, on its stack (Python 3.10, torch 2.7.1; CI's users' leg).

The sources: ``../shared/third_party``'s archives of MindSpeed-LLM, MindSpeed and Megatron-LM
(``CEZ_THIRD_PARTY`` names another folder; ``CEZ_MINDSPEED_LLM_TRIPLE`` = v26.0.0 (default), master
or v2.2.0), or unpacked trees in ``CEZ_MINDSPEED_LLM_SOURCES=<Megatron-LM>:<MindSpeed>:<MindSpeed-LLM>``;
``tests/support/mindspeed_llm_source.py`` stubs what needs Ascend. Without them the tests skip, except in
CI (``CI=true``), where that is an error. In fresh processes, whatever the order of
``import mindspeed_cez.megatron_adaptor``, ``mindspeed_cez.patches.apply()``, the launcher and
MindSpeed-LLM's adaptor: registering imports no Megatron module, Megatron's ``jit_fuser`` is
MindSpeed's no-op, no Megatron function is compiled, and every patch is attached by MindSpeed's
patch manager; a bad flag through the launcher and MindSpeed-LLM's ``pretrain_gpt.py`` is one line
and exit status 2; an ``apply()`` before parsing is kept, or refused by flags that differ. In real gloo processes,
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

The same contract runs against ``tests/support/stand_ins`` on the other megatron-core lines
(``test_mindspeed_llm_stand_in.py``).
"""

import contextlib
import io
import os
import re
import sys

import pytest
import torch

from support import REPO, TESTS, mindspeed_llm_source  # noqa: E402

SOURCES = mindspeed_llm_source.sources() if sys.version_info[:2] == (3, 10) else None
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SOURCES, reason="no MindSpeed-LLM sources: ../shared/third_party's archives, or set "
                                           "CEZ_MINDSPEED_LLM_SOURCES to Megatron-LM:MindSpeed:MindSpeed-LLM"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo test"),
    # MindSpeed-LLM 26.x's stack (CI's users' leg); its 0.12 sources would shadow another megatron-core
    pytest.mark.skipif(sys.version_info[:2] != (3, 10), reason="MindSpeed-LLM's stack: Python 3.10, torch 2.7.1"),
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
    llm = SOURCES[2]
    return os.path.exists(os.path.join(llm, "mindspeed_llm", "core", "models", "common", "chunk_loss.py"))


def _start(tp, order, extra, apply=None):
    """Load the sources, import both adaptors in ``order``, parse and validate Megatron's arguments
    (``apply``: ``mindspeed_cez.patches.apply(z_loss_coeff=apply)`` first, and no ``--lm-*`` flag
    unless ``extra`` has one)."""
    from support import mindspeed_llm_source as source

    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron's check for TP > 1
    source.load(*SOURCES)
    if apply is not None:
        from mindspeed_cez import patches

        patches.apply(z_loss_coeff=apply)
    world = torch.distributed.get_world_size()
    dense = "dense" in extra
    extra = [a for a in extra if a != "dense"] + ([] if dense else MOE)
    if "--loss-compute-mode" in extra and not _has_chunk_mode():
        extra = [a for a in extra if a not in ("--loss-compute-mode", "chunk")]
    argv = ARGV if apply is None else ARGV[:-2]  # without --lm-z-loss-coeff
    sys.argv = ["pretrain_gpt.py", *argv, "--tensor-model-parallel-size", str(tp),
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
    from support import tiny_gpt as gpt
    import test_mindspeed_llm_stand_in as stand_in
    from megatron.core import parallel_state as ps
    from megatron.training import global_vars

    from support import mindspeed_llm_source as source
    from mindspeed_cez.patches.model_context import TransformedLogits
    from mindspeed_cez.patches.model_context import DeferredLogits

    args.padded_vocab_size = VOCAB  # what the tokenizer would set
    global_vars.set_global_variables(args, build_tokenizer=False)
    gpt.cpu_mode.apply(force=True)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    import mindspeed_llm.core.models.gpt.gpt_model as llm_gpt

    pretrain_gpt = source.pretrain_gpt(SOURCES[2])

    torch.manual_seed(1234)
    model = pretrain_gpt.model_provider(pre_process=True, post_process=True)
    assert type(model) is llm_gpt.GPTModel
    model.train()
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    dp_group = ps.get_data_parallel_group()
    batches = gpt.micro_batches(ps.get_data_parallel_rank())
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = gpt.local_gpt.causal_attention_mask(SEQ)

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


# ---------------------------------------------------------------- registering imports nothing of Megatron

PROBE_ORDERS = ["cez first", "cez last", "apply first", "launched"]


def _probe(order, *launch_args):
    """``tests/support/mindspeed_llm_source.py ORDER`` in a fresh process (``launched``: through the launcher,
    the source trees on PYTHONPATH as a user's install has them)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TESTS, *SOURCES, os.environ.get("PYTHONPATH", "")]), CUDA_DEVICE_MAX_CONNECTIONS="1")
    script = mindspeed_llm_source.__file__
    command = [sys.executable, *(["-m", "mindspeed_cez.launch"] if order == "launched" else []), script, order, *SOURCES]
    if launch_args:
        command = [sys.executable, "-m", "mindspeed_cez.launch", *launch_args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


@pytest.mark.parametrize("order", PROBE_ORDERS)
def test_registering_imports_no_megatron_and_mindspeed_replacements_hold(order):
    """Whatever the order: the adaptor (or apply(), or the launcher) imports no Megatron module, MindSpeed's
    no-op ``torch.compile`` is Megatron's ``jit_fuser``, nothing of Megatron is compiled, and every patch is
    attached by MindSpeed's patch manager, MindSpeed-LLM's model and training log among them."""
    import json

    proc = _probe(order)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE "))[len("PROBE "):])
    assert seen["megatron_before"] == []
    assert seen.get("megatron_after_register", []) == [], seen["megatron_after_register"][:10]
    assert seen.get("mindspeed_after_register", []) == []
    assert seen["jit_fuser"] == "mindspeed.core.megatron_basic.requirements_basic.dummy_compile", seen["jit_fuser"]
    assert seen["compiled"] == [], seen["compiled"]
    assert seen["mode"] == "mindspeed"
    lm = "megatron.core.models.common.language_module.language_module.LanguageModule.compute_language_model_loss"
    assert {lm, "megatron.core.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy",
            "mindspeed_llm.core.models.gpt.gpt_model.GPTModel.forward",
            "mindspeed_llm.training.training.training_log"} <= set(seen["ours_in_mindspeed"]), seen["ours_in_mindspeed"]
    assert seen["direct"] == [] and seen["loss_patched"]


@pytest.mark.parametrize("bad", [["--lm-z-loss-coeff", "-1"], ["--lm-fused-output-layer", "sideways"]])
def test_a_refused_flag_is_the_first_and_only_line(bad):
    """MindSpeed-LLM's pretrain_gpt.py through the launcher: a bad flag ends the run with one line of ours,
    before MindSpeed, Megatron or the script print anything."""
    proc = _probe(None, os.path.join(SOURCES[2], "pretrain_gpt.py"), *ARGV[:-2], *bad)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("pretrain_gpt.py: error: ") and bad[0] in proc.stderr, proc.stderr


def _apply_worker(rank, world_size, order):
    """apply() before the arguments are parsed: kept by flags that choose nothing; refused by flags
    that choose otherwise (one line, exit status 2 as an argument error)."""
    from mindspeed_cez import patches
    from mindspeed_cez.patches.arguments import FlagValueError

    _start(1, order, ["dense"], apply=1e-3)
    assert patches.active_settings() is not None and patches.active_settings().z_loss_coeff == 1e-3
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args

    sys.argv += ["--lm-z-loss-coeff", "2e-3"]
    with pytest.raises(FlagValueError, match=r"apply\(z_loss_coeff=0.001\) and the flags \(--lm-z-loss-coeff 0.002\)"):
        validate_args(parse_args(), {})
    sys.argv[-1] = "1e-3"  # the same choice twice: served
    global_vars.set_args(validate_args(parse_args(), {}))
    assert patches.active_settings().z_loss_coeff == 1e-3


@pytest.mark.parametrize("order", ["cez first", "cez last"])
def test_apply_before_parsing_is_kept_or_refused(order):
    from support import run_on_ranks

    run_on_ranks(1, _apply_worker, order, timeout=600)
