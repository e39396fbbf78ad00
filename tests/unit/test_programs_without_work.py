"""Every program given nothing to do prints its usage and exits 2 (``python -m mcit.cli.study`` with no
arguments used to do nothing and exit 0; ``python -m mcit.cli.run`` had no ``__main__`` and did nothing at all);
``mcit-report`` over a glob that catches an unfinished run reports the rest and names it."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the programs that need an input to do anything (the embedded builders digits / tiny_mcit / pretrain_vit /
# pretrain_clip have defaults: given nothing, they build the embedded benchmark)
PROGRAMS = ["mcit.cli.run", "mcit.cli.evaluate", "mcit.cli.sweep", "mcit.cli.report", "mcit.cli.study",
            *(f"data_prep.{m}" for m in ("answer_styles", "cifar100", "coin", "convert_llava", "cub200", "domainnet",
                                         "imagenet_r", "llava_json", "llava_mix", "mllm_acl", "mllm_dcl", "ucit",
                                         "pretrain_tiny_llava"))]


@pytest.mark.parametrize("module", PROGRAMS)
def test_a_program_given_no_work_prints_its_usage_and_exits_2(module, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no data/ here: pretrain_tiny_llava's default shards are missing
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main([])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" in err, err
    assert not any(tmp_path.iterdir())  # nothing written


def test_every_command_module_runs_as_python_m():
    """Each program under mcit/cli/ runs as ``python -m mcit.cli.<name>`` (one is checked launched)."""
    mods = [p for p in (ROOT / "mcit" / "cli").glob("*.py") if p.stem not in ("__init__", "common")]
    assert len(mods) >= 5
    assert [p.name for p in mods if 'if __name__ == "__main__"' not in p.read_text()] == []
    r = subprocess.run([sys.executable, "-m", "mcit.cli.run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "usage:" in r.stderr, r.stderr


def _run_dir(root: Path, name: str, finished: bool) -> Path:
    """A run directory as the pipeline leaves it (finished, or stopped after task 0's commit)."""
    d = root / name
    (d / "eval").mkdir(parents=True)
    (d / "config.yaml").write_text("name: x\n")
    completed = ["zero_shot", "0/train", "0/eval", "0/commit"] + (["1/train", "1/eval", "1/commit"] if finished else [])
    (d / "state.json").write_text(json.dumps({"completed": completed, "finished": finished}))
    m = {"name": name, "method": "l2p", "tasks": ["a", "b"], "acc_matrix": [[90.0], [80.0, 70.0]], "complete": True,
         "zero_shot": None, "test_counts": [10, 10], "final_avg_acc": 75.0}
    if finished:
        (d / "metrics.json").write_text(json.dumps(m))
    return d


def test_report_leaves_out_and_names_unfinished_runs(tmp_path, capsys):
    from mcit.cli.report import main

    done, going = _run_dir(tmp_path, "done", True), _run_dir(tmp_path, "going", False)
    assert main([str(done), str(going), str(tmp_path / "stray")]) == 0
    out = capsys.readouterr()
    assert "== done (l2p) ==" in out.out and "going" not in out.out
    skipped = out.err.strip().splitlines()
    assert skipped == [f"skipped {going}: unfinished (state.json ends at stage 0/commit)",
                       f"skipped {tmp_path / 'stray'}: not a run directory"]
    assert main([str(going)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no finished run to report") and str(going) in err[0]
