"""Dataset converters: exact raw-format fixtures convert, verify, resume, fail clearly, and train."""

from __future__ import annotations

import json
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
    assert other.returncode == 0, other.stderr
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

    if spec[5] >= stop_at:
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
    recs[5] = (*recs[5][:4], recs[5][4][:100], recs[5][5])  # a truncated image
    with pytest.raises(DataError, match="record 'train_5.png'.*3072"):
        write_shards(tmp_path / "f", recs, partial(encode, num_classes=N_CLASSES), shard_size=8, label_space=[0],
                     progress=False)
    m = write_shards(tmp_path / "s", recs, partial(encode, num_classes=N_CLASSES), shard_size=8, label_space=[0],
                     on_error="skip", progress=False)
    assert m["skipped"] == 1 and m["skipped_records"] == ["train_5.png"] and m["num_samples"] == len(recs) - 1


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


# --------------------------------------------------------------------------------------------------
# Image-folder benchmarks: ImageNet-R (class folders), DomainNet (txt lists), CUB-200 (id tables)

def _image(path, c, fmt="JPEG"):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(abs(hash(path.name)) % 2**31)
    arr = np.clip(np.array([40 * c, 255 - 40 * c, 128]) + rng.randint(-20, 20, (24, 20, 3)), 0, 255)
    Image.fromarray(arr.astype(np.uint8)).save(path, format=fmt)


def _imagenet_r_raw(root, per_class=5):
    wnids = [f"n0{1000 + 7 * c}" for c in range(N_CLASSES)]
    for c, w in enumerate(wnids):
        for i in range(per_class):
            _image(root / "imagenet-r" / w / f"art_{i}.{'png' if i == 0 else 'jpg'}", c, "PNG" if i == 0 else "JPEG")
    (root / "classnames.txt").write_text("".join(f"{w} thing_{c}\n" for c, w in enumerate(wnids)))
    return wnids


def _domainnet_raw(root, per_class=4):
    domains, classes = ["clipart", "real"], [f"cls_{c}" for c in range(N_CLASSES)]
    lines = {"train": [], "test": []}
    for c, name in enumerate(classes):
        for d in domains:
            for i in range(per_class):
                rel = f"{d}/{name}/{d}_{c:03d}_{i:06d}.jpg"
                _image(root / rel, c)
                lines["test" if i == 0 else "train"].append(f"{rel} {c}")
    for s in lines:
        (root / f"sdomain_{s}.txt").write_text("\n".join(lines[s]) + "\n")
    return lines


