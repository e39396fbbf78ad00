"""The loader with worker processes: the same batches for any worker count, augmentation that depends only on
(seed, sample key), and errors from a worker as one line."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from mcit.data import transforms
from mcit.data.loader import classification_collate, eval_batches, micro_steps_per_epoch, train_batches
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
                              num_workers=workers))


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
    with pytest.raises(ValueError, match="needs a seed"):
        collate(samples)
    # evaluation is deterministic and takes no seed
    ev = _collate(split, "coda", train=False)
    assert torch.equal(ev(samples).pixel_values, ev(samples).pixel_values)


def test_eval_batches_are_identical_for_0_and_2_workers(split):
    ev = _collate(split, "l2p", train=False)
    a = list(eval_batches(split, rank=0, world=2, batch_size=5, policy="shard", collate=ev))
    b = list(eval_batches(split, rank=0, world=2, batch_size=5, policy="shard", collate=ev, num_workers=2))
    assert sum(len(x) for x in a) > 5 and _same(a, b)


def test_a_sample_that_cannot_be_decoded_in_a_worker_is_one_line_naming_it(tmp_path):
    samples = _patterned(10)
    samples[6]["png"] = b"\x89PNG not an image"
    write_split(tmp_path / "bad", samples, shard_size=5, label_space=[0, 1, 2])
    sp = open_split(tmp_path / "bad")
    with pytest.raises(DataError) as e:
        list(eval_batches(sp, rank=0, world=1, batch_size=3, policy="sample", collate=_collate(sp, "none", False),
                          num_workers=2))
    msg = str(e.value)
    assert "\n" not in msg and "sample p0006" in msg and "cannot decode" in msg
