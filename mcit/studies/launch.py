"""Running a sweep's points: one after another through a local launcher, or as one Slurm job array; each
launch is recorded in ``<out>/attempts.jsonl`` (the latest per point explains a failure in the tables)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mcit.core.checkpoint import atomic_write_text
from mcit.studies.spec import Point, SweepSpec, finished

ROOT = Path(__file__).resolve().parents[2]


def record_attempt(out: Path, entry: dict[str, Any]) -> None:
    """Append one launch record to ``<out>/attempts.jsonl`` (the latest per point explains a failure)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "attempts.jsonl", "a") as f:
        f.write(json.dumps({**entry, "time": time.time()}) + "\n")


def last_attempts(out: Path) -> dict[str, dict]:
    p = out / "attempts.jsonl"
    if not p.is_file():
        return {}
    last: dict[str, dict] = {}
    for line in p.read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill: ignore it
        last[e["point"]] = e
    return last


def local_command(point: Point, launcher: str, nproc: int) -> list[str]:
    from mcit.core.distributed import free_port

    entry = str(ROOT / "pipelines" / "run_task_sequence.py")
    if launcher == "deepspeed":
        return [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
                "--master_port", str(free_port()), entry, "--config", str(point.config_path)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port()), entry, "--config", str(point.config_path)]
    if launcher == "python":
        return [sys.executable, "-u", entry, "--config", str(point.config_path)]
    raise ValueError(f"unknown launcher {launcher!r}")


def run_local(spec: SweepSpec, points: list[Point], *, launcher: str = "deepspeed", nproc: int = 1,
              echo=print) -> dict[str, int]:
    """Run every unfinished point, one after another, each through ``launcher``; a failed point is
    recorded and the sweep goes on. Returns {point: exit code} of what ran."""
    out = spec.out_dir()
    todo = [p for p in points if not finished(p)]
    echo(f"sweep {spec.resolved_name}: {len(points)} points, {len(points) - len(todo)} finished, "
         f"{len(todo)} to run ({launcher}, {nproc} process(es) each)")
    codes: dict[str, int] = {}
    for i, p in enumerate(todo, 1):
        log = out / "logs" / f"{p.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = local_command(p, launcher, nproc)
        t0 = time.time()
        with open(log, "a") as f:
            f.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=Path.cwd(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait()
            except KeyboardInterrupt:  # stop the whole launcher tree; the run resumes on the next sweep
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
                record_attempt(out, {"point": p.name, "launcher": launcher, "rc": "interrupted", "log": str(log)})
                raise
        codes[p.name] = rc
        record_attempt(out, {"point": p.name, "launcher": launcher, "rc": rc, "log": str(log),
                             "seconds": round(time.time() - t0, 1)})
        status = "done" if rc == 0 and finished(p) else f"FAILED (exit {rc}; log {log})"
        echo(f"[{i}/{len(todo)}] {p.name}: {status} in {time.time() - t0:.1f} s")
    return codes


def submit_slurm(spec: SweepSpec, points: list[Point], *, throttle: int | None = None, sbatch_args: list[str] = (),
                 env: dict[str, str] | None = None, echo=print) -> tuple[str | None, list[Point]]:
    """One array job over the unfinished points (``pipelines/slurm/sweep_array.sbatch``, ``%throttle``
    tasks at a time). Returns (job id, the points in array-index order); (None, []) when all finished."""
    out = spec.out_dir().resolve()
    todo = [p for p in points if not finished(p)]
    if not todo:
        echo(f"sweep {spec.resolved_name}: all {len(points)} points finished; nothing to submit")
        return None, []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    listing = out / "slurm" / f"array-{stamp}-{os.getpid()}.txt"
    atomic_write_text(listing, "".join(f"{p.config_path.resolve()}\n" for p in todo))
    array = f"0-{len(todo) - 1}" + (f"%{throttle}" if throttle else "")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    cmd = ["sbatch", "--parsable", f"--array={array}", f"--job-name=mcit-sweep-{spec.resolved_name}",
           f"--output={out / 'logs' / 'slurm-%A_%a.out'}", *sbatch_args,
           str(ROOT / "pipelines" / "slurm" / "sweep_array.sbatch"), str(listing)]
    res = subprocess.run(cmd, cwd=Path.cwd(), env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"sbatch failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
    job = res.stdout.strip().split(";")[0]
    for i, p in enumerate(todo):
        record_attempt(out, {"point": p.name, "launcher": "slurm", "job": f"{job}_{i}", "rc": None,
                             "log": str(out / "logs" / f"slurm-{job}_{i}.out")})
    echo(f"sweep {spec.resolved_name}: submitted array job {job} ({len(todo)} points, --array={array}); "
         f"{len(points) - len(todo)} already finished")
    return job, todo


def wait_slurm(job: str, *, env: dict[str, str] | None = None, poll_s: float = 2.0, echo=print) -> None:
    """Block until no task of array job ``job`` is left in the queue (requeued tasks included)."""
    last = None
    while True:
        res = subprocess.run(["squeue", "-h", "-r", "-j", job, "-o", "%i %T"], env=env, capture_output=True, text=True)
        lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
        if res.returncode != 0 and "Invalid job id" not in res.stderr:
            raise RuntimeError(f"squeue failed: {res.stderr.strip()[-300:]}")
        if not lines:
            return
        if len(lines) != last:
            echo(f"array job {job}: {len(lines)} task(s) queued or running")
            last = len(lines)
        time.sleep(poll_s)
