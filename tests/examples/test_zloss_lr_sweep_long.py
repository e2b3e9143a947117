"""``examples/zloss_lr_sweep.py --quick --phase pilot``: the long runs' plumbing on the CPU. Four real runs of
Megatron's ``pretrain`` (two learning rates x c in {0, 1e-4}, 40 iterations, log interval 4) on a small corpus
of this checkout's own files; the runs at learning rate 1 meet the divergence rule and the sweep stops them
before their last iteration, the others complete; the summary keeps every log line's values and the report
counts them. About 90 s on 2 cores."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import load_example

pytest.importorskip("megatron.training")
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pilot(tmp_path_factory):
    out = tmp_path_factory.mktemp("zloss_pilot")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "zloss_lr_sweep.py"), "--quick", "--phase", "pilot",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    with open(out / "summary.json") as fh:
        return out, json.load(fh), proc.stdout


def test_diverged_runs_stopped_the_others_complete(pilot):
    _, summary, stdout = pilot
    runs = {r["name"]: r for r in summary["runs"]}
    assert len(runs) == 4
    for name, run in runs.items():
        if run["lr"] == 1.0:
            assert run["verdict"] and run["stopped_diverged"] == run["verdict"], name
            assert run["last_step"] < run["steps"] and run["final_validation"] is None
            assert f"{name}: diverged" in stdout
        else:
            assert run["verdict"] is None and run["last_step"] == run["steps"] == 40
            assert run["final_validation"] is not None and run["steps_per_s"] > 0


def test_summary_keeps_every_log_line(pilot):
    _, summary, _ = pilot
    zd = load_example("zloss_divergence")

    for run in summary["runs"]:
        points = zd.run_points(run)
        assert points[0]["step"] == 1 and all(p["step"] % 4 == 0 for p in points[1:])
        assert {"loss", "lse", "lse_max"} <= set(points[0])
        assert ("z_loss" in points[0]) == (run["coeff"] > 0)
        assert zd.divergence(points, max(1, int(run["steps"] * 0.05))) == run["verdict"]  # the same rule afterwards


def test_long_report(pilot, tmp_path):
    out, summary, _ = pilot
    rep = load_example("zloss_sweep_report")

    paths = rep.report_long([summary], str(tmp_path))
    assert all(os.path.getsize(p) > 0 for p in paths.values())
    stats = json.loads(Path(paths["stats"]).read_text())
    by_lr = {row["arm"]["lr"]: row for row in stats["fisher"]}
    assert by_lr[1.0]["diverged"] == by_lr[1.0]["diverged_c0"] == 1 and by_lr[1.0]["p"] == 1.0
    assert by_lr[0.01]["diverged"] == 0 and by_lr[0.01]["decided"] == 1
