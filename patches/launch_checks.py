"""What a user types, checked before Megatron parses it: the ``--lm-*`` flags' names, flag pairs that
contradict each other, and the ``MINDSPEED_CEZ_*`` variables; and how a refusal is reported.

The adaptor's import (``python -m mindspeed_cez.launch`` or ``import mindspeed_cez.megatron_adaptor``)
checks ``sys.argv`` and the environment (:func:`.arguments.check_launch`), whatever the flags turn on:

* an unknown ``--lm-*`` option (a typo, or an abbreviation: Megatron's parser takes none, its
  ``allow_abbrev=False``) is refused naming the closest flag, before Megatron's usage dump;
* ``--lm-fused-ce`` with ``--no-lm-fused-ce`` is refused (argparse would keep the last silently);
* an unknown ``--lm-*`` option spelled with underscores (``--lm_z_loss_coeff``) likewise;
* an unknown ``MINDSPEED_CEZ_*`` variable, a bad value of a known one, or a backend that cannot run
  here is refused naming it (:func:`mindspeed_cez.environment.read_backends`, the same on every route).

:func:`report` prints a refusal as argparse does (``SCRIPT: error: ...``) from the first process only
(``RANK`` 0, else ``LOCAL_RANK`` 0, else a process without either), so that a ``torchrun`` of N ranks
shows it once; every rank then exits with status 2. Under torchrun each rank also writes the line to
torchelastic's error file (``TORCHELASTIC_ERROR_FILE``), so torchrun's failure summary names it as
each rank's cause instead of a link. torchrun itself still prints its failure report (its own
traceback and that summary) and exits with status 1, whatever status its ranks exit with.
"""

import difflib
import json
import os
import signal
import sys
import time

PREFIXES = ("--lm-", "--no-lm-")
CONTRADICTIONS = (("--lm-fused-ce", "--no-lm-fused-ce"),)


def _closest(name, known):
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"did you mean {match[0]}?" if match else "the flags: " + ", ".join(known)


def flag_error(argv, known_flags):
    """The one-line refusal of ``argv``'s unknown ``--lm-*`` options and contradictory pairs, or None.
    Options after a bare ``--`` are the script's own and not read."""
    argv = list(argv)
    if "--" in argv:
        argv = argv[:argv.index("--")]
    names = [token.split("=", 1)[0] for token in argv if token.replace("_", "-").startswith(PREFIXES)]
    for name in names:
        if name not in known_flags:  # underscores are typos too: Megatron's flags take hyphens
            return f"unrecognized argument {name}: {_closest(name.replace('_', '-'), list(known_flags))}"
    for first, second in CONTRADICTIONS:
        if first in names and second in names:
            return f"{first} and {second} contradict each other: keep one"
    return None


def first_process(environ=None):
    """Whether this process prints the launch's refusals: ``RANK`` 0 (torchrun, Megatron's launchers),
    else ``LOCAL_RANK`` 0, else a process started without either (``python SCRIPT``)."""
    environ = os.environ if environ is None else environ
    for variable in ("RANK", "LOCAL_RANK"):
        value = environ.get(variable)
        if value not in (None, ""):
            return value.strip() == "0"
    return True


def report(message, environ=None):
    """Print ``SCRIPT: error: <message>`` (argparse's one line) from the first process and return the
    line. Under torchrun every rank also writes it to its torchelastic error file (torchrun's summary
    then names it), and the other ranks wait for the first one's line (:func:`_wait_for_first_process`)."""
    environ = os.environ if environ is None else environ
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    line = f"{prog}: error: {message}"
    if environ.get("TORCHELASTIC_ERROR_FILE"):
        _write_error_file(environ["TORCHELASTIC_ERROR_FILE"], line)
    if first_process(environ):
        print(line, file=sys.stderr, flush=True)
    elif environ.get("TORCHELASTIC_RUN_ID"):
        _wait_for_first_process()
    return line


def _write_error_file(path, line):
    """torchelastic's error-file format (``ErrorHandler.record_exception``'s fields), with the line in
    place of a Python traceback."""
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass  # torchrun then shows its link in place of the line


# Long enough for the first rank to import torch and Megatron on a loaded host.
WAIT_FOR_FIRST_PROCESS_S = 30.0


def _wait_for_first_process():
    """torchrun stops every rank once one exits: a rank that exits before the first one has printed
    its line would have torchrun kill the first one silently. So the other ranks wait (at most
    :data:`WAIT_FOR_FIRST_PROCESS_S`) for torchrun's SIGTERM, and exit with status 2 on it."""
    def exit_2(signum, frame):
        os._exit(2)

    try:
        signal.signal(signal.SIGTERM, exit_2)
    except ValueError:  # not the main thread: no wait
        return
    time.sleep(WAIT_FOR_FIRST_PROCESS_S)
