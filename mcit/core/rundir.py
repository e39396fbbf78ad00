"""The run directory's layout: the one object that knows where every file of a run lives.

::

    <run_dir>/
      config.yaml                        the resolved config (a re-run must match it)
      backbone.json                      tag, format, source, sha256 of the backbone (and auxiliary ones)
      state.json                         the commit point: completed stages, current method state
      metrics.json  report.md  report.html  acc_matrix.png
      PREEMPT                            a stop request (written by the Slurm scripts' trap)
      logs/train.jsonl                   the training log (rank 0; each record with its global_step)
      logs/trackers.json  logs/tb/  logs/wandb/  logs/mlruns/   the trackers of log.report_to: their run ids,
                                         TensorBoard's events, W&B's and MLflow's local stores
      eval/zero_shot.json                accuracy-matrix rows: the zero-shot row ...
      eval/after_task_<t>.json           ... and the row after each task
      eval/answers/<row>/<task>.jsonl    generated answers (instruction tasks; <task>.metrics.json: a
                                         corpus scorer's metrics, e.g. CIDEr)
      eval/evaluate/                     evaluation-only passes (pipelines/evaluate.py), same layout
      eval/cells/<d[:2]>/<d>/            evaluation cells (mcit.run.cells): answers.jsonl + cell.json, or chunks/
                                         while one is answered (eval.cells may put the store elsewhere)
      eval/rescored/<time>/              the rows, metrics.json, report.md a --rescore replaced
      checkpoints/current.safetensors    the method state the last committed stage left
      checkpoints/zero_shot/method.safetensors  the state the zero-shot row was evaluated in
      checkpoints/task_<t>/method.safetensors + method.json   the export after task t
      checkpoints/task_<t>/steps[.<phase>]/                    DeepSpeed step checkpoints of a task

The Slurm job scripts (pipelines/slurm/common.sh) write ``PREEMPT`` and put the launcher's logs in ``logs/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ZERO_SHOT = "zero_shot"
# What the project itself puts in a run directory before the run writes its config: the Slurm scripts' launcher
# logs and hostfiles (logs/), the run lock, a stop request (PREEMPT), a config write killed half-way. A start
# killed at any of those moments leaves only these, and the same command then starts the run there.
OWN_BEFORE_CONFIG = ("logs", "run.lock", "PREEMPT")


def own_before_config(name: str) -> bool:
    """Whether a file of that name in a run directory without config.yaml is one of the project's own."""
    return name in OWN_BEFORE_CONFIG or name.startswith(".config.yaml.tmp")


class RunDirError(ValueError):
    """The run directory belongs to a different run; one line."""


def row_tag(trained: int | None) -> str:
    """The name of an accuracy-matrix row: after task ``trained``, or the zero-shot row (None)."""
    return ZERO_SHOT if trained is None else f"after_task_{trained}"


class RunDirLock:
    """One live run per run directory: an exclusive ``flock`` on ``<run_dir>/run.lock`` held by rank 0 for the
    run's lifetime. The kernel drops it when the process ends, however it ends (SIGKILL, OOM, a node's job
    cancelled), so a killed or requeued run never needs a hand clean-up. The file names the holder (host,
    pid, Slurm job) for the second launch's message. flock is per host: on a shared file system it excludes
    across nodes only where that file system supports it (NFSv4, Lustre with flock; GPFS)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; None on success, else a one-line description of the holder."""
        import fcntl
        import os
        import socket
        import time

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            try:
                holder = json.loads(self.path.read_text() or "{}")
            except (OSError, json.JSONDecodeError):
                holder = {}
            job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
            return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}{job}, since "
                    f"{holder.get('since', '?')}")
        info = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return None

    def held(self) -> bool:
        """Whether another process holds the lock now (a probe: nothing is written, the lock is not kept)."""
        import fcntl
        import os

        if not self.path.is_file():
            return False
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)  # closing drops a lock the probe took
        return False

    def release(self) -> None:
        import os

        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


