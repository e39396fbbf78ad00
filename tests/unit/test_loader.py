"""The loader with worker processes: the same batches for any worker count, augmentation that depends only on
(seed, sample key), errors from a worker as one line, and a stuck worker as one."""

from __future__ import annotations

import io
import time
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mcit.data import transforms
from mcit.data.loader import LoaderOptions, classification_collate, eval_batches, micro_steps_per_epoch, train_batches
from mcit.data.shards import DataError, open_split, write_split


def _patterned(n: int) -> list[dict]:
    """RGB images whose every pixel differs (a crop or flip changes the bytes), 3 classes, mixed sizes."""
    out = []
    for i in range(n):
        w, h = 12 + i % 5, 10 + i % 7
        y, x = np.mgrid[0:h, 0:w]
        arr = np.stack([(x * 17 + y * 5 + i) % 256, (x * y * 3 + i * 7) % 256, (x * 31 + 200 - y) % 256], -1)
        buf = io.BytesIO()
        Image.fromarray(arr.astype("uint8"), "RGB").save(buf, format="PNG")
        out.append({"__key__": f"p{i:04d}", "png": buf.getvalue(), "cls": i % 3})
    return out


def _to_tensor(images: list) -> torch.Tensor:
    return torch.from_numpy(np.stack([np.asarray(im.convert("RGB").resize((8, 8)), dtype=np.float32) for im in images]))


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    d = tmp_path_factory.mktemp("loader") / "sp"
    write_split(d, _patterned(45), shard_size=7, label_space=[0, 1, 2])
    return open_split(d)


def _collate(split, preset: str = "l2p", train: bool = True):
    return classification_collate(_to_tensor, {0: 0, 1: 1, 2: 2}, 0, split,
                                  transforms.build(preset, train=train, size=8))


def _train(split, workers: int, skip: int = 0, aug_seed: int = 11, rank: int = 1):
    steps = micro_steps_per_epoch(split, 2, 4, 1, "sample")
    return list(train_batches(split, rank=rank, world=2, batch_size=4, num_steps=steps + 2, skip_steps=skip, seed=3,
                              policy="sample", shuffle_buffer=5, collate=_collate(split), aug_seed=aug_seed,
                              loader=LoaderOptions(num_workers=workers)))


def _same(a, b) -> bool:
    return (len(a) == len(b) and all(torch.equal(x.pixel_values, y.pixel_values) and torch.equal(x.labels, y.labels)
                                     and torch.equal(x.valid, y.valid) and x.keys == y.keys for x, y in zip(a, b)))


def test_train_batches_are_identical_for_0_and_2_workers_and_a_resume_draws_the_same_crops(split):
    """Rank 1 of 2 holds 22 samples: 6 batches of 4 (the last padded), then 2 all-padding steps. With 2 workers
    every batch, its augmentation and its padding are the same as in-process; skipping 3 steps (a mid-epoch
    resume) gives the rest of the epoch exactly; another aug seed gives other crops of the same samples."""
    inline = _train(split, 0)
    assert len(inline) == 8 and [int(b.valid.sum()) for b in inline] == [4, 4, 4, 4, 4, 2, 0, 0]
    assert _same(_train(split, 2), inline)
    assert _same(_train(split, 2, skip=3), inline[3:])
    other = _train(split, 0, aug_seed=12)
    assert [b.keys for b in other] == [b.keys for b in inline]
    assert not torch.equal(other[0].pixel_values, inline[0].pixel_values)


def test_a_sample_s_augmentation_depends_on_the_seed_and_its_key_only(split):
    from mcit.data.shards import iter_samples

    samples = list(iter_samples(split, 0, 1, policy="sample"))[:5]
    collate = _collate(split)
    together = collate(samples, seed=4).pixel_values
    alone = torch.cat([collate([s], seed=4).pixel_values for s in samples])
    assert torch.equal(together, alone)
    assert not torch.equal(collate(samples, seed=5).pixel_values, together)
    # the same image under two keys: each key draws its own crop and flip (not one draw for the whole batch)
    twins = [{**samples[0], "__key__": f"twin{i}"} for i in range(4)]
    drawn = collate(twins, seed=4).pixel_values
    assert len({tuple(x.flatten().tolist()) for x in drawn}) > 1
    with pytest.raises(ValueError, match="needs a seed"):
        collate(samples)
    # evaluation is deterministic and takes no seed
    ev = _collate(split, "coda", train=False)
    assert torch.equal(ev(samples).pixel_values, ev(samples).pixel_values)


def test_eval_batches_are_identical_for_0_and_2_workers(split):
    ev = _collate(split, "l2p", train=False)
    a = list(eval_batches(split, rank=0, world=2, batch_size=5, policy="shard", collate=ev))
    b = list(eval_batches(split, rank=0, world=2, batch_size=5, policy="shard", collate=ev,
                          loader=LoaderOptions(num_workers=2)))
    assert sum(len(x) for x in a) > 5 and _same(a, b)


