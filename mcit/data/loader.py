"""Batches for the engine and the evaluator, built from a rank's part of a split.

Training runs the same number of micro steps on every rank (collectives inside DeepSpeed require
it): ``steps_per_epoch`` is computed from the manifest for the largest rank, and a rank that has run
out of samples pads with zero-weight copies (``Batch.valid == 0``). ``global_valid`` gives, for any
micro step, the number of real samples summed over ranks, which the engine uses to normalise the
loss so the gradient is the mean over exactly the real samples.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch

from mcit.data.shards import DataError, Split, assign, decode_sample, iter_samples
from mcit.data.types import Batch


@dataclass(frozen=True)
class LoaderOptions:
    """How a stream's batches are made: ``num_workers`` worker processes (0: in this process), page-locked
    buffers (``pin_memory``, on CUDA), and how long to wait for a batch before ``WorkerTimeout``. A run reads
    them from its config once (``from_config``; ``Plan.loader``) and every stream of the run takes that object."""

    num_workers: int = 0
    pin_memory: bool = False
    worker_timeout_s: float = 600.0
    worker_nice: int = 0

    @classmethod
    def from_config(cls, data: Any) -> "LoaderOptions":
        """The config's ``data`` section (num_workers, worker_timeout_s, worker_nice); pinned where the device is
        CUDA."""
        return cls(data.num_workers, torch.cuda.is_available(), data.worker_timeout_s, data.worker_nice)


def rank_counts(split: Split, world: int, policy: str) -> list[int]:
    return assign(split, 0, world, policy)[2]


def micro_steps_per_epoch(split: Split, world: int, batch_size: int, grad_accum: int, policy: str) -> int:
    """Micro steps every rank runs per epoch (a multiple of ``grad_accum``)."""
    longest = max(rank_counts(split, world, policy))
    steps = max(1, math.ceil(longest / batch_size))
    return math.ceil(steps / grad_accum) * grad_accum


def global_valid(counts: list[int], step: int, batch_size: int) -> int:
    """Real samples in micro step ``step`` summed over ranks."""
    return sum(min(batch_size, max(0, n - step * batch_size)) for n in counts)


Collate = Callable[..., Batch]  # collate(samples, seed=None): ``seed`` seeds each sample's augmentation


def classification_collate(preprocess: Callable, label_index: dict[int, int], task: int, split: Split,
                           transform: Callable | None = None) -> Collate:
    """Raw (image, class) samples -> a Batch of pixel values and global class indices.

    ``label_index`` holds the labels a sample may carry (a task's own classes when the split is that task's):
    any other label is a one-line DataError naming the sample and its shard, raised as the sample is
    decoded; unchecked, a label of another task meets a logit masked to -inf and the run stops later
    at "loss is inf" with no pointer to the cause.

    ``transform`` (mcit.data.transforms) runs on each decoded image before ``preprocess``; a random one
    draws from a generator seeded by (``seed``, sample key), so a sample's augmentation does not depend on
    which worker, rank or resumed run collates it.
    """
    return ClassificationCollate(preprocess, label_index, task, str(getattr(split, "location", "?")), transform)


@dataclass
class ClassificationCollate:
    """``classification_collate``'s collate: an object, not a closure, so it pickles into the loader's
    persistent workers (with ``preprocess`` bound to a ``collation_view``, in kilobytes)."""

    preprocess: Callable
    label_index: dict[int, int]
    task: int
    location: str
    transform: Callable | None = None

    def __call__(self, samples: list[dict], seed: int | None = None) -> Batch:
        from mcit.data.transforms import sample_generator

        transform = self.transform
        random_transform = transform is not None and getattr(transform, "random", False)
        images, labels, keys = [], [], []
        for s in samples:
            image, label, key = decode_sample(s)
            if label not in self.label_index:
                raise DataError(f"sample {key} in {s.get('__url__', self.location)}: label {label} is not one of "
                                f"its task's {len(self.label_index)} classes (a corrupted .cls, or another task's "
                                f"shard)")
            if transform is not None:
                if random_transform and seed is None:
                    raise ValueError(f"sample {key}: a random train transform needs a seed")
                image = transform(image, sample_generator(seed, key) if random_transform else None)
            images.append(image)
            labels.append(self.label_index[label])
            keys.append(key)
        return Batch(self.preprocess(images), torch.tensor(labels, dtype=torch.long), torch.ones(len(labels)),
                     self.task, keys)


# --------------------------------------------------------------------------------------------------
# Parallel collation. The main process reads the raw samples (bytes: cheap) and decides every batch —
# which samples, in which order, how it is padded and seeded — and worker processes only decode,
# augment and collate. torch's DataLoader hands the work items out and returns results in order, so
# the batches are the same for any ``num_workers`` (0: the same code in this process).

@dataclass
class _Work:
    samples: list[dict]
    seed: int | None
    pad_to: int  # 0: no padding (evaluation)
    fallback: dict | None  # a sample to pad an empty batch with (the split's first)
    part: int = 0  # which collate (eval_parts: which split)
    key: str = ""  # in a persistent worker: the collate's file in the pool's registry (``WorkerPool.register``)


@dataclass
class _Failed:
    """An exception raised in a worker, returned as a value: torch would re-raise it with the worker's
    traceback in the message, and the pipeline's errors are one line."""

    error: BaseException