def _cub_raw(root, per_class=4):
    cub = root / "CUB_200_2011"
    images, labels, split = [], [], []
    n = 0
    for c in range(N_CLASSES):
        for i in range(per_class):
            n += 1
            rel = f"{c + 1:03d}.Bird_{c}/Bird_{c}_{i:04d}.jpg"
            _image(cub / "images" / rel, c)
            images.append(f"{n} {rel}")
            labels.append(f"{n} {c + 1}")
            split.append(f"{n} {0 if i == 0 else 1}")
    (cub / "images.txt").write_text("\n".join(images) + "\n")
    (cub / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (cub / "train_test_split.txt").write_text("\n".join(split) + "\n")
    (cub / "classes.txt").write_text("".join(f"{c + 1} {c + 1:03d}.Bird_{c}\n" for c in range(N_CLASSES)))
    return cub


def _convert(module, *args):
    return subprocess.run([sys.executable, "-m", f"data_prep.{module}", *map(str, args), "--no-progress"], cwd=ROOT,
                          env=run_env(), capture_output=True, text=True)


def _train_one_task(assets, tmp_path, root, name):
    cfg = tiny_config(assets, tmp_path, name, data={"root": str(root), "tasks": ["task0"]},
                      train={"epochs": 1, "deepspeed_config": "deepspeed_configs/cpu.json"})
    res = launch(["--config", str(cfg)], launcher="python")
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((tmp_path / "runs" / name / "metrics.json").read_text())
    assert m["complete"]
    return m


def test_image_folder_benchmarks_convert_verify_and_train(assets, tmp_path):
    """ImageNet-R (seeded 80/20 split and fixed lists), DomainNet lists and CUB-200 tables, each in its
    distributed layout: convert, --verify, reproducible class order and split, and one task trains."""
    import torch

    from mcit.data.shards import iter_samples

    raw = tmp_path / "raw"
    wnids = _imagenet_r_raw(raw / "inr")
    r = _convert("imagenet_r", "--raw", raw / "inr", "--out", tmp_path / "inr", "--classes-per-task", 3, "--seed", 5,
                 "--split-seed", 42, "--class-names", raw / "inr" / "classnames.txt", "--workers", 2, "--shard-size", 4)
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "inr" / "benchmark.json").read_text())
    assert meta["class_order"] == [int(c) for c in np.random.RandomState(5).permutation(N_CLASSES)]
    assert meta["class_names"][0] == "thing 0" and meta["num_samples"] == {"train": 24, "test": 6}
    # the split is torch.randperm over the sorted ImageFolder list with the split seed
    files = [f"{w}/{f}" for w in wnids for f in sorted(p.name for p in (raw / "inr" / "imagenet-r" / w).iterdir())]
    perm = torch.randperm(len(files), generator=torch.Generator().manual_seed(42)).tolist()
    ids = [json.loads(s["json"])["id"] for t in range(2)
           for s in iter_samples(open_split(tmp_path / "inr" / f"task{t}" / "test", "sha256"), 0, 1, policy="sample")]
    assert sorted(ids) == sorted(files[i] for i in perm[24:])
    assert _convert("imagenet_r", "--verify", tmp_path / "inr").returncode == 0
    (raw / "train.txt").write_text("".join(f"imagenet-r/{f}\n" for f in files[6:]))
    (raw / "test.txt").write_text("".join(f"imagenet-r/{f}\n" for f in files[:6]))
    r = _convert("imagenet_r", "--raw", raw / "inr", "--out", tmp_path / "inr_lists", "--classes-per-task", 3,
                 "--train-list", raw / "train.txt", "--test-list", raw / "test.txt")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "inr_lists" / "benchmark.json").read_text())["num_samples"] == {"train": 24, "test": 6}

    lines = _domainnet_raw(raw / "dn")
    r = _convert("domainnet", "--raw", raw / "dn", "--train-list", raw / "dn" / "sdomain_train.txt", "--test-list",
                 raw / "dn" / "sdomain_test.txt", "--out", tmp_path / "dn", "--classes-per-task", 2, "--seed", 0)
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "dn" / "benchmark.json").read_text())
    assert meta["class_names"] == [f"cls_{c}" for c in range(N_CLASSES)]
    assert meta["num_samples"] == {"train": len(lines["train"]), "test": len(lines["test"])}
    assert _convert("domainnet", "--verify", tmp_path / "dn").returncode == 0

    _cub_raw(raw / "cub")
    r = _convert("cub200", "--raw", raw / "cub", "--out", tmp_path / "cub", "--classes-per-task", 2, "--seed", 1)
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "cub" / "benchmark.json").read_text())
    assert meta["class_names"][0] == "Bird 0" and meta["num_samples"] == {"train": 18, "test": 6}
    assert _convert("cub200", "--verify", tmp_path / "cub").returncode == 0
    again = _convert("cub200", "--raw", raw / "cub", "--out", tmp_path / "cub2", "--classes-per-task", 2, "--seed", 1)
    assert again.returncode == 0
    sha = [json.loads((tmp_path / d / "task2" / "train" / "manifest.json").read_text())["shards"][0]["sha256"]
           for d in ("cub", "cub2")]
    assert sha[0] == sha[1]  # byte-identical shards from the same raw data

    for name, root in (("inr", tmp_path / "inr"), ("dn", tmp_path / "dn"), ("cub", tmp_path / "cub")):
        m = _train_one_task(assets, tmp_path, root, name)
        assert len(m["acc_matrix"]) == 1


