"""Experiment trackers: TensorBoard, Weights & Biases, MLflow (``log.report_to``, transformers' names and meaning).

Rank 0 logs the resolved config once, every training record of ``logs/train.jsonl`` (its numbers, at the
sequence-wide ``global_step``: tasks one after another, so one chart holds the whole sequence), each committed
accuracy-matrix row (``eval/<task>`` and ``eval/mean``, at the global step where that task's training ended; the
zero-shot row at step 0) and the final metrics (``final/<metric>``).

A resumed run continues the same tracker run (its id kept in ``logs/trackers.json``: W&B's run id, MLflow's run
id; TensorBoard appends to ``logs/tb``) and gives each tracker exactly what it does not hold, from
``logs/train.jsonl`` (every record is there, at its ``global_step``; a step a resumed task trains again after its
last step checkpoint is in the file twice with the same numbers, the run resuming bit for bit, and goes to a
tracker once). What a tracker holds is known per tracker: MLflow writes each call through, so its store is asked;
TensorBoard is flushed after every commit and its mark kept (a resumed writer purges the steps after the mark, as
TensorBoard's ``purge_step`` does); W&B holds a launch's records for sure only once its run is finished (offline,
a killed launch leaves an empty file), so its mark is kept at each finish and a killed launch's records are sent
again; online, W&B's own summary of the resumed run counts too. A kill in the instant between a tracker's call and
its mark can leave one row or step in that tracker twice or not at all; nothing else.

Where the trackers write, as transformers' callbacks do, is theirs to read from the environment (``WANDB_MODE=
offline``, ``WANDB_DIR``, ``WANDB_PROJECT``, ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``); without them W&B
writes under ``logs/``, MLflow to ``logs/mlruns`` of the run directory, and both name the project / experiment
``log.project`` (default ``mcit``) and the run by the config's name. The trackers are optional extras (``pip
install 'mcit[trackers]'``); one that is configured and not installed is a pre-flight error.
"""

from __future__ import annotations

import abc
import json
import os
import uuid
from typing import Any

from mcit.core.checkpoint import atomic_write_text
from mcit.core.console import reroute
from mcit.core.metrics import FINAL_METRICS
from mcit.core.rundir import RunDir

NOT_SCALARS = ("task", "epoch", "step", "micro_step", "global_step", "time", "event", "stage", "segment")


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (MLflow's parameters, W&B's config)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v)
    return out


class _Tracker(abc.ABC):
    """One tracker: what it durably holds (``step``: every training record up to that global step; ``rows``; whether
    the final metrics), as ``logs/trackers.json`` keeps it, and how to write to it."""

    name = ""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state  # its entry in trackers.json
        state.setdefault("step", 0)
        state.setdefault("rows", [])
        state.setdefault("final", False)
        self.sent, self.rows, self.final = state["step"], set(state["rows"]), state["final"]  # in this launch

    @abc.abstractmethod
    def log(self, values: dict[str, float], step: int) -> None:
        """Send ``values`` at global step ``step``."""

    def durable(self) -> bool:
        """Make what was sent durable, where the tracker can; whether it now is."""
        return False

    def mark(self) -> None:
        self.state.update(step=self.sent, rows=sorted(self.rows), final=self.final)

    def close(self) -> None:  # noqa: B027 - a tracker with nothing to end (none today) keeps this
        """End the tracker's run (what it was sent is then held)."""


class _TensorBoard(_Tracker):
    name = "tensorboard"

    def __init__(self, state: dict[str, Any], run: RunDir, config: dict[str, Any]) -> None:
        super().__init__(state)
        from torch.utils.tensorboard import SummaryWriter

        # events after the mark that a killed launch wrote are dropped by TensorBoard's readers
        self.writer = SummaryWriter(str(run.tensorboard), purge_step=self.sent + 1 if self.sent else None)
        if not state.get("config"):
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)
            state["config"] = True

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def durable(self) -> bool:
        self.writer.flush()
        return True

    def close(self) -> None:
        self.writer.close()


class _Wandb(_Tracker):
    name = "wandb"

    def __init__(self, state: dict[str, Any], run: RunDir, run_name: str, project: str, config: dict[str, Any],
                 save: Any) -> None:
        super().__init__(state)
        import wandb

        os.environ.setdefault("WANDB_DIR", str(run.logs))
        state.setdefault("id", uuid.uuid4().hex[:8])  # W&B ids: [a-z0-9]
        save()  # the id is kept before the run exists: a kill now resumes the same id
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", project), name=run_name, id=state["id"],
                              resume="allow", config=flat(config), settings=wandb.Settings(silent=True))
        # every series against the sequence's global step: rows and resent records arrive after later steps
        self.run.define_metric("global_step")
        for series in ("train/*", "eval/*", "final/*"):
            self.run.define_metric(series, step_metric="global_step")
        online = self.run.summary.get("global_step")  # a resumed online run: what W&B's server holds
        if isinstance(online, (int, float)) and online > self.sent:
            self.sent = int(online)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "global_step": step})

    def summary(self, values: dict[str, float]) -> None:
        self.run.summary.update(values)

    def close(self) -> None:
        self.run.finish()


