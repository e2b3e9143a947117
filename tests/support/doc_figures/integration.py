"""Where each figure quoted in docs/adaptor.md, docs/megatron_features.md, docs/ascend.md, docs/install.md,
docs/architecture.md and examples/README.md comes from: rows as in __init__.py (docs/install.md quotes versions
and dates only)."""
import re
import statistics

DAY = "bench/results/2026-11-27_4xh100/"
LAYOUTS = DAY + "layouts/results.json"
FEATURES = DAY + "features/results.json"  # run 1: reshards, faults, graphs (local), FSDP2 at DP4
FEATURES_RUN4 = DAY + "features_run4/results.json"  # full-iteration graphs
FEATURES_RUN5 = DAY + "features_run5/results.json"  # per-layer graphs, the whole fsdp group
MOE_LOG = DAY + "final_checks/megatron_lm_moe_gpu.log"  # examples/run_megatron_lm_moe.sh, TRAIN_ITERS=10, 2 GPUs


def _sci(x):
    """1.44e-07 -> '1.4e-7', 6.01e-05 -> '6e-5': as the docs write a bound."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def _values(results, pattern, layout=None):
    """The values of the checks whose text matches ``pattern`` (and of ``layout``); none: a KeyError."""
    values = [c["value"] for c in results["checks"] if re.search(pattern, c["check"])
              and (layout is None or c["layout"] == layout)]
    if not values or None in values:
        raise KeyError(pattern)
    return values


def _details(results, pattern):
    return [c["detail"] for c in results["checks"] if re.search(pattern, c["check"])]


def _launches(results):
    launches = results["launches"]
    return dict(launches.items() if isinstance(launches, dict) else launches)


def _median_after(launch, step):
    """The median 'elapsed time per iteration (ms)' of a launch's logged steps after ``step``."""
    rows = launch["rows"]
    return statistics.median(r["elapsed time per iteration (ms)"] for k, r in rows.items() if int(k) > step)


def _moe_log_line(log, iteration=3):
    line = next(x for x in log.splitlines() if re.search(rf"\biteration\s+{iteration}/", x))
    fields = dict(re.findall(r"\| ([a-z_ ]+): ([0-9.E+-]+)", line))
    total = re.search(rf"iteration\s+{iteration}/\s*(\d+)", line).group(1)
    return {"total": total, "lm": fields["lm loss"], "z": fields["lm_z_loss"], "lb": fields["load_balancing_loss"]}


def _bitwise(results, pattern, layout="fsdp"):
    """True when every check matching ``pattern`` found a difference of exactly 0."""
    return all(v == 0 for v in _values(results, pattern, layout))


def _fsdp(results, kind, layouts=("dp4", "tp2dp2")):
    """torch FSDP2 ('fsdp2') or Megatron-FSDP ('mfsdp') against DDP (run 5): iteration 1 bitwise, the largest later
    difference, the largest gradient difference against DDP (iterations 1 and 2) and against float64."""
    launches = "|".join(layouts)
    if not _bitwise(results, rf"^({launches})-{kind}-\S+: iteration 1 (grad norm )?= "):
        return {}
    return {"later": _sci(max(_values(results, rf"^({launches})-{kind}-\S+: later iterations"))),
            "ddp": _sci(max(_values(results, rf"^({launches})-{kind}-\S+: iteration \d's output-layer .* = \S+'s$"))),
            "f64": _sci(max(_values(results, rf"^({launches})-{kind}-\S+: iteration 1's output-layer .* = float64")))}


def _float64(results):
    f64 = lambda pattern: _values(results, rf"^{pattern}: iteration 1's output-layer .* = float64")  # noqa: E731
    ddp = f64(r"\S+-ddp-\S+")
    fsdp = f64(r"\S+-(m?fsdp2?)-\S+")
    return {"lo": _sci(min(ddp)), "hi": _sci(max(ddp)), "ce": _sci(max(f64(r"dp4-ddp-ce"))),
            "fol": _sci(max(f64(r"\S+-ddp-fol(_recompute)?"))), "fsdp": _sci(max(fsdp))}


def _reshard(results):
    iteration_5 = _values(results, r"^resume-(afol-at-b-fol|bfol-at-a-fol): iteration 5 = ", "reshard")
    later = _values(results, r"^resume-(afol-at-b-fol|bfol-at-a-fol): iterations 6-8 = ", "reshard")
    return {"s5": _sci(max(iteration_5)), "s68": _sci(max(later)), "bf16": _sci(max(iteration_5 + later)),
            "with": _sci(max(_values(results, r"^resume-ace-at-b-fol: iteration 5 = ", "reshard"))),
            "without": _sci(max(_values(results, r"^resume-afol-at-b-ce: iteration 5 = ", "reshard")))}


