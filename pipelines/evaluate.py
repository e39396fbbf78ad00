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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install


def exported_tasks(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_", 1)[1]) for p in run_dir.glob("checkpoints/task_*/method.safetensors"))


def main(argv: list[str] | None = None) -> int:
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
    from mcit.models.vit import BackboneError
    from mcit.pipeline import preflight

    def fail(msg: str) -> int:
        if rank0:
            print(f"error: {msg}", file=sys.stderr)
        return 2

    run_dir = args.run.resolve()
    if not (run_dir / "config.yaml").is_file():
        return fail(f"{run_dir} is not a run directory (no config.yaml)")
    overrides = [f"eval.batch_size={args.batch_size}"] if args.batch_size else []
    try:
        plan = preflight(load_config(run_dir / "config.yaml", overrides), run_dir=run_dir)
    except (ConfigError, DataError, BackboneError) as e:
        return fail(str(e))
    available = exported_tasks(run_dir)
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
        return fail(f"{run_dir}: no exported checkpoint after task {missing[0] if missing else '(any)'} "
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
    return evaluate(plan, ks, tasks, zero_shot=args.zero_shot, write_rows=args.write_rows)


def evaluate(plan, ks: list[int], tasks: list[int], *, zero_shot: bool, write_rows: bool) -> int:
    from mcit import distributed as dist
    from mcit import metrics as M
    from mcit.checkpoint import load_state, write_json
    from mcit.pipeline import Pipeline

    dist.init()
    pipe = Pipeline(plan)
    pipe.build_model()
    out_dir = plan.run_dir / "eval" / "evaluate"
    rows: list[tuple[str, list[float]]] = []
    jobs = ([("zero_shot", None)] if zero_shot else []) + [(f"after_task_{k}", k) for k in ks]
    for tag, k in jobs:
        if k is None:
            with pipe.method.zero_shot():
                row = pipe._eval_row("zero-shot eval", 0, tag, tasks, out_dir / "answers")
        else:
            pipe._reload(load_state(plan.run_dir / "checkpoints" / f"task_{k}" / "method.safetensors"))
            pipe.method.set_task(k)
            row = pipe._eval_row(f"after task {k}", k + 1, tag, tasks, out_dir / "answers")
            row["first_task_loss"] = pipe._first_task_loss()
        row.update({"tasks": [plan.names[i] for i in tasks], "checkpoint": None if k is None else k,
                    "world_size": dist.world_size()})
        if dist.is_main():
            write_json(out_dir / f"{tag}.json", row)
            if write_rows:
                write_json(plan.run_dir / "eval" / f"{tag}.json", {key: v for key, v in row.items()
                                                                  if key not in ("tasks", "checkpoint", "world_size")})
        rows.append((tag, row["acc"]))
    if dist.is_main():
        print(f"== {plan.cfg.name} · {plan.run_dir} · evaluated on {dist.world_size()} process(es) ==")
        width = max(len(plan.names[i]) for i in tasks)
        print(" " * 14 + " ".join(f"{plan.names[i]:>{max(width, 7)}}" for i in tasks))
        for tag, acc in rows:
            print(f"{tag:<14}" + " ".join(f"{a:>{max(width, 7)}.2f}" for a in acc))
        if write_rows:
            done = 0
            while (plan.run_dir / "eval" / f"after_task_{done}.json").is_file() and done < len(plan.names):
                done += 1
            if done:
                m = pipe.write_metrics(done)
                print(M.format_summary(m))
    dist.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
