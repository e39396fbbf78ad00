"""Batches for the engine and the evaluator, built from a rank's part of a split.

Training runs the same number of micro steps on every rank (collectives inside DeepSpeed require
it): ``steps_per_epoch`` is computed from the manifest for the largest rank, and a rank that has run
out of samples pads with zero-weight copies (``Batch.valid == 0``). ``global_valid`` gives, for any
micro step, the number of real samples summed over ranks, which the engine uses to normalise the
loss so the gradient is the mean over exactly the real samples.
"""

from __future__ import annotations

import math
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


Collate = Callable[[list[dict]], Batch]


def classification_collate(preprocess: Callable, label_index: dict[int, int], task: int, split: Split) -> Collate:
    """Raw (image, class) samples -> a Batch of pixel values and global class indices."""

    def collate(samples: list[dict]) -> Batch:
        images, labels, keys = [], [], []
        for s in samples:
            image, label, key = decode_sample(s)
            if label not in label_index:
                raise DataError(f"sample {key} in {split.directory}: label {label} is not in the task sequence's classes")
            images.append(image)
            labels.append(label_index[label])
            keys.append(key)
        return Batch(preprocess(images), torch.tensor(labels, dtype=torch.long), torch.ones(len(labels)), task, keys)

    return collate


def train_batches(
    split: Split, *, rank: int, world: int, batch_size: int, num_steps: int, skip_steps: int, seed: int,
    policy: str, shuffle_buffer: int, collate: Collate,
) -> Iterator[Batch]:
    """Exactly ``num_steps - skip_steps`` batches of size ``batch_size`` for this rank."""
    stream = iter_samples(split, rank, world, policy=policy, shuffle_seed=seed, shuffle_buffer=shuffle_buffer,
                          skip=skip_steps * batch_size)
    template: Batch | None = None
    for _ in range(skip_steps, num_steps):
        chunk = [s for _, s in zip(range(batch_size), stream)]
        if chunk:
            batch = collate(chunk)
            template = batch
        else:
            batch = None
        if batch is None or len(batch) < batch_size:
            if template is None:  # this rank owns no sample at all: borrow one to keep shapes
                first = next(iter_samples(split, 0, 1, policy="sample"))
                template = collate([first])
            batch = _pad(batch, template, batch_size)
        yield batch


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
                 collate: Collate) -> Iterator[Batch]:
    """This rank's part of a split in manifest order, unpadded (evaluation runs no collectives)."""
    chunk: list[dict] = []
    for s in iter_samples(split, rank, world, policy=policy):
        chunk.append(s)
        if len(chunk) == batch_size:
            yield collate(chunk)
            chunk = []
    if chunk:
        yield collate(chunk)