def test_a_sample_that_cannot_be_decoded_in_a_worker_is_one_line_naming_it(tmp_path):
    samples = _patterned(10)
    samples[6]["png"] = b"\x89PNG not an image"
    write_split(tmp_path / "bad", samples, shard_size=5, label_space=[0, 1, 2])
    sp = open_split(tmp_path / "bad")
    with pytest.raises(DataError) as e:
        list(eval_batches(sp, rank=0, world=1, batch_size=3, policy="sample", collate=_collate(sp, "backbone", False),
                          loader=LoaderOptions(num_workers=2)))
    msg = str(e.value)
    assert "\n" not in msg and "sample p0006" in msg and "cannot decode" in msg


class _StuckInWorker:
    """The collate of a worker that never returns for the batch holding ``key`` (a worker stuck on storage, or
    deadlocked in ``fork``); the same collate in the training process works."""

    def __init__(self, inner, key: str) -> None:
        self.inner, self.key = inner, key

    def __call__(self, samples, seed=None):
        if torch.utils.data.get_worker_info() is not None and any(s["__key__"] == self.key for s in samples):
            time.sleep(3600)
        return self.inner(samples, seed)


@pytest.mark.parametrize("stream", ["train", "eval"])
def test_a_stuck_worker_stops_the_stream_with_one_line_naming_the_split(split, stream):
    """No silent hang: past ``worker_timeout_s`` without a batch the stream raises, after the batches before the
    stuck one, and the workers are gone (a fork deadlock hung a CI run for 15 minutes before this)."""
    import gc
    import multiprocessing

    from mcit.data.loader import shutdown_workers

    shutdown_workers()  # earlier tests' persistent workers: only this stream's are counted below
    got = []
    t0 = time.monotonic()
    with pytest.raises(DataError) as e:
        if stream == "train":
            collate = _StuckInWorker(_collate(split), "p0020")
            batches = train_batches(split, rank=0, world=1, batch_size=4, num_steps=12, skip_steps=0, seed=0,
                                    policy="sample", shuffle_buffer=1, collate=collate, aug_seed=11,
                                    loader=LoaderOptions(num_workers=2, worker_timeout_s=2))
        else:
            collate = _StuckInWorker(_collate(split, "backbone", False), "p0020")
            batches = eval_batches(split, rank=0, world=1, batch_size=4, policy="sample", collate=collate,
                                   loader=LoaderOptions(num_workers=2, worker_timeout_s=2))
        for b in batches:
            got.append(b)
    elapsed = time.monotonic() - t0
    msg = str(e.value)
    assert "\n" not in msg and split.location in msg and "data.worker_timeout_s" in msg and " 2 s " in msg
    assert elapsed < 30 and len(got) >= 3  # the batches before p0020's (samples 20-23) came through
    del batches, b
    gc.collect()
    deadline = time.monotonic() + 20
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not multiprocessing.active_children()


def test_one_stream_over_several_splits_or_epochs_equals_one_stream_each(split, tmp_path):
    """eval_parts streams a row's test splits through one set of workers, tagging each batch with its split;
    train_epochs streams a task's epochs. Both give, with 2 workers, exactly the batches of one in-process
    stream per split / epoch, large (3 x 128 x 128 floats) and small."""
    from mcit.data.loader import Epoch, eval_parts, train_epochs

    write_split(tmp_path / "other", _patterned(9), shard_size=4, label_space=[0, 1, 2])
    other = open_split(tmp_path / "other")
    big = classification_collate(
        lambda ims: torch.from_numpy(np.stack([np.asarray(im.convert("RGB").resize((128, 128)), dtype=np.float32)
                                               for im in ims])).permute(0, 3, 1, 2).contiguous(),
        {0: 0, 1: 1, 2: 2}, 0, split)
    small = _collate(other, "l2p", train=False)
    got = list(eval_parts([split, other], [big, small], rank=0, world=1, batch_size=20, policy="sample",
                          loader=LoaderOptions(num_workers=2)))
    assert [i for i, _ in got] == [0, 0, 0, 1]
    want = [list(eval_batches(split, rank=0, world=1, batch_size=20, policy="sample", collate=big)),
            list(eval_batches(other, rank=0, world=1, batch_size=20, policy="sample", collate=small))]
    assert _same([b for i, b in got if i == 0], want[0]) and _same([b for i, b in got if i == 1], want[1])
    steps = micro_steps_per_epoch(split, 2, 4, 1, "sample")
    epochs = [Epoch(2, 3, 11), Epoch(0, 4, 12)]  # a resumed first epoch, then a whole one
    stream = list(train_epochs(split, epochs, rank=1, world=2, batch_size=4, num_steps=steps, policy="sample",
                               shuffle_buffer=5, collate=_collate(split), loader=LoaderOptions(num_workers=2)))
    each = [b for e in epochs for b in train_batches(split, rank=1, world=2, batch_size=4, num_steps=steps,
                                                     skip_steps=e.skip_steps, seed=e.seed, policy="sample",
                                                     shuffle_buffer=5, collate=_collate(split), aug_seed=e.aug_seed)]
    assert len(stream) == 2 * steps - 2 and _same(stream, each)


