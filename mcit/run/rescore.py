"""Re-scoring a finished run (or every run of a sweep) from its stored answers, without the model.

``mcit-evaluate --rescore RUN_OR_SWEEP [--config C]`` reads every row's answer files (``eval/answers/<row>/``, and
those of evaluation-only passes under ``eval/evaluate/``), scores them with the current scorers and writes the
rows (with each task's scorer and its version: ``mcit.run.cells.scorer_version``), metrics.json, report.md and the
heatmap again; for a sweep, every run (the program then aggregates the sweep's tables and figures again).
``--config`` swaps scorers: a config equal to the run's own except for task scorers (``data.tasks[i].scorer``)
and ``eval.judge``. Rows whose answers are missing are refused before anything is written (one line naming the
file). The rows, metrics.json and report.md the run had are kept under ``eval/rescored/<time>/`` first. A judged scorer
(MLLM-ACL Math) loads its judge model; no other model is loaded.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from mcit.core.checkpoint import atomic_write_text, read_json, write_json
from mcit.core.config import ConfigError, RunConfig, TaskSpec, load_config
from mcit.core.rundir import RunDir
from mcit.run import cells as CS


class RescoreError(ValueError):
    """A run that cannot be rescored (not a run, answers missing, a config that changes more than scorers)."""


def _task_names(cfg: RunConfig) -> list[str]:
    return [t if isinstance(t, str) else t.name for t in cfg.data.tasks]


def _own_scorers(cfg: RunConfig) -> dict[str, str]:
    """Scorers a config sets on its tasks (``data.tasks[i].scorer``), by task name."""
    return {t.name: t.scorer for t in cfg.data.tasks if isinstance(t, TaskSpec) and t.scorer}


def _answers_part(cfg: RunConfig) -> str:
    """The config with what scoring reads taken out: the tasks by name only, no judge."""
    data = json.loads(json.dumps(cfg.model_dump(mode="json")))
    data["data"]["tasks"] = _task_names(cfg)
    data["eval"].pop("judge", None)
    return json.dumps(data, sort_keys=True)


def swapped_config(run: RunDir, config: Path) -> RunConfig:
    """``config`` as the run's config with other scorers: refused (one line naming the first other key) when it
    changes anything that decides the answers."""
    stored = load_config(run.config)
    cfg = load_config(config).with_absolute_paths(Path.cwd())
    a, b = json.loads(_answers_part(stored.with_absolute_paths(Path.cwd()))), json.loads(_answers_part(cfg))
    for d in (a, b):
        d.pop("run_dir", None)  # where the run lies, not what it answered
    if a != b:
        def first(x: Any, y: Any, path: str) -> str:
            if isinstance(x, dict) and isinstance(y, dict):
                for k in sorted(set(x) | set(y)):
                    if x.get(k) != y.get(k):
                        return first(x.get(k), y.get(k), f"{path}.{k}" if path else k)
            return path or "<root>"

        raise RescoreError(f"--config {config}: {first(a, b, '')} differs from the run's own config "
                           f"({run.config}); --rescore swaps scorers only (data.tasks[i].scorer, eval.judge)")
    return cfg


def _rows_of(run: RunDir) -> list[tuple[Path, Path, list[int] | None]]:
    """(row file, its answers directory, its task indices or None for all) of every row the run has."""
    out: list[tuple[Path, Path, list[int] | None]] = []
    for evaluate_only in (False, True):
        base = run.eval_dir(evaluate_only)
        for f in sorted(base.glob("*.json")):
            tag = f.stem
            if tag != "zero_shot" and not tag.startswith("after_task_"):
                continue
            out.append((f, base / "answers" / tag, None))
    return out


def answer_files(run: RunDir, names: list[str]) -> list[tuple[Path, dict[str, Any], list[tuple[int, Path]]]]:
    """(row file, row, [(task index, answer file)]) of every row; a missing answer file is one line naming it."""
    jobs = []
    for f, answers, _ in _rows_of(run):
        row = read_json(f)
        idx = [names.index(n) for n in row["tasks"]] if "tasks" in row else list(range(len(row["acc"])))
        files = [(i, answers / f"{i}.jsonl") for i in idx]
        missing = [(i, p) for i, p in files if not p.is_file()]
        if missing:
            raise RescoreError(f"{run.root}: row {f.name} has no stored answers for task {names[missing[0][0]]} "
                               f"({missing[0][1]}); rescoring needs them (mcit-evaluate --write-rows answers again)")
        jobs.append((f, row, files))
    return jobs


def rescore_run(root: Path, config: Path | None = None, *, judge_cfg: Any = None) -> dict[str, Any]:
    """Rescore one run directory; returns its new metrics.json (or {} for a run with no committed row)."""
    run = RunDir(root)
    if not run.config.is_file():
        raise RescoreError(f"{run.root} is not a run directory (no config.yaml)")
    try:
        stored = load_config(run.config)
    except ConfigError as e:
        raise RescoreError(str(e)) from None
    cfg = swapped_config(run, config) if config is not None else stored
    names = _task_names(stored)
    swap = _own_scorers(cfg)
    jobs = answer_files(run, names)
    if not jobs:
        raise RescoreError(f"{run.root}: no evaluated row to rescore")
    # the previous rows and results, kept before anything is rewritten
    keep = run.root / "eval" / "rescored" / time.strftime("%Y%m%dT%H%M%S")
    for f, _, _ in jobs:
        dest = keep / f.relative_to(run.root / "eval")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
    for f in (run.metrics, run.report):
        if f.is_file():
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, keep / f.name)
    judge = CS.Judge(judge_cfg if judge_cfg is not None else cfg.eval.judge)
    for f, row, files in jobs:
        generation = "scorers" in row
        acc, sums, scorers, versions, counts = [], [], [], [], []
        for j, (i, path) in enumerate(files):
            rows = [json.loads(line) for line in path.read_text().splitlines() if line]
            if generation:
                scorer = swap.get(names[i], row["scorers"][j])
                total, table, scored = CS.score_rows(scorer, rows, judge)
                versions.append(CS.scorer_version(scorer))
                if table is not None:
                    atomic_write_text(path.with_name(f"{i}.metrics.json"), json.dumps(
                        {"scorer": scorer, "score": total / max(len(rows), 1), "metrics": table,
                         "samples": len(rows)}, indent=1))
            else:  # a class-incremental row: the stored predictions against the labels
                scorer, scored = "class_match", [{**r, "score": float(r["prediction"] == r["label"])} for r in rows]
                total = float(sum(r["score"] for r in scored))
            if scored != rows:
                atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in scored))
            acc.append(100.0 * total / max(len(rows), 1))
            counts.append(len(rows))
            sums.append(total)
            scorers.append(scorer)
        new = {**row, "acc": acc, "total": counts}
        if generation:
            new.update(score_sum=sums, scorers=scorers, scorer_versions=versions)
        else:
            new["correct"] = [int(s) for s in sums]
        new["rescored"] = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "previous": str(keep)}
        write_json(f, new)
    done = run.rows_done(len(stored.data.tasks) if stored.data.schedule != "joint" else 1)
    if not done:
        return {}
    from mcit.run.results import write_metrics

    return write_metrics(results_plan(stored, run, scorers_of(run, done)), done)


def scorers_of(run: RunDir, done: int) -> list[str] | None:
    """The scorers the run's last row used (None for class-incremental rows)."""
    last = read_json(run.row(done - 1))
    return last.get("scorers")


