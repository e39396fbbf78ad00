"""Batches for the engine and the evaluator, built from a rank's part of a split.

Training runs the same number of micro steps on every rank (collectives inside DeepSpeed require
it): ``steps_per_epoch`` is computed from the manifest for the largest rank, and a rank that has run
out of samples pads with zero-weight copies (``Batch.valid == 0``). ``global_valid`` gives, for any
micro step, the number of real samples summed over ranks, which the engine uses to normalise the
loss so the gradient is the mean over exactly the real samples.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch

from mcit.data.shards import DataError, Split, assign, decode_sample, iter_samples
from mcit.data.types import Batch


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

    ``transform`` (mcit.data.transforms) runs on each decoded image before ``preprocess``; a random one
    draws from a generator seeded by (``seed``, sample key), so a sample's augmentation does not depend on
    which worker, rank or resumed run collates it.
    """
    from mcit.data.transforms import sample_generator

    random_transform = transform is not None and getattr(transform, "random", False)

    def collate(samples: list[dict], seed: int | None = None) -> Batch:
        images, labels, keys = [], [], []
        for s in samples:
            image, label, key = decode_sample(s)
            if label not in label_index:
                raise DataError(f"sample {key} in {split.location}: label {label} is not in the task sequence's "
                                f"classes")
            if transform is not None:
                if random_transform and seed is None:
                    raise ValueError(f"sample {key}: a random train transform needs a seed")
                image = transform(image, sample_generator(seed, key) if random_transform else None)
            images.append(image)
            labels.append(label_index[label])
            keys.append(key)
        return Batch(preprocess(images), torch.tensor(labels, dtype=torch.long), torch.ones(len(labels)), task, keys)

    return collate


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
    """A map-style dataset whose index is the work item itself; in a worker process, the result is packed."""

    def __init__(self, collates: list[Collate]) -> None:
        self.collates = collates

    def __getitem__(self, work: _Work) -> Batch | _Packed | _Failed:  # type: ignore[override]
        try:
            collate = self.collates[work.part]
            batch = collate(work.samples, seed=work.seed) if work.samples else None
            if work.pad_to and (batch is None or len(batch) < work.pad_to):
                template = batch if batch is not None else collate([work.fallback], seed=work.seed)
                batch = _pad(batch, template, work.pad_to)
            if batch is not None and torch.utils.data.get_worker_info() is not None:
                return _Packed.of(batch)
            return batch
        except Exception as e:  # noqa: BLE001 - re-raised as it is in the main process
            return _Failed(e)

    def __len__(self) -> int:  # never asked: the sampler is a stream
        raise TypeError("a stream of work items has no length")


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
            raise DataError(f"the loader workers for {what} delivered no batch in {timeout_s:g} s "
                            f"(data.worker_timeout_s): a worker is stuck; the run resumes from its last commit") from None
        yield out


def _run(works: Iterator[_Work], collates: list[Collate], num_workers: int, pin_memory: bool,
         timeout_s: float = 600.0, what: str = "") -> Iterator[Batch]:
    """The batches of ``works`` in order. With workers, the first one is built here while the workers start
    and take the next ones, so a stream starts as soon as in-process collation would (the worker start-up
    and the first batch's trip through them cost a short evaluation more than its collation)."""
    data = _Collating(collates)

    def here(items: Iterator[_Work]) -> Iterator:
        for w in items:
            out = data[w]
            yield out.pin_memory() if pin_memory and not isinstance(out, _Failed) and out is not None else out

    works = iter(works)
    rest = None
    if num_workers == 0:
        stream: Iterator = here(works)
    else:
        first = next(works, None)
        rest = iter(torch.utils.data.DataLoader(
            data, batch_size=None, sampler=works, num_workers=num_workers, collate_fn=_first,  # type: ignore[arg-type]
            pin_memory=pin_memory, prefetch_factor=4, timeout=timeout_s))  # the workers start now, on the items after the first
        stream = itertools.chain(here(iter([first] if first is not None else [])), _waited(rest, timeout_s, what))
    try:
        for out in stream:
            if isinstance(out, _Failed):
                raise out.error
            yield out.unpack() if isinstance(out, _Packed) else out
    finally:
        # the workers stop here, however the stream ends: a traceback that keeps the loader alive (an error
        # shown at the top of a run) would otherwise keep a stuck worker alive with it
        stop = getattr(rest, "_shutdown_workers", None)
        if stop is not None:
            stop()


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
    shuffle_buffer: int, collate: Collate, num_workers: int = 0, pin_memory: bool = False,
    worker_timeout_s: float = 600.0,
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

    return _run(works(), [collate], num_workers, pin_memory, worker_timeout_s, split.location)


def train_batches(
    split: Split, *, rank: int, world: int, batch_size: int, num_steps: int, skip_steps: int, seed: int,
    policy: str, shuffle_buffer: int, collate: Collate, aug_seed: int | None = None, num_workers: int = 0,
    pin_memory: bool = False, worker_timeout_s: float = 600.0,
) -> Iterator[Batch]:
    """One epoch of ``train_epochs``."""
    return train_epochs(split, [Epoch(skip_steps, seed, aug_seed)], rank=rank, world=world, batch_size=batch_size,
                        num_steps=num_steps, policy=policy, shuffle_buffer=shuffle_buffer, collate=collate,
                        num_workers=num_workers, pin_memory=pin_memory, worker_timeout_s=worker_timeout_s)


def _pad(batch: Batch | None, template: Batch, size: int) -> Batch:
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
               policy: str, num_workers: int = 0, pin_memory: bool = False,
               worker_timeout_s: float = 600.0) -> Iterator[tuple[int, Batch]]:
    """(split index, batch) over this rank's part of each split in turn, in manifest order, unpadded (evaluation
    runs no collectives). One stream: the loader workers start once for all the splits and prepare the next
    split's first batches while the current one is evaluated (an evaluation row is many small test splits)."""
    parts: list[int] = []  # the split of each work item handed out; results come back in the same order

    def works() -> Iterator[_Work]:
        for i, split in enumerate(splits):
            chunk: list[dict] = []
            for s in iter_samples(split, rank, world, policy=policy):
                chunk.append(s)
                if len(chunk) == batch_size:
                    parts.append(i)
                    yield _Work(chunk, None, 0, None, i)
                    chunk = []
            if chunk:
                parts.append(i)
                yield _Work(chunk, None, 0, None, i)

    what = splits[0].location if len(splits) == 1 else f"{len(splits)} splits from {splits[0].location}"
    for n, batch in enumerate(_run(works(), collates, num_workers, pin_memory, worker_timeout_s, what)):
        yield parts[n], batch


def eval_batches(split: Split, *, rank: int, world: int, batch_size: int, policy: str,
                 collate: Collate, num_workers: int = 0, pin_memory: bool = False,
                 worker_timeout_s: float = 600.0) -> Iterator[Batch]:
    """This rank's part of one split: ``eval_parts`` of one."""
    for _, batch in eval_parts([split], [collate], rank=rank, world=world, batch_size=batch_size, policy=policy,
                               num_workers=num_workers, pin_memory=pin_memory, worker_timeout_s=worker_timeout_s):
        yield batch