def _nan_verdicts(results):
    validate = _details(results, r"^nan-validate_results-ce: Megatron's verdict")[0]
    disabled = _details(results, r"^nan-disabled-ce: Megatron's verdict")[0]
    if "First rerun: unexpected result is reproducible within the tolerance (nan = nan)" not in validate:
        return {}
    return {"validate": re.search(r"exit statuses \[(\d+)\]", validate).group(1),
            "step": re.search(r"iteration #(\d+)", validate).group(1),
            "disabled": re.search(r"exit statuses \[(\d+)\]", disabled).group(1)}


def _graphs(results, impl):
    """Every variant's logged values bitwise eager's, and every launch of that graph kind ended (rc 0)."""
    ended = all(launch["rc"] == 0 for name, launch in _launches(results).items()
                if name.startswith(f"graph-{impl}-") and not name.endswith("-exit"))
    return {} if not (ended and _bitwise(results, rf"^graph-{impl}-\S+: .* = eager", "graphs")) else {"ok": True}


def _layouts(results):
    dump = _values(results, r"iteration 3 = float64 from the dumped logits")
    return {"dump": _sci(max(dump)), "ok": sum(c["ok"] for c in results["checks"]), "n": len(results["checks"]),
            "iterations": results["iterations"]}


def _selfcheck_tp4(printed):
    """The TP=4 self-check's summary line, printed by the device call (op_tp/printed.txt)."""
    m = re.search(r"Selfcheck, torchrun --nproc-per-node 4 -m mindspeed_cez\.selfcheck \(rc 0\):\n.*\n"
                  r"PASSED: (\d+) ok, 0 failed, 0 skipped", printed)
    return {"ok": int(m.group(1))} if m else {}


def _constant(name):
    return lambda text: {"n": re.search(rf"^{name} = (\d+)(\.0)?\b", text, re.M).group(1)}


