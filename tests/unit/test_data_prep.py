"""Dataset converters: exact raw-format fixtures (tests/raw_formats.py) convert, verify, resume and fail clearly."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from raw_formats import (
    N_CLASSES,
    cifar_raw,
    coin_raw,
    convert,
    convert_instruction_sets,
    cub_raw,
    domainnet_raw,
    imagenet_r_raw,
    llava_mix_raw,
    mllm_acl_raw,
    mllm_dcl_raw,
    ucit_json_raw,
)

from mcit.data.shards import DataError, open_split


def test_cifar100_converts_verifies_and_orders_reproducibly(tmp_path):
    raw = cifar_raw(tmp_path / "cifar-100-python")
    r = convert("cifar100", "--raw", raw, "--out", tmp_path / "a", "--classes-per-task", 2, "--seed", 3,
                "--shard-size", 4, "--workers", 2)
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "a" / "benchmark.json").read_text())
    assert meta["class_order"] == [int(c) for c in np.random.RandomState(3).permutation(N_CLASSES)]
    split = open_split(tmp_path / "a" / "task0" / "train", "sha256")
    assert split.num_samples == 10 and split.label_space == sorted(meta["tasks"][0]["classes"])
    assert split.manifest["class_order"] == meta["class_order"] and split.manifest["skipped"] == 0
    assert convert("cifar100", "--verify", tmp_path / "a").returncode == 0
    again = convert("cifar100", "--raw", raw, "--out", tmp_path / "b", "--classes-per-task", 2, "--seed", 3,
                    "--shard-size", 4)
    assert again.returncode == 0
    for t in range(3):
        for s in ("train", "test"):
            a = json.loads((tmp_path / "a" / f"task{t}" / s / "manifest.json").read_text())
            b = json.loads((tmp_path / "b" / f"task{t}" / s / "manifest.json").read_text())
            assert [x["sha256"] for x in a["shards"]] == [x["sha256"] for x in b["shards"]]  # byte-identical
    other = convert("cifar100", "--raw", raw, "--out", tmp_path / "c", "--classes-per-task", 2, "--seed", 4,
                    "--shard-size", 4)
    assert other.returncode == 0, other.stderr
    assert json.loads((tmp_path / "c" / "benchmark.json").read_text())["class_order"] != meta["class_order"]
    # a corrupted shard is caught by --verify
    shard = tmp_path / "a" / "task1" / "test" / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    bad = convert("cifar100", "--verify", tmp_path / "a")
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

    raw = cifar_raw(tmp_path / "raw")
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
    raw = cifar_raw(tmp_path / "badlabel", bad_label=True)
    r = convert("cifar100", "--raw", raw, "--out", tmp_path / "o1", "--classes-per-task", 2, "--seed", 0)
    assert r.returncode == 2 and "record 'train_3.png'" in r.stderr and "label 250" in r.stderr
    assert str(raw / "train") in r.stderr
    r = convert("cifar100", "--raw", raw, "--out", tmp_path / "o2", "--classes-per-task", 2, "--seed", 0,
                "--on-error", "skip")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "o2" / "benchmark.json").read_text())["skipped_records"]["train"] == ["train_3.png"]
    assert json.loads((tmp_path / "o2" / "task0" / "train" / "manifest.json").read_text())["source_skipped"] == 1
    dup = cifar_raw(tmp_path / "dup", duplicate=True)
    r = convert("cifar100", "--raw", dup, "--out", tmp_path / "o3", "--classes-per-task", 2)
    assert r.returncode == 2 and "'train_2.png'" in r.stderr and "duplicate id" in r.stderr
    (tmp_path / "nometa").mkdir()
    r = convert("cifar100", "--raw", tmp_path / "nometa", "--out", tmp_path / "o4")
    assert r.returncode == 2 and "missing file" in r.stderr and "meta" in r.stderr
    weird = cifar_raw(tmp_path / "weird")
    with open(weird / "train", "wb") as f:
        pickle.dump([1, 2, 3], f)
    r = convert("cifar100", "--raw", weird, "--out", tmp_path / "o5", "--classes-per-task", 2)
    assert r.returncode == 2 and "unknown format" in r.stderr


def test_skip_policy_counts_skipped_records(tmp_path):
    from functools import partial

    from data_prep.cifar100 import encode, load_pickle, records
    from data_prep.common import write_shards

    raw = cifar_raw(tmp_path / "raw")
    recs, _ = records(load_pickle(raw / "train"), "train", raw / "train", N_CLASSES)
    recs[5] = (*recs[5][:4], recs[5][4][:100], recs[5][5])  # a truncated image
    with pytest.raises(DataError, match="record 'train_5.png'.*3072"):
        write_shards(tmp_path / "f", recs, partial(encode, num_classes=N_CLASSES), shard_size=8, label_space=[0],
                     progress=False)
    m = write_shards(tmp_path / "s", recs, partial(encode, num_classes=N_CLASSES), shard_size=8, label_space=[0],
                     on_error="skip", progress=False)
    assert m["skipped"] == 1 and m["skipped_records"] == ["train_5.png"] and m["num_samples"] == len(recs) - 1


# --------------------------------------------------------------------------------------------------
# Image-folder benchmarks: ImageNet-R (class folders), DomainNet (txt lists), CUB-200 (id tables)


def test_image_folder_benchmarks_convert_and_verify(tmp_path):
    """ImageNet-R (seeded 80/20 split and fixed lists), DomainNet lists and CUB-200 tables, each in its
    distributed layout: convert, --verify, reproducible class order and split (training one converted task
    of each: tests/launch/test_data_prep_pipeline.py)."""
    import torch

    from mcit.data.shards import iter_samples

    raw = tmp_path / "raw"
    wnids = imagenet_r_raw(raw / "inr")
    r = convert("imagenet_r", "--raw", raw / "inr", "--out", tmp_path / "inr", "--classes-per-task", 3, "--seed", 5,
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
    assert convert("imagenet_r", "--verify", tmp_path / "inr").returncode == 0
    (raw / "train.txt").write_text("".join(f"imagenet-r/{f}\n" for f in files[6:]))
    (raw / "test.txt").write_text("".join(f"imagenet-r/{f}\n" for f in files[:6]))
    r = convert("imagenet_r", "--raw", raw / "inr", "--out", tmp_path / "inr_lists", "--classes-per-task", 3,
                 "--train-list", raw / "train.txt", "--test-list", raw / "test.txt")
    assert r.returncode == 0, r.stderr
    assert (json.loads((tmp_path / "inr_lists" / "benchmark.json").read_text())["num_samples"]
            == {"train": 24, "test": 6})

    lines = domainnet_raw(raw / "dn")
    r = convert("domainnet", "--raw", raw / "dn", "--train-list", raw / "dn" / "sdomain_train.txt", "--test-list",
                 raw / "dn" / "sdomain_test.txt", "--out", tmp_path / "dn", "--classes-per-task", 2, "--seed", 0)
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "dn" / "benchmark.json").read_text())
    assert meta["class_names"] == [f"cls_{c}" for c in range(N_CLASSES)]
    assert meta["num_samples"] == {"train": len(lines["train"]), "test": len(lines["test"])}
    assert convert("domainnet", "--verify", tmp_path / "dn").returncode == 0

    cub_raw(raw / "cub")
    r = convert("cub200", "--raw", raw / "cub", "--out", tmp_path / "cub", "--classes-per-task", 2, "--seed", 1)
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "cub" / "benchmark.json").read_text())
    assert meta["class_names"][0] == "Bird 0" and meta["num_samples"] == {"train": 18, "test": 6}
    assert convert("cub200", "--verify", tmp_path / "cub").returncode == 0
    again = convert("cub200", "--raw", raw / "cub", "--out", tmp_path / "cub2", "--classes-per-task", 2, "--seed", 1)
    assert again.returncode == 0
    sha = [json.loads((tmp_path / d / "task2" / "train" / "manifest.json").read_text())["shards"][0]["sha256"]
           for d in ("cub", "cub2")]
    assert sha[0] == sha[1]  # byte-identical shards from the same raw data



def test_bad_image_folder_inputs_name_the_record_and_file(tmp_path):
    raw = tmp_path / "raw"
    cub_raw(raw / "cub")
    cub = raw / "cub" / "CUB_200_2011"
    victim = next((cub / "images").glob("003.*/*_0001.jpg"))
    victim.write_bytes(b"not a jpeg at all")  # unreadable image
    r = convert("cub200", "--raw", raw / "cub", "--out", tmp_path / "o1", "--classes-per-task", 2)
    assert (r.returncode == 2 and "record '10'" in r.stderr and "unreadable image" in r.stderr
            and str(victim) in r.stderr)
    r = convert("cub200", "--raw", raw / "cub", "--out", tmp_path / "o2", "--classes-per-task", 2, "--on-error", "skip")
    assert r.returncode == 0, r.stderr
    skipped = [json.loads(p.read_text())["skipped"] for p in (tmp_path / "o2").glob("*/*/manifest.json")]
    assert sum(skipped) == 1
    victim.unlink()  # missing image
    r = convert("cub200", "--raw", raw / "cub", "--out", tmp_path / "o3", "--classes-per-task", 2)
    assert r.returncode == 2 and "record '10'" in r.stderr and "image file not found" in r.stderr
    with open(cub / "images.txt", "a") as f:
        f.write("3 001.Bird_0/again.jpg\n")  # duplicate id
    r = convert("cub200", "--raw", raw / "cub", "--out", tmp_path / "o4", "--classes-per-task", 2)
    assert r.returncode == 2 and "record '3'" in r.stderr and "duplicate id" in r.stderr and "images.txt" in r.stderr

    lines = domainnet_raw(raw / "dn")
    bad = raw / "dn" / "bad.txt"
    bad.write_text(lines["train"][0].replace(" ", "\t") + " extra\n")  # unknown format
    r = convert("domainnet", "--raw", raw / "dn", "--train-list", bad, "--test-list", raw / "dn" / "sdomain_test.txt",
                 "--out", tmp_path / "o5")
    assert r.returncode == 2 and "bad.txt line 1: unknown format" in r.stderr
    (raw / "dn" / "dup.txt").write_text("\n".join(lines["train"] + lines["train"][:1]) + "\n")
    r = convert("domainnet", "--raw", raw / "dn", "--train-list", raw / "dn" / "dup.txt", "--test-list",
                 raw / "dn" / "sdomain_test.txt", "--out", tmp_path / "o6", "--classes-per-task", 2)
    assert r.returncode == 2 and "duplicate id" in r.stderr and lines["train"][0].split()[0] in r.stderr
    r = convert("imagenet_r", "--raw", tmp_path / "nowhere", "--out", tmp_path / "o7")
    assert r.returncode == 2 and "missing directory" in r.stderr


# --------------------------------------------------------------------------------------------------
# Instruction sets: CoIN / UCIT JSON (+ annotation files) and datasets-loadable parquet / arrow


def test_instruction_sets_convert_and_verify(tmp_path):
    from mcit.data.instructions import decode_instruction
    from mcit.data.shards import iter_samples

    out = convert_instruction_sets(tmp_path)
    test = open_split(out["coin"] / "textvqa" / "test", "sha256")
    assert test.manifest["kind"] == "instruction" and test.manifest["scorer"] == "coin_textvqa"
    assert test.manifest["source"].endswith("TextVQA/val.json")  # the file CoIN's 2_eval_textqa.sh reads
    decoded = [decode_instruction(s)[1] for s in iter_samples(test, 0, 1, policy="sample")]
    assert decoded[0]["question"].startswith("<image>\n") and decoded[0]["answer"] == "red"
    assert decoded[0]["answers"] == ["red"] * 7 + ["dark red"] * 3  # joined from the annotation file
    g = [decode_instruction(s)[1] for s in iter_samples(open_split(out["coin"] / "grounding" / "test"), 0, 1,
                                                        policy="sample")]
    assert g[0]["box"] == [0.1, 0.1, 0.9, 0.9] and g[0]["size"] == [32, 32]  # CoIN's scorer scales by max(size)
    assert test.manifest["references"] == {"samples": 3, "answers_min": 10, "answers_max": 10, "with_size": 0,
                                           "annotations_format": "question_id", "with_image_name": 3,
                                           "with_answer_type": 0}
    cap = open_split(out["ucit_json"] / "vizwiz_caption" / "test")
    assert cap.manifest["references"]["annotations_format"] == "coco_captions"
    caps = [decode_instruction(s)[1]["answers"] for s in iter_samples(cap, 0, 1, policy="sample")]
    assert caps == [["a red square", "a square that is red", "red"],
                    ["a green square", "green colour", "a plain green picture"],
                    ["a blue square", "a square of blue", "blue and dark"]]  # image_id k is the k-th record
    assert convert("coin", "--verify", out["coin"]).returncode == 0
    tr = open_split(out["ucit"] / "arxivqa" / "train")
    assert tr.num_samples == 3 and tr.manifest["scorer"] == "ucit_accuracy"
    s = next(iter_samples(tr, 0, 1, policy="sample"))
    assert "png" in s and json.loads(s["json"])["choices"] == ["warm", "cool"]
    assert convert("ucit", "--verify", out["ucit"]).returncode == 0
    assert open_split(out["arrow_split"], "sha256").num_samples == 2


def test_coin_test_split_is_the_file_its_evaluation_reads(tmp_path):
    """TextVQA, VizWiz and VQAv2 are evaluated on val.json in CoIN (scripts/LLaVA/Eval/2_, 5_, 7_*.sh): with a
    test.json beside it, val.json is still the test split; Grounding keeps test.json."""
    from mcit.data.instructions import decode_instruction
    from mcit.data.shards import iter_samples

    raw = coin_raw(tmp_path / "coin_raw")
    tv = raw / "Instructions_Original" / "TextVQA"
    decoy = [dict(r, answer="decoy") for r in json.loads((tv / "val.json").read_text())]
    (tv / "test.json").write_text(json.dumps(decoy))
    r = convert("coin", "--instructions", raw / "Instructions_Original", "--images", raw / "images",
                "--task", "textvqa", "grounding", "--out", tmp_path / "coin")
    assert r.returncode == 0, r.stderr
    test = open_split(tmp_path / "coin" / "textvqa" / "test")
    assert [decode_instruction(s)[1]["answer"] for s in iter_samples(test, 0, 1, policy="sample")] == \
        ["red", "green", "blue"]
    assert open_split(tmp_path / "coin" / "grounding" / "test").manifest["source"].endswith("Grounding/test.json")


def test_vizwiz_annotations_join_by_image(tmp_path):
    """VizWiz's annotation file (val.json of the VizWiz release: {"image", "question", "answers": [{"answer",
    "answer_confidence"}] x 10}, no question_id) joins CoIN's VizWiz/val.json records by image file name, as
    the VizWiz evaluation does; a question whose image is not annotated names itself."""
    from mcit.data.instructions import decode_instruction
    from mcit.data.shards import iter_samples

    raw = coin_raw(tmp_path / "coin_raw")  # VizWiz/val.json and vizwiz_val_annotations.json as described
    viz = raw / "Instructions_Original" / "VizWiz"
    val = json.loads((viz / "val.json").read_text())
    q = val[0]["text"]
    ann = json.loads((raw / "vizwiz_val_annotations.json").read_text())
    args = ["--instructions", raw / "Instructions_Original", "--images", raw / "images", "--task", "vizwiz",
            "--annotations", f"vizwiz={raw / 'vizwiz_val_annotations.json'}"]
    r = convert("coin", *args, "--out", tmp_path / "o1")
    assert r.returncode == 0, r.stderr
    got = {d["question_id"]: d["answers"] for d in (decode_instruction(s)[1] for s in
           iter_samples(open_split(tmp_path / "o1" / "vizwiz" / "test"), 0, 1, policy="sample"))}
    assert got == {"7": ["red"] * 8 + ["dark"] * 2, "8": ["green"] * 8 + ["dark"] * 2}
    (viz / "val.json").write_text(json.dumps(val + [{"question_id": 9, "image": "vqa/blue2.jpg", "text": q,
                                                       "answer": "blue"}]))
    r = convert("coin", *args, "--out", tmp_path / "o2")
    assert r.returncode == 2 and "record '9'" in r.stderr and "nor its image is in the annotation file" in r.stderr
    (raw / "vizwiz_val_annotations.json").write_text(json.dumps(ann + [dict(ann[0])]))
    r = convert("coin", *args, "--out", tmp_path / "o3")
    assert r.returncode == 2 and "record 'green2.jpg'" in r.stderr and "duplicate image" in r.stderr


def test_ucit_reads_mcitlib_folder_names(tmp_path):
    """MCITlib's UCIT tree names the captioning task's folder VizWiz (configs/data_configs/UCIT/VizWiz.json);
    it becomes the vizwiz_caption task."""
    raw = coin_raw(tmp_path / "coin_raw")
    ucit = tmp_path / "UCIT"
    (ucit / "VizWiz").mkdir(parents=True)
    (ucit / "VizWiz" / "train.json").write_text((raw / "Instructions_Original" / "TextVQA" / "train.json").read_text())
    (ucit / "VizWiz" / "test.json").write_text((raw / "Instructions_Original" / "TextVQA" / "val.json").read_text())
    r = convert("ucit", "--instructions", ucit, "--images", raw / "images", "--task", "vizwiz_caption", "--out",
                tmp_path / "ucit_out")
    assert r.returncode == 0, r.stderr
    assert open_split(tmp_path / "ucit_out" / "vizwiz_caption" / "test").num_samples == 3


def test_coco_caption_file_joins_by_position_and_refuses_a_misaligned_one(tmp_path):
    """MCITlib's eval_caption.py numbers the k-th answer image_id k: a COCO caption file joins by position. A
    file whose k-th image is not the k-th record's image, or that lacks an image_id, is an error naming the
    record, before anything is written."""
    raw = coin_raw(tmp_path / "coin_raw")
    uj = ucit_json_raw(tmp_path / "uj", raw / "images")
    coco_path = uj / "VizWiz" / "test_captions_coco.json"
    coco = json.loads(coco_path.read_text())

    def run(out, data):
        coco_path.write_text(json.dumps(data))
        return convert("ucit", "--instructions", uj, "--images", uj / "datasets", "--task", "vizwiz_caption",
                       "--out", tmp_path / out, "--annotations", f"vizwiz_caption={coco_path}")

    swapped = dict(coco, images=[dict(im, file_name=n) for im, n in zip(coco["images"], ("green2.jpg", "red2.jpg",
                                                                                             "blue2.jpg"))])
    r = run("o1", swapped)
    assert r.returncode == 2 and "record 'ctred'" in r.stderr and "out of order" in r.stderr
    assert not (tmp_path / "o1").exists()
    short = dict(coco, annotations=[a for a in coco["annotations"] if a["image_id"] != 3])
    r = run("o2", short)
    assert r.returncode == 2 and "record 'ctblue'" in r.stderr and "no image_id 3" in r.stderr
    unnamed = {"annotations": coco["annotations"]}  # no images list: the position alone joins
    assert run("o3", unnamed).returncode == 0


def test_bad_instruction_inputs_name_the_record_and_file(tmp_path):
    raw = coin_raw(tmp_path / "coin_raw")
    tv = raw / "Instructions_Original" / "TextVQA"
    args = ["--instructions", raw / "Instructions_Original", "--images", raw / "images", "--task", "textvqa"]
    test = json.loads((tv / "val.json").read_text())

    def run(out, *extra):
        return convert("coin", *args, "--out", tmp_path / out, *extra)

    ann = json.loads((raw / "TextVQA_val.json").read_text())
    ann["data"].append(dict(ann["data"][1]))  # the VizWiz mismatch: an id twice in the annotations
    (raw / "dup_ann.json").write_text(json.dumps(ann))
    r = run("o1", "--annotations", f"textvqa={raw / 'dup_ann.json'}")
    assert r.returncode == 2 and "record '101'" in r.stderr and "duplicate question_id" in r.stderr
    assert "dup_ann.json" in r.stderr and not (tmp_path / "o1").exists()

    (tv / "val.json").write_text(json.dumps(test + [dict(test[0])]))  # duplicate question id
    r = run("o2")
    assert r.returncode == 2 and "record '100'" in r.stderr and "duplicate id" in r.stderr and "val.json" in r.stderr

    broken = [dict(t) for t in test]
    del broken[1]["answer"]  # a record without an answer
    (tv / "val.json").write_text(json.dumps(broken))
    r = run("o3")
    assert r.returncode == 2 and "record '101'" in r.stderr and "no answer" in r.stderr
    r = run("o4", "--on-error", "skip")
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "o4" / "textvqa" / "test" / "manifest.json").read_text())
    assert m["num_samples"] == 2 and m["source_skipped"] == 1 and m["source_skipped_records"] == ["101"]

    missing = [dict(t) for t in test]
    missing[2]["image"] = "vqa/nothing.jpg"  # a missing image
    (tv / "val.json").write_text(json.dumps(missing))
    r = run("o5")
    assert r.returncode == 2 and "record '102'" in r.stderr and "image file not found" in r.stderr

    (raw / "images" / "vqa" / "bad.jpg").write_bytes(b"\x89PNG but truncated")  # an unreadable image
    missing[2]["image"] = "vqa/bad.jpg"
    (tv / "val.json").write_text(json.dumps(missing))
    r = run("o6")
    assert r.returncode == 2 and "record '102'" in r.stderr and "unreadable image" in r.stderr

    (tv / "val.json").write_text(json.dumps([{"question_id": 1, "image": "vqa/red0.jpg", "caption": "x"}]))
    r = run("o7")
    assert r.returncode == 2 and "record '1'" in r.stderr and "unknown format" in r.stderr
    (tv / "val.json").unlink()
    (tv / "test.csv").write_text("a,b\n")
    r = run("o8")
    assert r.returncode == 2 and "no val.json" in r.stderr and "(the test split)" in r.stderr
    r = convert("llava_json", "--json", tv / "test.csv", "--images", raw / "images", "--out", tmp_path / "o9")
    assert r.returncode == 2 and "test.csv: unknown format" in r.stderr


def test_embedded_backbone_bytes_depend_neither_on_the_cpu_kernels_nor_the_thread_count(tmp_path, monkeypatch):
    """The tiny ViT built with this machine's own kernels on 2 threads and with ATen, MKL and oneDNN held to AVX2 on
    1 thread is the same file: pre-training runs in a fresh process on the portable kernels and a fixed thread
    count (on an AVX-512 and an AVX2 machine the tiny LLaVA's zero-shot accuracy was 46.7% and 14.7% before), and
    the caller's thread count is what it was."""
    import hashlib

    import torch

    from data_prep.pretrain_vit import pretrain

    before = torch.get_num_threads()
    digests = []
    try:
        for threads, kernels in ((2, {}), (1, {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                               "DNNL_MAX_CPU_ISA": "AVX2"})):
            for k, v in kernels.items():
                monkeypatch.setenv(k, v)
            torch.set_num_threads(threads)
            info = pretrain(tmp_path / f"vit{threads}", hidden=32, layers=2, heads=2, n_train=256, epochs=1,
                            force=True)  # a small ViT: the same code path, a third of the time
            assert torch.get_num_threads() == threads
            digests.append(hashlib.sha256((tmp_path / f"vit{threads}" / "model.safetensors").read_bytes()).hexdigest())
    finally:
        torch.set_num_threads(before)
    assert digests[0] == digests[1]
    assert info["environment"]["cpu_capability"] == "DEFAULT" and info["environment"]["threads"] == 2
    assert info["environment"]["torch"] == torch.__version__


def test_text_only_and_multi_turn_records_are_kept(tmp_path):
    """CoIN's ScienceQA questions without an image stay in both splits, marked text_only and stored without an
    image (with --on-error skip as well: nothing is skipped); a mix665k-shaped file's multi-turn conversations
    stay one sample each with every turn, its ShareGPT records are text-only, and --sample draws the same
    records for the same seed (file order, keyed by position: the mix repeats ids)."""
    from mcit.data.instructions import decode_instruction
    from mcit.data.shards import iter_samples

    raw = coin_raw(tmp_path / "coin_raw")
    for n, policy in enumerate(("fail", "skip")):
        r = convert("coin", "--instructions", raw / "Instructions_Original", "--images", raw / "images", "--task",
                    "scienceqa", "--on-error", policy, "--out", tmp_path / f"coin{n}")
        assert r.returncode == 0, r.stderr
        test = open_split(tmp_path / f"coin{n}" / "scienceqa" / "test")
        assert test.num_samples == 3 and test.manifest["source_skipped"] == 0
        samples = {s["__key__"]: s for s in iter_samples(test, 0, 1, policy="sample")}
        assert "png" not in samples["sq1"] and "jpg" not in samples["sq1"]
        image, rec, _ = decode_instruction(samples["sq1"])
        assert image is None and rec["text_only"] and "<image>" not in rec["question"]
        image, rec, _ = decode_instruction(samples["sq0"])
        assert image is not None and "text_only" not in rec and rec["question"].startswith("<image>\n")
        assert open_split(tmp_path / f"coin{n}" / "scienceqa" / "train").num_samples == 4
    assert convert("coin", "--verify", tmp_path / "coin0").returncode == 0

    mix = llava_mix_raw(tmp_path / "data")
    outs = []
    for n, seed in enumerate((0, 0, 1)):
        r = convert("llava_mix", "--json", mix, "--images", tmp_path / "data", "--out", tmp_path / f"mix{n}",
                    "--sample", 6, "--seed", seed)
        assert r.returncode == 0, r.stderr
        split = open_split(tmp_path / f"mix{n}" / "train")
        assert split.manifest["sample"] == {"size": 6, "seed": seed, "of": 11}
        outs.append([s["__key__"] for s in iter_samples(split, 0, 1, policy="sample")])
    assert outs[0] == outs[1] != outs[2] and len(outs[0]) == 6
    r = convert("llava_mix", "--json", mix, "--images", tmp_path / "data", "--out", tmp_path / "all", "--sample", 0)
    assert r.returncode == 0, r.stderr
    decoded = {k: decode_instruction(s)[:2] for s in iter_samples(open_split(tmp_path / "all" / "train"), 0, 1,
                                                                     policy="sample") for k in [s["__key__"]]}
    assert len(decoded) == 11  # the repeated id is a sample of its own
    image, rec = decoded["0000002_000000000002"]
    assert len(rec["turns"]) == 3 and rec["turns"][1] == ("Is it bright?", "no") and image is not None
    image, rec = decoded["0000008_sharegpt_1"]
    assert image is None and rec["text_only"] and rec["turns"][1][1] == "3 2 1"
    assert convert("llava_mix", "--verify", tmp_path / "all" / "train").returncode == 0
    r = convert("llava_mix", "--json", mix, "--images", tmp_path / "data", "--out", tmp_path / "big", "--sample", 99)
    assert r.returncode == 2 and "holds only 11 records" in r.stderr


def test_data_prep_names_the_missing_key_and_keeps_images_inside_their_folder(tmp_path):
    """A test pickle without fine_labels is named as such (it used to surface as a class-count message), a meta
    whose fine_label_names is not a list is named, and an image path leading out of --images ("..", absolute,
    or through a link) is refused before anything is written."""
    import json

    from PIL import Image

    raw = cifar_raw(tmp_path / "cifar", test_without=b"fine_labels")
    r = convert("cifar100", "--raw", raw, "--out", tmp_path / "o1", "--classes-per-task", 3)
    lines = r.stderr.strip().splitlines()
    assert (r.returncode == 2 and len(lines) == 1
            and f"{raw / 'test'}: unknown format (no 'fine_labels' entry)" in lines[0])
    raw2 = cifar_raw(tmp_path / "cifar2")
    with open(raw2 / "meta", "wb") as f:
        pickle.dump({b"fine_label_names": b"apple"}, f)
    r = convert("cifar100", "--raw", raw2, "--out", tmp_path / "o2", "--classes-per-task", 2)
    assert r.returncode == 2 and "'fine_label_names' list of class names" in r.stderr and str(raw2 / "meta") in r.stderr

    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (8, 8), (9, 9, 9)).save(images / "in.png")
    Image.new("RGB", (8, 8), (1, 2, 3)).save(tmp_path / "secret.png")
    (images / "link.png").symlink_to(tmp_path / "secret.png")
    for bad in ["../secret.png", str(tmp_path / "secret.png"), "link.png"]:
        recs = [{"id": "ok", "image": "in.png", "conversations": [{"from": "human", "value": "<image>\nq"},
                                                                  {"from": "gpt", "value": "a"}]},
                {"id": "evil", "image": bad, "conversations": [{"from": "human", "value": "<image>\nq"},
                                                              {"from": "gpt", "value": "a"}]}]
        (tmp_path / "x.json").write_text(json.dumps(recs))
        out = tmp_path / "o3"
        r = convert("llava_json", "--json", tmp_path / "x.json", "--images", images, "--out", out)
        assert (r.returncode == 2 and "'evil'" in r.stderr
                and f"image path {bad!r} leads outside --images" in r.stderr), r.stderr
        assert not out.exists()
    # a multi-image record (MLLM-DCL ships a few): one line that says so, not "image file not found: [...]"
    multi = {**recs[0], "id": "two", "image": ["in.png", "in.png"]}
    (tmp_path / "x.json").write_text(json.dumps([recs[0], multi]))
    r = convert("llava_json", "--json", tmp_path / "x.json", "--images", images, "--out", tmp_path / "o5")
    lines = r.stderr.strip().splitlines()
    assert (r.returncode == 2 and len(lines) == 1 and "'two'" in lines[0]
            and "record has 2 images ('in.png', 'in.png'); multi-image records are not supported" in lines[0]), r.stderr
    (tmp_path / "x.json").write_text(json.dumps([recs[0], {**multi, "image": ["in.png"]}]))  # one image in a list
    assert convert("llava_json", "--json", tmp_path / "x.json", "--images", images,
                   "--out", tmp_path / "o6").returncode == 0
    (tmp_path / "x.json").write_text(json.dumps(recs[:1]))
    assert convert("llava_json", "--json", tmp_path / "x.json", "--images", images,
                   "--out", tmp_path / "o4").returncode == 0


