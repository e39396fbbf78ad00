"""Raw datasets in their distributed formats, built small from scratch, and the converters run on them.

Shared by tests/unit/test_data_prep.py (conversion, verification, errors) and
tests/launch/test_data_prep_pipeline.py (converted data trains through the pipeline).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import pickle
import subprocess

import numpy as np

N_CLASSES = 6


def convert(module: str, *args: object) -> subprocess.CompletedProcess:
    """``python -m data_prep.<module> ARGS --no-progress``, run in this process through the converter's own
    ``main(argv)``; its exit status and what it printed come back as a CompletedProcess."""
    mod = importlib.import_module(f"data_prep.{module}")
    argv = [*map(str, args), "--no-progress"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = mod.main(argv)
        except SystemExit as e:  # argparse's usage errors
            rc = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["python", "-m", f"data_prep.{module}", *argv], rc, out.getvalue(),
                                       err.getvalue())


def cifar_raw(root, n_train=5, n_test=2, bad_label=False, duplicate=False, test_without=None):
    """A cifar-100-python directory in the real pickle format (bytes keys, uint8 rows of 3072); ``test_without``:
    a key (e.g. b"fine_labels") the test pickle lacks."""
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
        record = {b"data": data, b"fine_labels": labels, b"coarse_labels": [0] * len(labels),
                  b"filenames": names, b"batch_label": split.encode()}
        if split == "test":
            record.pop(test_without, None)
        with open(root / split, "wb") as f:
            pickle.dump(record, f)
    return root


def image(path, c, fmt="JPEG"):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(abs(hash(path.name)) % 2**31)
    arr = np.clip(np.array([40 * c, 255 - 40 * c, 128]) + rng.randint(-20, 20, (24, 20, 3)), 0, 255)
    Image.fromarray(arr.astype(np.uint8)).save(path, format=fmt)


def imagenet_r_raw(root, per_class=5):
    wnids = [f"n0{1000 + 7 * c}" for c in range(N_CLASSES)]
    for c, w in enumerate(wnids):
        for i in range(per_class):
            image(root / "imagenet-r" / w / f"art_{i}.{'png' if i == 0 else 'jpg'}", c, "PNG" if i == 0 else "JPEG")
    (root / "classnames.txt").write_text("".join(f"{w} thing_{c}\n" for c, w in enumerate(wnids)))
    return wnids


def domainnet_raw(root, per_class=4):
    domains, classes = ["clipart", "real"], [f"cls_{c}" for c in range(N_CLASSES)]
    lines = {"train": [], "test": []}
    for c, name in enumerate(classes):
        for d in domains:
            for i in range(per_class):
                rel = f"{d}/{name}/{d}_{c:03d}_{i:06d}.jpg"
                image(root / rel, c)
                lines["test" if i == 0 else "train"].append(f"{rel} {c}")
    for s in lines:
        (root / f"sdomain_{s}.txt").write_text("\n".join(lines[s]) + "\n")
    return lines


def cub_raw(root, per_class=4):
    cub = root / "CUB_200_2011"
    images, labels, split = [], [], []
    n = 0
    for c in range(N_CLASSES):
        for i in range(per_class):
            n += 1
            rel = f"{c + 1:03d}.Bird_{c}/Bird_{c}_{i:04d}.jpg"
            image(cub / "images" / rel, c)
            images.append(f"{n} {rel}")
            labels.append(f"{n} {c + 1}")
            split.append(f"{n} {0 if i == 0 else 1}")
    (cub / "images.txt").write_text("\n".join(images) + "\n")
    (cub / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (cub / "train_test_split.txt").write_text("\n".join(split) + "\n")
    (cub / "classes.txt").write_text("".join(f"{c + 1} {c + 1:03d}.Bird_{c}\n" for c in range(N_CLASSES)))
    return cub


def coin_raw(root):
    """A CoIN tree as zackschen/CoIN's scripts read it: Instructions_Original/<Task>/train.json and, for
    TextVQA, val.json (scripts/LLaVA/Eval/2_eval_textqa.sh), for Grounding test.json, in the benchmark's own
    record forms; TextVQA's annotator answers in a TextVQA_0.5.1_val.json-shaped file."""
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
        {"from": "human", "value": "<image>\nGive the box of the object."},
        {"from": "gpt", "value": "[0.1, 0.1, 0.9, 0.9]"}]}
        for n, c in enumerate(colours)]
    gtest = [{"question_id": f"gq{n}", "image": f"vqa/{c}1.jpg", "text": "Give the box of the object.",
              "answer_bbox": "[0.1,0.1,0.9,0.9]", "size": [32, 32]} for n, c in enumerate(colours)]
    # ScienceQA as CoIN ships it: some questions have no image (no "image" key), the test text lists the options
    opts = "A. red\nB. blue\nAnswer with the option's letter from the given choices directly."
    strain = [{"id": f"s{n}", **({"image": f"vqa/{c}0.jpg"} if n % 2 == 0 else {}), "conversations": [
        {"from": "human", "value": ("<image>\n" if n % 2 == 0 else "") + f"Which colour is warm?\n{opts}"},
        {"from": "gpt", "value": "A"}]} for n, c in enumerate(("red", "blue", "red", "green"))]
    stest = [{"question_id": f"sq{n}", **({"image": f"vqa/{c}1.jpg"} if n != 1 else {}),
              "text": f"Which colour is warm?\n{opts}", "answer": "A"} for n, c in enumerate(("red", "blue", "green"))]
    # VizWiz: CoIN's val.json questions; the VizWiz release's val.json annotations (no question_id) beside
    vq = "What colour is this?\nWhen the provided information is insufficient, respond with 'Unanswerable'."
    vtrain = [dict(r, id=f"v{n}") for n, r in enumerate(train)]
    vval = [{"question_id": 7 + n, "image": f"vqa/{c}2.jpg", "text": vq, "answer": c}
            for n, c in enumerate(("red", "green"))]
    vann = [{"image": f"{c}2.jpg", "question": "What colour is this?", "answerable": 1, "answer_type": "other",
             "answers": [{"answer": c, "answer_confidence": "yes"}] * 8
                        + [{"answer": "dark", "answer_confidence": "maybe"}] * 2}
            for c in ("green", "red")]
    for task, (tr, te, test_file) in {"TextVQA": (train, test, "val"), "Grounding": (gtrain, gtest, "test"),
                                      "ScienceQA": (strain, stest, "test"), "VizWiz": (vtrain, vval, "val")}.items():
        (root / "Instructions_Original" / task).mkdir(parents=True, exist_ok=True)
        (root / "Instructions_Original" / task / "train.json").write_text(json.dumps(tr))
        (root / "Instructions_Original" / task / f"{test_file}.json").write_text(json.dumps(te))
    (root / "TextVQA_val.json").write_text(json.dumps(ann))
    (root / "vizwiz_val_annotations.json").write_text(json.dumps(vann))
    return root


