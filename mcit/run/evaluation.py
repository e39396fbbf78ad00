"""Evaluation of every task, sharded across ranks: classification accuracy or scored generations.

``evaluate_row`` (one accuracy-matrix row) and ``first_task_loss`` serve both the pipeline's eval
stage and ``pipelines/evaluate.py``; the answers go through evaluation cells (``mcit.run.cells``: computed
once, committed in chunks, reused). No collectives run inside the loops (ranks may hold different numbers of
test samples); each split's rows are gathered to rank 0 at the end, which scores them and commits the cells.
Predictions are per sample, so the result does not depend on ``eval.batch_size``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from mcit.core import distributed as dist
from mcit.core.checkpoint import atomic_write_text
from mcit.core.config import RunConfig
from mcit.data.instructions import SCORER_KEYS
from mcit.data.loader import LoaderOptions, eval_batches, eval_parts
from mcit.data.shards import Split
from mcit.methods.base import Method
from mcit.run.plan import Plan


class Host(Protocol):
    """What evaluation needs of the method host (``mcit.run.lifecycle.MethodHost``): the plan, the method in
    its current state, and each task's collate. A protocol, so evaluation sits beside the host, not above it."""

    plan: Plan
    cfg: RunConfig
    method: Method

    def collate(self, task: int, *, train: bool, split: Split | None = None,
                augment: bool | None = None) -> Callable: ...


