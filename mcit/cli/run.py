"""Run a whole task sequence: ``deepspeed pipelines/run_task_sequence.py --config C [key.path=value ...]``.

Also works under ``torchrun`` and as plain ``python`` (one process), and as the command ``mcit-run``.
Re-running the same command resumes after the last committed stage; a finished run prints its summary
and does nothing else. ``--config`` may be given several times: the runs go one after another in one launch
(one launcher start and one process group for all of them: ``make demo``'s six methods), every config checked
before the first trains; re-running the command skips the finished runs and resumes the one that stopped.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from mcit.cli import common


def main(argv: list[str] | None = None) -> int:
    """The entry point; what the libraries print on the way goes to the run's rank log (mcit.core.console)."""
    return common.quietly(_main, argv)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, action="append",
                    help="YAML run config; repeat it to run several sequences one after another in this launch")
    ap.add_argument("--run-dir", default=None, help="run directory (default runs/<config name>; one config only)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=0.01 (applied to every config)")
    args = ap.parse_args(argv)
    from mcit.core.distributed import default_accelerator

    default_accelerator()  # before DeepSpeed is imported

    from mcit.core.config import ConfigError, load_config
    from mcit.core.rundir import RunDir
    from mcit.run.preflight import preflight
    from mcit.run.results import summary_text

    if args.run_dir and len(args.config) > 1:
        return common.fail(f"--run-dir names one run directory; {len(args.config)} configs were given (each runs "
                           f"in its own run_dir)")
    overrides = list(args.overrides) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    plans: list[Any] = []
    seen: dict[str, str] = {}
    try:  # every config and its inputs checked before anything trains
        for path in args.config:
            cfg = load_config(path, overrides)
            run = RunDir(cfg.resolved_run_dir())
            if str(run.root) in seen:
                raise ConfigError(f"{path}: its run directory {run.root} is also {seen[str(run.root)]}'s (give each "
                                  f"config its own run_dir)")
            seen[str(run.root)] = path
            done = run.finished_metrics()
            if done is not None:
                run.check_belongs_to(cfg)
                if common.is_rank0():
                    print(summary_text(done, run.root))
                    print(f"(run already finished; nothing to do. Delete {run.root} or set run_dir= to run again)")
                continue
            plans.append(preflight(cfg))
    except Exception as e:  # noqa: BLE001 - every pre-flight failure is one line and exit 2
        return common.before_launch(e)
    if not plans:
        return 0

    from mcit.core import console, preemption
    from mcit.core import distributed as dist

    dist.startup_moment("preflight")  # test seams only (mcit.core.distributed.on_startup)
    console.log_to(plans[0].run.logs / f"rank{os.environ.get('RANK', '0')}.log")
    try:
        with console.stdout_to_log("deepspeed"):  # its op builds print to stdout on every rank
            dist.init(timeout_s=max(p.cfg.train.collective_timeout_s for p in plans))
    except Exception as e:  # noqa: BLE001 - e.g. DeepSpeed's op lock held too long: one line (mcit.cli.common)
        return common.after_launch(e, plans[0].run_dir)
    preemption.install()
    for plan in plans:
        code = _run_one(plan)
        if code is not None:
            return code
    dist.shutdown()
    return 0


def _run_one(plan: Any) -> int | None:
    """One sequence under the launch's process group: its lock, its stages, its summary; None when it finished,
    else the launch's exit code (the ranks have stopped together)."""
    from mcit.core import console
    from mcit.core import distributed as dist
    from mcit.data.loader import shutdown_workers
    from mcit.run.pipeline import Pipeline
    from mcit.run.results import summary_text

    console.log_to(plan.run.logs / f"rank{os.environ.get('RANK', '0')}.log")
    lock = plan.run.lock
    holder = lock.acquire() if dist.is_main() else None
    if not dist.all_ok(holder is None):
        if dist.is_main():
            common.fail(f"run directory {plan.run.root} is in use by another launch ({holder}); wait for it to "
                        f"end, or stop it (its lock goes with it)")
        dist.shutdown()
        return common.BAD_INPUT
    dist.startup_moment("run_locked")

    def resume_hint() -> str:
        done = (plan.run.read_state() or {}).get("completed") or ["nothing"]
        return (f"state.json still ends at stage {done[-1]}: free space (or fix the permissions) and re-run the "
                f"same command to resume")

    try:
        metrics = Pipeline(plan).run()
    except Exception as e:  # noqa: BLE001 - mapped to one line and an exit code (mcit.cli.common)
        return common.after_launch(e, plan.run_dir, resume_hint=resume_hint)
    finally:
        shutdown_workers()  # the loader's persistent workers (mcit.data.loader.WorkerPool)
        lock.release()  # also dropped by the kernel if this process dies first
    if dist.is_main():
        print(summary_text(metrics, plan.run_dir))
    return None


if __name__ == "__main__":  # python -m mcit.cli.run (the command and pipelines/ start main too)
    common.script(main)
