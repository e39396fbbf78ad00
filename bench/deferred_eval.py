#!/usr/bin/env python
"""Evaluation beside training: wall(deferred) / wall(inline) of one task sequence on a Slurm cluster, in one run.

The same config twice through ``pipelines/slurm/one_node.sbatch`` (one rank, ``MCIT_GPUS_PER_NODE``, on node n1):
inline (``eval.schedule: inline``: every row answered in the run's own eval stage), then deferred
(``eval.schedule: deferred``, ``eval.workers: slurm``: each committed checkpoint's row answered on node n2 while
the run trains on, by one job that follows the commits, ``eval.worker_follow``). Wall = submission to the end of
the run's job (the deferred run's job ends when every row is in). Prints both walls, the ratio (target <= 0.75
for the embedded 4-task MCIT sequence: its rows cost about as much as its training) and whether the two runs'
matrices, zero-shot rows and metrics are equal
(the bench stops if not).

    python bench/deferred_eval.py [--config configs/tiny_mcit_lora.yaml] [--out DIR] [key=value ...]

Needs a Slurm cluster with nodes n1 and n2: ``SLURM_CONF`` pointing at one, else the project's localhost cluster
(``tests/launch/slurm/cluster.sh``: Debian's slurm-wlm, 2 simulated nodes, root) is brought up and down here. The
default config needs ``make data`` (the embedded MCIT benchmark and the tiny LLaVA). On a 2-core machine each
run's rank and each evaluation job take one core: the deferred run's evaluation has its own core, as it has its
own node on a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _job(env: dict[str, str], job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def _run(env: dict[str, str], config: Path, out: Path, name: str, overrides: list[str]) -> float:
    """Submit one run, wait for its job; the wall from submission to the job's end (seconds)."""
    t0 = time.time()
    sub = subprocess.run(["sbatch", "--parsable", "-w", "n1", "--output", str(out / f"slurm-{name}-%j.out"),
                          str(ROOT / "pipelines" / "slurm" / "one_node.sbatch"), str(config), f"name={name}",
                          f"run_dir={out / name}", *overrides], env=env, cwd=ROOT, capture_output=True, text=True)
    if sub.returncode != 0:
        raise SystemExit(f"sbatch refused the {name} run: {sub.stderr.strip()}")
    job = sub.stdout.strip().split(";")[0]
    while True:
        state = _job(env, job).get("JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            break
        time.sleep(0.5)
    wall = time.time() - t0
    if state != "COMPLETED":
        log = next(out.glob(f"slurm-{name}-{job}.out"), None)
        raise SystemExit(f"the {name} run's job {job} ended {state}: {log.read_text()[-2000:] if log else ''}")
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_mcit_lora.yaml"))
    ap.add_argument("--out", default=None, help="where the two runs go (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for both runs")
    args = ap.parse_args()
    env = {**os.environ, "MCIT_GPUS_PER_NODE": "1", "MCIT_PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "CUDA_VISIBLE_DEVICES": ""}
    cluster = None
    with tempfile.TemporaryDirectory(prefix="mcit-bench-deferred-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o711)  # munged needs o+x on every parent of the cluster's directory
        if not env.get("SLURM_CONF"):
            cluster = Path(tmp) / "slurm"
            cluster.mkdir()
            up = subprocess.run(["bash", str(ROOT / "tests" / "launch" / "slurm" / "cluster.sh"), "up", str(cluster),
                                 "2"], capture_output=True, text=True, timeout=900)
            if up.returncode != 0:
                raise SystemExit(f"the localhost Slurm did not come up: {up.stderr[-1500:]}")
            env["SLURM_CONF"] = up.stdout.strip().splitlines()[-1]
        try:
            out = Path(args.out).resolve() if args.out else Path(tmp) / "runs"
            out.mkdir(parents=True, exist_ok=True)
            inline = _run(env, Path(args.config), out, "inline", ["eval.schedule=inline", *args.overrides])
            deferred = _run(env, Path(args.config), out, "deferred",
                            ["eval.schedule=deferred", "eval.workers=slurm", "eval.slurm.sbatch_args=[-w,n2]",
                             *args.overrides])
            a = json.loads((out / "inline" / "metrics.json").read_text())
            b = json.loads((out / "deferred" / "metrics.json").read_text())
            same = all(a[k] == b[k] for k in ("acc_matrix", "zero_shot", "final_avg_acc", "forgetting",
                                              "first_task_loss"))
            jobs = [json.loads(p.read_text()) for p in sorted((out / "deferred" / "eval" / "workers").glob("*.json"))]
            print(f"config {args.config} ({len(a['tasks'])} tasks, rows: {len(jobs)}), 1 rank per run, "
                  f"evaluation jobs on n2")
            print(f"inline   wall {inline:7.1f} s  final_avg_acc {a['final_avg_acc']:.2f}")
            print(f"deferred wall {deferred:7.1f} s  final_avg_acc {b['final_avg_acc']:.2f}  "
                  f"({len({j['job'] for j in jobs})} evaluation job(s) for {len(jobs)} rows)")
            print(f"wall(deferred) / wall(inline) = {deferred / inline:.3f} (target <= 0.75); matrices, zero-shot "
                  f"rows and metrics {'equal' if same else 'DIFFER'}")
            return 0 if same else 1
        finally:
            if cluster is not None:
                subprocess.run(["bash", str(ROOT / "tests" / "launch" / "slurm" / "cluster.sh"), "down",
                                str(cluster)], capture_output=True, text=True, timeout=300)


if __name__ == "__main__":
    raise SystemExit(main())
