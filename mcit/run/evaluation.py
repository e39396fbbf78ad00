"""Evaluation of every task, sharded across ranks: classification accuracy or scored generations.

``evaluate_row`` (one accuracy-matrix row) and ``first_task_loss`` serve both the pipeline's eval
stage and ``pipelines/evaluate.py``. No collectives run inside the loops (ranks may hold different
numbers of test samples); one all_reduce of (correct, total) per task at the end. Predictions are per
sample, so the result does not depend on ``eval.batch_size``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from mcit.core import distributed as dist
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
    every class allowed); instruction tasks write their answers under ``answers_dir``."""
    plan, cfg, method = host.plan, host.cfg, host.method
    tasks = list(range(len(plan.test))) if tasks is None else tasks
    tests = [plan.test[i] for i in tasks]
    collates = [host.collate(i, train=False) for i in tasks]
    if plan.scorers is not None:
        scorers = [plan.scorers[i] for i in tasks]
        res = evaluate_generation(method, tests, batch_size=cfg.eval.batch_size, policy=cfg.data.split,
                                  collates=collates, loader=plan.loader, scorers=scorers,
                                  max_new_tokens=[cfg.task_max_new_tokens(i) for i in tasks],
                                  answers_dir=answers_dir, progress=cfg.train.progress, desc=desc, file_ids=tasks,
                                  model_id=cfg.backbone.tag if cfg.backbone.tag != "local"
                                  else Path(cfg.backbone.path).name, judge=cfg.eval.judge)
        return {"score_sum": [c for c, _ in res], "total": [n for _, n in res],
                "acc": [100.0 * c / max(n, 1) for c, n in res], "scorers": scorers}
    allowed = None
    if cfg.eval.mask_unseen_classes and trained > 0:
        allowed = torch.zeros(plan.sequence.num_classes, dtype=torch.bool)
        for task in plan.sequence.tasks[:trained]:
            allowed[list(task.classes)] = True
    res = evaluate_tasks(method, tests, batch_size=cfg.eval.batch_size, policy=cfg.data.split, collates=collates,
                         loader=plan.loader, allowed_classes=allowed, progress=cfg.train.progress, desc=desc)
    return {"correct": [c for c, _ in res], "total": [n for _, n in res],
            "acc": [100.0 * c / max(n, 1) for c, n in res]}


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
def evaluate_tasks(method: Method, splits: list[Split], *, batch_size: int, policy: str, collates: list[Callable],
                   loader: LoaderOptions = LoaderOptions(), allowed_classes: torch.Tensor | None = None,
                   progress: bool = False, desc: str = "eval") -> list[tuple[int, int]]:
    """(correct, total) per split, summed over ranks. ``allowed_classes``: bool mask over classes."""
    method.eval()
    device = dist.device()
    counts = torch.zeros(len(splits), 2, dtype=torch.float64)
    bar = None
    if progress and dist.is_main():
        from mcit.core.progress import progress_bar

        bar = progress_bar(sum(s.num_samples for s in splits), desc, "sample")
    for i, batch in eval_parts(splits, collates, rank=dist.rank(), world=dist.world_size(), batch_size=batch_size,
                               policy=policy, loader=loader):
        batch.allowed_classes = allowed_classes
        batch = batch.to(device, non_blocking=True)
        pred = method.predict(batch)
        counts[i, 0] += float((pred == batch.labels).sum())
        counts[i, 1] += len(batch)
        if bar is not None:
            bar.update(len(batch) * dist.world_size())
    if bar is not None:
        bar.close()
    dist.all_reduce_sum(counts)
    return [(int(c), int(n)) for c, n in counts.tolist()]


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
def evaluate_generation(method: Method, splits: list[Split], *, batch_size: int, policy: str,
                        collates: list[Callable], scorers: list[str], max_new_tokens: int | list[int],
                        loader: LoaderOptions = LoaderOptions(),
                        answers_dir: Any | None = None, progress: bool = False,
                        desc: str = "eval", file_ids: list[int] | None = None,
                        model_id: str = "mcit", judge: Any | None = None) -> list[tuple[float, int]]:
    """(summed score, count) per split. Each rank generates for its part of every split; the answers
    are gathered to rank 0, which writes ``answers_dir/<task index>.jsonl`` (``answer_row``) sorted by key,
    so scores can be recomputed without the model. A corpus scorer (mcit.core.caption_metrics: CIDEr, MCITlib's
    caption average) scores the gathered answers once (rows carry ``score: null``; the task's number and
    every metric go to ``<task index>.metrics.json``); its summed score is the corpus value x count. A judged
    scorer (mcit.core.judge: MLLM-ACL Math) scores the gathered answers on rank 0 with the local judge model of
    ``judge`` (eval.judge), loaded once when a row needs it; each row keeps the judge's reply.
    ``file_ids``: the task index of each split (default its position); ``max_new_tokens``: one cap, or one per
    split."""
    import json

    from mcit.core import caption_metrics as C
    from mcit.core import scorers as S
    from mcit.core.checkpoint import atomic_write_text

    method.eval()
    device = dist.device()
    out: list[tuple[float, int]] = []
    bar = None
    if progress and dist.is_main():
        from mcit.core.progress import progress_bar

        bar = progress_bar(sum(s.num_samples for s in splits), desc, "sample")
    from mcit.core import judge as J

    judged = [name in J.JUDGED for name in scorers]
    local_judge: list[Any] = []  # loaded on rank 0 at the first judged task

    def judge_rows(name: str, rows: list[dict]) -> list[dict]:
        def generate(prompts: list[str]) -> list[str]:
            if not local_judge:
                local_judge.append(J.LocalJudge(judge.path, judge.max_new_tokens, judge.batch_size))
            return local_judge[0](prompts)

        return J.score_rows(name, rows, generate)

    corpora = [name in C.CORPUS for name in scorers]  # a corpus metric (CIDEr ...): scored once over all answers
    score_fns = [None if corpus or j else S.get(name) for corpus, j, name in zip(corpora, judged, scorers)]
    answered: list[list[dict]] = [[] for _ in splits]
    for i, batch in eval_parts(splits, collates, rank=dist.rank(), world=dist.world_size(), batch_size=batch_size,
                               policy=policy, loader=loader):
        cap = max_new_tokens[i] if isinstance(max_new_tokens, list) else max_new_tokens
        preds = method.generate(batch.to(device, non_blocking=True), cap)
        score = score_fns[i]
        for pred, ref in zip(preds, batch.meta):
            answered[i].append(answer_row(ref, pred, None if score is None else score(pred, ref), model_id))
        if bar is not None:
            bar.update(len(batch) * dist.world_size())
    for i, rows in enumerate(answered):
        corpus = corpora[i]
        gathered = sorted((r for part in dist.gather_objects(rows) for r in part), key=lambda r: r["key"])
        name = f"{file_ids[i] if file_ids else i}"
        if corpus:  # rank 0 runs the metric; every rank gets its value
            value, table = dist.broadcast_object(C.score_rows(scorers[i], gathered) if dist.is_main() else None)
            if answers_dir is not None:
                summary = {"scorer": scorers[i], "score": value, "metrics": table, "samples": len(gathered)}
                dist.on_main(functools.partial(atomic_write_text, answers_dir / f"{name}.metrics.json",
                                               json.dumps(summary, indent=1)))  # small: built on every rank
            total = value * len(gathered)
        elif judged[i]:  # rank 0 asks the judge; every rank gets the scores
            scored = dist.broadcast_object(judge_rows(scorers[i], gathered) if dist.is_main() else None)
            for r, sc in zip(gathered, scored):
                r.update(sc)
            total = float(sum(r["score"] for r in gathered))
        else:
            total = float(sum(r["score"] for r in gathered))
        if answers_dir is not None:
            def write_answers(path: Path = answers_dir / f"{name}.jsonl", rows: list[dict] = gathered) -> None:
                atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))  # rank 0 alone serialises

            dist.on_main(write_answers)
        out.append((float(total), len(gathered)))
    if bar is not None:
        bar.close()
    return out


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
