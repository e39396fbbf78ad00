#!/usr/bin/env python
"""Run a whole task sequence: ``deepspeed pipelines/run_task_sequence.py --config C [key.path=value ...]``.

Also works under ``torchrun`` and as plain ``python`` (one process). Re-running the same command
resumes after the last committed stage; a finished run prints its summary and does nothing else.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _unexpected(e: BaseException, run_root: Path | None) -> None:
    """One line on rank 0 for an exception nobody anticipated; every rank's traceback goes to
    ``<run_dir>/logs/traceback.rank<r>.txt`` (a temporary file where there is no usable run directory)."""
    import tempfile
    import traceback

    rank = os.environ.get("RANK", "0")
    text = "".join(traceback.format_exception(e))
    where = None
    if run_root is not None:
        try:
            (run_root / "logs").mkdir(parents=True, exist_ok=True)
            where = run_root / "logs" / f"traceback.rank{rank}.txt"
            where.write_text(text)
        except OSError:
            where = None
    if where is None:
        fd, name = tempfile.mkstemp(prefix=f"mcit-traceback-rank{rank}-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        where = Path(name)
    if rank == "0":
        first = (str(e).splitlines() or [""])[0]
        print(f"error: {e.__class__.__name__}: {first} (traceback in {where})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """The entry point; what the libraries print on the way goes to the run's rank log (mcit.console)."""
    from mcit import console

    with console.quiet():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    from mcit import console

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="YAML run config")
    ap.add_argument("--run-dir", default=None, help="run directory (default runs/<config name>)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=0.01")
    args = ap.parse_args(argv)
    from mcit.distributed import default_accelerator

    default_accelerator()

    from mcit.config import ConfigError, load_config
    from mcit.data.shards import DataError
    from mcit.models.base import BackboneError
    from mcit.pipeline import Pipeline, summary_text
    from mcit.preflight import preflight
    from mcit.rundir import RunDir, RunDirError

    overrides = list(args.overrides) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    try:
        cfg = load_config(args.config, overrides)
        run = RunDir(cfg.resolved_run_dir())
        done = run.finished_metrics()
        if done is not None:
            run.check_belongs_to(cfg)
            if _is_rank0():
                print(summary_text(done, run.root))
                print(f"(run already finished; nothing to do. Delete {run.root} or set run_dir= to run again)")
            return 0
        plan = preflight(cfg)
    except (ConfigError, DataError, BackboneError, RunDirError) as e:
        if _is_rank0():
            print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - anything else in pre-flight: one line, the traceback kept
        _unexpected(e, None)
        return 2

    from mcit import distributed as dist
    from mcit import preemption
    from mcit.checkpoint import WriteError
    from mcit.data.loader import shutdown_workers
    from mcit.engine import NonFiniteError
    from mcit.pipeline import CollectiveError

    console.log_to(plan.run.logs / f"rank{os.environ.get('RANK', '0')}.log")
    with console.stdout_to_log("deepspeed"):  # its op builds print to stdout on every rank
        dist.init(timeout_s=cfg.train.collective_timeout_s)
    lock = plan.run.lock
    holder = lock.acquire() if dist.is_main() else None
    if not dist.all_ok(holder is None):
        if dist.is_main():
            print(f"error: run directory {plan.run.root} is in use by another launch ({holder}); wait for it to "
                  f"end, or stop it (its lock goes with it)", file=sys.stderr)
        dist.shutdown()
        return 2
    preemption.install()
    try:
        metrics = Pipeline(plan).run()
    except preemption.Preempted as e:
        if dist.is_main():
            print(f"preempted at {e}; resume with the same command (exit code {preemption.RESUME_EXIT_CODE})",
                  file=sys.stderr)
        dist.shutdown()
        return preemption.RESUME_EXIT_CODE
    except (DataError, BackboneError, CollectiveError) as e:
        print(f"error (rank {dist.rank()}): {e}", file=sys.stderr)
        return 1
    except NonFiniteError as e:  # every rank agreed on it: one line
        if dist.is_main():
            print(f"error: {e}", file=sys.stderr)
        return 1
    except WriteError as e:  # rank 0's files, or one rank's step checkpoint: the ranks agreed to stop
        done = (plan.run.read_state() or {}).get("completed") or ["nothing"]
        print(f"error: {e}; state.json still ends at stage {done[-1]}: free space (or fix the permissions) and "
              f"re-run the same command to resume", file=sys.stderr)
        return 1
    except dist.PeerFailed:  # the rank that failed says why
        return 1
    except Exception as e:  # noqa: BLE001 - e.g. a method's own check: one line from rank 0, not a traceback per rank
        _unexpected(e, plan.run_dir)
        return 1
    finally:
        shutdown_workers()  # the loader's persistent workers (mcit.data.loader.WorkerPool)
        lock.release()  # also dropped by the kernel if this process dies first
    if dist.is_main():
        print(summary_text(metrics, plan.run_dir))
    dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install
    from mcit.distributed import exit_process

    exit_process(main())
