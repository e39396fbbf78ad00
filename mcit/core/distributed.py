"""Process-group set-up and the few collectives the pipeline needs.

The same entry point runs under the deepspeed launcher, torchrun, Slurm's srun (``srun -n N python ...``:
ranks from SLURM_PROCID / SLURM_NTASKS), or plain ``python``
(one process): whatever the launcher, we end with an initialised torch.distributed group, nccl when
CUDA is present and gloo otherwise.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def free_port() -> int:
    """A TCP port free on this host now (for a master port or a launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_accelerator() -> None:
    """DeepSpeed's accelerator for the entry points, set before DeepSpeed is imported: cuda where CUDA
    is available, else cpu (an explicit DS_ACCELERATOR wins)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


# Test seam: functions called with the name of each start-up moment this module passes ("process_group": the
# group exists, DeepSpeed's set-up and its op load not done yet); a test kills a launch there. The entry points add
# none (the run's own moments: mcit.cli.run).
on_startup: list[Callable[[str], None]] = []


def startup_moment(name: str) -> None:
    """Call the ``on_startup`` hooks with ``name``."""
    for hook in on_startup:
        hook(name)


def _from_srun() -> None:
    """Processes started directly by ``srun -n N python ...``: ranks from SLURM_PROCID / SLURM_NTASKS,
    the master from the step's first host (or MASTER_ADDR), a port every task derives the same way."""
    import subprocess

    env = os.environ
    if "MASTER_ADDR" not in env:
        hosts = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_STEP_NODELIST"]], capture_output=True,
                               text=True, check=True).stdout.split()
        env["MASTER_ADDR"] = hosts[0]
    env.setdefault("MASTER_PORT", str(20000 + (int(env["SLURM_JOB_ID"]) * 31 + int(env["SLURM_STEP_ID"])) % 20000))
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"], LOCAL_RANK=env.get("SLURM_LOCALID", "0"))


def init(timeout_s: float = 1800.0) -> None:
    """Initialise the default process group from launcher environment variables (idempotent)."""
    if dist.is_initialized():
        return
    default_accelerator()  # before DeepSpeed is imported: its own probing costs tens of seconds on CPU machines
    from mcit.core import extensions

    extensions.extensions_root()
    if "RANK" not in os.environ and "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", 1)) > 1:
        _from_srun()
    if "RANK" not in os.environ:
        # Plain `python script.py`: one process, talking to itself.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    bound = {}
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
        # the group bound to the rank's GPU: NCCL otherwise guesses the device from the global rank (a hang
        # where the rank-to-GPU mapping is not the identity) and says so on stderr at the first barrier
        bound = {"device_id": torch.device("cuda", local_rank())}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **bound)
    startup_moment("process_group")
    # DeepSpeed's C++ ops under mcit's extension lock, before init_distributed asks for its shm op (it then finds
    # the op loaded; the lock cannot be held through init_distributed, whose shm set-up waits for every rank)
    extensions.load_ops(extensions.ops_for(None))
    # DeepSpeed reuses the existing group instead of creating its own.
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    release_shm_workspace()


def shm_workspace_path(rank_: int | None = None) -> Path:
    """Where DeepSpeed's CPU shared-memory allreduce keeps one rank's 69 MB workspace (the name its
    ``shm.cpp`` builds: ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``)."""
    env = os.environ
    r = rank() if rank_ is None else rank_
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_{env.get('MASTER_PORT', '')}_{r}"
    return Path("/dev/shm") / name