def test_bad_image_folder_inputs_name_the_record_and_file(tmp_path):
    raw = tmp_path / "raw"
    _cub_raw(raw / "cub")
    cub = raw / "cub" / "CUB_200_2011"
    victim = next((cub / "images").glob("003.*/*_0001.jpg"))
    victim.write_bytes(b"not a jpeg at all")  # unreadable image
    r = _convert("cub200", "--raw", raw / "cub", "--out", tmp_path / "o1", "--classes-per-task", 2)
    assert r.returncode == 2 and "record '10'" in r.stderr and "unreadable image" in r.stderr and str(victim) in r.stderr
    r = _convert("cub200", "--raw", raw / "cub", "--out", tmp_path / "o2", "--classes-per-task", 2, "--on-error", "skip")
    assert r.returncode == 0, r.stderr
    skipped = [json.loads(p.read_text())["skipped"] for p in (tmp_path / "o2").glob("*/*/manifest.json")]
    assert sum(skipped) == 1
    victim.unlink()  # missing image
    r = _convert("cub200", "--raw", raw / "cub", "--out", tmp_path / "o3", "--classes-per-task", 2)
    assert r.returncode == 2 and "record '10'" in r.stderr and "image file not found" in r.stderr
    with open(cub / "images.txt", "a") as f:
        f.write("3 001.Bird_0/again.jpg\n")  # duplicate id
    r = _convert("cub200", "--raw", raw / "cub", "--out", tmp_path / "o4", "--classes-per-task", 2)
    assert r.returncode == 2 and "record '3'" in r.stderr and "duplicate id" in r.stderr and "images.txt" in r.stderr

    lines = _domainnet_raw(raw / "dn")
    bad = raw / "dn" / "bad.txt"
    bad.write_text(lines["train"][0].replace(" ", "\t") + " extra\n")  # unknown format
    r = _convert("domainnet", "--raw", raw / "dn", "--train-list", bad, "--test-list", raw / "dn" / "sdomain_test.txt",
                 "--out", tmp_path / "o5")
    assert r.returncode == 2 and "bad.txt line 1: unknown format" in r.stderr
    (raw / "dn" / "dup.txt").write_text("\n".join(lines["train"] + lines["train"][:1]) + "\n")
    r = _convert("domainnet", "--raw", raw / "dn", "--train-list", raw / "dn" / "dup.txt", "--test-list",
                 raw / "dn" / "sdomain_test.txt", "--out", tmp_path / "o6", "--classes-per-task", 2)
    assert r.returncode == 2 and "duplicate id" in r.stderr and lines["train"][0].split()[0] in r.stderr
    r = _convert("imagenet_r", "--raw", tmp_path / "nowhere", "--out", tmp_path / "o7")
    assert r.returncode == 2 and "missing directory" in r.stderr


# --------------------------------------------------------------------------------------------------
# Instruction sets: CoIN / UCIT JSON (+ annotation files) and datasets-loadable parquet / arrow

def _coin_raw(root):
    """A CoIN-like tree: Instructions/<Task>/{train,test}.json in the benchmark's own record forms."""
    from PIL import Image

    img = root / "images"
    colours = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
    for name, rgb in colours.items():
        for i in range(3):
            (img / "vqa").mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (32, 32), tuple(max(0, v - 20 * i) for v in rgb)).save(img / "vqa" / f"{name}{i}.jpg")
    q = "What colour is the image? Answer with one word."
    train = [{"id": f"tv{n}", "image": f"vqa/{c}{i}.jpg",
              "conversations": [{"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": c}]}
             for n, (c, i) in enumerate((c, i) for c in colours for i in range(2))]
    test = [{"question_id": 100 + n, "image": f"vqa/{c}2.jpg", "text": q, "answer": c} for n, c in enumerate(colours)]
    ann = {"data": [{"question_id": 100 + n, "answers": [c] * 7 + ["dark " + c] * 3} for n, c in enumerate(colours)]}
    gtrain = [{"id": f"g{n}", "image": f"vqa/{c}0.jpg", "conversations": [
        {"from": "human", "value": "<image>\nGive the box of the object."}, {"from": "gpt", "value": "[0.1, 0.1, 0.9, 0.9]"}]}
        for n, c in enumerate(colours)]
    gtest = [{"question_id": f"gq{n}", "image": f"vqa/{c}1.jpg", "text": "Give the box of the object.",
              "answer_bbox": "[0.1,0.1,0.9,0.9]", "size": [32, 32]} for n, c in enumerate(colours)]
    for task, (tr, te) in {"TextVQA": (train, test), "Grounding": (gtrain, gtest)}.items():
        (root / "Instructions" / task).mkdir(parents=True, exist_ok=True)
        (root / "Instructions" / task / "train.json").write_text(json.dumps(tr))
        (root / "Instructions" / task / "test.json").write_text(json.dumps(te))
    (root / "TextVQA_val.json").write_text(json.dumps(ann))
    return root


