#!/usr/bin/env python
"""Score a run's checkpoints without training: ``python pipelines/evaluate.py --run RUN_DIR``.

    python pipelines/evaluate.py --run runs/X [--task-checkpoint K [K ...] | all] [--zero-shot]
                                 [--tasks NAME ...] [--batch-size B] [--write-rows]
    deepspeed --num_gpus 2 pipelines/evaluate.py --run runs/X ...   (or torchrun / srun: sharded)

Loads the run's own config (``RUN_DIR/config.yaml``) and the consolidated export of task K
(``checkpoints/task_K/method.safetensors``, no DeepSpeed state needed, any world size), evaluates the
chosen tasks sharded across ranks with the run's class-incremental protocol (after task K only the
classes of tasks 0..K can be predicted) and writes ``eval/evaluate/after_task_K.json`` (and, for
instruction tasks, the answers under ``eval/evaluate/answers/after_task_K/``). The run's training
state (state.json, checkpoints, the accuracy-matrix rows) is not touched, except with
``--write-rows``: then each evaluated row (all tasks) is written as ``eval/after_task_K.json`` and
metrics.json / report.md are recomputed, which fills in rows a run lost or never wrote.
Default: the last exported checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    """The entry point; what the libraries print on the way goes to ``logs/evaluate.rank<r>.log``."""
    from mcit import console

    with console.quiet():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--run", type=Path, required=True, help="the run directory")
    ap.add_argument("--task-checkpoint", nargs="+", default=None, metavar="K",
                    help="the checkpoints after these tasks (indices, or 'all'; default: the last one)")
    ap.add_argument("--zero-shot", action="store_true", help="evaluate the zero-shot row (no checkpoint)")
    ap.add_argument("--tasks", nargs="+", default=None, help="task names or indices to evaluate (default all)")
    ap.add_argument("--batch-size", type=int, default=None, help="eval batch size (results do not depend on it)")
    ap.add_argument("--write-rows", action="store_true",
                    help="store the rows as the run's accuracy-matrix rows and recompute metrics.json")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    rank0 = os.environ.get("RANK", "0") == "0"
    from mcit.distributed import default_accelerator

    default_accelerator()

    from mcit.config import ConfigError, load_config
    from mcit.data.shards import DataError
    from mcit.models.base import BackboneError
    from mcit.preflight import preflight
    from mcit.rundir import RunDir

    def fail(msg: str) -> int:
        if rank0:
            print(f"error: {msg}", file=sys.stderr)
        return 2

    if args.batch_size is not None and args.batch_size < 1:
        return fail(f"--batch-size must be at least 1, got {args.batch_size}")
    run = RunDir(args.run.resolve())
    if not run.config.is_file():
        return fail(f"{run.root} is not a run directory (no config.yaml)")
    overrides = [f"eval.batch_size={args.batch_size}"] if args.batch_size is not None else []
    try:
        plan = preflight(load_config(run.config, overrides), run_dir=run.root)
    except (ConfigError, DataError, BackboneError) as e:
        return fail(str(e))
    available = run.exported_tasks()
    if args.task_checkpoint is None:
        ks = [] if args.zero_shot else available[-1:]
    elif args.task_checkpoint == ["all"]:
        ks = available
    else:
        try:
            ks = [int(k) for k in args.task_checkpoint]
        except ValueError:
            return fail(f"--task-checkpoint: expected task indices or 'all', got {args.task_checkpoint}")
    missing = [k for k in ks if k not in available]
    if missing or (not ks and not args.zero_shot):
        return fail(f"{run.root}: no exported checkpoint after task {missing[0] if missing else '(any)'} "
                    f"(exported: {available or 'none'})")
    names = plan.names
    if args.tasks is None:
        tasks = list(range(len(names)))
    else:
        tasks = []
        for t in args.tasks:
            if t.isdigit() and int(t) < len(names):
                tasks.append(int(t))
            elif t in names:
                tasks.append(names.index(t))
            else:
                return fail(f"--tasks: unknown task {t!r}; the run has {', '.join(names)}")
    if args.write_rows and tasks != list(range(len(names))):
        return fail("--write-rows needs every task evaluated (leave out --tasks)")
    from mcit.checkpoint import WriteError
    from mcit.distributed import PeerFailed

    try:
        return evaluate(plan, ks, tasks, zero_shot=args.zero_shot, write_rows=args.write_rows)
    except WriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except PeerFailed:  # rank 0 says why
        return 1


def evaluate(plan: Any, ks: list[int], tasks: list[int], *, zero_shot: bool, write_rows: bool) -> int:
    """Rows for the checkpoints after tasks ``ks`` (and the zero-shot row) on ``tasks``; see the module doc."""
    from mcit import distributed as dist
    from mcit import metrics as M
    from mcit.checkpoint import load_state, write_json
    from mcit.evaluation import evaluate_row, first_task_loss
    from mcit.lifecycle import MethodHost
    from mcit.pipeline import write_metrics
    from mcit.rundir import row_tag

    from mcit import console

    console.log_to(plan.run.logs / f"evaluate.rank{os.environ.get('RANK', '0')}.log")
    with console.stdout_to_log("deepspeed"):  # its op builds print to stdout on every rank
        dist.init()
    run = plan.run
    host = MethodHost(plan)
    host.build()
    results: list[tuple[str, list[float]]] = []
    for k in ([None] if zero_shot else []) + ks:
        if k is None:
            with host.zero_shot():
                row = evaluate_row(host, trained=0, tasks=tasks, answers_dir=run.answers(None, evaluate_only=True),
                                   desc="zero-shot eval")
        else:
            host.load(load_state(run.task_state(k)))
            host.enter_eval(k)
            row = evaluate_row(host, trained=k + 1, tasks=tasks, answers_dir=run.answers(k, evaluate_only=True),
                               desc=f"after task {k}")
            row["first_task_loss"] = first_task_loss(host)
        def write() -> None:
            write_json(run.row(k, evaluate_only=True), {**row, "tasks": [plan.names[i] for i in tasks],
                                                         "checkpoint": k, "world_size": dist.world_size()})
            if write_rows:
                write_json(run.row(k), row)

        dist.on_main(write)
        results.append((row_tag(k), row["acc"]))
    if dist.is_main():
        print(f"== {plan.cfg.name} · {run.root} · evaluated on {dist.world_size()} process(es) ==")
        width = max(len(plan.names[i]) for i in tasks)
        print(" " * 14 + " ".join(f"{plan.names[i]:>{max(width, 7)}}" for i in tasks))
        for tag, acc in results:
            print(f"{tag:<14}" + " ".join(f"{a:>{max(width, 7)}.2f}" for a in acc))
        if write_rows:
            done = run.rows_done(plan.num_stages)
            if done:
                print(M.format_summary(write_metrics(plan, done)))
    from mcit.data.loader import shutdown_workers

    shutdown_workers()
    dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install
    from mcit.distributed import exit_process

    exit_process(main())
