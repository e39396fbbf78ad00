"""Dataset converters: exact raw-format fixtures convert, verify, resume, fail clearly, and train."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, launch, run_env, tiny_config
from mcit.data.shards import DataError, open_split

N_CLASSES = 6


def _cifar_raw(root, n_train=5, n_test=2, bad_label=False, duplicate=False):
    """A cifar-100-python directory in the real pickle format (bytes keys, uint8 rows of 3072)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(0)
    with open(root / "meta", "wb") as f:
        pickle.dump({b"fine_label_names": [f"class{c}".encode() for c in range(N_CLASSES)],
                     b"coarse_label_names": [b"all"]}, f)
    for split, n in (("train", n_train), ("test", n_test)):
        labels = [c for c in range(N_CLASSES) for _ in range(n)]
        data = np.stack([np.tile(np.array([40 * c, 255 - 40 * c, 128], dtype=np.uint8).repeat(1024), 1)
                         + rng.randint(0, 20, 3072).astype(np.uint8) for c in labels])
        if bad_label and split == "train":
            labels[3] = 250
        names = [f"{split}_{i}.png".encode() for i in range(len(labels))]
        if duplicate and split == "train":
            names[4] = names[2]
        with open(root / split, "wb") as f:
            pickle.dump({b"data": data, b"fine_labels": labels, b"coarse_labels": [0] * len(labels),
                         b"filenames": names, b"batch_label": split.encode()}, f)
    return root


def _run(*args):
    return subprocess.run([sys.executable, "-m", "data_prep.cifar100", *map(str, args), "--no-progress"], cwd=ROOT,
                          env=run_env(), capture_output=True, text=True)


def test_cifar100_converts_verifies_and_orders_reproducibly(tmp_path):
    raw = _cifar_raw(tmp_path / "cifar-100-python")
    r = _run("--raw", raw, "--out", tmp_path / "a", "--classes-per-task", 2, "--seed", 3, "--shard-size", 4,
             "--workers", 2)
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "a" / "benchmark.json").read_text())
    assert meta["class_order"] == [int(c) for c in np.random.RandomState(3).permutation(N_CLASSES)]
    split = open_split(tmp_path / "a" / "task0" / "train", "sha256")
    assert split.num_samples == 10 and split.label_space == sorted(meta["tasks"][0]["classes"])
    assert split.manifest["class_order"] == meta["class_order"] and split.manifest["skipped"] == 0
    assert _run("--verify", tmp_path / "a").returncode == 0
    again = _run("--raw", raw, "--out", tmp_path / "b", "--classes-per-task", 2, "--seed", 3, "--shard-size", 4)
    assert again.returncode == 0
    for t in range(3):
        for s in ("train", "test"):
            a = json.loads((tmp_path / "a" / f"task{t}" / s / "manifest.json").read_text())
            b = json.loads((tmp_path / "b" / f"task{t}" / s / "manifest.json").read_text())
            assert [x["sha256"] for x in a["shards"]] == [x["sha256"] for x in b["shards"]]  # byte-identical
    other = _run("--raw", raw, "--out", tmp_path / "c", "--classes-per-task", 2, "--seed", 4, "--shard-size", 4)
    assert json.loads((tmp_path / "c" / "benchmark.json").read_text())["class_order"] != meta["class_order"]
    # a corrupted shard is caught by --verify
    shard = tmp_path / "a" / "task1" / "test" / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    bad = _run("--verify", tmp_path / "a")
    assert bad.returncode == 2 and "sha256 does not match" in bad.stderr


class _Interrupt(Exception):
    pass


def _encode_until(spec, stop_at):
    from data_prep.cifar100 import encode

    if spec[3] >= stop_at:
        raise _Interrupt()
    return encode(spec, N_CLASSES)