def llava_mix_raw(root):
    """Records as llava_v1_5_mix665k.json has them: single- and multi-turn conversations over images in
    LLaVA's playground/data folders, ShareGPT conversations without an image, an id used twice."""
    from PIL import Image

    (root / "coco" / "train2017").mkdir(parents=True, exist_ok=True)
    (root / "gqa" / "images").mkdir(parents=True, exist_ok=True)
    for n in range(6):
        Image.new("RGB", (32, 32), (40 * n, 200 - 30 * n, 90)).save(root / "coco" / "train2017" / f"{n:012d}.jpg")
    Image.new("RGB", (32, 32), (10, 20, 30)).save(root / "gqa" / "images" / "n1.jpg")
    recs = []
    for n in range(6):
        conv = [{"from": "human", "value": "<image>\nWhat colour is the image?"}, {"from": "gpt", "value": "a colour"},
                {"from": "human", "value": "Is it bright?"}, {"from": "gpt", "value": "yes" if n % 2 else "no"},
                {"from": "human", "value": "Describe it in one word."},
                {"from": "gpt", "value": "square"}][: 2 + 2 * (n % 3)]
        recs.append({"id": f"{n:012d}", "image": f"coco/train2017/{n:012d}.jpg", "conversations": conv})
    recs.append({"id": "n1", "image": "gqa/images/n1.jpg", "conversations": [
        {"from": "human", "value": "Is the image dark?\n<image>"}, {"from": "gpt", "value": "Yes"}]})
    for n in range(3):
        recs.append({"id": f"sharegpt_{n}", "model": "", "conversations": [
            {"from": "human", "value": f"Count to {n + 2}."},
            {"from": "gpt", "value": " ".join(str(i + 1) for i in range(n + 2))},
            {"from": "human", "value": "And back?"},
            {"from": "gpt", "value": " ".join(str(i + 1) for i in range(n + 2))[::-1]}]})
    recs.append(dict(recs[0]))  # ids repeat in the real mix
    (root / "llava_v1_5_mix665k.json").write_text(json.dumps(recs))
    return root / "llava_v1_5_mix665k.json"