class _Mlflow(_Tracker):
    name = "mlflow"

    def __init__(self, state: dict[str, Any], run: RunDir, run_name: str, project: str, config: dict[str, Any],
                 save: Any, row_steps: list[tuple[str, int]]) -> None:
        super().__init__(state)
        import mlflow

        reroute("mlflow")  # its records go to the rank log, as every library's
        if "MLFLOW_TRACKING_URI" not in os.environ:  # the run directory's own file store (MLflow 3 asks for
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a database: opted out for this one)
            mlflow.set_tracking_uri((run.logs / "mlruns").resolve().as_uri())
        self.mlflow = mlflow
        if state.get("run_id") is None:
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", project))
            state["run_id"] = mlflow.start_run(run_name=run_name).info.run_id
            save()
            params = flat(config)
            for i in range(0, len(params), 100):  # MLflow's batch limit
                mlflow.log_params({k: str(v)[:6000] for k, v in list(params.items())[i:i + 100]})
            return
        mlflow.start_run(run_id=state["run_id"])
        # written through: the store itself says what it holds
        client, rid = mlflow.tracking.MlflowClient(), state["run_id"]
        steps = [m.step for m in client.get_metric_history(rid, "train/loss")]
        self.sent = max(steps, default=0)
        held = {m.step for m in client.get_metric_history(rid, "eval/mean")}
        self.rows = {tag for tag, step in row_steps if step in held}
        self.final = bool(client.get_metric_history(rid, "final/final_avg_acc"))

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def durable(self) -> bool:
        return True

    def close(self) -> None:
        self.mlflow.end_run()


class Trackers:
    """The run's trackers on rank 0 (``names`` from ``resolve``). ``records``: the training log's records so far
    (the first of each global step); ``row_steps``: (row tag, its global step) of the rows committed so far."""

    def __init__(self, names: list[str], run: RunDir, run_name: str, project: str, config: dict[str, Any],
                 records: list[dict[str, Any]], row_steps: list[tuple[str, int]]) -> None:
        self.state_file = run.logs / "trackers.json"
        self.state: dict[str, Any] = json.loads(self.state_file.read_text()) if self.state_file.is_file() else {}
        run.logs.mkdir(parents=True, exist_ok=True)
        self.all: list[_Tracker] = []
        for n in names:
            st = self.state.setdefault(n, {})
            if n == "tensorboard":
                self.all.append(_TensorBoard(st, run, config))
            elif n == "wandb":
                self.all.append(_Wandb(st, run, run_name, project, config, self._save))
            elif n == "mlflow":
                self.all.append(_Mlflow(st, run, run_name, project, config, self._save, row_steps))
            else:
                raise ValueError(f"log.report_to: unknown tracker {n!r}")
        for r in records:  # what a killed launch logged and a tracker does not hold
            self.train_record(r)
        self.commit()

    def _save(self) -> None:
        atomic_write_text(self.state_file, json.dumps(self.state, indent=1))

    def train_record(self, record: dict[str, Any]) -> None:
        """One training record (``logs/train.jsonl``'s line, with its ``global_step``), to each tracker that does
        not hold its step."""
        g = int(record["global_step"])
        values = {f"train/{k}": float(v) for k, v in record.items()
                  if k not in NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for t in self.all:
            if g > t.sent:
                t.log(values, g)
                t.sent = g

    def row(self, tag: str, names: list[str], acc: list[float], step: int) -> None:
        """A committed accuracy-matrix row, to each tracker that does not hold it."""
        values = {f"eval/{n}": float(a) for n, a in zip(names, acc)}
        values["eval/mean"] = sum(acc) / len(acc)
        for t in self.all:
            if tag not in t.rows:
                t.log(values, step)
                t.rows.add(tag)

    def final(self, metrics: dict[str, Any], step: int) -> None:
        """The final metrics, to each tracker that does not hold them."""
        values = {f"final/{k}": float(metrics[k]) for k in FINAL_METRICS if metrics.get(k) is not None}
        for t in self.all:
            if not t.final:
                t.log(values, step)
                if isinstance(t, _Wandb):
                    t.summary(values)
                t.final = True

    def commit(self) -> None:
        """After a commit of the run: each tracker that can make what it was sent durable does, and its mark is
        kept."""
        for t in self.all:
            if t.durable():
                t.mark()
        self._save()

    def close(self) -> None:
        for t in self.all:
            t.close()
            t.mark()  # finished: everything sent is held (W&B's offline file is complete now)
        self._save()
