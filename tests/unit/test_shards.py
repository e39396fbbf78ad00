import io
import json
from pathlib import Path

import pytest
from PIL import Image

from mcit.data.loader import classification_collate, global_valid, micro_steps_per_epoch, rank_counts, train_batches
from mcit.data.shards import DataError, assign, decode_sample, iter_samples, open_split, write_split


def _samples(n, label_of=lambda i: i % 3):
    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.new("L", (4, 4), i % 255).save(buf, format="PNG")
        out.append({"__key__": f"s{i:04d}", "png": buf.getvalue(), "cls": label_of(i)})
    return out


@pytest.fixture
def split(tmp_path):
    write_split(tmp_path / "sp", _samples(103), shard_size=10, label_space=[0, 1, 2])
    return open_split(tmp_path / "sp", verify="sha256")


def test_roundtrip_and_manifest(split):
    m = split.manifest
    assert m["num_samples"] == 103 and len(m["shards"]) == 11
    assert sum(s["num_samples"] for s in m["shards"]) == 103
    assert all(len(s["sha256"]) == 64 for s in m["shards"])
    keys = [s["__key__"] for s in iter_samples(split, 0, 1)]
    assert keys == [f"s{i:04d}" for i in range(103)]
    img, label, key = decode_sample(next(iter_samples(split, 0, 1)))
    assert img.size == (4, 4) and label == 0 and key == "s0000"


def test_manifest_keeps_class_names_and_the_builders_extra_fields(tmp_path):
    """Tasks are told apart by what data_prep writes beside the shards (task, class order, seed, scorer):
    a manifest that dropped them would make every task look alike."""
    extra = {"task": "task3", "class_order": [2, 0, 1], "seed": 7}
    write_split(tmp_path / "sp", _samples(5), shard_size=4, label_space=[2, 0, 1], class_names={0: "a", 2: "c"},
                extra=extra)
    m = open_split(tmp_path / "sp").manifest
    assert {k: m[k] for k in extra} == extra
    assert m["class_names"] == {"0": "a", "2": "c"} and m["label_space"] == [0, 1, 2]
    assert [s["num_samples"] for s in m["shards"]] == [4, 1]


@pytest.mark.parametrize("policy", ["shard", "sample", "auto"])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_disjoint_and_complete(split, policy, world):
    per_rank = [[s["__key__"] for s in iter_samples(split, r, world, policy=policy)] for r in range(world)]
    flat = [k for keys in per_rank for k in keys]
    assert len(flat) == len(set(flat)) == 103  # disjoint, and every sample exactly once
    assert [len(k) for k in per_rank] == rank_counts(split, world, policy)


def test_shuffle_is_deterministic_and_skip_resumes(split):
    a = [s["__key__"] for s in iter_samples(split, 1, 2, shuffle_seed=5, shuffle_buffer=16)]
    b = [s["__key__"] for s in iter_samples(split, 1, 2, shuffle_seed=5, shuffle_buffer=16)]
    c = [s["__key__"] for s in iter_samples(split, 1, 2, shuffle_seed=6, shuffle_buffer=16)]
    assert a == b and a != c and sorted(a) == sorted(c)
    tail = [s["__key__"] for s in iter_samples(split, 1, 2, shuffle_seed=5, shuffle_buffer=16, skip=7)]
    assert tail == a[7:]


def test_uneven_ranks_padding_and_global_valid(split):
    world, B = 2, 16
    counts = rank_counts(split, world, "shard")  # 11 shards of 10,...,3 -> unequal
    assert counts[0] != counts[1]
    steps = micro_steps_per_epoch(split, world, B, 1, "shard")
    seen = 0
    for r in range(world):
        batches = list(train_batches(split, rank=r, world=world, batch_size=B, num_steps=steps, skip_steps=0, seed=1,
                                     policy="shard", shuffle_buffer=8,
                                     collate=classification_collate(_t, {0: 0, 1: 1, 2: 2}, 0, split)))
        assert len(batches) == steps and all(len(b) == B for b in batches)
        seen += int(sum(b.valid.sum() for b in batches))
    assert seen == 103
    assert sum(global_valid(counts, s, B) for s in range(steps)) == 103
    assert global_valid([5, 3], 1, 4) == 1  # the second rank has nothing left at step 1: it adds 0, not 1