def ucit_json_raw(root, images):
    """MCITlib's UCIT tree for a captioning task: <UCIT>/VizWiz/{train,test}.json (VizWiz-caption), images
    under <UCIT>/datasets; the test records carry one caption, and every reference caption is in a COCO
    caption file (<UCIT>/VizWiz/test_captions_coco.json, MCITlib's anno_path: image_id k is the k-th test
    record, its images named), three captions an image."""
    import shutil

    folder = root / "UCIT" / "VizWiz"
    folder.mkdir(parents=True)
    shutil.copytree(images, root / "UCIT" / "datasets")
    q = "<image>\nGenerate a brief caption for the image."
    caps = {"red": ["a red square", "a square that is red", "red"], "green": ["a green square", "green colour",
            "a plain green picture"], "blue": ["a blue square", "a square of blue", "blue and dark"]}
    train = [{"id": f"c{c}{i}", "image": f"vqa/{c}{i}.jpg", "conversations": [
        {"from": "human", "value": q}, {"from": "gpt", "value": caps[c][0]}]} for c in caps for i in range(2)]
    test = [{"question_id": f"ct{c}", "image": f"vqa/{c}2.jpg", "text": q.split("\n", 1)[1], "answer": caps[c][0]}
            for c in caps]
    coco = {"images": [{"id": k + 1, "file_name": f"{c}2.jpg"} for k, c in enumerate(caps)],
            "annotations": [{"image_id": k + 1, "id": 10 * k + j, "caption": cap}
                            for k, c in enumerate(caps) for j, cap in enumerate(caps[c])]}
    (folder / "train.json").write_text(json.dumps(train))
    (folder / "test.json").write_text(json.dumps(test))
    (folder / "test_captions_coco.json").write_text(json.dumps(coco))
    return root / "UCIT"


def ucit_parquet(root):
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


def convert_instruction_sets(tmp_path) -> dict[str, object]:
    """CoIN (TextVQA with an annotation file, Grounding, ScienceQA with text-only questions, VizWiz joined
    by image), UCIT (parquet train, saved-dataset test; a JSON captioning task), a bare arrow file and a
    seeded sample of a mix665k-shaped file through their converters; every conversion must succeed.
    Returns the raw and output folders by name."""
    raw = coin_raw(tmp_path / "coin_raw")
    r = convert("coin", "--instructions", raw / "Instructions_Original", "--images", raw / "images",
                "--task", "textvqa", "grounding", "scienceqa", "vizwiz",
                "--annotations", f"textvqa={raw / 'TextVQA_val.json'}",
                f"vizwiz={raw / 'vizwiz_val_annotations.json'}", "--out", tmp_path / "coin", "--shard-size", 2,
                "--workers", 2)
    assert r.returncode == 0, r.stderr
    mix = llava_mix_raw(tmp_path / "llava_data")
    r = convert("llava_mix", "--json", mix, "--images", tmp_path / "llava_data", "--out", tmp_path / "mix_sample",
                "--sample", 8, "--seed", 0)
    assert r.returncode == 0, r.stderr
    uj = ucit_json_raw(tmp_path / "ucit_json_raw", raw / "images")
    r = convert("ucit", "--instructions", uj, "--images", uj / "datasets", "--task", "vizwiz_caption", "--out",
                tmp_path / "ucit_json", "--annotations", f"vizwiz_caption={uj / 'VizWiz' / 'test_captions_coco.json'}")
    assert r.returncode == 0, r.stderr
    ucit = ucit_parquet(tmp_path / "ucit_raw")
    r = convert("ucit", "--instructions", ucit, "--task", "arxivqa", "--out", tmp_path / "ucit")
    assert r.returncode == 0, r.stderr
    arrow = next((ucit / "ArxivQA" / "test").glob("*.arrow"))  # a bare arrow file, read through datasets
    r = convert("llava_json", "--json", arrow, "--out", tmp_path / "arrow_split", "--scorer", "multiple_choice")
    assert r.returncode == 0, r.stderr
    return {"coin_raw": raw, "coin": tmp_path / "coin", "ucit_raw": ucit, "ucit": tmp_path / "ucit",
            "arrow_split": tmp_path / "arrow_split", "mix_raw": mix, "mix_sample": tmp_path / "mix_sample",
            "ucit_json": tmp_path / "ucit_json"}