class RunDir:
    """Paths of one run directory (nothing is created until something is written)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    # -- files at the top ----------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def lock(self) -> RunDirLock:
        return RunDirLock(self.root / "run.lock")

    @property
    def backbone(self) -> Path:
        return self.root / "backbone.json"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def report(self) -> Path:
        return self.root / "report.md"

    @property
    def heatmap(self) -> Path:
        return self.root / "acc_matrix.png"

    @property
    def preempt_request(self) -> Path:
        return self.root / "PREEMPT"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def train_log(self) -> Path:
        return self.logs / "train.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.logs / "tb"

    # -- evaluation rows -------------------------------------------------------------------------------
    def eval_dir(self, evaluate_only: bool = False) -> Path:
        """Where rows go: the run's own ``eval/``, or ``eval/evaluate/`` for evaluation-only passes."""
        return self.root / "eval" / "evaluate" if evaluate_only else self.root / "eval"

    def row(self, trained: int | None, evaluate_only: bool = False) -> Path:
        return self.eval_dir(evaluate_only) / f"{row_tag(trained)}.json"

    def answers(self, trained: int | None, evaluate_only: bool = False) -> Path:
        """The directory of one row's generated answers (``<task index>.jsonl`` inside)."""
        return self.eval_dir(evaluate_only) / "answers" / row_tag(trained)

    def rows_done(self, num_tasks: int) -> int:
        """How many consecutive after-task rows exist, from task 0."""
        done = 0
        while done < num_tasks and self.row(done).is_file():
            done += 1
        return done

    # -- checkpoints -----------------------------------------------------------------------------------
    CURRENT_STATE = "checkpoints/current.safetensors"  # relative: state.json records it by this name

    @property
    def current_state(self) -> Path:
        return self.root / self.CURRENT_STATE

    @property
    def zero_shot_state(self) -> Path:
        """The method state the zero-shot row was evaluated in (an evaluation-only pass loads it: the same cells)."""
        return self.root / "checkpoints" / "zero_shot" / "method.safetensors"

    def task_dir(self, task: int) -> Path:
        return self.root / "checkpoints" / f"task_{task}"

    def task_state(self, task: int) -> Path:
        return self.task_dir(task) / "method.safetensors"

    def task_info(self, task: int) -> Path:
        return self.task_dir(task) / "method.json"

    def step_dir(self, task: int, phase: str = "") -> Path:
        return self.task_dir(task) / ("steps" + (f".{phase}" if phase else ""))

    def step_dirs(self, task: int) -> list[Path]:
        return sorted(self.task_dir(task).glob("steps*"))

    def exported_tasks(self) -> list[int]:
        """Tasks with an exported method state, in order."""
        exports = self.root.glob("checkpoints/task_*/method.safetensors")
        return sorted(int(p.parent.name.split("_", 1)[1]) for p in exports)

    # -- status ----------------------------------------------------------------------------------------
    def _json(self, path: Path) -> Any:
        """A run file's JSON; one that is not (edited by hand, written by something else) is named."""
        try:
            return json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RunDirError(f"{path} is not valid JSON ({e}): the run writes it by rename, so something else "
                              f"changed it; restore it, or start again in another run_dir") from None

    def read_state(self) -> dict[str, Any] | None:
        st = self._json(self.state) if self.state.is_file() else None
        if st is not None and not (isinstance(st, dict) and isinstance(st.get("completed", []), list)):
            raise RunDirError(f"{self.state} does not hold a run's state (a mapping with a 'completed' list)")
        return st

    def finished_metrics(self) -> dict[str, Any] | None:
        """metrics.json of a finished run, else None."""
        st = self.read_state()
        if st and st.get("finished") and self.metrics.is_file():
            return self._json(self.metrics)
        return None

    def check_belongs_to(self, cfg: Any) -> None:
        """Refuse to mix two runs: an existing run directory must hold this exact resolved config
        (validated again, so keys added to the schema since it was written take their defaults)."""
        for parent in [self.root, *self.root.parents]:
            if parent.exists() and not parent.is_dir():
                what = "run_dir" if parent == self.root else f"run_dir {self.root}: its parent"
                raise RunDirError(f"{what} {parent} exists and is not a directory")
        if self.config.is_file() and not self._same_config(cfg):
            raise RunDirError(
                f"run directory {self.root} holds a run with a different config ({self.config}); "
                f"use another run_dir (e.g. run_dir={self.root}_2) or restore the original config")
        foreign = [p.name for p in self.root.iterdir() if not own_before_config(p.name)] \
            if self.root.is_dir() and not self.config.is_file() else []
        if foreign:
            raise RunDirError(f"run directory {self.root} exists, holds {', '.join(sorted(foreign)[:3])}"
                              f"{' ...' if len(foreign) > 3 else ''} and no config.yaml (not a run of this "
                              f"project); refusing to write into it")

    def _same_config(self, cfg: Any) -> bool:
        from mcit.core.config import ConfigError, dump_config, read_yaml_mapping, validate_config

        try:
            old = validate_config(read_yaml_mapping(self.config, "run config"), str(self.config))
        except ConfigError:
            return False
        old = old.with_absolute_paths(Path.cwd())  # a run directory written before paths were stored absolute
        return dump_config(old) == dump_config(cfg)