def evaluate_row(host: Host, *, trained: int, answers_dir: Path, tasks: list[int] | None = None,
                 desc: str = "eval") -> dict[str, Any]:
    """The method's accuracy on ``tasks`` (default every task) after ``trained`` tasks (0 = zero-shot:
    every class allowed), through the evaluation cells (``mcit.run.cells``): a complete cell is reused, a
    partial one's committed chunks are kept and only the rest is answered. Each task's answers go to
    ``answers_dir/<task>.jsonl``; the row names its cells and how many answers each reused and computed."""
    from mcit.run import cells as CS

    plan, cfg, method = host.plan, host.cfg, host.method
    tasks = list(range(len(plan.test))) if tasks is None else tasks
    generation = plan.scorers is not None
    allowed = None
    if not generation and cfg.eval.mask_unseen_classes and trained > 0:
        allowed = torch.zeros(plan.sequence.num_classes, dtype=torch.bool)
        for task in plan.sequence.tasks[:trained]:
            allowed[list(task.classes)] = True
    state_sha = dist.broadcast_object(CS.state_digest(method.state_dict()) if dist.is_main() else None)
    allowed_list = None if allowed is None else [int(i) for i in allowed.nonzero().flatten()]
    root = CS.store_root(cfg, plan.run.root)
    cells = [CS.Cell(root, CS.cell_key(plan, i, trained, state_sha, allowed_list)) for i in tasks]
    prior: list[dict[str, dict]] = [{} for _ in tasks]  # rank 0: the rows each cell already holds

    def look() -> list[list[str] | None]:
        """None for a complete cell; else the keys its committed chunks answer."""
        out: list[list[str] | None] = []
        for j, cell in enumerate(cells):
            if cfg.eval.reuse and cell.complete():
                out.append(None)
                continue
            prior[j] = cell.chunk_rows() if cfg.eval.reuse else {}
            out.append(sorted(prior[j]))
        return out

    status = dist.broadcast_object(dist.on_main(look))
    todo = [j for j, st in enumerate(status) if st is not None]
    splits = [plan.test[tasks[j]] for j in todo]
    skips = [set(status[j]) for j in todo]
    collates = [host.collate(tasks[j], train=False) for j in todo]
    writers = []
    for j in todo:
        w = cells[j].writer(dist.rank(), dist.world_size())
        w.cell = cells[j]
        writers.append(w)
    common = dict(batch_size=cfg.eval.batch_size, policy=cfg.data.split, collates=collates, loader=plan.loader,
                  progress=cfg.train.progress, desc=desc, skip=skips, writers=writers, chunk_size=cfg.eval.chunk_size)
    if not todo:
        new: list[list[dict]] = []
    elif generation:
        new = answer_generation(method, splits, max_new_tokens=[cfg.task_max_new_tokens(tasks[j]) for j in todo],
                                scorers=[plan.scorers[tasks[j]] for j in todo], model_id=cfg.backbone.tag
                                if cfg.backbone.tag != "local" else Path(cfg.backbone.path).name, **common)
    else:
        new = answer_classification(method, splits, allowed_classes=allowed, **common)
    judge = CS.Judge(cfg.eval.judge)

    def finish() -> list[dict[str, Any]]:
        out = []
        for j, i in enumerate(tasks):
            cell = cells[j]
            scorer = plan.scorers[i] if generation else "class_match"
            version = CS.scorer_version(scorer) if generation else None
            if j in todo:
                rows = dict(prior[j])
                answered = new[todo.index(j)]
                for r in answered:
                    rows.setdefault(r["key"], r)
                expected = plan.test[i].num_samples
                if len(rows) != expected:
                    raise CS.CellError(f"task {plan.names[i]}: {len(rows)} answers for {expected} test samples in "
                                       f"{cell.dir} (a split changed under its manifest?)")
                ordered = sorted(rows.values(), key=lambda r: r["key"])
                if generation:
                    total, table, ordered = _score_fresh(scorer, ordered, judge)
                else:
                    total, table = float(sum(r["score"] for r in ordered)), None
                cell.finish(ordered, {"scorer": scorer, "scorer_version": version, "score_sum": total,
                                      "metrics": table})
                reused, computed = len(prior[j]), len(answered)
            else:
                ordered, info = cell.rows(), cell.info()
                if (info.get("scorer"), info.get("scorer_version")) == (scorer, version):
                    total, table = float(info["score_sum"]), info.get("metrics")
                else:  # scored by another scorer (or another version of it): scored again, no model needed
                    total, table, ordered = CS.score_rows(scorer, ordered, judge)
                reused, computed = len(ordered), 0
            if answers_dir is not None:
                CS.publish_answers(cell, ordered, answers_dir / f"{i}.jsonl")
                if table is not None:
                    atomic_write_text(answers_dir / f"{i}.metrics.json", json.dumps(
                        {"scorer": scorer, "score": total / max(len(ordered), 1), "metrics": table,
                         "samples": len(ordered)}, indent=1))
            out.append({"total": total, "count": len(ordered), "scorer": scorer, "scorer_version": version,
                        "cell": {"digest": cell.digest, "reused": reused, "computed": computed}})
        return out

    res = dist.broadcast_object(dist.on_main(finish))
    row: dict[str, Any] = {"total": [r["count"] for r in res],
                           "acc": [100.0 * r["total"] / max(r["count"], 1) for r in res],
                           "cells": [r["cell"] for r in res]}
    if generation:
        row["score_sum"] = [r["total"] for r in res]
        row["scorers"] = [r["scorer"] for r in res]
        row["scorer_versions"] = [r["scorer_version"] for r in res]
    else:
        row["correct"] = [int(r["total"]) for r in res]
    return row


def _score_fresh(scorer: str, rows: list[dict], judge: Any) -> tuple[float, dict | None, list[dict]]:
    """A freshly answered cell: per-sample scores were given as each batch was answered (from the batch's
    references); a corpus metric or a judge scores all the rows now."""
    from mcit.core import caption_metrics as C
    from mcit.core import judge as J
    from mcit.run import cells as CS

    if scorer in C.CORPUS or scorer in J.JUDGED:
        return CS.score_rows(scorer, rows, judge)
    return float(sum(r["score"] for r in rows)), None, rows