def test_interrupted_conversion_resumes_keeping_finished_shards(tmp_path):
    from functools import partial

    from data_prep.cifar100 import encode, load_pickle, records
    from data_prep.common import write_shards

    raw = _cifar_raw(tmp_path / "raw")
    recs, _ = records(load_pickle(raw / "train"), "train", raw / "train", N_CLASSES)
    clean = write_shards(tmp_path / "clean", recs, partial(encode, num_classes=N_CLASSES), shard_size=8,
                         label_space=list(range(N_CLASSES)), progress=False)
    out = tmp_path / "resumed"
    with pytest.raises(_Interrupt):
        write_shards(out, recs, partial(_encode_until, stop_at=20), shard_size=8, label_space=list(range(N_CLASSES)),
                     progress=False)
    assert not (out / "manifest.json").exists()
    assert sorted(p.name for p in out.glob("*.tar")) == ["shard-000000.tar", "shard-000001.tar"]  # no partial shard
    assert not list(out.glob("*.tmp*"))
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    resumed = write_shards(out, recs, partial(encode, num_classes=N_CLASSES), shard_size=8,
                           label_space=list(range(N_CLASSES)), progress=False)
    assert {p: (out / p).stat().st_mtime_ns for p in kept} == kept  # finished shards were not rewritten
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in clean["shards"]]
    assert not (out / ".progress.json").exists()


def test_bad_cifar_inputs_name_the_record_and_file(tmp_path):
    raw = _cifar_raw(tmp_path / "badlabel", bad_label=True)
    r = _run("--raw", raw, "--out", tmp_path / "o1", "--classes-per-task", 2, "--seed", 0)
    assert r.returncode == 2 and "record 'train_3.png'" in r.stderr and "label 250" in r.stderr
    assert str(raw / "train") in r.stderr
    r = _run("--raw", raw, "--out", tmp_path / "o2", "--classes-per-task", 2, "--seed", 0, "--on-error", "skip")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "o2" / "benchmark.json").read_text())["skipped_records"]["train"] == ["train_3.png"]
    assert json.loads((tmp_path / "o2" / "task0" / "train" / "manifest.json").read_text())["source_skipped"] == 1
    dup = _cifar_raw(tmp_path / "dup", duplicate=True)
    r = _run("--raw", dup, "--out", tmp_path / "o3", "--classes-per-task", 2)
    assert r.returncode == 2 and "'train_2.png'" in r.stderr and "duplicate id" in r.stderr
    (tmp_path / "nometa").mkdir()
    r = _run("--raw", tmp_path / "nometa", "--out", tmp_path / "o4")
    assert r.returncode == 2 and "missing file" in r.stderr and "meta" in r.stderr
    weird = _cifar_raw(tmp_path / "weird")
    with open(weird / "train", "wb") as f:
        pickle.dump([1, 2, 3], f)
    r = _run("--raw", weird, "--out", tmp_path / "o5", "--classes-per-task", 2)
    assert r.returncode == 2 and "unknown format" in r.stderr


def test_skip_policy_counts_skipped_records(tmp_path):
    from functools import partial

    from data_prep.cifar100 import encode, load_pickle, records
    from data_prep.common import write_shards

    raw = _cifar_raw(tmp_path / "raw")
    recs, _ = records(load_pickle(raw / "train"), "train", raw / "train", N_CLASSES)
    recs[5] = (recs[5][0], recs[5][1], recs[5][2][:100], recs[5][3], recs[5][4])  # a truncated image
    with pytest.raises(DataError, match="record 'train_000005'.*3072"):
        write_shards(tmp_path / "f", recs, partial(encode, num_classes=N_CLASSES), shard_size=8, label_space=[0],
                     progress=False)
    m = write_shards(tmp_path / "s", recs, partial(encode, num_classes=N_CLASSES), shard_size=8, label_space=[0],
                     on_error="skip", progress=False)
    assert m["skipped"] == 1 and m["skipped_records"] == ["train_000005"] and m["num_samples"] == len(recs) - 1


def test_converted_cifar_task_trains_through_the_pipeline(assets, tmp_path):
    raw = _cifar_raw(tmp_path / "raw", n_train=8, n_test=4)
    r = _run("--raw", raw, "--out", tmp_path / "cifar", "--classes-per-task", 2, "--seed", 0, "--shard-size", 4)
    assert r.returncode == 0, r.stderr
    cfg = tiny_config(assets, tmp_path, "cifar", data={"root": str(tmp_path / "cifar"), "tasks": ["task0", "task1"]},
                      train={"epochs": 1, "deepspeed_config": "deepspeed_configs/cpu.json"})
    res = launch(["--config", str(cfg)], launcher="python")
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((tmp_path / "runs" / "cifar" / "metrics.json").read_text())
    assert m["complete"] and m["test_counts"] == [8, 8]