@dataclass
class _Packed:
    """A batch built in a worker with every tensor in one buffer. torch sends each tensor of a worker's result
    as its own shared-memory file descriptor, with a connection handshake each (about 0.6 ms per tensor here,
    measured with bench/train_stage_throughput.py): for a small batch that cost more than collating it in the
    training process. One buffer is one handshake. (Not bytes through the result pipe, which would be cheaper
    still: a worker whose parent dies with the pipe full never exits, its queue's feeder thread blocked on the
    write; results of a few bytes never fill it.)"""

    batch: Batch  # its tensors are empty placeholders
    buffer: torch.Tensor
    layout: list[tuple[str, torch.dtype, tuple[int, ...], int, int]]  # (field, dtype, shape, offset, bytes)

    @staticmethod
    def of(batch: Batch) -> "_Packed":
        parts, layout, offset = [], [], 0
        for name, t in _tensor_fields(batch):
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            pad = -offset % 16  # every field starts aligned for any dtype
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8))
            offset += pad
            layout.append((name, t.dtype, tuple(t.shape), offset, flat.numel()))
            parts.append(flat)
            offset += flat.numel()
        buffer = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
        empty = _replace_fields(batch, {name: torch.empty(0) for name, *_ in layout})
        return _Packed(empty, buffer, layout)

    def pin_memory(self) -> "_Packed":  # torch's pin-memory thread calls this: one page-locked copy
        return _Packed(self.batch, self.buffer.pin_memory(), self.layout)

    def unpack(self) -> Batch:
        buf = self.buffer
        return _replace_fields(self.batch, {name: buf[off:off + n].view(dtype).reshape(shape)
                                            for name, dtype, shape, off, n in self.layout})


def _tensor_fields(batch: Batch) -> list[tuple[str, torch.Tensor]]:
    out = [("pixel_values", batch.pixel_values), ("labels", batch.labels), ("valid", batch.valid)]
    if batch.allowed_classes is not None:
        out.append(("allowed_classes", batch.allowed_classes))
    return out + [(f"inputs.{k}", v) for k, v in batch.inputs.items()]


def _replace_fields(batch: Batch, tensors: dict[str, torch.Tensor]) -> Batch:
    inputs = {k: tensors.get(f"inputs.{k}", v) for k, v in batch.inputs.items()}
    top = {k: v for k, v in tensors.items() if not k.startswith("inputs.")}
    return replace(batch, inputs=inputs, **top)


class _Collating(torch.utils.data.Dataset):
    """A map-style dataset whose index is the work item itself; in a worker process, the result is packed.
    ``collates`` by position (in this process, or inherited by a per-stream worker's fork), or, in a persistent
    worker, by the work item's ``key``: loaded once from the pool's registry ``directory`` and kept."""

    KEEP = 64  # collates a persistent worker keeps (each stage brings a few: one per split it reads)

    def __init__(self, collates: list[Collate] | None = None, directory: str | None = None) -> None:
        self.collates = collates or []
        self.directory = directory
        self.loaded: dict[str, Collate] = {}

    def _collate(self, work: _Work) -> Collate:
        if not work.key:
            return self.collates[work.part]
        collate = self.loaded.get(work.key)
        if collate is None:
            import pickle

            with open(os.path.join(str(self.directory), work.key), "rb") as f:
                collate = pickle.load(f)
            if len(self.loaded) >= self.KEEP:
                self.loaded.pop(next(iter(self.loaded)))
            self.loaded[work.key] = collate
        return collate

    def __getitem__(self, work: _Work) -> Batch | _Packed | _Failed:  # type: ignore[override]
        try:
            collate = self._collate(work)
            batch = collate(work.samples, seed=work.seed) if work.samples else None
            if work.pad_to and (batch is None or len(batch) < work.pad_to):
                template = batch if batch is not None else collate([work.fallback], seed=work.seed)
                batch = pad_batch(batch, template, work.pad_to)
            if batch is not None and torch.utils.data.get_worker_info() is not None:
                return _Packed.of(batch)
            return batch
        except Exception as e:  # noqa: BLE001 - re-raised as it is in the main process
            return _Failed(e)

    def __len__(self) -> int:  # never asked: the sampler is a stream
        raise TypeError("a stream of work items has no length")