class _Tagged:
    """A collate that records which process built each batch (in its keys) and with what ``tag``."""

    def __init__(self, inner, tag: str) -> None:
        self.inner, self.tag = inner, tag

    def __call__(self, samples, seed=None):
        import os

        batch = self.inner(samples, seed)
        batch.keys = [f"{k}|{self.tag}|{os.getpid()}" for k in batch.keys]
        return batch


def _parts(batches) -> tuple[list[str], list[str], set[str]]:
    keys = [k.split("|") for b in batches for k in b.keys]
    return [k for k, _, _ in keys], [t for _, t, _ in keys], {p for _, _, p in keys}


def test_workers_persist_across_streams_and_take_each_streams_own_collate(split):
    """The process's loader workers serve stream after stream (no fork per task, per evaluation): the same
    processes, each stream collated by its own collate, abandoned streams drained, batches as in-process."""
    import os

    from mcit.data.loader import shutdown_workers

    shutdown_workers()
    a, b = _Tagged(_collate(split, "backbone", False), "a"), _Tagged(_collate(split, "l2p", True), "b")

    def ev(c: Any, w: int) -> list:
        return list(eval_batches(split, rank=0, world=1, batch_size=4, policy="sample", collate=c,
                                 loader=LoaderOptions(num_workers=w)))

    keys, tags, pids = _parts(ev(a, 2))
    assert len(keys) == 45 and set(tags) == {"a"} and len(pids - {str(os.getpid())}) == 2  # two workers did most
    workers = pids - {str(os.getpid())}
    tr = list(train_batches(split, rank=0, world=1, batch_size=4, num_steps=12, skip_steps=0, seed=3, policy="sample",
                            shuffle_buffer=5, collate=b, aug_seed=11, loader=LoaderOptions(num_workers=2)))
    tkeys, ttags, tpids = _parts(tr)
    assert set(ttags) == {"b"} and tpids - {str(os.getpid())} == workers  # the same workers, the new collate
    inline = list(train_batches(split, rank=0, world=1, batch_size=4, num_steps=12, skip_steps=0, seed=3,
                                policy="sample", shuffle_buffer=5, collate=b, aug_seed=11,
                                loader=LoaderOptions(num_workers=0)))
    assert all(torch.equal(x.pixel_values, y.pixel_values) for x, y in zip(tr, inline)) and len(tr) == len(inline)
    c = _Tagged(_collate(split, "backbone", False), "c")
    stream = iter(eval_batches(split, rank=0, world=1, batch_size=4, policy="sample", collate=c,
                               loader=LoaderOptions(num_workers=2)))
    next(stream), next(stream)
    del stream  # abandoned with batches still in the workers: the next stream must not receive them
    keys, tags, pids = _parts(ev(a, 2))
    assert keys == _parts(ev(a, 0))[0] and set(tags) == {"a"} and pids - {str(os.getpid())} == workers
    from mcit.data.loader import eval_parts

    row = list(eval_parts([split, split], [a, c], rank=0, world=1, batch_size=4, policy="sample",
                          loader=LoaderOptions(num_workers=2)))
    assert [(i, t) for i, batch in row for t in _parts([batch])[1]] == [(0, "a")] * 45 + [(1, "c")] * 45


def test_a_collate_that_cannot_travel_gets_workers_of_its_own(split):
    """A closure cannot be pickled, and a collate holding a model must not be: each gets a per-stream loader
    whose workers inherit it (the same batches); a stream opened while another runs does too."""
    import os

    from mcit.data.loader import WorkerPool, shutdown_workers

    shutdown_workers()
    inner = _collate(split, "backbone", False)
    closure = lambda samples, seed=None: inner(samples, seed)  # noqa: E731
    want = list(eval_batches(split, rank=0, world=1, batch_size=4, policy="sample", collate=inner))
    got = list(eval_batches(split, rank=0, world=1, batch_size=4, policy="sample", collate=closure,
                            loader=LoaderOptions(num_workers=2)))
    assert _same(got, want)
    pool = WorkerPool(1, False, 600.0)
    model = torch.nn.Linear(4, 4)
    heavy = classification_collate(lambda ims, m=model: _to_tensor(ims), {0: 0}, 0, split)
    assert pool.register([closure]) is None and pool.register([_Tagged(inner, model)]) is None
    assert pool.register([heavy]) is None and pool.register([_Tagged(inner, torch.zeros(1 << 21))]) is None
    keys = pool.register([inner, _Tagged(inner, "x"), inner])
    assert (keys is not None and keys[0] == keys[2] != keys[1]
            and sorted(os.listdir(pool.directory)) == sorted(set(keys)))
    outer = eval_batches(split, rank=0, world=1, batch_size=4, policy="sample", collate=_Tagged(inner, "o"),
                         loader=LoaderOptions(num_workers=2))
    first = [next(outer)]
    nested = list(eval_batches(split, rank=0, world=1, batch_size=4, policy="sample", collate=_Tagged(inner, "n"),
                               loader=LoaderOptions(num_workers=2)))
    rest = first + list(outer)
    assert _parts(nested)[0] == _parts(rest)[0] == [k for b in want for k in b.keys]
    assert set(_parts(nested)[1]) == {"n"} and set(_parts(rest)[1]) == {"o"}
