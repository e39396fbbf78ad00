"""Evaluation-only passes: rows for a run's exported checkpoints without training (``mcit-evaluate``).

The run's training state (state.json, checkpoints, the accuracy-matrix rows) is not touched, except with
``write_rows``: then each evaluated row (all tasks) is also written as the run's own row and metrics.json /
report.md are recomputed, which fills in rows a run lost or never wrote.
"""

from __future__ import annotations

import os
import time

from mcit.core import console
from mcit.core import distributed as dist
from mcit.core.checkpoint import load_state, write_json
from mcit.core.rundir import row_tag
from mcit.data.loader import shutdown_workers
from mcit.run.evaluation import evaluate_row, first_task_loss
from mcit.run.lifecycle import MethodHost
from mcit.run.plan import Plan
from mcit.run.results import write_metrics


def worker_row(plan: Plan, tag: str, follow: bool = False) -> bool:
    """A deferred run's evaluation worker (``mcit-evaluate --worker-row TAG [--follow]``, started by the run:
    mcit.run.deferred): the row ``tag`` of the run itself, as its inline eval stage would write it (the row, its
    answers, its cells), under the row's worker lock; ``follow``: then every row committed after it, as they come,
    while the run's launch lives (``deferred.next_row``), on the model loaded once. False when it answered none
    (another worker held the lock, or the row was in)."""
    from mcit.core.rundir import RunDirLock
    from mcit.run.deferred import WAIT, next_row, tag_row, take_over

    run = plan.run
    log = console.log_to(run.logs / f"eval_worker.{tag}.rank{os.environ.get('RANK', '0')}.log")
    with console.stdout_to_log("deepspeed"):
        dist.init()
    host = MethodHost(plan)
    first, answered = tag, 0
    current: str | None = tag
    while current is not None:
        k = tag_row(current)
        lock = RunDirLock(run.root / "eval" / "workers" / f"{current}.lock")
        holder = lock.acquire() if dist.is_main() else None
        if not dist.all_ok(holder is None) or run.row(k).is_file():
            if dist.is_main():
                print(f"row {current}: " + (f"another worker evaluates it ({holder})" if holder else "already in"),
                      flush=True)
        else:
            if current != first:
                dist.on_main(lambda c=current: take_over(run, c, first, log))
            row = _answer_row(host, k)
            dist.on_main(lambda k=k, row=row: write_json(run.row(k), row))
            answered += 1
            if dist.is_main():
                print(f"row {current}: " + " ".join(f"{a:.2f}" for a in row["acc"]), flush=True)
        lock.release()
        current = None
        while follow:  # every rank takes part in each look: a wait longer than the collective timeout is fine
            current = dist.broadcast_object(next_row(plan) if dist.is_main() else None)
            if current != WAIT:
                break
            time.sleep(plan.cfg.eval.poll_s)
    shutdown_workers()
    dist.shutdown()
    return answered > 0


def _answer_row(host: MethodHost, k: int | None) -> dict:
    """The row after task ``k`` (None: the zero-shot row) from the run's committed state, as its eval stage."""
    run = host.plan.run
    if k is None:
        host.load(load_state(run.zero_shot_state))
        with host.zero_shot():
            return evaluate_row(host, trained=0, answers_dir=run.answers(None), desc="zero-shot eval")
    host.load(load_state(run.task_state(k)))
    host.enter_eval(k)
    row = evaluate_row(host, trained=k + 1, answers_dir=run.answers(k), desc=f"task {k} eval")
    row["first_task_loss"] = first_task_loss(host)
    return row


def evaluate_checkpoints(plan: Plan, ks: list[int], tasks: list[int], *, zero_shot: bool,
                         write_rows: bool) -> list[tuple[str, list[float]]]:
    """Rows for the checkpoints after tasks ``ks`` (and the zero-shot row) on ``tasks``, written to
    ``eval/evaluate/after_task_K.json`` (and the answers beside them); printed as a table on rank 0.
    Starts and ends the process group; returns (row tag, accuracies) per row."""
    console.log_to(plan.run.logs / f"evaluate.rank{os.environ.get('RANK', '0')}.log")
    with console.stdout_to_log("deepspeed"):  # its op builds print to stdout on every rank
        dist.init()
    run = plan.run
    host = MethodHost(plan)
    host.build()
    results: list[tuple[str, list[float]]] = []
    for k in ([None] if zero_shot else []) + ks:
        if k is None:
            if run.zero_shot_state.is_file():  # the state the run's own zero-shot row saw
                host.load(load_state(run.zero_shot_state))
            with host.zero_shot():
                row = evaluate_row(host, trained=0, tasks=tasks, answers_dir=run.answers(None, evaluate_only=True),
                                   desc="zero-shot eval")
        else:
            host.load(load_state(run.task_state(k)))
            host.enter_eval(k)
            row = evaluate_row(host, trained=k + 1, tasks=tasks, answers_dir=run.answers(k, evaluate_only=True),
                               desc=f"after task {k}")
            row["first_task_loss"] = first_task_loss(host)

        def write(k: int | None = k, row: dict = row) -> None:
            write_json(run.row(k, evaluate_only=True), {**row, "tasks": [plan.names[i] for i in tasks],
                                                         "checkpoint": k, "world_size": dist.world_size()})
            if write_rows:
                write_json(run.row(k), row)

        dist.on_main(write)
        results.append((row_tag(k), row["acc"]))
    if dist.is_main():
        from mcit.core import metrics as M

        print(f"== {plan.cfg.name} · {run.root} · evaluated on {dist.world_size()} process(es) ==")
        width = max(len(plan.names[i]) for i in tasks)
        print(" " * 14 + " ".join(f"{plan.names[i]:>{max(width, 7)}}" for i in tasks))
        for tag, acc in results:
            print(f"{tag:<14}" + " ".join(f"{a:>{max(width, 7)}.2f}" for a in acc))
        if write_rows:
            done = run.rows_done(plan.num_stages)
            if done:
                print(M.format_summary(write_metrics(plan, done)))
    shutdown_workers()
    dist.shutdown()
    return results