class _Unshippable(Exception):
    """A collate that carries a model (or a large tensor): it stays in the training process."""


class _Feed(torch.utils.data.Sampler):
    """The persistent loader's sampler: each ``iter`` (one per stream) hands out the stream set last."""

    def __init__(self) -> None:
        self.source: Iterator[_Work] = iter(())

    def __iter__(self) -> Iterator[_Work]:  # torch asks twice when it starts the workers: the same iterator
        return self.source


class WorkerPool:
    """Loader workers that live as long as the process: a run's streams (each task's training, each
    evaluation row, the statistics passes) reuse them instead of forking a fresh set each time, which cost a
    short stream more than its collation (forking a large process, then copy-on-write faults in both:
    ~75 ms per evaluation of the embedded benchmark, a sixth of it; ``bench/eval_throughput.py``).

    Workers outlive the collates, so each stream's collates are pickled into a registry directory under the
    digest of their bytes, and a worker loads a collate the first time a work item names it. A collate that
    cannot be pickled, or that would carry a model, is served by a per-stream loader instead (its workers
    inherit it by fork), as is a stream opened while another one still runs."""

    TENSOR_LIMIT = 1 << 20  # elements: a collate holding a larger tensor is carrying weights, not settings

    def __init__(self, num_workers: int, pin_memory: bool, timeout_s: float, nice: int = 0) -> None:
        import shutil
        import tempfile
        import weakref

        self.directory = tempfile.mkdtemp(prefix="mcit-collates-")
        weakref.finalize(self, shutil.rmtree, self.directory, True)
        self.feed = _Feed()
        self.loader = torch.utils.data.DataLoader(
            _Collating(directory=self.directory), batch_size=None, sampler=self.feed, num_workers=num_workers,
            collate_fn=_first, pin_memory=pin_memory, prefetch_factor=4, timeout=timeout_s, persistent_workers=True,
            worker_init_fn=functools.partial(_lower_priority, nice))
        self.busy = False
        self.iterator: Iterator | None = None  # torch's persistent iterator, once the workers have started

    def register(self, collates: list[Collate]) -> list[str] | None:
        """The registry key of each collate (written once per distinct pickle), or None when one cannot go."""
        import hashlib
        import io
        import pickle

        limit = self.TENSOR_LIMIT

        class Checked(pickle.Pickler):
            def persistent_id(self, obj: object) -> None:
                tensors = itertools.chain(obj.parameters(), obj.buffers()) if isinstance(obj, torch.nn.Module) else ()
                if any(True for _ in tensors):
                    raise _Unshippable
                if isinstance(obj, torch.Tensor) and obj.numel() > limit:
                    raise _Unshippable
                return None

        keys = []
        for collate in collates:
            buf = io.BytesIO()
            try:
                Checked(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(collate)
            except (_Unshippable, pickle.PicklingError, AttributeError, TypeError):
                return None
            blob = buf.getvalue()
            key = hashlib.sha256(blob).hexdigest()[:32]
            path = os.path.join(self.directory, key)
            if not os.path.exists(path):
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    f.write(blob)
                os.replace(tmp, path)
            keys.append(key)
        return keys

    def stream(self, works: Iterator[_Work]) -> Iterator:
        """The results of ``works`` in order; the first call starts the workers, later ones drain what an
        abandoned stream left in them and go on."""
        self.feed.source = works
        self.busy = True
        self.iterator = iter(self.loader)
        return self.iterator

    def close(self) -> None:
        """Stop the workers (a stuck one, or at shutdown); the pool is not used again."""
        stop = getattr(self.iterator, "_shutdown_workers", None)
        if stop is not None:
            stop()
        reap(getattr(self.iterator, "_workers", []))


_POOLS: dict[tuple[int, bool, float, int], WorkerPool] = {}


def reap(workers: list) -> None:
    """Kill the loader workers still alive after their loader's shutdown. torch's shutdown ends a worker with
    SIGTERM, which a worker forked from a rank keeps the rank's handler for (the preemption flag): one that hung in
    ``fork`` itself (a lock another thread of the rank held at that instant: seen in CI, the child never reached
    its loop) then outlived the loader, and the rank's exit joined it forever."""
    for w in workers:
        if w.is_alive():
            w.kill()
            w.join(timeout=5)


def shutdown_workers() -> None:
    """Stop the persistent loader workers of this process (the next stream starts new ones)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def _lower_priority(nice: int, worker_id: int) -> None:
    """A loader worker's start (``data.worker_nice``): below the training or evaluating process, so on a busy CPU
    its threads come first and the workers take what they leave (a worker that cannot keep up still gets the CPU
    the moment the rank waits for a batch)."""
    if nice > 0:
        os.nice(nice)


def _first(work: _Work) -> _Work:
    return work


def _waited(batches: Iterator, timeout_s: float, what: str) -> Iterator:
    """The loader's batches, its timeout as a one-line DataError: a worker that hangs (stuck on storage, or
    deadlocked in ``fork`` by a lock another thread of the training process held at that moment) would
    otherwise stall the rank, and the run, with nothing said. The DataLoader stops its workers on the way out."""
    while True:
        try:
            out = next(batches)
        except StopIteration:
            return
        except RuntimeError as e:
            if "timed out" not in str(e):
                raise
            raise _stuck(what, timeout_s) from None
        yield out


class WorkerTimeout(DataError):
    """No batch from the loader workers within ``data.worker_timeout_s``."""


def _stuck(what: str, timeout_s: float) -> WorkerTimeout:
    return WorkerTimeout(f"the loader workers for {what} delivered no batch in {timeout_s:g} s "
                         f"(data.worker_timeout_s): a worker is stuck; the run resumes from its last commit")


def _run(works: Iterator[_Work], collates: list[Collate], loader: LoaderOptions, what: str = "") -> Iterator[Batch]:
    """The batches of ``works`` in order. With workers (the process's persistent ones, ``WorkerPool``), the first
    one is built here and the workers take the next ones, so a stream starts as soon as in-process collation
    would."""
    num_workers, pin_memory, timeout_s = loader.num_workers, loader.pin_memory, loader.worker_timeout_s
    data = _Collating(collates)

    def here(items: Iterator[_Work]) -> Iterator:
        for w in items:
            out = data[w]
            yield out.pin_memory() if pin_memory and not isinstance(out, _Failed) and out is not None else out

    works = iter(works)
    pool, rest = None, None
    if num_workers == 0:
        stream: Iterator = here(works)
    else:
        first = next(works, None)
        where = (num_workers, pin_memory, timeout_s, loader.worker_nice)
        pool = _POOLS.get(where) or _POOLS.setdefault(where, WorkerPool(num_workers, pin_memory, timeout_s,
                                                                          loader.worker_nice))
        keys = None if pool.busy else pool.register(collates)
        if keys is not None:
            try:
                rest = pool.stream(replace(w, key=keys[w.part]) for w in works)
            except RuntimeError as e:  # draining a stuck worker's leftovers from an abandoned stream
                pool.busy = False
                if "timed out" not in str(e):
                    raise
                _POOLS.pop(where, None)
                pool.close()
                raise _stuck(what, timeout_s) from None
        else:
            pool = None  # a per-stream loader: its workers inherit ``collates`` by fork
            # the workers start now, on the items after the first
            rest = iter(torch.utils.data.DataLoader(
                data, batch_size=None, sampler=works, num_workers=num_workers, collate_fn=_first,  # type: ignore[arg-type]
                pin_memory=pin_memory, prefetch_factor=4, timeout=timeout_s,
                worker_init_fn=functools.partial(_lower_priority, loader.worker_nice)))
        # the first batch is built here while the workers take the next ones (building it before they start
        # measured slower: 0.84 / 0.82 against 0.88 / 0.84 in bench/eval_throughput.py, 2 workers, 2 cores)
        stream = itertools.chain(here(iter([first] if first is not None else [])), _waited(rest, timeout_s, what))
    stuck = False
    try:
        for out in stream:
            if isinstance(out, _Failed):
                raise out.error
            yield out.unpack() if isinstance(out, _Packed) else out
    except WorkerTimeout:
        stuck = True
        raise
    finally:
        # a per-stream loader's workers stop here, however the stream ends (a traceback that keeps the loader
        # alive, an error shown at the top of a run, would otherwise keep a stuck worker alive with it); the
        # pool's stay for the next stream, unless one is stuck
        if pool is not None:
            pool.busy = False
            if stuck:
                _POOLS.pop(where, None)
                pool.close()
        else:
            stop = getattr(rest, "_shutdown_workers", None)
            if stop is not None:
                stop()
            reap(getattr(rest, "_workers", []))


@dataclass(frozen=True)
class Epoch:
    """One epoch of a rank's training stream: the micro steps already done (a resume), the seed that orders
    the samples (it may differ per rank) and the one that seeds their augmentation (the same on every rank,
    so a sample's crops do not depend on the world size)."""

    skip_steps: int
    seed: int
    aug_seed: int | None = None


def train_epochs(
    split: Split, epochs: list[Epoch], *, rank: int, world: int, batch_size: int, num_steps: int, policy: str,
    shuffle_buffer: int, collate: Collate, loader: LoaderOptions = LoaderOptions(),
) -> Iterator[Batch]:
    """For each of ``epochs`` in turn, exactly ``num_steps - skip_steps`` batches of size ``batch_size`` for this
    rank, as one stream: the loader workers start once per stream (not per epoch) and keep preparing across an
    epoch's end. A short batch is padded with zero-weight copies of its own rows, an empty one with copies of
    the split's first sample.
    """
    def works() -> Iterator[_Work]:
        fallback = None
        for e in epochs:
            stream = iter_samples(split, rank, world, policy=policy, shuffle_seed=e.seed,
                                  shuffle_buffer=shuffle_buffer, skip=e.skip_steps * batch_size)
            for _ in range(e.skip_steps, num_steps):
                chunk = [s for _, s in zip(range(batch_size), stream)]
                if not chunk and fallback is None:
                    fallback = next(iter_samples(split, 0, 1, policy="sample"))
                yield _Work(chunk, e.aug_seed, batch_size, fallback if not chunk else None)

    return _run(works(), [collate], loader, split.location)


def train_batches(
    split: Split, *, rank: int, world: int, batch_size: int, num_steps: int, skip_steps: int, seed: int,
    policy: str, shuffle_buffer: int, collate: Collate, aug_seed: int | None = None,
    loader: LoaderOptions = LoaderOptions(),
) -> Iterator[Batch]:
    """One epoch of ``train_epochs``."""
    return train_epochs(split, [Epoch(skip_steps, seed, aug_seed)], rank=rank, world=world, batch_size=batch_size,
                        num_steps=num_steps, policy=policy, shuffle_buffer=shuffle_buffer, collate=collate,
                        loader=loader)


def pad_batch(batch: Batch | None, template: Batch, size: int) -> Batch:
    """Fill a short batch up to ``size`` with zero-weight copies of its own rows (or the template's)."""
    have = 0 if batch is None else len(batch)
    source = batch if have else template
    reps = torch.arange(size - have) % len(source)
    extra = source.select(reps)
    extra.valid = torch.zeros(size - have)
    if batch is None or have == 0:
        extra.keys = []
        return extra
    return Batch.concat([batch, extra])


def eval_parts(splits: list[Split], collates: list[Collate], *, rank: int, world: int, batch_size: int,
               policy: str, loader: LoaderOptions = LoaderOptions(),
               aug_seed: int | None = None, skip: list[set[str]] | None = None) -> Iterator[tuple[int, Batch]]:
    """(split index, batch) over this rank's part of each split in turn, in manifest order, unpadded (evaluation
    runs no collectives). One stream: the loader workers start once for all the splits and prepare the next
    split's first batches while the current one is evaluated (an evaluation row is many small test splits).
    ``aug_seed`` seeds a random transform's per-sample draws (a statistics pass over augmented images);
    ``skip[i]``: keys of split i already answered (an evaluation cell's committed chunks), left out before they
    are decoded."""
    parts: list[int] = []  # the split of each work item handed out; results come back in the same order

    def works() -> Iterator[_Work]:
        for i, split in enumerate(splits):
            chunk: list[dict] = []
            done = skip[i] if skip else None
            for s in iter_samples(split, rank, world, policy=policy):
                if done and s["__key__"] in done:
                    continue
                chunk.append(s)
                if len(chunk) == batch_size:
                    parts.append(i)
                    yield _Work(chunk, aug_seed, 0, None, i)
                    chunk = []
            if chunk:
                parts.append(i)
                yield _Work(chunk, aug_seed, 0, None, i)

    what = splits[0].location if len(splits) == 1 else f"{len(splits)} splits from {splits[0].location}"
    for n, batch in enumerate(_run(works(), collates, loader, what)):
        yield parts[n], batch


def eval_batches(split: Split, *, rank: int, world: int, batch_size: int, policy: str,
                 collate: Collate, loader: LoaderOptions = LoaderOptions(),
                 aug_seed: int | None = None) -> Iterator[Batch]:
    """This rank's part of one split: ``eval_parts`` of one."""
    for _, batch in eval_parts([split], [collate], rank=rank, world=world, batch_size=batch_size, policy=policy,
                               loader=loader, aug_seed=aug_seed):
        yield batch