def first_task_loss(host: Host) -> float | None:
    """The method's training loss on the first task's test split under its current state (the
    training-interference curve: how much each later task moves the first task's loss); None when
    ``eval.first_task_loss`` is off."""
    cfg = host.cfg
    if not cfg.eval.first_task_loss:
        return None
    split = host.plan.test[0]
    return evaluate_loss(host.method, split, task=0, batch_size=cfg.eval.batch_size, policy=cfg.data.split,
                         collate=host.collate(0, train=True, split=split, augment=False),
                         loader=host.plan.loader)


@torch.no_grad()
def answer_classification(method: Method, splits: list[Split], *, batch_size: int, policy: str,
                          collates: list[Callable], loader: LoaderOptions = LoaderOptions(),
                          allowed_classes: torch.Tensor | None = None, progress: bool = False, desc: str = "eval",
                          skip: list[set[str]] | None = None, writers: list[Any] | None = None,
                          chunk_size: int = 256) -> list[list[dict]]:
    """Per split, every rank's answers gathered on rank 0 (``[]`` elsewhere): one row per sample (key, label,
    predicted class, score 0/1). ``allowed_classes``: bool mask over classes; ``skip``: keys already answered;
    ``writers``: each split's chunk writer (``mcit.run.cells``), which commits the rows as they come."""
    method.eval()
    device = dist.device()
    mine: list[list[dict]] = [[] for _ in splits]
    bar = _bar(progress, splits, skip, desc)
    current = -1
    for i, batch in eval_parts(splits, collates, rank=dist.rank(), world=dist.world_size(), batch_size=batch_size,
                               policy=policy, loader=loader, skip=skip):
        if writers and i != current and current >= 0:
            writers[current].flush()
        current = i
        batch.allowed_classes = allowed_classes
        keys = list(batch.keys)
        batch = batch.to(device, non_blocking=True)
        pred = method.predict(batch).cpu().tolist()
        labels = batch.labels.cpu().tolist()
        rows = [{"key": k, "label": int(lab), "prediction": int(p), "score": float(int(p) == int(lab))}
                for k, lab, p in zip(keys, labels, pred)]
        mine[i] += rows
        if writers:
            writers[i].add(rows, chunk_size)
        if bar is not None:
            advance_bar(bar, len(rows))
    return gather_answers(mine, writers, bar)


def _bar(progress: bool, splits: list[Split], skip: list[set[str]] | None, desc: str) -> Any:
    if not (progress and dist.is_main()):
        return None
    from mcit.core.progress import progress_bar

    left = sum(s.num_samples - (len(skip[i]) if skip else 0) for i, s in enumerate(splits))
    return progress_bar(left, desc, "sample")


def advance_bar(bar: Any, n: int) -> None:
    """Rank 0's ``n`` new answers as the whole launch's progress (each rank answers its share at about the same
    pace), never past the total: the ranks' shares differ by up to a batch, and a bar that overshot showed
    ``2560/?`` for 2400 samples."""
    bar.update(min(n * dist.world_size(), max(int(bar.total or 0) - bar.n, 0)))


def gather_answers(mine: list[list[dict]], writers: list[Any] | None, bar: Any) -> list[list[dict]]:
    """Commit what each writer holds, then every rank's rows of each split to rank 0."""
    for w in writers or []:
        w.flush()
    if bar is not None:  # every rank is at the gather: the whole pass is done
        bar.update(max(int(bar.total or 0) - bar.n, 0))
        bar.close()
    out = []
    for rows in mine:
        parts = dist.gather_objects(rows)
        out.append([r for part in parts for r in part] if dist.is_main() else [])
    return out


