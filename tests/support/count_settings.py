"""Run a command as ``python`` would, counting the adaptor's :class:`Settings` built and activated.

    python tests/support/count_settings.py -m MODULE ARGS...   (e.g. -m mindspeed_cez.launch SCRIPT ARGS)
    python tests/support/count_settings.py SCRIPT ARGS...

At exit it writes ``cez-settings rank=R built=N activated=M same=S`` (one write call): N Settings constructed in this
process, M distinct Settings made active (None not counted), S whether every one made active is the
first one built.
Imports nothing of Megatron before the command does (the adaptor's settings module imports none).
"""

import atexit
import os
import runpy
import sys

from mindspeed_cez.patches import runtime, settings

BUILT, ACTIVATED = [], []
_init, _set_active = settings.Settings.__init__, runtime.set_active


def _counted_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    BUILT.append(self)


def _recorded_set_active(value):
    if value is not None and not any(value is s for s in ACTIVATED):
        ACTIVATED.append(value)
    _set_active(value)


settings.Settings.__init__ = _counted_init
runtime.set_active = _recorded_set_active


@atexit.register
def _report():
    same = bool(BUILT) and all(s is BUILT[0] for s in ACTIVATED)
    rank = os.environ.get("RANK", "-")
    line = f"cez-settings rank={rank} built={len(BUILT)} activated={len(ACTIVATED)} same={same}\n"
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())  # one write: whole even where ranks share the pipe (print split it)


def main():
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