ROWS = [
    # docs/adaptor.md: where the metric appears (the committed log of the Megatron-LM launch on GPUs)
    ("docs/adaptor.md", "iteration 3/ {total} | ... | lm loss: {lm} | lm_z_loss: {z} | load_balancing_loss: {lb} | "
     "loss scale: 1.0 | ...", MOE_LOG, _moe_log_line),
    # docs/adaptor.md: the refusal under torchrun (the launcher's wait for rank 0)
    ("docs/adaptor.md", "the other ranks wait for it, at most {n} s", "patches/launch_checks.py",
     _constant("WAIT_FOR_FIRST_PROCESS_S")),
    # docs/adaptor.md: parallel layouts on GPUs
    ("docs/adaptor.md", "that with `--lm-fused-output-layer` forward and recompute, {iterations} iterations, one seed",
     LAYOUTS, _layouts),
    ("docs/adaptor.md", "equal float64 from every micro-batch's logits (within {dump}); the fused layer's default path "
     "added the weight gradient into the `main_grad` of Megatron's DDP buckets. {ok} of {n} checks", LAYOUTS, _layouts),

    # docs/megatron_features.md: the summary table
    ("docs/megatron_features.md", "| `--cuda-graph-impl full_iteration` | trains, every logged value bitwise the eager "
     "run's", FEATURES_RUN4, lambda d: _graphs(d, "full_iteration")),
    ("docs/megatron_features.md", "| `--cuda-graph-impl local` (per-layer graphs) | bitwise the eager run's, every "
     "variant; ends |", FEATURES, lambda d: _graphs(d, "local")),
    ("docs/megatron_features.md", "| `--use-torch-fsdp2` (DP4, TP2 x DP2) | equal to DDP: iteration 1 bitwise, later "
     "iterations within {later}; the output layer's gradient within {f64} of float64 |", FEATURES_RUN5,
     lambda d: _fsdp(d, "fsdp2")),
    ("docs/megatron_features.md", "equal to DDP (iteration 1 bitwise, later within {later}); the output layer's "
     "gradient within {f64} of float64", FEATURES_RUN5, lambda d: _fsdp(d, "mfsdp")),
    ("docs/megatron_features.md", "TP2 x PP2 -> TP4 and back within {bf16} (bf16)", FEATURES, _reshard),
    ("docs/megatron_features.md", "the first resumed step's `lm loss` equals the saving run's ({with}, {without})",
     FEATURES, _reshard),
    # docs/megatron_features.md: CUDA graphs' step times (run 1: after the capture at step 4)
    ("docs/megatron_features.md", "the z-loss run's median step after the capture was {graph:.0f} ms against "
     "{eager:.0f} ms eager", FEATURES,
     lambda d: (lambda ls: {"graph": _median_after(ls["graph-full_iteration-z"], 4),
                            "eager": _median_after(ls["graph-none-z"], 4)})(_launches(d))),
    # docs/megatron_features.md: FSDP
    ("docs/megatron_features.md", "the later iterations within {later}, and iteration 1's output-layer gradient after "
     "the sync (gathered from its shards) within {ddp} of DDP's", FEATURES,
     lambda d: {"later": _sci(max(_values(d, r"^dp4-fsdp2-\S+: later iterations"))),
                "ddp": _sci(max(_values(d, r"^dp4-fsdp2-\S+: iteration 1's output-layer .* = \S+'s$")))}
     if _bitwise(d, r"^dp4-fsdp2-\S+: iteration 1 (grad norm )?= ") else {}),
    ("docs/megatron_features.md", "DDP's fused-layer gradient is within {g} of its unfused one", FEATURES,
     lambda d: {"g": _sci(max(_values(d, r"^dp4-ddp-fol\S*: iteration 1's output-layer .* = dp4-ddp-z's")))}),
    ("docs/megatron_features.md", "later iterations within {later}, the output layer's gradient after the sync "
     "within {ddp} of DDP's at iterations 1 and 2", FEATURES_RUN5, lambda d: _fsdp(d, "mfsdp")),
    ("docs/megatron_features.md", "DDP within {lo} to {hi} of float64 (Megatron's CE {ce}, the fused layer {fol}), "
     "Megatron-FSDP and torch FSDP2 within {fsdp}", FEATURES_RUN5, _float64),
    # docs/megatron_features.md: checkpoints resumed at another layout
    ("docs/megatron_features.md", "step 5 within {s5} of the run that never stopped, steps 6-8 within {s68} "
     "(`lm loss`, `lm_z_loss`, `lm_lse`, `lm_lse_max`). A checkpoint saved without the flags resumed with them: "
     "step 5's `lm loss` within {with} of the saving run's, `lm_z_loss` logged from the first resumed step; the "
     "reverse: within {without}, no `lm_z_loss`.", FEATURES, _reshard),
    # docs/megatron_features.md: fault tolerance
    ("docs/megatron_features.md", "{lo}-{hi} comparisons per run on GPUs", FEATURES,
     lambda d: (lambda n: {"lo": min(n), "hi": max(n)})(
         [int(re.match(r"(\d+) compared", x).group(1)) for x in _details(d, r"^stats-\S+: every step re-run")])),
    ("docs/megatron_features.md", "exits with status {validate} (\"First rerun: unexpected result is reproducible "
     "within the tolerance (nan = nan)\"; Megatron numbers that step #{step}); `disabled`: Megatron's `RuntimeError` "
     "(\"Unexpected result nan\"), exit status {disabled}.", FEATURES, _nan_verdicts),

    # docs/ascend.md: the TP=4 self-check (the two H200 runs' rows are in __init__.py)
    ("docs/ascend.md", "TP = 4 on four H100s (2026-11-26, {ok} checks each", "bench/results/2026-11-26_4xh100/op_tp/"
     "printed.txt", _selfcheck_tp4),

    # docs/architecture.md: the limits the package tests enforce
    ("docs/architecture.md", "at most {n} imports deep", "tests/package/test_layering.py",
     _constant("MAX_PATCHES_DEPTH")),
    ("docs/architecture.md", "module-level mutable names (at most {n}:", "tests/package/test_module_state.py",
     _constant("MAX_GLOBALS")),

    # examples/README.md: the Megatron-LM launch (its default length, its log line on GPUs), the corpus
    ("examples/README.md", "iteration 3/{total} | ... | lm loss: {lm} | lm_z_loss: {z} | load_balancing_loss: {lb} | "
     "...", MOE_LOG, _moe_log_line),
    ("examples/README.md", "# CPU: gloo over 2 processes, {n} iterations of a tiny MoE",
     "examples/run_megatron_lm_moe.sh",
     lambda text: {"n": re.search(r'^TRAIN_ITERS="\$\{TRAIN_ITERS:-(\d+)\}"', text, re.M).group(1)}),
    ("examples/README.md", "the source and documentation files of {n} pinned PyPI wheels",
     "examples/pypi_text_corpus.json", lambda d: {"n": len(d["wheels"])}),
]
