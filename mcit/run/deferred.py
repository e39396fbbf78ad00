"""Evaluation beside training (``eval.schedule: deferred``): each committed checkpoint's row is answered by a worker
while the run trains the next task.

The pipeline hands a row over once its method state is on disk (the zero-shot state at the ``zero_shot`` stage,
the export of task t at ``t/commit``) and goes on. A worker is ``mcit-evaluate --run R --worker-row TAG [--follow]``: a
process on this machine (``eval.workers: local``, on the devices of ``eval.devices``) or a Slurm job
(``eval.workers: slurm``, resources from ``eval.slurm``). By default (``eval.worker_follow``) a worker goes on with
the rows committed after its own while the run's launch lives, so a run pays one worker start and one model load,
not one per row; the run starts a worker only when none is alive. It holds an ``flock`` on ``eval/workers/<row>.lock``
while it lives and writes the run's own row file (the row, its answers, its cells) and nothing else; the run
itself writes metrics.json and report.md once every row is in, then marks itself finished. A row's record
(``eval/workers/<row>.json``: launcher, pid or job id, attempt) lets the next launch of the same command tell a
live worker from a dead one: a live one (its lock held, its process alive, its job pending or running) is left to
finish, a dead one whose row is missing is started again, at most ``eval.worker_attempts`` times per launch, so a
cancelled or preempted worker costs a resubmission, never a duplicate.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mcit.core.checkpoint import write_json
from mcit.core.rundir import RunDir, RunDirLock, row_tag

ALIVE_SLURM = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
               "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING"}


class WorkerError(RuntimeError):
    """A row's workers ended without it as often as allowed; one line naming the row and the worker's log."""


def tag_row(tag: str) -> int | None:
    """The checkpoint of a row tag (``zero_shot`` -> None, ``after_task_3`` -> 3)."""
    return None if tag == "zero_shot" else int(tag.rsplit("_", 1)[1])


def worker_lock(run: RunDir, tag: str) -> RunDirLock:
    return RunDirLock(run.root / "eval" / "workers" / f"{tag}.lock")


class Workers:
    """Rank 0's view of a deferred run's evaluation workers."""

    def __init__(self, cfg: Any, run: RunDir, repo: Path | None = None) -> None:
        self.cfg, self.run = cfg, run
        self.where = run.root / "eval" / "workers"
        self.started: dict[str, int] = {}  # this launch's starts per row
        self.repo = repo or Path.cwd()  # where a Slurm worker job starts (the run's paths are absolute)

    def record(self, tag: str) -> dict[str, Any] | None:
        p = self.where / f"{tag}.json"
        try:
            return json.loads(p.read_text()) if p.is_file() else None
        except json.JSONDecodeError:
            return None

    def alive(self, tag: str) -> bool:
        """Whether a worker of ``tag`` is running or still to start (its lock held, its process alive on this host,
        or its Slurm job pending / running)."""
        if worker_lock(self.run, tag).held():
            return True
        rec = self.record(tag)
        if rec is None:
            return False
        if rec.get("launcher") == "slurm":
            return self._slurm_state(str(rec["job"])) in ALIVE_SLURM
        if rec.get("host") != socket.gethostname():
            return False
        try:
            os.kill(int(rec["pid"]), 0)
        except (OSError, ValueError, KeyError):
            return False
        try:  # a pid taken over by another program since is not the worker
            return "--worker-row" in Path(f"/proc/{rec['pid']}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return True

    @staticmethod
    def _slurm_state(job: str) -> str | None:
        try:
            out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return "UNKNOWN"  # squeue unreachable: do not start a second worker on a guess
        if out.returncode != 0:
            return None  # "Invalid job id": ended long enough ago to be forgotten
        state = out.stdout.strip().splitlines()
        return state[0].strip() if state else None

    def ensure(self, tags: list[str]) -> list[str]:
        """Every row of ``tags`` is in, or being answered; starts a worker for each one that is neither (following
        workers, ``eval.worker_follow``: one for the first missing row when no worker is alive; it goes on with the
        rest). Returns the rows still missing."""
        missing = [t for t in tags if not self.run.row(tag_row(t)).is_file()]
        if self.cfg.eval.worker_follow:
            if missing and not any(self.alive(t) for t in tags):
                first = next((t for t in missing if not self.run.row(tag_row(t)).is_file()), None)
                if first is not None:  # (a worker may have written them all and ended meanwhile)
                    self.start(first)
            return missing
        for tag in missing:
            if self.alive(tag):
                continue
            if not self.run.row(tag_row(tag)).is_file():  # the worker may have written it and ended meanwhile
                self.start(tag)
        return missing

    def start(self, tag: str) -> None:
        n = self.started.get(tag, 0)
        limit = self.cfg.eval.worker_attempts
        if n >= limit:
            rec = self.record(tag) or {}
            raise WorkerError(f"row {tag}: {n} evaluation worker(s) ended without writing it (last log: "
                              f"{rec.get('log', '?')}); fix what the log says, then re-run the same command")
        self.started[tag] = n + 1
        self.where.mkdir(parents=True, exist_ok=True)
        attempt = (self.record(tag) or {}).get("attempt", 0) + 1
        log = self.run.logs / f"eval_worker.{tag}.{attempt}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        rec: dict[str, Any] = {"row": tag, "attempt": attempt, "launcher": self.cfg.eval.workers, "log": str(log),
                               "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        if self.cfg.eval.workers == "slurm":
            rec["job"] = self._sbatch(tag, log)
        else:
            rec["pid"] = self._spawn(tag, log)
        write_json(self.where / f"{tag}.json", rec)
        where = f"Slurm job {rec['job']}" if "job" in rec else f"pid {rec['pid']}"
        print(f"row {tag}: evaluation worker started ({where}, attempt {attempt}; log {log})", file=sys.stderr,
              flush=True)

    def _command(self, tag: str) -> list[str]:
        args = ["--run", str(self.run.root), "--worker-row", tag,
                *(["--follow"] if self.cfg.eval.worker_follow else [])]
        n = self.cfg.eval.worker_nproc
        if n == 1 or self.cfg.eval.workers == "slurm":  # srun starts the ranks of a Slurm worker
            return [sys.executable, "-m", "mcit.cli.evaluate", *args]
        from mcit.core.distributed import free_port

        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port",
                str(free_port()), "-m", "mcit.cli.evaluate", *args]

    def _spawn(self, tag: str, log: Path) -> int:
        env = worker_env()
        if self.cfg.eval.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cfg.eval.devices
        with open(log, "ab") as out:
            proc = subprocess.Popen(self._command(tag), stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=self.repo, start_new_session=True)  # outlives this launch if it must
        return proc.pid

    def _sbatch(self, tag: str, log: Path) -> str:
        s = self.cfg.eval.slurm
        opts = ["--parsable", "--job-name", f"mcit-eval-{tag}", "--output", str(log), "--open-mode=append",
                "--nodes", str(s.nodes), "--ntasks-per-node", str(self.cfg.eval.worker_nproc),
                "--chdir", str(self.repo)]
        if s.gpus_per_node:
            opts += [f"--gres=gpu:{s.gpus_per_node}"]
        if s.time:
            opts += ["--time", s.time]
        if s.partition:
            opts += ["--partition", s.partition]
        script = Path(__file__).resolve().parents[2] / "pipelines" / "slurm" / "eval_row.sbatch"
        cmd = ["sbatch", *opts, *s.sbatch_args, str(script), str(self.run.root), tag,
               *(["--follow"] if self.cfg.eval.worker_follow else [])]
        env = {k: v for k, v in worker_env().items()  # nor this job's allocation, nor its devices
               if (not k.startswith("SLURM_") or k == "SLURM_CONF") and k != "CUDA_VISIBLE_DEVICES"}
        env["MCIT_PYTHON"] = sys.executable
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=self.repo)
        if out.returncode != 0:
            raise WorkerError(f"row {tag}: sbatch refused the evaluation job ({out.stderr.strip()[:300]}); "
                              f"command: {' '.join(cmd)}")
        return out.stdout.strip().split(";")[0]


RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "CROSS_RANK", "CROSS_SIZE",
                  "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def worker_env() -> dict[str, str]:
    """This process's environment without its launcher's rank variables: a worker is a job of its own (with the
    rank 0's RANK / WORLD_SIZE it waited for ranks that never come)."""
    return {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}


def row_tags(plan: Any, done: int) -> list[str]:
    """The rows a deferred run has handed over after ``done`` committed tasks."""
    tags = [row_tag(None)] if plan.cfg.eval.zero_shot else []
    return tags + [row_tag(t) for t in range(done)]


def committed_rows(plan: Any, completed: list[str]) -> list[str]:
    """The rows whose method state is committed, given a state file's completed stages."""
    return ((["zero_shot"] if "zero_shot" in completed else [])
            + [row_tag(t) for t in range(plan.num_stages) if f"{t}/commit" in completed])


WAIT = "wait"


def next_row(plan: Any) -> str | None:
    """A following worker's next row, from one look (rank 0): the first committed row that is neither in nor held
    by another worker; ``WAIT`` while the run's launch lives (it holds ``run.lock``) and may commit more; None once
    every row is in, the run is finished, or the launch is gone with nothing committed left (the next launch starts
    a worker of its own)."""
    run = plan.run
    state = run.read_state() or {}
    for tag in committed_rows(plan, state.get("completed", [])):
        if not run.row(tag_row(tag)).is_file() and not worker_lock(run, tag).held():
            return tag
    if state.get("finished") or all(run.row(tag_row(t)).is_file() for t in row_tags(plan, plan.num_stages)):
        return None
    return WAIT if run.lock.held() else None


def take_over(run: RunDir, tag: str, first: str, log: Path | None) -> None:
    """The record of a row a following worker took on after ``first``: this process (or this Slurm job) answers
    it, so the run's launch sees it alive and starts no other."""
    where = run.root / "eval" / "workers"

    def read(name: str) -> dict[str, Any]:
        try:
            return json.loads((where / f"{name}.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    old = read(tag)
    log = Path(read(first)["log"]) if read(first).get("log") else log  # the log its starter gave it (its output)
    job = os.environ.get("SLURM_JOB_ID")
    rec: dict[str, Any] = {"row": tag, "attempt": int(old.get("attempt", 0)) + 1,
                           "launcher": "slurm" if job else "local", "log": str(log) if log else None,
                           "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "followed": first}
    rec.update({"job": job} if job else {"pid": os.getpid()})
    where.mkdir(parents=True, exist_ok=True)
    write_json(where / f"{tag}.json", rec)
