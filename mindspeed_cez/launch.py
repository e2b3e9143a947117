"""Run a pretraining script with the adaptor, changing no Python file.

    python -m mindspeed_cez.launch SCRIPT [ARGS...]
    torchrun --nproc-per-node 8 ... -m mindspeed_cez.launch SCRIPT [ARGS...]

Runs SCRIPT as ``python SCRIPT ARGS`` would (as ``__main__``, ``sys.argv == [SCRIPT, *ARGS]``,
SCRIPT's folder first on ``sys.path``), with ``import mindspeed_cez.megatron_adaptor`` done
first, as if it were SCRIPT's first line. That import imports nothing of Megatron or MindSpeed, so
MindSpeed-LLM's ``pretrain_gpt.py`` (whose ``from mindspeed_llm import megatron_adaptor`` then
runs) and Megatron-LM's take ``--lm-z-loss-coeff`` and the other flags unchanged.

``python -m mindspeed_cez.launch --help`` lists the flags with their defaults; ``SCRIPT --help``
lists them first, then runs SCRIPT's own ``--help``.
"""

import os
import runpy
import sys

USAGE = "usage: python -m mindspeed_cez.launch SCRIPT [ARGS...]   (or torchrun ... -m mindspeed_cez.launch SCRIPT ARGS)"


def _flags_help():
    from mindspeed_cez.patches.arguments import flags_help

    return flags_help()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        if not argv:
            print(USAGE, file=sys.stderr)
            return 2
        print(f"{USAGE}\n\nRuns SCRIPT with the fused LM loss available; SCRIPT takes these flags too.\n\n{_flags_help()}")
        return 0
    script = argv[0]
    if not os.path.isfile(script):
        print(f"mindspeed_cez.launch: SCRIPT {script!r} is not a file\n{USAGE}", file=sys.stderr)
        return 2
    if "-h" in argv[1:] or "--help" in argv[1:]:
        print(_flags_help() + "\n", flush=True)  # before SCRIPT's own --help (which may fail)
    sys.argv = [script, *argv[1:]]  # the adaptor reads the flags from here when there is no Megatron parser
    folder = os.path.dirname(os.path.abspath(script))
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path[0] = folder  # python -m put the working directory there; python SCRIPT puts SCRIPT's folder
    else:
        sys.path.insert(0, folder)
    import mindspeed_cez.megatron_adaptor  # noqa: F401

    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