def _ucit_parquet(root):
    """A UCIT task as a dataset ``datasets`` loads from local parquet / arrow files (images embedded)."""
    import io

    import datasets
    from PIL import Image

    def png(rgb):
        buf = io.BytesIO()
        Image.new("RGB", (32, 32), rgb).save(buf, format="PNG")
        return {"bytes": buf.getvalue(), "path": None}

    rows = {"train": [("a", (220, 30, 30), "A"), ("b", (30, 200, 30), "B"), ("c", (30, 30, 220), "A")],
            "test": [("t1", (200, 40, 40), "A"), ("t2", (40, 190, 40), "B")]}
    folder = root / "UCIT" / "ArxivQA"
    folder.mkdir(parents=True)
    features = datasets.Features({"question_id": datasets.Value("string"), "image": datasets.Image(),
                                  "text": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "choices": datasets.Sequence(datasets.Value("string"))})
    for split, rs in rows.items():
        ds = datasets.Dataset.from_dict(
            {"question_id": [r[0] for r in rs], "image": [png(r[1]) for r in rs],
             "text": ["Which colour is it?\nA. warm\nB. cool\nAnswer with the option's letter."] * len(rs),
             "answer": [r[2] for r in rs], "choices": [["warm", "cool"]] * len(rs)}, features=features)
        if split == "train":
            ds.to_parquet(str(folder / "train.parquet"))
        else:
            ds.save_to_disk(str(folder / "test"))
    return root / "UCIT"


def test_instruction_sets_convert_verify_and_train(mcit_assets, tmp_path):
    from conftest import mcit_config
    from mcit.data.instructions import decode_instruction
    from mcit.data.shards import iter_samples

    raw = _coin_raw(tmp_path / "coin_raw")
    r = _convert("coin", "--instructions", raw / "Instructions", "--images", raw / "images", "--task", "textvqa",
                 "grounding", "--annotations", f"textvqa={raw / 'TextVQA_val.json'}", "--out", tmp_path / "coin",
                 "--shard-size", 2, "--workers", 2)
    assert r.returncode == 0, r.stderr
    test = open_split(tmp_path / "coin" / "textvqa" / "test", "sha256")
    assert test.manifest["kind"] == "instruction" and test.manifest["scorer"] == "vqa_accuracy"
    decoded = [decode_instruction(s)[1] for s in iter_samples(test, 0, 1, policy="sample")]
    assert decoded[0]["question"].startswith("<image>\n") and decoded[0]["answer"] == "red"
    assert decoded[0]["answers"] == ["red"] * 7 + ["dark red"] * 3  # joined from the annotation file
    g = [decode_instruction(s)[1] for s in iter_samples(open_split(tmp_path / "coin" / "grounding" / "test"), 0, 1,
                                                        policy="sample")]
    assert g[0]["box"] == [0.1, 0.1, 0.9, 0.9]
    assert _convert("coin", "--verify", tmp_path / "coin").returncode == 0

    ucit = _ucit_parquet(tmp_path / "ucit_raw")
    r = _convert("ucit", "--instructions", ucit, "--task", "arxivqa", "--out", tmp_path / "ucit")
    assert r.returncode == 0, r.stderr
    tr = open_split(tmp_path / "ucit" / "arxivqa" / "train")
    assert tr.num_samples == 3 and tr.manifest["scorer"] == "multiple_choice"
    s = next(iter_samples(tr, 0, 1, policy="sample"))
    assert "png" in s and json.loads(s["json"])["choices"] == ["warm", "cool"]
    assert _convert("ucit", "--verify", tmp_path / "ucit").returncode == 0
    arrow = next((ucit / "ArxivQA" / "test").glob("*.arrow"))  # a bare arrow file, read through datasets
    r = _convert("llava_json", "--json", arrow, "--out", tmp_path / "arrow_split", "--scorer", "multiple_choice")
    assert r.returncode == 0, r.stderr
    assert open_split(tmp_path / "arrow_split", "sha256").num_samples == 2

    cfg = mcit_config(mcit_assets, tmp_path, "real_formats", data={"tasks": [
        {"name": "textvqa", "train": str(tmp_path / "coin" / "textvqa" / "train"),
         "test": str(tmp_path / "coin" / "textvqa" / "test")},
        {"name": "grounding", "train": str(tmp_path / "coin" / "grounding" / "train"),
         "test": str(tmp_path / "coin" / "grounding" / "test")},
        {"name": "arxivqa", "train": str(tmp_path / "ucit" / "arxivqa" / "train"),
         "test": str(tmp_path / "ucit" / "arxivqa" / "test")}],
        "reference": str(mcit_assets["shards"] / "base" / "test")},
        train={"epochs": 1, "batch_size": 4, "lr": 0.05, "checkpoint_every": 2, "log_every": 2, "progress": False,
               "deepspeed_config": "deepspeed_configs/cpu.json"})
    res = launch(["--config", str(cfg)], launcher="python")
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((tmp_path / "runs" / "real_formats" / "metrics.json").read_text())
    assert m["complete"] and m["test_counts"] == [3, 3, 2]


