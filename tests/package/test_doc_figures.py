"""Every figure README.md and docs/ quote from a results file equals what that file yields (doc_figures.ROWS),
and the results tree holds what the docs cite: a README per folder, no run-by-run logs."""
import importlib.util
import json
import os
import re

import pytest

from support.doc_figures import ROWS
from support.doc_figures.results_files import ROOT, load

RESULTS = os.path.join(ROOT, "bench", "results")


def _text(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return " ".join(fh.read().split())


def _source(name):
    """A committed results file (JSON parsed, any other file as text) or a bench/ module by name."""
    if os.path.isfile(os.path.join(ROOT, name)):
        return load(name)
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _passage(row):
    doc, template, source, compute = row
    return " ".join(template.format(**compute(_source(source))).split())


@pytest.mark.parametrize("row", ROWS, ids=[f"{r[0]}:{r[1][:40]}" for r in ROWS])
def test_figure_matches_its_source(row):
    passage = _passage(row)
    assert passage in _text(row[0]), f"{row[0]} does not say, as {row[2]} yields: {passage!r}"


def test_a_drifted_figure_fails():
    """The check can fail: the table with one digit changed is not found."""
    row = ROWS[0]
    passage = _passage(row)
    drifted = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), passage, count=1)
    assert drifted != passage and drifted not in _text(row[0])


def test_readme_is_short():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        assert len(fh.read().splitlines()) <= 160


def _cited():
    texts = [_text("README.md")]
    for base, _, files in os.walk(os.path.join(ROOT, "docs")):
        texts += [_text(os.path.relpath(os.path.join(base, f), ROOT)) for f in files if f.endswith(".md")]
    return " ".join(texts)


def test_results_folders_are_cited_and_described():
    """Each results folder is cited by README or docs (directly, or through the README of a folder they cite)
    and has a README; no development log lies in the tree."""
    cited = _cited()
    folders = sorted(f for f in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, f)))
    readmes = {f: _text(os.path.join("bench", "results", f, "README.md")) for f in folders
               if os.path.exists(os.path.join(RESULTS, f, "README.md"))}
    assert sorted(readmes) == folders, f"results folders without a README: {sorted(set(folders) - set(readmes))}"
    direct = {f for f in folders if f in cited}
    through = {f for f in folders for g in direct if f != g and f in readmes[g]}
    assert direct | through == set(folders), f"results folders no doc cites: {sorted(set(folders) - direct - through)}"
    for name in ("GPU_RUNS.md", "what_ran_where.md", "archive"):
        assert not os.path.exists(os.path.join(RESULTS, name))
    patches = [os.path.join(b, f) for b, _, fs in os.walk(RESULTS) for f in fs if f.endswith(".patch")]
    assert not patches


def test_claims_file_is_what_the_script_prints():
    """claims.json, which the z-loss figures cite, is examples/zloss_claims.py's output on the raw summaries."""
    spec = importlib.util.spec_from_file_location("zloss_claims", os.path.join(ROOT, "examples", "zloss_claims.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    summaries = []
    for path in (module.PILOT, module.STUDY):
        with open(path) as fh:
            summaries.append(json.load(fh))
    with open(os.path.join(ROOT, "bench", "results", "2026-11-28_zloss_study_4xh200", "claims.json")) as fh:
        assert json.loads(json.dumps(module.claims(summaries))) == json.load(fh)


def test_relative_links_resolve():
    docs = ["README.md", "examples/README.md", "bench/results/README.md"] + [
        os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")]
    broken = []
    for doc in docs:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as fh:
            for target in re.findall(r"\]\(([^)#\s]+)", fh.read()):
                if not target.startswith(("http://", "https://")) and not os.path.exists(
                        os.path.join(ROOT, os.path.dirname(doc), target)):
                    broken.append(f"{doc}: {target}")
    assert not broken
