"""Run a whole task sequence: ``deepspeed pipelines/run_task_sequence.py --config C [key.path=value ...]``.

Also works under ``torchrun`` and as plain ``python`` (one process), and as the command ``mcit-run``.
Re-running the same command resumes after the last committed stage; a finished run prints its summary
and does nothing else.
"""

from __future__ import annotations

import argparse
import os

from mcit.cli import common


def main(argv: list[str] | None = None) -> int:
    """The entry point; what the libraries print on the way goes to the run's rank log (mcit.core.console)."""
    return common.quietly(_main, argv)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="YAML run config")
    ap.add_argument("--run-dir", default=None, help="run directory (default runs/<config name>)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=0.01")
    args = ap.parse_args(argv)
    from mcit.core.distributed import default_accelerator

    default_accelerator()  # before DeepSpeed is imported

    from mcit.core.config import load_config
    from mcit.core.rundir import RunDir
    from mcit.run.preflight import preflight
    from mcit.run.results import summary_text

    overrides = list(args.overrides) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    try:
        cfg = load_config(args.config, overrides)
        run = RunDir(cfg.resolved_run_dir())
        done = run.finished_metrics()
        if done is not None:
            run.check_belongs_to(cfg)
            if common.is_rank0():
                print(summary_text(done, run.root))
                print(f"(run already finished; nothing to do. Delete {run.root} or set run_dir= to run again)")
            return 0
        plan = preflight(cfg)
    except Exception as e:  # noqa: BLE001 - every pre-flight failure is one line and exit 2
        return common.before_launch(e)

    from mcit.core import console, preemption
    from mcit.core import distributed as dist
    from mcit.data.loader import shutdown_workers
    from mcit.run.pipeline import Pipeline

    dist.startup_moment("preflight")  # test seams only (mcit.core.distributed.on_startup)
    console.log_to(plan.run.logs / f"rank{os.environ.get('RANK', '0')}.log")
    try:
        with console.stdout_to_log("deepspeed"):  # its op builds print to stdout on every rank
            dist.init(timeout_s=cfg.train.collective_timeout_s)
    except Exception as e:  # noqa: BLE001 - e.g. DeepSpeed's op lock held too long: one line (mcit.cli.common)
        return common.after_launch(e, plan.run_dir)
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

    preemption.install()
    try:
        metrics = Pipeline(plan).run()
    except Exception as e:  # noqa: BLE001 - mapped to one line and an exit code (mcit.cli.common)
        return common.after_launch(e, plan.run_dir, resume_hint=resume_hint)
    finally:
        shutdown_workers()  # the loader's persistent workers (mcit.data.loader.WorkerPool)
        lock.release()  # also dropped by the kernel if this process dies first
    if dist.is_main():
        print(summary_text(metrics, plan.run_dir))
    dist.shutdown()
    return 0


if __name__ == "__main__":  # python -m mcit.cli.run (the command and pipelines/ start main too)
    common.script(main)
