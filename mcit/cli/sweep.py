"""Run a study: seeds x task orders x config settings, then one aggregated table and figures.

    mcit-sweep --config configs/digits_vpt_nsp2.yaml --seeds 0 1 2 --orders 0-2 \\
        --grid method.eta=1.0,0.95,0.9,0.85,0.8

Every point is an ordinary run directory (``<out>/runs/<point>``) made by the task-sequence
pipeline; a re-run of the same command runs only the points that have not finished, then
aggregates. ``--launch deepspeed`` (default) runs the points one after another on this machine,
each through the DeepSpeed launcher with ``--nproc`` ranks; ``--launch slurm`` submits one job array
(``pipelines/slurm/sweep_array.sbatch``, ``--throttle`` tasks at a time) and, with ``--wait``,
aggregates when it has drained; ``--launch none`` only aggregates what is there. The spec can also
come from a YAML file (``--spec``; the command line adds to it): keys configs, seeds, orders,
order_unit, grid, settings, overrides, name, out, std_ddof (see mcit/studies/spec.py).
``python -m pipelines.sweep`` and ``python -m mcit.cli.sweep`` are the same program.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mcit.cli import common


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", type=Path, default=None, help="sweep spec YAML")
    ap.add_argument("--config", dest="configs", action="append", default=None,
                    help="run config (repeat for several methods)")
    ap.add_argument("--seeds", nargs="+", type=int, default=None)
    ap.add_argument("--orders", nargs="+", default=None,
                    help="order ids (0 = the config's order, k = seeded shuffle k), ranges a-b, "
                         "or permutations 4,3,2,1,0")
    ap.add_argument("--order-unit", choices=["auto", "task", "class"], default=None)
    ap.add_argument("--grid", action="append", default=[], help="key.path=v1,v2,... (repeat: cartesian product)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="key.path=value for every point")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default=None, help="sweep directory (default runs/sweeps/<name>)")
    ap.add_argument("--launch", choices=["deepspeed", "torchrun", "python", "slurm", "none"], default="deepspeed")
    ap.add_argument("--nproc", type=int, default=1, help="ranks per point (local launchers)")
    ap.add_argument("--throttle", type=int, default=None, help="slurm: at most this many array tasks at once")
    ap.add_argument("--sbatch-arg", action="append", default=[], help="extra sbatch option (repeat)")
    ap.add_argument("--wait", action="store_true", help="slurm: wait for the array, then aggregate")
    ap.add_argument("--dry-run", action="store_true", help="list the points and exit")
    args = ap.parse_args(argv)
    if args.spec is None and not args.configs:
        ap.error("nothing to sweep: give --spec FILE or --config C (repeatable)")

    from mcit.studies import launch, results
    from mcit.studies import spec as S

    try:
        cli = {"configs": args.configs, "seeds": args.seeds, "order_unit": args.order_unit, "name": args.name,
               "out": args.out, "orders": S.parse_orders(args.orders) if args.orders else None,
               "grid": S.parse_grid(args.grid) if args.grid else None, "overrides": args.overrides or None}
        spec = S.load_spec(args.spec, cli)
        points = S.expand(spec, materialize=not args.dry_run)
        if args.dry_run:
            for p in points:
                print(f"{p.name}\t{'finished' if S.finished(p) else 'to run'}\t{p.config_path}")
            return 0
        S.write_points(spec, points)
    except Exception as e:  # noqa: BLE001 - a bad spec, config, data set or run directory: one line, exit 2
        return common.before_launch(e)

    if args.launch == "slurm":
        job, _ = launch.submit_slurm(spec, points, throttle=args.throttle, sbatch_args=args.sbatch_arg)
        if job is not None and not args.wait:
            print("aggregate when it is done: the same command with --launch none")
            return 0
        if job is not None:
            launch.wait_slurm(job)
    elif args.launch != "none":
        launch.run_local(spec, points, launcher=args.launch, nproc=args.nproc)

    agg = results.aggregate(spec, points)
    files = results.write_tables(spec, agg) + results.figures(spec, agg)
    print(results.markdown(agg))
    print("written: " + " ".join(str(f) for f in files))
    sys.stdout.flush()
    return 1 if agg["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