def release_shm_workspace() -> None:
    """Unlink this rank's DeepSpeed shm allreduce workspace as soon as every rank has mapped it.

    DeepSpeed (CPU accelerator, all ranks on one host) creates the segment in ``init_distributed``
    and never unlinks it, so every launched run (one rank included) left 69 MB per rank in /dev/shm, which is RAM:
    a test suite's worth filled 20 GB and thrashed the machine. ``shm_initialize`` returns only after
    the rank has opened every peer's segment, so after a barrier all mappings exist; unlinking then
    frees the memory when the processes exit, however they exit (a killed run leaks nothing).
    """
    if not dist.is_initialized():  # one rank under a launcher gets a segment too
        return
    path = shm_workspace_path()
    dist.barrier()
    try:
        path.unlink()
    except FileNotFoundError:
        pass  # not all ranks local (no shm op), or the op is not built on this platform


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0


def device() -> torch.device:
    return torch.device("cuda", local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def barrier() -> None:
    if dist.is_initialized() and world_size() > 1:
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (in place, also returned); a no-op on one process."""
    if dist.is_initialized() and world_size() > 1:
        if dist.get_backend() == "nccl" and t.device.type != "cuda":
            moved = t.to(device())
            dist.all_reduce(moved, op=dist.ReduceOp.SUM)
            t.copy_(moved.cpu())
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Send a picklable object from ``src`` to every rank."""
    if not (dist.is_initialized() and world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank."""
    if not (dist.is_initialized() and world_size() > 1):
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_ok(ok: bool) -> bool:
    """True on every rank iff ``ok`` is true on every rank (so all ranks fail together)."""
    t = torch.tensor([0 if ok else 1], dtype=torch.int64)
    all_reduce_sum(t)
    return int(t.item()) == 0


class PeerFailed(RuntimeError):
    """Raised on the other ranks when rank 0's own part of a step failed (rank 0 raises, and reports, the cause)."""


def on_main(fn: Callable[[], T]) -> T | None:
    """``fn()`` on rank 0 only (its files: rows, checkpoints, the state file), then one all-reduce so every
    rank knows whether it worked. Without it a full disk on rank 0 raised there while the other ranks waited
    at the next barrier until the collective timeout; now rank 0 re-raises its error (one line names the
    file) and the others raise :class:`PeerFailed` at once. Returns ``fn()``'s value on rank 0."""
    err: BaseException | None = None
    out = None
    if is_main():
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
            err = e
    agree(err, "rank 0 failed (it reports why)")
    return out


def agree(err: BaseException | None, peer_message: str) -> None:
    """One all-reduce: if any rank has an ``err``, every rank stops now -- those with one raise it, the
    others :class:`PeerFailed` (``peer_message``)."""
    if not all_ok(err is None):
        if err is not None:
            raise err
        raise PeerFailed(peer_message)


def exit_process(code: int | None) -> None:
    """End a launched rank's process with ``code`` now, without the interpreter's finalization.

    Even after ``shutdown`` (barrier, then destroy_process_group), objects that DeepSpeed and the engines
    still hold keep gloo's C++ groups alive until the interpreter tears down; their worker threads then
    meet a finalizing interpreter and the process dies in C++ ("terminate called without an active
    exception", SIGABRT) after its work is done and committed -- seen in CI on 2-rank runs under load, and
    a job scheduler would report the run as failed. The Python-level exit work still runs (``atexit``:
    multiprocessing's temporary directories and children, weakref finalizers, logging's flush); only the
    C-level teardown is skipped. Entry points' ``__main__`` only: tests call ``main()`` in-process.
    """
    import atexit

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass

    flush()
    # a child still alive now (a loader worker hung in fork: it keeps the rank's SIGTERM handler, so the
    # terminate at exit does not end it) would hold the exit below in multiprocessing's join forever
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=2)
        if child.is_alive():
            child.kill()
            child.join(timeout=5)
    atexit._run_exitfuncs()  # the documented-by-use way to run them before os._exit
    flush()
    os._exit(int(code or 0))


def shutdown() -> None:
    """Tear the group down once every rank got here (the success path).

    Without the barrier a rank that finishes first destroys its gloo context while a peer is still
    talking to it, and the peer can die in C++ ("terminate called without an active exception",
    SIGABRT) after its work is done, seen in CI on the 2-rank tests.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
