"""Batches for the engine and the evaluator, built from a rank's part of a split.

Training runs the same number of micro steps on every rank (collectives inside DeepSpeed require
it): ``steps_per_epoch`` is computed from the manifest for the largest rank, and a rank that has run
out of samples pads with zero-weight copies (``Batch.valid == 0``). ``global_valid`` gives, for any
micro step, the number of real samples summed over ranks, which the engine uses to normalise the
loss so the gradient is the mean over exactly the real samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
                raise DataError(f"sample {key} in {split.location}: label {label} is not in the task sequence's classes")
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


@dataclass
class _Failed:
    """An exception raised in a worker, returned as a value: torch would re-raise it with the worker's
    traceback in the message, and the pipeline's errors are one line."""

    error: BaseException


class _Collating(torch.utils.data.Dataset):
    """A map-style dataset whose index is the work item itself."""

    def __init__(self, collate: Collate) -> None:
        self.collate = collate

    def __getitem__(self, work: _Work) -> Batch | _Failed:  # type: ignore[override]
        try:
            batch = self.collate(work.samples, seed=work.seed) if work.samples else None
            if work.pad_to and (batch is None or len(batch) < work.pad_to):
                template = batch if batch is not None else self.collate([work.fallback], seed=work.seed)
                batch = _pad(batch, template, work.pad_to)
            return batch
        except Exception as e:  # noqa: BLE001 - re-raised as it is in the main process
            return _Failed(e)

    def __len__(self) -> int:  # never asked: the sampler is a stream
        raise TypeError("a stream of work items has no length")


def _first(work: _Work) -> _Work:
    return work


def _run(works: Iterator[_Work], collate: Collate, num_workers: int, pin_memory: bool) -> Iterator[Batch]:
    data = _Collating(collate)
    if num_workers == 0:
        stream: Iterator = (data[w] for w in works)
        if pin_memory:
            stream = (out if isinstance(out, _Failed) else out.pin_memory() for out in stream)
    else:
        stream = iter(torch.utils.data.DataLoader(
            data, batch_size=None, sampler=works, num_workers=num_workers, collate_fn=_first,  # type: ignore[arg-type]
            pin_memory=pin_memory, prefetch_factor=4))
    for out in stream:
        if isinstance(out, _Failed):
            raise out.error
        yield out


def train_batches(
    split: Split, *, rank: int, world: int, batch_size: int, num_steps: int, skip_steps: int, seed: int,
    policy: str, shuffle_buffer: int, collate: Collate, aug_seed: int | None = None, num_workers: int = 0,
    pin_memory: bool = False,
) -> Iterator[Batch]:
    """Exactly ``num_steps - skip_steps`` batches of size ``batch_size`` for this rank.

    ``seed`` orders the samples (it may differ per rank); ``aug_seed`` seeds their augmentation (the same on
    every rank, so a sample's crops do not depend on the world size). A short batch is padded with
    zero-weight copies of its own rows, an empty one with copies of the split's first sample.
    """
    def works() -> Iterator[_Work]:
        stream = iter_samples(split, rank, world, policy=policy, shuffle_seed=seed, shuffle_buffer=shuffle_buffer,
                              skip=skip_steps * batch_size)
        fallback = None
        for _ in range(skip_steps, num_steps):
            chunk = [s for _, s in zip(range(batch_size), stream)]
            if not chunk and fallback is None:
                fallback = next(iter_samples(split, 0, 1, policy="sample"))
            yield _Work(chunk, aug_seed, batch_size, fallback if not chunk else None)

    return _run(works(), collate, num_workers, pin_memory)


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


def eval_batches(split: Split, *, rank: int, world: int, batch_size: int, policy: str,
                 collate: Collate, num_workers: int = 0, pin_memory: bool = False) -> Iterator[Batch]:
    """This rank's part of a split in manifest order, unpadded (evaluation runs no collectives)."""
    def works() -> Iterator[_Work]:
        chunk: list[dict] = []
        for s in iter_samples(split, rank, world, policy=policy):
            chunk.append(s)
            if len(chunk) == batch_size:
                yield _Work(chunk, None, 0, None)
                chunk = []
        if chunk:
            yield _Work(chunk, None, 0, None)

    return _run(works(), collate, num_workers, pin_memory)
