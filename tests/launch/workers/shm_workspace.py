"""Worker (1 or 2 ranks): initialise the group as the pipeline does, use DeepSpeed's CPU allreduce, and report
whether this rank's shm workspace is still in /dev/shm while the process lives (run by
tests/launch/test_shm_workspace.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main(out: str) -> None:
    from mcit.core import distributed as dist

    path = dist.shm_workspace_path()
    dist.init()
    import deepspeed.comm as ds_comm
    from deepspeed.comm import comm as ds_backend

    t = torch.full((4,), float(dist.rank() + 1))
    ds_comm.inference_all_reduce(t)  # the shm kernel: still works on the unlinked mapping
    record = {"rank": dist.rank(), "path": str(path), "exists": path.exists(), "sum": t.tolist(),
              "shm_op": ds_backend.cdb.shm_comm_op is not None}
    Path(out, f"rank{dist.rank()}.json").write_text(json.dumps(record))
    dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[-1])
    from mcit.core.distributed import exit_process

    exit_process(0)