def test_mllm_cl_layouts_convert_verify_and_keep_what_their_scorers_read(tmp_path):
    """MLLM-DCL (<Domain>/{train,test}.json, images under each domain) and MLLM-ACL (<Ability>/train.json,
    <Ability>_test/test.json): every domain and the local abilities convert and verify, each test split
    scored by its MLLM-CL script; Sci keeps the image's file name, OCR its list of answers and OCRBench
    category, VP its task. Math joins MathVista's answer table by MLLM-CL's rule (testmini_<n> is row n), refusing
    a table whose rows ask other questions; without the table, and APP always, are refused by name."""
    from mcit.data.instructions import decode_instruction
    from mcit.data.shards import iter_samples

    dcl, acl = mllm_dcl_raw(tmp_path / "raw"), mllm_acl_raw(tmp_path / "raw")
    r = convert("mllm_dcl", "--instructions", dcl, "--out", tmp_path / "dcl")
    assert r.returncode == 0, r.stderr
    scorers = {t: open_split(tmp_path / "dcl" / t / "test").manifest["scorer"]
               for t in ("rs", "med", "ad", "sci", "fin")}
    assert scorers == {"rs": "mllm_cl_ai2d", "med": "mllm_cl_pvqa", "ad": "mllm_cl_ai2d", "sci": "mllm_cl_sci",
                       "fin": "mllm_cl_finvis"}
    assert convert("mllm_dcl", "--verify", tmp_path / "dcl").returncode == 0
    sci = [decode_instruction(s)[1] for s in iter_samples(open_split(tmp_path / "dcl" / "sci" / "test"), 0, 1,
                                                          policy="sample")]
    assert [r["image_name"] for r in sci] == ["images/AI2D_0000.png", "images/MapQA_0001.png", "images/AI2D_0002.png"]
    assert sci[1]["question"] == "<image>\nWhich states have a value lower than 100?"  # CoIN-style: <image> added
    # the official evaluation's added instructions (data_prep/inference_prompts.py): Med's, Fin's by answer
    def questions(task: str, out: str = "dcl") -> list[str]:
        split = open_split(tmp_path / out / task / "test")
        return [decode_instruction(s)[1]["question"] for s in iter_samples(split, 0, 1, policy="sample")]

    assert questions("med") == [f"<image>\n{q} Answer the question with a single word (or phrase)." for q in
                                ("Is this squamous cell carcinoma?", "What organ is shown?", "Is there necrosis?")]
    assert questions("fin") == [
        "<image>\nWill the closing price rise on the next day? Only answer with yes or no directly.",
        "<image>\nWhich pattern is shown?\nA. Hammer\nB. Doji\nC. Engulfing\nD. Star Answer with the given letter "
        "directly, e.g., A, B, C, D.",
        "<image>\nIs the volume rising? Only answer with yes or no directly."]
    manifest = open_split(tmp_path / "dcl" / "fin" / "test").manifest
    assert "model_fin.py L43-47" in manifest["inference_prompt"]["source"]
    assert "inference_prompt" not in open_split(tmp_path / "dcl" / "fin" / "train").manifest  # training text as is
    r = convert("mllm_dcl", "--instructions", dcl, "--out", tmp_path / "dcl_raw", "--task", "med",
                "--inference-prompts", "none")
    assert r.returncode == 0 and questions("med", "dcl_raw")[0] == "<image>\nIs this squamous cell carcinoma?"

    r = convert("mllm_acl", "--instructions", acl, "--out", tmp_path / "acl")
    assert r.returncode == 0 and "math: not converted" in r.stderr and "app: not converted" in r.stderr
    ocr = [decode_instruction(s)[1] for s in iter_samples(open_split(tmp_path / "acl" / "ocr" / "test"), 0, 1,
                                                          policy="sample")]
    assert ocr[0]["answers"] == ["STOP", "stop sign"] and ocr[0]["answer"] == "STOP"
    assert ocr[1]["answer_type"] == "Handwritten Mathematical Expression Recognition"
    assert ocr[0]["question"] == "<image> what is written in the image?"  # MLLM-CL's model_ocr.py: a space
    vp = open_split(tmp_path / "acl" / "vp" / "test")
    assert [decode_instruction(s)[1]["task"] for s in iter_samples(vp, 0, 1, policy="sample")] == ["Count", "Depth"]
    assert convert("mllm_acl", "--verify", tmp_path / "acl").returncode == 0
    r = convert("mllm_acl", "--instructions", acl, "--out", tmp_path / "acl_math", "--task", "math")
    assert r.returncode == 2 and "task 'math'" in r.stderr and "MathVista" in r.stderr
    assert not (tmp_path / "acl_math").exists()
    table = acl / "MathVista_MINI.tsv"  # with MathVista's answer table: testmini_<n> is row n
    r = convert("mllm_acl", "--instructions", acl, "--out", tmp_path / "acl_math", "--task", "math", "--annotations",
                f"math={table}")
    assert r.returncode == 0, r.stderr
    math = [decode_instruction(s)[1] for s in iter_samples(open_split(tmp_path / "acl_math" / "math" / "test"), 0, 1,
                                                           policy="sample")]
    assert [(x["answer"], x["question_type"], x["answer_type"]) for x in math] == [
        ("145°", "multi_choice", "text"), ("5", "free_form", "integer"), ("1.5", "free_form", "float")]
    assert math[0]["choices"] == ["135°", "140°", "145°", "150°"] and math[0]["answer_option"] == "C"
    test = json.loads((acl / "Math_test" / "test.json").read_text())
    (acl / "Math_test" / "test.json").write_text(json.dumps([dict(t, question_id=f"testmini_{n + 1}")
                                                             for n, t in enumerate(test)]))  # ids from 1: off by one
    r = convert("mllm_acl", "--instructions", acl, "--out", tmp_path / "acl_math2", "--task", "math", "--annotations",
                f"math={table}")
    assert r.returncode == 2 and "record 'testmini_1'" in r.stderr and "asks another question" in r.stderr
    (dcl / "Med" / "images" / "med_0001.png").unlink()  # images live in the domain folder: a missing one is named
    r = convert("mllm_dcl", "--instructions", dcl, "--task", "med", "--out", tmp_path / "dcl2")
    assert r.returncode == 2 and "med_train_1" in r.stderr and "med_0001.png" in r.stderr
