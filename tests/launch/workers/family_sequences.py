"""Several whole task sequences in one launch (``deepspeed --num_gpus 2 family_sequences.py C1 C2 ...``): each
config runs as ``run_task_sequence.py --config C`` would (pre-flight, then the pipeline's stages on every rank,
into its own run directory), under one process group, so the families x methods matrix pays for one launcher
start instead of one per run. Rank 0 prints one JSON line per run: the config, and the error if it failed."""

from __future__ import annotations

import json
import os
import sys
import traceback


def main(configs: list[str]) -> int:
    from mcit.core.distributed import default_accelerator

    default_accelerator()
    import torch.distributed

    from mcit.core import console
    from mcit.core import distributed as dist
    from mcit.core.config import load_config
    from mcit.data.loader import shutdown_workers
    from mcit.run.pipeline import Pipeline
    from mcit.run.preflight import preflight

    failed = 0
    for path in configs:
        error = None
        together = torch.distributed.is_initialized()
        if together:
            dist.barrier()  # every rank has finished the previous run before any starts this one
        try:
            cfg = load_config(path)
            plan = preflight(cfg)
        except Exception as e:  # noqa: BLE001 - reported per run; the next run goes on
            error = f"rank {os.environ.get('RANK', '0')}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        if together and not dist.all_ok(error is None):  # the ranks skip a run together
            error = error or "another rank's pre-flight failed"
        if error is None:
            try:
                console.log_to(plan.run.logs / f"rank{os.environ.get('RANK', '0')}.log")
                with console.stdout_to_log("deepspeed"):
                    dist.init(timeout_s=cfg.train.collective_timeout_s)
                Pipeline(plan).run()
            except Exception as e:  # noqa: BLE001
                error = f"rank {os.environ.get('RANK', '0')}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
            finally:
                shutdown_workers()
        failed += error is not None
        if error is not None or dist.is_main():
            print(json.dumps({"config": path, "error": error}), flush=True)
    dist.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main([a for a in sys.argv[1:] if not a.startswith("--local")]))
