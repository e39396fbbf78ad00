"""Score a run's checkpoints without training: ``python pipelines/evaluate.py --run RUN_DIR``.

    python pipelines/evaluate.py --run runs/X [--task-checkpoint K [K ...] | all] [--zero-shot]
                                 [--tasks NAME ...] [--batch-size B] [--write-rows] [--recompute]
                                 [eval.KEY=VALUE ...]
    python pipelines/evaluate.py --run runs/X --lmms-eval TASK ... [--lmms-include DIR] [--zero-shot] [...]
    python pipelines/evaluate.py --rescore --run runs/X|runs/sweeps/S [--config C]   (no model loaded)
    deepspeed --num_gpus 2 pipelines/evaluate.py --run runs/X ...   (or torchrun / srun: sharded; or mcit-evaluate)

Loads the run's own config (``RUN_DIR/config.yaml``) and the consolidated export of task K
(``checkpoints/task_K/method.safetensors``, no DeepSpeed state needed, any world size), evaluates the
chosen tasks sharded across ranks with the run's class-incremental protocol (after task K only the
classes of tasks 0..K can be predicted) and writes ``eval/evaluate/after_task_K.json`` (and, for
instruction tasks, the answers under ``eval/evaluate/answers/after_task_K/``). The run's training
state (state.json, checkpoints, the accuracy-matrix rows) is not touched, except with
``--write-rows``: then each evaluated row (all tasks) is written as ``eval/after_task_K.json`` and
metrics.json / report.md are recomputed, which fills in rows a run lost or never wrote.
Default: the last exported checkpoint. ``--lmms-eval TASKS`` scores general ability instead: lmms-eval's task
definitions answered by the checkpoint (mcit.run.general_ability), rows under ``eval/general/``.
Answers come from the run's evaluation cells where their key matches (mcit.run.cells: the pipeline's own rows
are reused, not generated again); ``--recompute`` answers every sample again. ``--rescore`` scores the stored
answers of a run, or of every run of a sweep, again with the current scorers (or those of ``--config``) and
rewrites rows, metrics.json and report.md without loading the model (mcit.run.rescore).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mcit.cli import common


def main(argv: list[str] | None = None) -> int:
    """The entry point; what the libraries print on the way goes to ``logs/evaluate.rank<r>.log``."""
    return common.quietly(_main, argv)


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
    ap.add_argument("--lmms-eval", nargs="+", default=None, metavar="TASK",
                    help="lmms-eval tasks (general ability) instead of the run's own: rows under eval/general/, "
                         "a table in report.md (one process; needs the lmms extra)")
    ap.add_argument("--lmms-include", nargs="+", type=Path, default=[], metavar="DIR",
                    help="folders of lmms-eval task files (e.g. a task over local data); without one, lmms-eval's "
                         "own tasks")
    ap.add_argument("--lmms-limit", type=int, default=None, help="the first N questions of each lmms-eval task")
    ap.add_argument("--recompute", action="store_true",
                    help="answer every sample again instead of reusing the run's evaluation cells")
    ap.add_argument("--rescore", action="store_true",
                    help="score the stored answers of --run (a run or a sweep directory) again, without the model: "
                         "rows, metrics.json, report.md (a sweep: also its tables)")
    ap.add_argument("--config", type=Path, default=None,
                    help="--rescore: the run's config with other task scorers (data.tasks[i].scorer, eval.judge)")
    ap.add_argument("--worker-row", default=None, metavar="ROW",
                    help="a deferred run's evaluation worker (started by the run): its row ROW (zero_shot or "
                         "after_task_<t>), written as the run's own")
    ap.add_argument("--follow", action="store_true",
                    help="--worker-row: then the rows committed after it, as they come, while the run's launch lives")
    ap.add_argument("overrides", nargs="*", metavar="eval.KEY=VALUE",
                    help="evaluation settings for this pass (e.g. eval.max_new_tokens=32): cells whose key they "
                         "change are answered again")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("task_checkpoint", "tasks"):  # a list option swallows the settings that follow it
        values = getattr(args, name)
        if values:
            setattr(args, name, [v for v in values if "=" not in v] or None)
            args.overrides += [v for v in values if "=" in v]
    if args.rescore or args.config is not None:
        return _rescore(args)
    from mcit.core.distributed import default_accelerator

    default_accelerator()  # before DeepSpeed is imported

    from mcit.core.config import load_config
    from mcit.core.rundir import RunDir
    from mcit.run.preflight import preflight

    if args.batch_size is not None and args.batch_size < 1:
        return common.fail(f"--batch-size must be at least 1, got {args.batch_size}")
    run = RunDir(args.run.resolve())
    if not run.config.is_file():
        return common.fail(f"{run.root} is not a run directory (no config.yaml)")
    overrides = [f"eval.batch_size={args.batch_size}"] if args.batch_size is not None else []
    overrides += ["eval.reuse=false"] if args.recompute else []
    for o in args.overrides:
        if not o.startswith("eval.") or "=" not in o:
            return common.fail(f"{o!r}: an evaluation pass takes eval.KEY=VALUE settings only; the rest of the run's "
                               f"config decides what its checkpoints are")
    overrides += args.overrides
    try:
        plan = preflight(load_config(run.config, overrides), run_dir=run.root)
    except Exception as e:  # noqa: BLE001 - every pre-flight failure is one line and exit 2
        return common.before_launch(e)
    if args.worker_row is not None:
        from mcit.run.deferred import tag_row
        from mcit.run.evaluate_only import worker_row

        try:
            k = tag_row(args.worker_row)
        except (ValueError, IndexError):
            return common.fail(f"--worker-row: a row is zero_shot or after_task_<t>, not {args.worker_row!r}")
        state = run.zero_shot_state if k is None else run.task_state(k)
        if not state.is_file():
            return common.fail(f"--worker-row {args.worker_row}: {state} does not exist (not committed yet?)")
        try:
            worker_row(plan, args.worker_row, follow=args.follow)
        except Exception as e:  # noqa: BLE001 - mapped to one line and an exit code (mcit.cli.common)
            return common.after_launch(e, plan.run_dir)
        return 0
    available = run.exported_tasks()
    if args.task_checkpoint is None:
        ks = [] if args.zero_shot else available[-1:]
    elif args.task_checkpoint == ["all"]:
        ks = available
    else:
        try:
            ks = [int(k) for k in args.task_checkpoint]
        except ValueError:
            return common.fail(f"--task-checkpoint: expected task indices or 'all', got {args.task_checkpoint}")
    missing = [k for k in ks if k not in available]
    if missing or (not ks and not args.zero_shot):
        return common.fail(f"{run.root}: no exported checkpoint after task {missing[0] if missing else '(any)'} "
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
                return common.fail(f"--tasks: unknown task {t!r}; the run has {', '.join(names)}")
    if args.write_rows and tasks != list(range(len(names))):
        return common.fail("--write-rows needs every task evaluated (leave out --tasks)")
    if args.lmms_eval is not None:
        if args.tasks is not None or args.write_rows:
            return common.fail("--lmms-eval evaluates lmms-eval's tasks: leave out --tasks and --write-rows")
        from mcit.run.general_ability import LmmsEvalError, evaluate_general, import_lmms

        try:
            import_lmms()
        except LmmsEvalError as e:
            return common.fail(str(e))
        try:
            rows = evaluate_general(plan, ks, args.lmms_eval, zero_shot=args.zero_shot, include=args.lmms_include,
                                    limit=args.lmms_limit)
        except LmmsEvalError as e:
            return common.fail(str(e))
        except Exception as e:  # noqa: BLE001 - mapped to one line and an exit code (mcit.cli.common)
            return common.after_launch(e, plan.run_dir)
        for tag, res in rows:
            print(f"{tag}: " + "  ".join(f"{t} {m}={v:.4g}" for t, ms in res.items() for m, v in ms.items()))
        return 0
    from mcit.run.evaluate_only import evaluate_checkpoints

    try:
        evaluate_checkpoints(plan, ks, tasks, zero_shot=args.zero_shot, write_rows=args.write_rows)
    except Exception as e:  # noqa: BLE001 - mapped to one line and an exit code (mcit.cli.common)
        return common.after_launch(e, plan.run_dir)
    return 0


def _rescore(args: argparse.Namespace) -> int:
    """``--rescore``: every row of a run (or of each run of a sweep) from its stored answers; no model, no ranks."""
    if not args.rescore:
        return common.fail("--config is read by --rescore only (an evaluation pass uses the run's own config)")
    other = [flag for flag, on in (("--task-checkpoint", args.task_checkpoint), ("--zero-shot", args.zero_shot),
                                   ("--tasks", args.tasks), ("--batch-size", args.batch_size),
                                   ("--write-rows", args.write_rows), ("--lmms-eval", args.lmms_eval),
                                   ("--recompute", args.recompute), ("eval settings", args.overrides)) if on]
    if other:
        return common.fail(f"--rescore reads the stored answers of every row; leave out {other[0]}")
    from mcit.core.config import ConfigError
    from mcit.run.rescore import RescoreError, rescore

    try:
        done = rescore(args.run.resolve(), args.config)
    except (RescoreError, ConfigError, FileNotFoundError) as e:
        return common.fail(str(e))
    from mcit.core import metrics as M

    for run, metrics in done:
        print(f"== rescored {run}")
        if metrics:
            print(M.format_summary(metrics))
    sweep = args.run / "sweep.json"
    if sweep.is_file():  # a sweep: its tables and figures from the rescored runs
        import json

        from mcit.studies import results
        from mcit.studies.spec import SweepSpec, expand

        try:
            spec = SweepSpec.model_validate(json.loads(sweep.read_text())["spec"])
            points = expand(spec, materialize=False)
        except Exception as e:  # noqa: BLE001 - the sweep's configs moved or changed: one line
            return common.fail(f"{sweep}: the runs are rescored, the tables not ({e})")
        agg = results.aggregate(spec, points)
        files = results.write_tables(spec, agg) + results.figures(spec, agg)
        print(results.markdown(agg))
        print("written: " + " ".join(str(f) for f in files))
    return 0


if __name__ == "__main__":  # python -m mcit.cli.evaluate (the command and pipelines/ start main too)
    common.script(main)