def test_bad_instruction_inputs_name_the_record_and_file(tmp_path):
    raw = _coin_raw(tmp_path / "coin_raw")
    tv = raw / "Instructions" / "TextVQA"
    args = ["--instructions", raw / "Instructions", "--images", raw / "images", "--task", "textvqa"]
    test = json.loads((tv / "test.json").read_text())

    def run(out, *extra):
        return _convert("coin", *args, "--out", tmp_path / out, *extra)

    ann = json.loads((raw / "TextVQA_val.json").read_text())
    ann["data"].append(dict(ann["data"][1]))  # the VizWiz mismatch: an id twice in the annotations
    (raw / "dup_ann.json").write_text(json.dumps(ann))
    r = run("o1", "--annotations", f"textvqa={raw / 'dup_ann.json'}")
    assert r.returncode == 2 and "record '101'" in r.stderr and "duplicate question_id" in r.stderr
    assert "dup_ann.json" in r.stderr and not (tmp_path / "o1").exists()

    (tv / "test.json").write_text(json.dumps(test + [dict(test[0])]))  # duplicate question id
    r = run("o2")
    assert r.returncode == 2 and "record '100'" in r.stderr and "duplicate id" in r.stderr and "test.json" in r.stderr

    broken = [dict(t) for t in test]
    del broken[1]["answer"]  # a record without an answer
    (tv / "test.json").write_text(json.dumps(broken))
    r = run("o3")
    assert r.returncode == 2 and "record '101'" in r.stderr and "no answer" in r.stderr
    r = run("o4", "--on-error", "skip")
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "o4" / "textvqa" / "test" / "manifest.json").read_text())
    assert m["num_samples"] == 2 and m["source_skipped"] == 1 and m["source_skipped_records"] == ["101"]

    missing = [dict(t) for t in test]
    missing[2]["image"] = "vqa/nothing.jpg"  # a missing image
    (tv / "test.json").write_text(json.dumps(missing))
    r = run("o5")
    assert r.returncode == 2 and "record '102'" in r.stderr and "image file not found" in r.stderr

    (raw / "images" / "vqa" / "bad.jpg").write_bytes(b"\x89PNG but truncated")  # an unreadable image
    missing[2]["image"] = "vqa/bad.jpg"
    (tv / "test.json").write_text(json.dumps(missing))
    r = run("o6")
    assert r.returncode == 2 and "record '102'" in r.stderr and "unreadable image" in r.stderr

    (tv / "test.json").write_text(json.dumps([{"question_id": 1, "image": "vqa/red0.jpg", "caption": "x"}]))
    r = run("o7")
    assert r.returncode == 2 and "record '1'" in r.stderr and "unknown format" in r.stderr
    (tv / "test.json").unlink()
    (tv / "test.csv").write_text("a,b\n")
    r = run("o8")
    assert r.returncode == 2 and "no test.json" in r.stderr
    r = _convert("llava_json", "--json", tv / "test.csv", "--images", raw / "images", "--out", tmp_path / "o9")
    assert r.returncode == 2 and "test.csv: unknown format" in r.stderr
