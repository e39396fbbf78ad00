"""The staged task-sequence loop with resume.

Stages, in order: ``reference`` (methods that need the backbone's pre-trained statistics),
``zero_shot`` (evaluate the untrained method: the forward-transfer baseline), then for each task t:
``t/train`` -> ``t/subspace`` (both once per phase of a multi-phase method, e.g. ``t/train.first``)
-> ``t/eval`` -> ``t/commit``. Every stage is collective (all ranks enter it), rank 0 alone writes
files, and ``state.json`` (written last, by rename) is the commit point: a re-run of the same command
skips every stage it lists and loads the method state the last stage left in
``checkpoints/current.safetensors``. The train stage also keeps DeepSpeed step checkpoints, so a run
killed mid-task resumes from its last step. The method's hooks are called by ``mcit.run.lifecycle`` only;
the layout of the run directory is ``mcit.core.rundir``'s.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mcit.core import distributed as dist
from mcit.core import preemption
from mcit.core.checkpoint import atomic_write_text, load_state, read_json, save_state, write_json
from mcit.core.config import dump_config
from mcit.core.registry import METHODS
from mcit.core.rundir import RunDir, row_tag
from mcit.data.loader import eval_batches
from mcit.data.shards import DataError, Split
from mcit.run.deferred import Workers
from mcit.run.engine import JsonlLogger, TaskTrainer, data_seed
from mcit.run.evaluation import evaluate_row, first_task_loss
from mcit.run.lifecycle import MethodHost
from mcit.run.plan import Plan
from mcit.run.results import rows, write_metrics
from mcit.run.subspace_stage import stream_statistics

STAGES = ("train", "subspace", "eval", "commit")


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a dead or stuck rank); names the stage."""