def _t(images):
    import numpy as np
    import torch

    return torch.from_numpy(np.stack([np.asarray(i, dtype=np.float32) for i in images]))


def test_missing_and_truncated_shards_name_the_file(tmp_path):
    d = tmp_path / "sp"
    write_split(d, _samples(30), shard_size=10, label_space=[0, 1, 2])
    (d / "shard-000001.tar").unlink()
    with pytest.raises(DataError, match=r"missing shard: .*shard-000001\.tar"):
        open_split(d)
    write_split(d, _samples(30), shard_size=10, label_space=[0, 1, 2])
    f = d / "shard-000002.tar"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(DataError, match=r"shard .*shard-000002\.tar has 1000 bytes.*truncated"):
        open_split(d)


def test_corrupted_shard_detected_by_sha256(tmp_path):
    d = tmp_path / "sp"
    write_split(d, _samples(10), shard_size=10, label_space=[0, 1, 2])
    f = d / "shard-000000.tar"
    data = bytearray(f.read_bytes())
    data[700] ^= 0xFF
    f.write_bytes(bytes(data))
    open_split(d, verify="size")  # same size: the fast check passes
    with pytest.raises(DataError, match="sha256 does not match"):
        open_split(d, verify="sha256")


def test_missing_manifest_and_bad_format(tmp_path):
    with pytest.raises(DataError, match="missing manifest"):
        open_split(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(DataError, match="format is 'other'"):
        open_split(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(["a", "list"]))  # valid JSON, not a manifest
    with pytest.raises(DataError, match="format is None, expected"):
        open_split(tmp_path)


def test_assign_is_balanced_greedy():
    class S:  # minimal stand-in for Split's two fields used by assign
        shard_counts = [10, 10, 10, 10, 10, 10, 10, 3]
        num_samples = 73

    mode, mine, load = assign(S(), 0, 2, "shard")
    assert mode == "shard" and sorted(load) == [33, 40]


@pytest.mark.parametrize("mtime", [0, 0.0])  # 0.0 makes tarfile write a pax header before every member
def test_fast_tar_reader_yields_what_webdataset_yields(tmp_path, mtime):
    import webdataset as wds

    from mcit.data.shards import tar_samples

    path = tmp_path / "s.tar"
    long_key = "k" * 120  # longer than ustar's 100-byte name field
    with wds.TarWriter(str(path), mtime=mtime) as sink:
        for i, key in enumerate(["a0", "b1", long_key, "dir_x"]):
            sink.write({"__key__": key, "png": bytes([i]) * (700 + i), "cls": i, "json": {"i": i}})
    ours = list(tar_samples(path))
    theirs = list(wds.tarfile_to_samples()([{"url": str(path)}]))
    assert [s["__key__"] for s in ours] == ["a0", "b1", long_key, "dir_x"]
    assert ours == [{k: v for k, v in s.items() if k in ours[0]} for s in theirs]
    data = path.read_bytes()
    for cut, msg in ((data.rfind(b'{"i": 3}') + 3, "truncated"), (700, "truncated")):
        (tmp_path / "cut.tar").write_bytes(data[:cut])
        with pytest.raises(DataError, match=msg):
            list(tar_samples(tmp_path / "cut.tar"))
    broken = bytearray(data)
    broken[10] ^= 0xFF  # a flipped byte in the first header
    (tmp_path / "flip.tar").write_bytes(bytes(broken))
    with pytest.raises(DataError, match=r"flip\.tar: bad tar header at byte 0"):
        list(tar_samples(tmp_path / "flip.tar"))


def test_greedy_assignment_takes_the_largest_shard_first():
    """Shards of 5, 3, 3, 3, 2 samples over 2 ranks: largest first gives 5+3 | 3+3+2 = 8 | 8; the same rule
    smallest first would give 2+3+5 | 3+3 = 10 | 6. Rank 0 owns the 5-sample shard and one 3."""
    class S:
        shard_counts = [3, 5, 2, 3, 3]
        num_samples = 16

    mode, mine, load = assign(S(), 0, 2, "shard")
    assert mode == "shard" and load == [8, 8] and mine == [1, 4]
    assert assign(S(), 1, 2, "shard")[1] == [0, 2, 3]


def test_steps_per_epoch_follow_the_largest_rank_and_round_to_grad_accum(tmp_path):
    """5 samples in one shard over 2 ranks (sample mode): ranks hold 3 and 2. Batch 2: the larger rank needs
    2 steps (the smaller one 1, then pads); with grad_accum 3 an epoch is one whole optimizer step, 3 micro steps."""
    write_split(tmp_path / "five", _samples(5), shard_size=10, label_space=[0, 1, 2])
    sp = open_split(tmp_path / "five")
    assert rank_counts(sp, 2, "sample") == [3, 2]
    assert micro_steps_per_epoch(sp, 2, 2, 1, "sample") == 2
    assert micro_steps_per_epoch(sp, 2, 2, 3, "sample") == 3
    assert micro_steps_per_epoch(sp, 2, 1, 2, "sample") == 4  # 3 steps rounded up to 2 x 2
    assert micro_steps_per_epoch(sp, 2, 8, 1, "sample") == 1  # smaller than one batch: one step, not more


def test_manifest_whose_count_disagrees_with_its_shards_is_refused(split):
    mpath = Path(split.location) / "manifest.json"
    m = json.loads(mpath.read_text())
    m["num_samples"] += 1
    mpath.write_text(json.dumps(m))
    with pytest.raises(DataError, match="shard sample counts do not add up to num_samples"):
        open_split(split.location)
    m["num_samples"] -= 1
    m["shards"][3]["num_samples"] -= 1
    mpath.write_text(json.dumps(m))
    with pytest.raises(DataError, match="do not add up"):
        open_split(split.location)


def test_written_shards_are_byte_identical_and_the_manifest_keeps_class_names(tmp_path):
    """Shards carry mtime 0 in every tar header, so the same samples written again (another day, another
    machine) give the same bytes and sha256; class names land in the manifest with string keys; an empty split
    is one empty shard, not a split without shards."""
    import tarfile

    a = write_split(tmp_path / "a", _samples(12), shard_size=5, label_space=[2, 0, 1],
                    class_names={0: "zero", 2: "two"})
    with tarfile.open(tmp_path / "a" / "shard-000000.tar") as tar:
        assert {m.mtime for m in tar.getmembers()} == {0}
    b = write_split(tmp_path / "b", _samples(12), shard_size=5, label_space=[0, 1, 2])
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    assert a["class_names"] == {"0": "zero", "2": "two"} and b["class_names"] == {}
    assert a["label_space"] == [0, 1, 2] and [s["num_samples"] for s in a["shards"]] == [5, 5, 2]
    empty = write_split(tmp_path / "e", [], shard_size=5, label_space=[0])
    assert [s["num_samples"] for s in empty["shards"]] == [0]
    assert list(iter_samples(open_split(tmp_path / "e", verify="sha256"), 0, 1)) == []


def test_validation_carve_is_disjoint_complete_deterministic_and_counted(split):
    from mcit.data.shards import carve

    fit, val = carve(split, 0.2)
    keys = lambda sp, r=0, w=1: [s["__key__"] for s in iter_samples(sp, r, w)]  # noqa: E731
    fk, vk = keys(fit), keys(val)
    assert not set(fk) & set(vk) and sorted(fk + vk) == [f"s{i:04d}" for i in range(103)]
    assert 10 <= len(vk) <= 32  # about a fifth, by the hash of the key
    # each side's manifest counts exactly what it yields, shard by shard (the loader's step count reads it)
    for sp, ks in ((fit, fk), (val, vk)):
        assert sp.num_samples == len(ks) and sum(sp.shard_counts) == len(ks)
        assert [sum(1 for _ in sp.shard_samples(i)) for i in range(len(sp.shard_locations))] == sp.shard_counts
        assert sorted(keys(sp, 0, 2) + keys(sp, 1, 2)) == sorted(ks)  # ranks still split it disjointly
    assert (fk, vk) == (keys(carve(split, 0.2)[0]), keys(carve(split, 0.2)[1]))  # the same carve every time
    assert set(keys(carve(split, 0.4)[1])) > set(vk)  # a larger fraction only adds samples to validation
    with pytest.raises(DataError, match="validation part empty"):
        carve(split, 1e-9)


def test_union_reads_every_splits_samples_once(tmp_path):
    from mcit.data.shards import union

    write_split(tmp_path / "a", _samples(25), shard_size=10, label_space=[0, 1, 2])
    write_split(tmp_path / "b", [{**s, "__key__": "b" + s["__key__"], "cls": 3} for s in _samples(12)],
                shard_size=5, label_space=[3])
    a, b = open_split(tmp_path / "a"), open_split(tmp_path / "b")
    u = union([a, b], "a+b")
    assert u.num_samples == 37 and u.label_space == [0, 1, 2, 3] and len(u.shard_locations) == 6
    got = [s["__key__"] for r in range(2) for s in iter_samples(u, r, 2, shuffle_seed=3)]
    assert sorted(got) == sorted([f"s{i:04d}" for i in range(25)] + [f"bs{i:04d}" for i in range(12)])


def test_carved_parts_name_their_own_classes_and_say_what_they_are(tmp_path):
    """Each side of a carve lists the classes its samples hold (a class that lands only on one side is not
    claimed by the other); a split whose samples carry no label (instruction data) keeps its manifest's label
    space; each part's location says which part of which carve it is, for error messages."""
    from mcit.data.shards import carve, validation_side

    keys = [f"k{i:03d}" for i in range(40)]
    val = {k for k in keys if validation_side(k, 0.5)}
    assert 0 < len(val) < len(keys)
    labelled = [{**s, "__key__": k, "cls": 7 if k in val else 5} for s, k in zip(_samples(40), keys)]
    write_split(tmp_path / "cil", labelled, shard_size=16, label_space=[5, 7])
    fit, v = carve(open_split(tmp_path / "cil"), 0.5)
    assert (fit.label_space, v.label_space) == ([5], [7])
    assert fit.location == f"{tmp_path / 'cil'} (fit part of a 0.5 carve)"
    assert v.location == f"{tmp_path / 'cil'} (validation part of a 0.5 carve)"
    unlabelled = [{"__key__": k, "png": s["png"]} for s, k in zip(_samples(40), keys)]
    write_split(tmp_path / "inst", unlabelled, shard_size=16, label_space=[0])
    assert [sp.label_space for sp in carve(open_split(tmp_path / "inst"), 0.5)] == [[0], [0]]


def test_union_manifest_keeps_kind_merges_class_names_and_is_named(tmp_path):
    """The joint split of the multi-task bound: its manifest's ``kind`` is the tasks' common kind (None when
    they differ, so neither collate is assumed), class names from every task, and its location is the name."""
    from mcit.data.shards import union

    write_split(tmp_path / "a", _samples(4), shard_size=4, label_space=[0, 1, 2], class_names={0: "zero"},
                extra={"kind": "classification"})
    write_split(tmp_path / "b", [{**s, "cls": 3} for s in _samples(4)], shard_size=4, label_space=[3],
                class_names={3: "three"}, extra={"kind": "classification", "task": "b"})
    write_split(tmp_path / "c", _samples(4), shard_size=4, label_space=[0], extra={"kind": "instruction"})
    a, b, c = (open_split(tmp_path / n) for n in "abc")
    u = union([a, b], "joint")
    assert u.location == "joint" and u.manifest["kind"] == "classification"
    assert u.manifest["class_names"] == {"0": "zero", "3": "three"}
    assert "task" not in u.manifest  # the first split's fields, not the second's
    assert union([b, a], "joint").manifest["task"] == "b"
    assert union([a, c], "mixed").manifest["kind"] is None


def test_padding_copies_the_batch_s_own_rows_at_zero_weight_and_concat_keeps_the_batch_fields():
    """A short batch is filled with its own rows (an instruction batch's token length differs from the
    template's, so the template's rows would not even fit), weight 0; a batch of padding only has no keys;
    concatenation keeps the task and the allowed classes."""
    import torch

    from mcit.data.loader import pad_batch
    from mcit.data.types import Batch

    def batch(n, length, task=1):
        return Batch(torch.arange(n, dtype=torch.float32).reshape(n, 1), torch.arange(n), torch.ones(n), task,
                     [f"k{i}" for i in range(n)], torch.tensor([True, False]),
                     {"input_ids": torch.full((n, length), 7)}, [{"i": i} for i in range(n)])

    template = batch(3, 9)
    one = pad_batch(batch(1, 5), template, 4)
    assert one.valid.tolist() == [1.0, 0.0, 0.0, 0.0] and one.keys[0] == "k0"
    assert one.inputs["input_ids"].shape == (4, 5)
    assert one.task == 1 and torch.equal(one.allowed_classes, torch.tensor([True, False]))
    two = pad_batch(batch(2, 5), template, 3)
    assert two.labels.tolist() == [0, 1, 0] and two.meta == [{"i": 0}, {"i": 1}, {"i": 0}]
    empty = pad_batch(None, template, 2)
    assert empty.valid.tolist() == [0.0, 0.0] and empty.keys == [] and empty.inputs["input_ids"].shape == (2, 9)


def test_task_sequence_names_its_tasks_and_maps_labels_to_contiguous_classes():
    """Original labels (here 10, 20, 5, 7) become contiguous indices in label order; each task keeps its name
    (the accuracy matrix, the logs and evaluate.py's --tasks all go by it) and its classes."""
    from mcit.data.types import TaskSequence

    seq = TaskSequence.from_label_spaces(["birds", "cars"], [[20, 10], [7, 5]], {5: "five"})
    assert [(t.name, t.classes) for t in seq.tasks] == [("birds", (3, 2)), ("cars", (1, 0))]
    assert seq.labels == (5, 7, 10, 20) and seq.class_names == ("five", "7", "10", "20")


def test_a_split_of_one_sample_is_one_shard_and_an_empty_one_still_has_a_manifest(tmp_path):
    assert [sh["num_samples"] for sh in write_split(tmp_path / "one", _samples(1), shard_size=1,
                                                     label_space=[0])["shards"]] == [1]
    assert [sh["num_samples"] for sh in write_split(tmp_path / "none", [], shard_size=4,
                                                     label_space=[0])["shards"]] == [0]


def test_each_epoch_is_its_own_shuffle_of_this_rank_s_part(split):
    """Two epochs of one stream: each is exactly what ``iter_samples`` gives for that epoch's seed, this rank's
    part under the split policy and the shuffle buffer asked for (so a different seed is a different order, and
    neither is the manifest's); a rank left without samples (1 sample, 2 ranks) gets padding-only batches built
    from the split's first sample."""
    from mcit.data.loader import Epoch, train_epochs

    collate = classification_collate(_t, {0: 0, 1: 1, 2: 2}, 0, split)
    got = [b.keys for b in train_epochs(split, [Epoch(0, 1, None), Epoch(0, 2, None)], rank=1, world=2,
                                        batch_size=16, num_steps=4, policy="sample", shuffle_buffer=8,
                                        collate=collate)]
    per_epoch = [[k for keys in got[i * 4:(i + 1) * 4] for k in keys] for i in range(2)]
    want = [[s["__key__"] for s in iter_samples(split, 1, 2, policy="sample", shuffle_seed=seed, shuffle_buffer=8)]
            for seed in (1, 2)]
    assert [p[:len(w)] for p, w in zip(per_epoch, want)] == want and want[0] != want[1]
    assert want[0] != sorted(want[0])


def test_a_rank_without_samples_trains_on_padding_only(tmp_path):
    from mcit.data.loader import Epoch, train_epochs

    write_split(tmp_path / "one", _samples(1), shard_size=4, label_space=[0, 1, 2])
    one = open_split(tmp_path / "one")
    collate = classification_collate(_t, {0: 0, 1: 1, 2: 2}, 0, one)
    batches = list(train_epochs(one, [Epoch(0, 1, None)], rank=1, world=2, batch_size=4, num_steps=2, policy="sample",
                                shuffle_buffer=8, collate=collate))
    assert len(batches) == 2 and all(b.valid.tolist() == [0.0] * 4 and b.keys == [] for b in batches)


@pytest.mark.parametrize("ext", ["png", "jpg", "jpeg"])
def test_decode_reads_each_image_member_and_names_a_sample_without_one(ext):
    """Converters write PNG or JPEG members (data_prep.common keeps a JPEG file's bytes as they are, as "jpg");
    webdataset's own "jpeg" suffix is read too."""
    buf = io.BytesIO()
    Image.new("RGB", (6, 4), (200, 10, 10)).save(buf, format="PNG" if ext == "png" else "JPEG")
    img, label, key = decode_sample({"__key__": "k1", ext: buf.getvalue(), "cls": b"7"})
    assert img.size == (6, 4) and label == 7 and key == "k1"
    with pytest.raises(DataError, match=r"sample k1 in s.tar: cannot decode"):
        decode_sample({"__key__": "k1", "__url__": "s.tar", "txt": b"x", "cls": 7})
