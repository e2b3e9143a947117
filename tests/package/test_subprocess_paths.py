"""Megatron the way Megatron-LM's and MindSpeed-LLM's users run it is a source checkout on ``PYTHONPATH``:
every subprocess the tests, benchmarks, examples and CI start extends ``PYTHONPATH``, never replaces it
(a replaced path drops that Megatron, and the import hook then reports megatron-core missing)."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDERS = ("tests", "bench", "examples", ".ci")
SKIP = (os.path.join("bench", "results"),)  # records of past runs, kept as they ran
# a Python assignment (``PYTHONPATH=...`` keyword, ``"PYTHONPATH": ...``) or a shell one; not prose (``PYTHONPATH=<dir>``)
PY_SET = re.compile(r"""PYTHONPATH["']?\s*[:=](?!<)""")
SH_SET = re.compile(r"""\bPYTHONPATH=(?!<)""")


def _sources():
    for folder in FOLDERS:
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            if any(os.path.relpath(root, REPO).startswith(s) for s in SKIP):
                continue
            for name in files:
                if os.path.join(root, name) == os.path.abspath(__file__):
                    continue  # this check's own patterns and samples
                if name.endswith((".py", ".sh")) or name == "run":
                    yield os.path.join(root, name)


def replaced_paths():
    """``file:line: text`` of every line that sets PYTHONPATH without what it held."""
    found = []
    for path in _sources():
        is_py = path.endswith(".py")
        for number, line in enumerate(open(path, encoding="utf-8"), 1):
            if (PY_SET if is_py else SH_SET).search(line) is None:
                continue
            keeps = ('os.environ.get("PYTHONPATH"' in line or "sys.path" in line) if is_py else (
                "$PYTHONPATH" in line or "${PYTHONPATH" in line)
            if not keeps:
                found.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    return found


def test_subprocesses_extend_pythonpath():
    assert replaced_paths() == []


def test_the_check_sees_a_replaced_path(tmp_path, monkeypatch):
    """The check itself: a subprocess environment that replaces the path is found."""
    folder = tmp_path / "tests"
    folder.mkdir()
    (folder / "test_x.py").write_text('env = dict(os.environ, PYTHONPATH=repo)\n')
    (folder / "run.sh").write_text('export PYTHONPATH=$SITE\n')
    monkeypatch.setattr(__import__(__name__), "REPO", str(tmp_path))
    assert sorted(line.split(":")[0] for line in replaced_paths()) == ["tests/run.sh", "tests/test_x.py"]