def _is_collective_failure(e: BaseException) -> bool:
    if isinstance(e, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(e).lower()
    return any(w in text for w in ("gloo", "nccl", "timed out", "connection closed", "connection reset",
                                   "broken pipe", "socket"))


def stage_keys(plan: Plan) -> list[str]:
    """Every stage of the run, in order (the names state.json lists once they are committed)."""
    phases = METHODS.get(plan.cfg.method.name).phases
    per_task = [f"{s}.{p}" if p else s for p in phases for s in STAGES[:2]] + list(STAGES[2:])
    return ((["reference"] if plan.reference is not None else []) + (["zero_shot"] if plan.cfg.eval.zero_shot else [])
            + [f"{t}/{s}" for t in range(plan.num_stages) for s in per_task])


def check_replay(path: Path, buffers: dict[str, list[str]], seed: int) -> None:
    """Keep the replay buffers in the run directory (``replay.json``); a resumed run must draw the same ones (its
    data changed under it otherwise)."""
    record = {"seed": seed, "buffers": buffers}
    if not path.is_file():
        write_json(path, record)
        return
    stored = json.loads(path.read_text())
    if stored != record:
        changed = [t for t in buffers if stored.get("buffers", {}).get(t) != buffers[t]]
        raise DataError(f"{path}: the replay buffer of task {changed[0] if changed else '?'} differs from the one "
                        f"this run started with (its training data changed); restore the data or start a new run")


class Pipeline:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.cfg = plan.cfg
        self.run_dir: RunDir = plan.run
        self.state: dict[str, Any] = {"completed": [], "method_state": None}
        self.logger: JsonlLogger | None = None
        self.host = MethodHost(plan)
        self.workers = Workers(plan.cfg, plan.run) if plan.cfg.eval.schedule == "deferred" else None

    # -- bookkeeping --------------------------------------------------------------------------------
    def _mark(self, key: str, **extra: Any) -> None:
        """Record ``key`` as done: state.json is written after the stage's own outputs, by rename, so a run
        stopped before this line (or a write of it that failed) re-runs the stage."""
        state = {**self.state, **extra, "completed": [*self.state["completed"], key], "updated": time.time()}

        def write() -> None:
            write_json(self.run_dir.state, state)
            self.logger.log({"event": "stage", "stage": key, "time": time.time()})

        dist.on_main(write)
        self.state = state

    def _say(self, text: str) -> None:
        if dist.is_main():
            print(text, file=sys.stderr, flush=True)

    def _save_current(self, key: str) -> str:
        dist.on_main(lambda: save_state(self.run_dir.current_state, self.host.method.state_dict(),
                                        {"after_stage": key}))
        return RunDir.CURRENT_STATE

    def _stream(self, split: Split, collate: Any, task: int, aug_seed: int | None = None) -> None:
        """The subspace protocol over this rank's part of ``split`` (mcit.run.subspace_stage), then its log line;
        ``aug_seed`` seeds the per-sample draws of an augmented stream."""
        cfg = self.cfg
        batches = eval_batches(split, rank=dist.rank(), world=dist.world_size(), batch_size=cfg.eval.batch_size,
                               policy=cfg.data.split, collate=collate, loader=self.plan.loader, aug_seed=aug_seed)
        report = stream_statistics(self.host.method, batches, task)
        if report is not None and dist.is_main():
            self.logger.log({"event": "subspace", "task": task, **report, "time": time.time()})

    # -- stages -------------------------------------------------------------------------------------
    def stage_reference(self) -> None:
        """Statistics of data.reference before the first task (e.g. Fwd-Prompt's pre-trained subspace)."""
        self.host.enter(0)
        split = self.plan.reference
        self._stream(split, self.host.collate(0, train=True, split=split, augment=False), -1)
        self._mark("reference", method_state=self._save_current("reference"))

    def stage_zero_shot(self) -> None:
        # kept, so an evaluation-only pass of the zero-shot row evaluates this state (and reuses its cells)
        dist.on_main(lambda: save_state(self.run_dir.zero_shot_state, self.host.method.state_dict(),
                                        {"zero_shot": "the state the zero-shot row was evaluated in"}))
        if self.workers is not None:  # deferred: a worker answers the row from that state
            self._mark("zero_shot")
            self._hand_off()
            return
        with self.host.zero_shot():
            row = evaluate_row(self.host, trained=0, answers_dir=self.run_dir.answers(None), desc="zero-shot eval")
        dist.on_main(lambda: write_json(self.run_dir.row(None), row))
        self._mark("zero_shot")

    def stage_train(self, t: int, phase: str = "") -> None:
        key = f"{t}/train" + (f".{phase}" if phase else "")
        if self.logger is not None:
            self.logger.segment = key  # the training records' segment: their global steps follow the sequence
        cfg = self.cfg
        overrides = self.host.method.phase_train(phase)
        if overrides:  # this phase's own epochs / lr / optimizer (validated like the config)
            train = type(cfg.train).model_validate({**cfg.train.model_dump(), **overrides})
            cfg = cfg.model_copy(update={"train": train})
            if "epochs" in overrides:  # the phase's epochs win over a task's own
                tasks = [s if isinstance(s, str) else s.model_copy(update={"epochs": None}) for s in cfg.data.tasks]
                cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"tasks": tasks})})
        trainer = TaskTrainer(cfg, self.logger, self.run_dir.preempt_request, self.plan.loader)
        pipeline = self.host.method_cls.image_pipeline(cfg.method.params(), phase, "train")
        collate = self.host.collate(t, train=True, pipeline=pipeline)
        self.host.train(t, phase, lambda method: trainer.train(method, t, self.plan.train[t], collate,
                                                                self.run_dir.step_dir(t, phase)))
        self._mark(key, method_state=self._save_current(key))

    def stage_subspace(self, t: int, phase: str = "") -> None:
        """Stream the task's statistics on every rank, sum over ranks, finalize on rank 0, broadcast."""
        key = f"{t}/subspace" + (f".{phase}" if phase else "")

        def stream(method: Any) -> None:
            pipeline = self.host.method_cls.image_pipeline(self.cfg.method.params(), phase, "subspace")
            augment = bool(pipeline.augment) and pipeline.auxiliary is None
            collate = self.host.collate(t, train=True, augment=False, pipeline=pipeline)
            # an augmented pass draws its own crops: another seed than any training epoch's
            return self._stream(self.plan.train[t], collate, t,
                                data_seed(self.cfg.seed + 29, t, 0, 0) if augment else None)

        self.host.subspace(t, phase, stream)
        self._mark(key, method_state=self._save_current(key))

    def stage_eval(self, t: int) -> None:
        if self.workers is not None:  # deferred: the row is answered from the export the commit writes
            self._mark(f"{t}/eval")
            return
        self.host.enter_eval(t)  # also when a resumed run starts at this stage
        row = evaluate_row(self.host, trained=t + 1, answers_dir=self.run_dir.answers(t), desc=f"task {t} eval")
        row["first_task_loss"] = first_task_loss(self.host)
        dist.on_main(lambda: write_json(self.run_dir.row(t), row))
        self._mark(f"{t}/eval")

    def stage_commit(self, t: int) -> None:
        def write() -> None:
            state = self.host.method.state_dict()
            save_state(self.run_dir.task_state(t), state,
                       {"task": t, "task_name": self.plan.stage_names[t], "method": self.cfg.method.name})
            write_json(self.run_dir.task_info(t), {
                "task": t, "task_name": self.plan.stage_names[t], "method": self.cfg.method.name,
                "method_params": self.cfg.method.params().model_dump(), "backbone": self.plan.backbone_records(),
                "tensors": {k: list(v.shape) for k, v in state.items()}})
            if self.workers is None:  # deferred: the rows come in later; metrics once they are all in
                write_metrics(self.plan, done=t + 1)
            for steps in self.run_dir.step_dirs(t):
                shutil.rmtree(steps, ignore_errors=True)

        dist.on_main(write)
        self._mark(f"{t}/commit")
        dist.on_main(self._track)
        if self.workers is not None:
            self._hand_off()

    # -- trackers -------------------------------------------------------------------------------------
    def _trackers(self) -> Any:
        """Rank 0's experiment trackers (``log.report_to``), continuing the run's own where it resumes."""
        from mcit.run.trackers import Trackers

        names = list(self.cfg.log.report_to)  # validated: installed ones only
        if not names:
            return None
        return Trackers(names, self.run_dir, self.cfg.name, self.cfg.log.project, self.cfg.model_dump(mode="json"),
                        self.logger.records, self._row_steps())

    def _row_steps(self) -> list[tuple[str, int]]:
        """(row tag, global step) of every row the trackers show: the zero-shot row at 0, the row after a task at the
        step its training ended."""
        return [("zero_shot", 0)] + [(row_tag(t), self.logger.task_end.get(t, self.logger.last_step))
                                     for t in range(self.plan.num_stages)]

    def _track(self) -> None:
        """Rank 0: the committed rows the trackers do not have yet, and once the run is complete its metrics."""
        trackers = self.logger.trackers if self.logger else None
        if trackers is None:
            return
        rd, names = self.run_dir, self.plan.names
        for (tag, step), t in zip(self._row_steps(), [None, *range(self.plan.num_stages)]):
            if rd.row(t).is_file():
                trackers.row(tag, names, read_json(rd.row(t))["acc"], step)
        if rd.metrics.is_file() and read_json(rd.metrics).get("complete"):
            trackers.final(read_json(rd.metrics), self.logger.last_step)
        trackers.commit()

    # -- deferred evaluation ----------------------------------------------------------------------------
    def _committed_rows(self) -> list[str]:
        """The rows whose method state is committed: the zero-shot row, and the row after each committed task."""
        from mcit.run.deferred import committed_rows

        return committed_rows(self.plan, self.state["completed"])

    def _hand_off(self) -> list[str]:
        """Rank 0 starts a worker for every committed row that is neither in nor being answered; every rank gets
        the rows still missing."""
        tags = self._committed_rows()
        return dist.broadcast_object(dist.on_main(lambda: self.workers.ensure(tags)))

    def _wait_rows(self) -> None:
        """Until every row is in (rank 0 restarting dead workers; one small collective per look), then metrics.json
        and report.md."""
        said = False
        while True:
            missing = self._hand_off()
            if not missing:
                break
            if not said:
                self._say(f"waiting for the evaluation workers of {len(missing)} row(s): {', '.join(missing)}")
                said = True
            if preemption.agreed(self.run_dir.preempt_request):
                raise preemption.Preempted("while waiting for the evaluation workers (every task committed)")
            time.sleep(self.cfg.eval.poll_s)
        dist.on_main(lambda: write_metrics(self.plan, done=self.plan.num_stages))

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        rd = self.run_dir
        def start() -> None:
            if not rd.config.is_file():
                atomic_write_text(rd.config, dump_config(self.cfg))
            if not rd.backbone.is_file():
                write_json(rd.backbone, self.plan.backbone_records())
            if self.plan.replay:
                check_replay(rd.root / "replay.json", self.plan.replay, self.cfg.seed)

        dist.on_main(start)
        self.state = rd.read_state() or self.state
        self.logger = JsonlLogger(rd.train_log if dist.is_main() else None)
        self.logger.trackers = dist.on_main(self._trackers)
        try:
            self.host.build()
            if self.state.get("method_state"):
                self.host.load(load_state(rd.root / self.state["method_state"]))
                self._say(f"resuming {rd.root}: {len(self.state['completed'])} stages done")
            if dist.is_main():
                preemption.clear(rd.preempt_request)  # a request that stopped an earlier job is done with
            dist.barrier()
            if self.workers is not None and self.state["completed"]:  # rows a killed launch left to dead workers
                self._hand_off()
            for key in stage_keys(self.plan):
                if key in self.state["completed"]:
                    continue
                if preemption.agreed(rd.preempt_request):
                    raise preemption.Preempted(f"before stage {key} (stages up to it committed)")
                try:
                    if key in ("zero_shot", "reference"):
                        getattr(self, f"stage_{key}")()
                        continue
                    t, stage = key.split("/")
                    stage, _, phase = stage.partition(".")
                    getattr(self, f"stage_{stage}")(int(t), *([phase] if phase else []))
                except RuntimeError as e:
                    if _is_collective_failure(e):
                        raise CollectiveError(f"stage {key}: a collective did not complete on rank {dist.rank()} "
                                              f"({str(e).strip().splitlines()[0][:300]}); another rank died or hangs "
                                              f"(train.collective_timeout_s={self.cfg.train.collective_timeout_s:g})"
                                              ) from None
                    raise
                if stage == "commit" and dist.is_main() and self.workers is not None:
                    self._say(f"task {t} ({self.plan.stage_names[int(t)]}) committed; its row goes to an evaluation "
                              f"worker")
                elif stage == "commit" and dist.is_main():
                    acc, _, _ = rows(self.plan, int(t) + 1)
                    seen = len(self.plan.names) if self.cfg.data.schedule == "joint" else int(t) + 1
                    self._say(f"task {t} ({self.plan.stage_names[int(t)]}) committed: acc on seen tasks "
                              + " ".join(f"{a:.1f}" for a in acc[-1][:seen]))
            if self.workers is not None:
                self._wait_rows()
            dist.on_main(self._track)
            dist.on_main(lambda: write_json(rd.state, {**self.state, "finished": True}))
            self.state["finished"] = True
        finally:  # however the launch ends: the trackers' runs finished, their marks kept (mcit.run.trackers)
            self.logger.close()
        return read_json(rd.metrics)