def answer_row(ref: dict[str, Any], pred: str, score: float, model_id: str) -> dict[str, Any]:
    """One line of an answer file: ours (key, question, answers, prediction, score) and CoIN's / LLaVA's
    model_vqa schema beside it (question_id, prompt, text, answer_id, model_id, metadata), so CoIN's
    evaluation scripts read our files as they are. question_id is the source record's id where the shards
    carry it (data_prep writes it), else the sample key; answer_id is the sample key (unique per run; the
    LLaVA scripts draw a random one). ``reference`` holds the answer and what else the scorer reads (a box, an
    image size, an OCRBench category: mcit.data.instructions.SCORER_KEYS), so every score can be recomputed from
    the row (``scorer(row["prediction"], {**row["reference"], "question": ..., "answers": ...})``)."""
    reference = {"answer": ref.get("answer"), **{k: ref[k] for k in SCORER_KEYS if k in ref}}
    return {"key": ref["key"], "question": ref["question"], "answers": ref["answers"], "prediction": pred,
            "score": score, "reference": reference, "question_id": ref.get("question_id", ref["key"]),
            "prompt": ref["question"].replace("<image>", "").strip(), "text": pred, "answer_id": ref["key"],
            "model_id": model_id, "metadata": {}}


@torch.no_grad()
def answer_generation(method: Method, splits: list[Split], *, batch_size: int, policy: str,
                      collates: list[Callable], scorers: list[str], max_new_tokens: int | list[int],
                      loader: LoaderOptions = LoaderOptions(), progress: bool = False, desc: str = "eval",
                      model_id: str = "mcit", skip: list[set[str]] | None = None, writers: list[Any] | None = None,
                      chunk_size: int = 256) -> list[list[dict]]:
    """Per split, every rank's answer rows (``answer_row``) gathered on rank 0 (``[]`` elsewhere). Each rank
    generates for its part of every split, minus the keys in ``skip``; a per-sample scorer scores each answer
    from the batch's references as it comes (a corpus metric or a judge scores the whole split later:
    ``score: null`` here); ``writers`` commit the rows in chunks as they come. ``max_new_tokens``: one cap, or one
    per split."""
    from mcit.core import caption_metrics as C
    from mcit.core import judge as J
    from mcit.core import scorers as S

    method.eval()
    device = dist.device()
    score_fns = [None if name in C.CORPUS or name in J.JUDGED else S.get(name) for name in scorers]
    mine: list[list[dict]] = [[] for _ in splits]
    bar = _bar(progress, splits, skip, desc)
    current = -1
    for i, batch in eval_parts(splits, collates, rank=dist.rank(), world=dist.world_size(), batch_size=batch_size,
                               policy=policy, loader=loader, skip=skip):
        if writers and i != current and current >= 0:
            writers[current].flush()
        current = i
        cap = max_new_tokens[i] if isinstance(max_new_tokens, list) else max_new_tokens
        preds = method.generate(batch.to(device, non_blocking=True), cap)
        score = score_fns[i]
        rows = [answer_row(ref, pred, None if score is None else score(pred, ref), model_id)
                for pred, ref in zip(preds, batch.meta)]
        mine[i] += rows
        if writers:
            writers[i].add(rows, chunk_size)
        if bar is not None:
            advance_bar(bar, len(rows))
    return gather_answers(mine, writers, bar)


@torch.no_grad()
def evaluate_loss(method: Method, split: Split, *, task: int, batch_size: int, policy: str,
                  collate: Callable, loader: LoaderOptions = LoaderOptions()) -> float:
    """Mean per-sample ``method.task_loss`` over ``split`` (its samples labelled as task ``task``),
    averaged over every rank's samples: one all_reduce, every rank gets the same value."""
    method.eval()
    device = dist.device()
    total = torch.zeros(2, dtype=torch.float64)
    for batch in eval_batches(split, rank=dist.rank(), world=dist.world_size(), batch_size=batch_size,
                              policy=policy, collate=collate, loader=loader):
        batch.task = task
        batch = batch.to(device, non_blocking=True)
        per_sample = method.task_loss(batch).detach().double().cpu()
        valid = batch.valid.detach().double().cpu()
        total[0] += float((per_sample * valid).sum())
        total[1] += float(valid.sum())
    dist.all_reduce_sum(total)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")
