"""Shared machinery of the dataset converters: resumable, parallel shard writing with a policy for bad
records, and ``--verify``.

A converter lists its records as small picklable specs (a file path and a label, an index into an
array, ...) and gives an ``encode(spec) -> sample dict`` function. Records are cut into shards by
position (shard k holds specs[k*S:(k+1)*S]), so the shard plan is the same on every run:

* each shard is encoded by a worker process, written under a temporary name and renamed;
* ``.progress.json`` (written atomically after each shard) lists the finished shards with their
  sha256, size, sample count and skipped records; a re-run after an interruption keeps every listed
  shard whose file still matches and writes only the missing ones, so no partial shard is ever
  left in place or trusted;
* the manifest (``mcit-shards/1``) is written last, with per-shard sha256 and counts and, under
  ``--on-error skip``, the number and ids of the records that were skipped.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from mcit.core.checkpoint import atomic_write_text
from mcit.data.shards import (
    MANIFEST,
    DataError,
    open_split,
    sha256_file,
    write_manifest,
)

PROGRESS = ".progress.json"


class RecordError(DataError):
    """A bad raw record; ``str()`` names the record id and the file."""

    def __init__(self, record_id: str, file: str | Path, problem: str) -> None:
        super().__init__(f"record {record_id!r} ({file}): {problem}")
        self.record_id = record_id


# The kernels every embedded backbone is pre-trained with, whatever the CPU: ATen's portable (non-vectorised)
# kernels, MKL's conditional-numerical-reproducibility path and oneDNN held to SSE4.1, on a fixed thread count.
PORTABLE_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "DNNL_MAX_CPU_ISA": "SSE41"}
PRETRAIN_THREADS = 2


def portable_kernels(pretrain: Callable[..., dict]) -> Callable[..., dict]:
    """Run an embedded backbone's pre-training in a fresh process on ``PORTABLE_KERNELS`` and
    ``PRETRAIN_THREADS`` threads, so its bytes are the same on every x86-64 CPU.

    Why: pre-training amplifies the last-bit differences between the CPU's vector kernels (AVX-512, AVX2, ...)
    into different models: the tiny LLaVA built on an AVX-512 and an AVX2 machine answered the same test
    questions zero-shot 46.7% and 14.7% right, and every method's number moved with it. Float64 does not help
    (transformers' Llama RMSNorm computes in float32). These kernel settings are read once when a process starts,
    hence the fresh process; the thread count is fixed because reductions split their sums by it. The cost is
    about 1.3x the single-threaded native time. ``portable=False`` runs the builder here, on this process's kernels.
    """
    @functools.wraps(pretrain)
    def run(*args: Any, portable: bool = True, **kwargs: Any) -> dict:
        if not portable:  # this process's own kernels and threads (the test suite's small fixtures: seconds, not bytes)
            return pretrain(*args, **kwargs)
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        saved = {k: os.environ.get(k) for k in PORTABLE_KERNELS}
        os.environ.update(PORTABLE_KERNELS)  # the child's environment is the parent's at start
        try:
            child = ctx.Process(target=_portable_child, args=(pretrain.__module__, pretrain.__qualname__, args, kwargs,
                                                              queue), daemon=True)
            child.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        import queue as queues

        try:
            while True:  # a child that dies without a word (killed, out of memory) must not leave this waiting
                try:
                    status, value = queue.get(timeout=5)
                    break
                except queues.Empty:
                    if not child.is_alive():
                        raise RuntimeError(f"the pre-training process ended with exit code {child.exitcode} and no "
                                           "result") from None
        finally:
            child.join()
        if status != "ok":
            raise RuntimeError(value)
        return value

    return run


def _portable_child(module: str, name: str, args: tuple, kwargs: dict, queue: Any) -> None:
    """The pre-training process: checks that its kernels are the portable ones, then runs the undecorated builder."""
    import importlib
    import traceback

    import torch

    if sys.platform.startswith("linux"):  # the child ends with its parent, so a killed build leaves nothing running
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    try:
        if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
            raise RuntimeError(f"pre-training process runs on {torch.backends.cpu.get_cpu_capability()} kernels, "
                               "not the portable ones")
        torch.set_num_threads(PRETRAIN_THREADS)
        fn = getattr(importlib.import_module(module), name).__wrapped__
        queue.put(("ok", fn(*args, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        queue.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def build_environment() -> dict[str, Any]:
    """What a pre-trained embedded backbone's bytes depend on besides its settings (recorded with it): the pinned
    library versions, the kernels torch dispatches to (the portable ones, ``portable_kernels``) and the thread
    count; not the CPU."""
    import numpy
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "numpy": numpy.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
            "threads": torch.get_num_threads(),
            "kernels": {k: os.environ.get(k) for k in PORTABLE_KERNELS}}


def _encode_shard(args: tuple[Callable[[Any], dict], Sequence[Any], str, str]) -> tuple[int, list[str], str]:
    """Worker: encode one shard's specs and write it (temporary name + rename)."""
    import webdataset as wds

    encode, specs, path, on_error = args
    skipped: list[str] = []
    tmp = f"{path}.tmp{os.getpid()}"
    n = 0
    try:
        with wds.TarWriter(tmp, mtime=0) as sink:  # int mtime: byte-identical, no pax headers
            for spec in specs:
                try:
                    sample = encode(spec)
                except RecordError as e:
                    if on_error == "fail":
                        raise
                    skipped.append(e.record_id)
                    continue
                sink.write(sample)
                n += 1
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return n, skipped, path


def write_shards(directory: Path, specs: Sequence[Any], encode: Callable[[Any], dict], *, shard_size: int,
                 label_space: list[int], class_names: dict[int, str] | None = None,
                 extra: dict[str, Any] | None = None, on_error: str = "fail", workers: int = 1,
                 progress: bool = True, desc: str = "shards") -> dict:
    """Convert ``specs`` into a split directory (see the module docstring). Returns the manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    plan = [list(specs[i:i + shard_size]) for i in range(0, max(len(specs), 1), shard_size)]
    if not specs:
        plan = [[]]
    settings = {"num_specs": len(specs), "shard_size": shard_size, "on_error": on_error}
    prog_path = directory / PROGRESS
    done: dict[str, dict] = {}
    if prog_path.is_file():
        prog = json.loads(prog_path.read_text())
        if prog.get("settings") == settings:
            for name, info in prog["shards"].items():
                f = directory / name
                if f.is_file() and f.stat().st_size == info["bytes"] and sha256_file(f) == info["sha256"]:
                    done[name] = info
    names = [f"shard-{k:06d}.tar" for k in range(len(plan))]
    todo = [(encode, plan[k], str(directory / names[k]), on_error) for k in range(len(plan)) if names[k] not in done]
    bar = None
    if progress:
        from mcit.core.progress import progress_bar

        bar = progress_bar(len(plan), desc, "shard", initial=len(plan) - len(todo), leave=True)

    def finish(n: int, skipped: list[str], path: str) -> None:
        f = Path(path)
        done[f.name] = {"num_samples": n, "bytes": f.stat().st_size, "sha256": sha256_file(f), "skipped": skipped}
        atomic_write_text(prog_path, json.dumps({"settings": settings, "shards": done}))
        if bar is not None:
            bar.update(1)

    if workers > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for n, skipped, path in pool.map(_encode_shard, todo):
                finish(n, skipped, path)
    else:
        for job in todo:
            finish(*_encode_shard(job))
    if bar is not None:
        bar.close()
    shards = [{"file": nm, "num_samples": done[nm]["num_samples"], "bytes": done[nm]["bytes"],
               "sha256": done[nm]["sha256"]} for nm in names]
    skipped = [r for nm in names for r in done[nm]["skipped"]]
    manifest = write_manifest(directory, shards, label_space, class_names,
                              {"skipped": len(skipped), "skipped_records": skipped[:1000], **(extra or {})})
    prog_path.unlink(missing_ok=True)
    return manifest


def verify(directory: Path, decode: bool = True) -> int:
    """Re-check a split against its manifest (sizes, sha256, and every sample decodes); returns its count."""
    from mcit.data.shards import iter_samples

    split = open_split(directory, "sha256")
    if decode:
        n = sum(1 for _ in iter_samples(split, 0, 1, policy="sample"))
        if n != split.num_samples:
            raise DataError(f"{directory}: {n} samples readable, manifest says {split.num_samples}")
    return split.num_samples


def png_bytes(image: Any) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


# --------------------------------------------------------------------------------------------------
# Class-incremental benchmarks: records of (id, label, payload) cut into tasks by a seeded class order

def class_order(num_classes: int, seed: int) -> list[int]:
    """``numpy.random.RandomState(seed).permutation(C)``: the convention of the iCaRL-derived code bases
    (seed 1993 gives their CIFAR-100 order); recorded in every manifest."""
    import numpy as np

    return [int(c) for c in np.random.RandomState(seed).permutation(num_classes)]


def read_image_file(record_id: str, path: str | Path) -> tuple[str, bytes]:
    """(extension, bytes) of an image file, checked to decode; a missing or unreadable file is a
    RecordError naming the record and the file. JPEG and PNG bytes are kept as they are (no
    re-encoding, no quality loss); any other format PIL reads is stored as PNG."""
    import io

    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.is_file():
        raise RecordError(record_id, p, "image file not found")
    data = p.read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = (im.format or "").upper()
            im.load()
            if fmt in ("JPEG", "PNG"):
                return ("jpg" if fmt == "JPEG" else "png"), data
            return "png", png_bytes(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise RecordError(record_id, p, f"unreadable image ({e.__class__.__name__}: {e})") from None


def encode_image_file(spec: tuple[str, str, int, str]) -> dict:
    """(key, path, label, record id) -> a classification sample with the image bytes as stored."""
    key, path, label, rid = spec
    ext, data = read_image_file(rid, path)
    return {"__key__": key, ext: data, "cls": label, "json": {"id": rid, "label": label}}


def check_unique(ids: Sequence[str], source: str | Path, on_error: str) -> set[int]:
    """Positions of records whose id was seen before (reported, or returned to skip)."""
    seen: set[str] = set()
    dup: set[int] = set()
    for i, rid in enumerate(ids):
        if rid in seen:
            if on_error == "fail":
                raise RecordError(rid, source, "duplicate id (an earlier record has the same id)")
            dup.add(i)
        seen.add(rid)
    return dup


def build_cil(out: Path, splits: dict[str, list[tuple[str, str, int, str]]], class_names: list[str], *,
              benchmark: str, classes_per_task: int, seed: int, encode: Callable[[Any], dict] = encode_image_file,
              source_skipped: dict[str, list[str]] | None = None, shard_size: int = 1000, workers: int = 1,
              on_error: str = "fail", progress: bool = True, extra: dict[str, Any] | None = None) -> dict:
    """Write ``<out>/task<t>/{train,test}`` for a class-incremental benchmark and ``benchmark.json``.

    ``splits`` maps a split name to specs whose third field is the class index; task t holds classes
    ``order[t*C:(t+1)*C]`` with ``order = class_order(len(class_names), seed)``.
    """
    C = len(class_names)
    if C == 0:
        raise DataError(f"{benchmark}: no classes found")
    if classes_per_task < 1 or C % classes_per_task:
        raise DataError(f"--classes-per-task {classes_per_task} does not divide {C} classes")
    order = class_order(C, seed)
    skipped_src = source_skipped or {s: [] for s in splits}
    tasks = []
    for t in range(C // classes_per_task):
        classes = order[t * classes_per_task:(t + 1) * classes_per_task]
        chosen_classes = set(classes)
        for s, recs in splits.items():
            chosen = [r for r in recs if r[2] in chosen_classes]
            write_shards(out / f"task{t}" / s, chosen, encode, shard_size=shard_size, label_space=classes,
                         class_names={c: class_names[c] for c in classes},
                         extra={"task": f"task{t}", "class_order": order, "seed": seed, "source": benchmark,
                                "source_skipped": len(skipped_src.get(s, [])), **(extra or {})},
                         on_error=on_error, workers=workers, progress=progress, desc=f"task{t}/{s}")
        tasks.append({"name": f"task{t}", "classes": classes})
    meta = {"benchmark": benchmark, "seed": seed, "class_order": order, "tasks": tasks, "class_names": class_names,
            "num_samples": {s: len(r) for s, r in splits.items()}, "skipped_records": skipped_src, **(extra or {})}
    atomic_write_text(out / "benchmark.json", json.dumps(meta, indent=1))
    return meta


def verify_tree(out: Path) -> int:
    """``verify`` every split directory under ``out`` (``*/manifest.json`` and ``*/*/manifest.json``)."""
    manifests = sorted({*out.glob("*/manifest.json"), *out.glob("*/*/manifest.json")})
    if (out / MANIFEST).is_file():
        manifests.insert(0, out / MANIFEST)
    total = sum(verify(m.parent) for m in manifests)
    if not manifests:
        raise DataError(f"no split directories (*/*/manifest.json) under {out}")
    return total


def converter_arguments(doc: str) -> Any:
    """The options every converter shares: shard size, workers, error policy, --verify, progress."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(doc.splitlines()[1:]))
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=1, help="processes encoding shards in parallel")
    ap.add_argument("--on-error", choices=["fail", "skip"], default="fail",
                    help="a bad record stops the conversion (fail) or is left out and counted (skip)")
    ap.add_argument("--verify", type=Path, metavar="OUT", help="re-check every split under OUT and exit")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def cil_arguments(doc: str, *, raw_help: str, classes_per_task: int, seed: int, out: str) -> Any:
    """The argument parser every image CIL converter shares (plus its own options)."""
    ap = converter_arguments(doc)
    ap.add_argument("--raw", type=Path, help=raw_help)
    ap.add_argument("--out", type=Path, default=Path(out))
    ap.add_argument("--classes-per-task", type=int, default=classes_per_task)
    ap.add_argument("--seed", type=int, default=seed, help="class order: RandomState(seed).permutation")
    return ap


def cil_summary(name: str) -> Callable[[Any, dict], str]:
    """The closing line of an image CIL conversion."""
    def summary(args: Any, meta: dict) -> str:
        order = meta.get("class_order") or []
        return f"{name} at {args.out}: {len(meta.get('tasks', []))} tasks, class order {order[:10]}..."

    return summary


def run_cli(ap: Any, argv: list[str] | None, build: Callable[[Any], Any], summary: Callable[[Any, Any], str], *,
            required: Sequence[str] = ("raw",), verify_fn: Callable[[Path], int] = verify_tree) -> int:
    """Every converter's command: parse, then ``--verify`` or ``build(args)`` and print ``summary``;
    a DataError becomes one ``error:`` line and exit status 2."""
    import sys

    args = ap.parse_args(argv)
    try:
        if args.verify:
            n = verify_fn(args.verify)
            print(f"{args.verify}: every shard matches its manifest, {n} samples decode", file=sys.stderr)
            return 0
        missing = [f"--{r.replace('_', '-')}" for r in required if getattr(args, r, None) is None]
        if missing:
            ap.error(f"{' and '.join(missing)} required (or use --verify)")
        line = summary(args, build(args))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if line:
        print(line, file=sys.stderr)
    return 0


def builder_main(doc: str, build: Callable[..., dict], summary: Callable[[Any, dict], str], argv: list[str] | None, *,
                 out: str, options: Sequence[str] = (), defaults: dict[str, Any] | None = None) -> int:
    """The command of an embedded builder (a benchmark or a pre-trained backbone) that writes one directory:
    ``--out``, an option per keyword argument of ``build`` named in ``options`` (default and type from
    ``build``'s signature, or from ``defaults``), and ``--force`` (rebuild even if a complete build with the
    same settings exists); runs ``build(out=..., force=..., **options)`` and prints ``summary(args, info)``."""
    import argparse
    import inspect
    import sys

    ap = argparse.ArgumentParser(description=doc.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(doc.splitlines()[1:]))
    ap.add_argument("--out", type=Path, default=Path(out))
    params = inspect.signature(build).parameters
    for name in options:
        default = (defaults or {}).get(name, params[name].default)
        ap.add_argument(f"--{name.replace('_', '-')}", type=Path if isinstance(default, Path) else type(default),
                        default=default)
    ap.add_argument("--force", action="store_true", help="rebuild even if a complete build with these settings exists")
    args = ap.parse_args(argv)
    for name in options:  # an input (the shards a backbone pre-trains on) that is not there: usage, exit 2
        value = getattr(args, name)
        if isinstance(value, Path) and not value.exists():
            ap.error(f"--{name.replace('_', '-')} {value}: not found (`make data` builds the embedded benchmarks; "
                     f"run from the repository root or pass the path)")
    info = build(out=args.out, force=args.force, **{name: getattr(args, name) for name in options})
    print(summary(args, info), file=sys.stderr)
    return 0