def results_plan(cfg: RunConfig, run: RunDir, scorers: list[str] | None) -> Any:
    """A ``Plan`` with what metrics.json and report.md read (names, scorers, backbone records), built from the run
    directory alone: no split opened, no model resolved."""
    from mcit.data.types import TaskSequence
    from mcit.run.plan import Plan, ResolvedBackbone

    names = _task_names(cfg)
    records = read_json(run.backbone) if run.backbone.is_file() else {"tag": cfg.backbone.tag}
    aux = {name: ResolvedBackbone("", "", rec) for name, rec in (records.pop("auxiliary", None) or {}).items()}
    stages = ["joint"] if cfg.data.schedule == "joint" else list(names)
    return Plan(cfg, run, names, [], [], TaskSequence((), ()), ResolvedBackbone(cfg.backbone.kind, "", records),
                aux, scorers, stage_names=stages)


def run_dirs_under(root: Path) -> list[Path]:
    """``root`` when it is a run directory, else every run directory below it (a sweep's ``runs/*``)."""
    if (root / "config.yaml").is_file():
        return [root]
    return sorted(p.parent for p in root.rglob("config.yaml") if (p.parent / "state.json").is_file())


def rescore(root: Path, config: Path | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """Rescore a run, or every run below a directory (a sweep's: ``mcit-evaluate --rescore`` then writes the sweep's
    tables again); every run is checked (answers present) before the first is rewritten."""
    runs = run_dirs_under(root)
    if not runs:
        raise RescoreError(f"{root}: neither a run directory (config.yaml) nor a directory holding runs")
    if config is not None and len(runs) > 1:
        raise RescoreError("--config swaps the scorers of one run; give a run directory, not a sweep")
    for r in runs:  # refuse before writing anything
        answer_files(RunDir(r), _task_names(load_config(r / "config.yaml")))
    return [(r, rescore_run(r, config)) for r in runs]