def _images(folder, names):
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    for n, name in enumerate(names):
        Image.new("RGB", (32, 32), (37 * n % 256, 200 - 23 * n % 200, 90 + 11 * n)).save(folder / "images" / name)


def mllm_dcl_raw(root):
    """MLLM-DCL as MLLM-CL publishes it (and MCITlib's Domain_data): <Domain>/{train,test}.json with the images in
    <Domain>/images, paths relative to the domain folder; train records in LLaVA's conversation form with a
    question_id, test records {question_id, image, text (no <image>), answer}. Sci's file names carry the source
    (AI2D_, MapQA_) its scorer reads; Fin answers Yes/No or a letter."""
    qa = {"RS": [("Is there a road in the image?", "yes"), ("How many buildings are there?", "12"),
                 ("Is there a lake?", "no"), ("What is the area covered by buildings?", "between 10 and 100")],
          "Med": [("Is this squamous cell carcinoma?", "yes"), ("What organ is shown?", "liver"),
                  ("Is there necrosis?", "no"), ("What stain is used?", "hematoxylin and eosin")],
          "AD": [("What is the ego vehicle doing?", "Going ahead."), ("Is there a pedestrian ahead?", "no"),
                 ("What should the car do at the light?", "Stop."), ("Where is the truck?", "<c1,CAM_FRONT,100,200>")],
          "Sci": [("Which label shows the root?\nA. a\nB. b", "A"), ("Which states have a value lower than 100?",
                  "Alabama,Alaska"), ("Which label shows the leaf?\nA. a\nB. b", "B"),
                  ("What is the highest value in the east?", "500-600")],
          "Fin": [("Will the closing price rise on the next day?", "Yes"), ("Which pattern is shown?\nA. Hammer\nB. "
                  "Doji\nC. Engulfing\nD. Star", "B"), ("Is the volume rising?", "No"), ("Which trend?\nA. up\nB. down",
                                                                                        "A")]}
    prefix = {"Sci": ["AI2D_", "MapQA_", "AI2D_", "MapQA_"]}
    root = root / "Domain_data"
    for domain, pairs in qa.items():
        folder = root / domain
        names = [f"{prefix.get(domain, [domain.lower() + '_'] * 4)[n]}{n:04d}.png" for n in range(len(pairs))]
        _images(folder, names)
        train = [{"question_id": f"{domain.lower()}_train_{n}", "image": f"images/{names[n]}", "conversations": [
            {"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a}]}
            for n, (q, a) in enumerate(pairs)]
        test = [{"question_id": f"{domain.lower()}_test_{n}", "image": f"images/{names[n]}", "text": q, "answer": a}
                for n, (q, a) in enumerate(pairs[:3])]
        (folder / "train.json").write_text(json.dumps(train))
        (folder / "test.json").write_text(json.dumps(test))
    return root


def mllm_acl_raw(root):
    """MLLM-ACL as MLLM-CL publishes it: <Ability>/train.json + images and <Ability>_test/test.json + images, each
    path relative to its own folder. OCR test records carry OCRBench's answer list and category (``answer_type``),
    VP's its ``type`` and ``task``; Math and APP folders exist (their scoring is not local)."""
    root = root / "Ability_data"
    data = {
        "OCR": ([("What is written on the sign?", "STOP"), ("What is the shop's name?", "Bakery")],
                [{"text": "what is written in the image?", "answer": ["STOP", "stop sign"],
                  "answer_type": "Regular Text Recognition"},
                 {"text": "Please write out the expression of the formula in the image using LaTeX format.",
                  "answer": ["x ^ { 2 } + 1"], "answer_type": "Handwritten Mathematical Expression Recognition"},
                 {"text": "What is the title?", "answer": "Open", "answer_type": "Scene Text-centric VQA"}]),
        "VP": ([("How many chairs are there?", "3"), ("How many cars are there?", "(B)")],
               [{"text": "How many chairs are in the image? Select from the following choices.\n(A) 3\n(B) 2",
                 "answer": "(A)", "type": "2D", "task": "Count"},
                {"text": "Which is closer to the camera?\n(A) the chair\n(B) the table", "answer": "(B)",
                 "type": "3D", "task": "Depth"}]),
        "Math": ([("What is 2 + 3?", "5"), ("Which angle is marked?\n(A) 30°\n(B) 60°", "B")],
                 [{"text": q} for q, *_ in MATHVISTA_ROWS]),
        "APP": ([("Which element opens settings?\nA. gear\nB. bell", "A")],
                [{"text": "Which element?", "answer": "A"}]),
    }
    for ability, (train_pairs, test_recs) in data.items():
        if ability == "Math":  # MathVista's ids: testmini_<n> is row n of the answer table
            test_recs = [dict(r, question_id=f"testmini_{n}") for n, r in enumerate(test_recs)]
        tr, te = root / ability, root / f"{ability}_test"
        tr_names = [f"{ability.lower()}_{n:04d}.jpg" for n in range(len(train_pairs))]
        te_names = [f"{ability.lower()}_test_{n:04d}.jpg" for n in range(len(test_recs))]
        _images(tr, tr_names)
        _images(te, te_names)
        train = [{"question_id": f"{ability.lower()}_train_{n}", "image": f"images/{tr_names[n]}", "conversations": [
            {"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a}]}
            for n, (q, a) in enumerate(train_pairs)]
        test = [{"question_id": f"{ability.lower()}_{n}", "image": f"images/{te_names[n]}", **rec}
                for n, rec in enumerate(test_recs)]
        (tr / "train.json").write_text(json.dumps(train))
        (te / "test.json").write_text(json.dumps(test))
    header = ["index", "question", "choices", "answer", "answer_option", "question_type", "answer_type"]
    lines = ["\t".join(header)] + ["\t".join([str(n + 1), q.replace("\n", "\\n"), ch, a, opt, qt, at])
                                   for n, (q, ch, a, opt, qt, at) in enumerate(MATHVISTA_ROWS)]
    (root / "MathVista_MINI.tsv").write_text("\n".join(lines) + "\n")
    return root


# MathVista answer-table rows (question, choices, answer, answer_option, question_type, answer_type), as VLMEvalKit's
# MathVista_MINI.tsv has them: a multiple-choice question, an integer and a float one
MATHVISTA_ROWS = [
    ("Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end. "
     "Question: Which angle is marked? Choices: (A) 135° (B) 140° (C) 145° (D) 150°",
     "['135°', '140°', '145°', '150°']", "145°", "C", "multi_choice", "text"),
    ("Hint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, at "
     "the end. Question: How many shapes are there?", "", "5", "", "free_form", "integer"),
    ("Hint: Please answer the question requiring a floating-point number with one decimal place and provide the "
     "final value, e.g., 1.2, 1.3, 1.4, at the end. Question: How long is the bar?", "", "1.5", "", "free_form",
     "float"),
]
