"""The CoIN / UCIT instruction sets -> instruction shards, from LLaVA JSON + an image folder or from a
dataset that ``datasets`` loads from local files (parquet / arrow / json).

Two record forms are read, as the benchmarks distribute them:

* training form (LLaVA): ``{"id", "image", "conversations": [{"from": "human", "value": "<image>\\n..."},
  {"from": "gpt", "value": ...}, ...]}``; a multi-turn conversation is one sample (each answer trained
  with the turns before it, as LLaVA trains);
* test form (CoIN's question files): ``{"question_id", "image", "text", "answer"}``, plus
  ``answer_bbox`` (and ``size``) for grounding.

Either form may carry ``answers`` (the annotators' answers, for VQA accuracy; strings or
``{"answer": ...}``), ``box`` and ``choices``; for test sets whose answer lists live in the original
annotation file (TextVQA ``{"data": [...]}``, VQAv2 ``{"annotations": [...]}``, VizWiz), pass it with
``--annotations``: its records are joined on ``question_id``, or, for an annotation file without one
(VizWiz's, one question per image), on the image's file name as the VizWiz evaluation does. Duplicate
ids are an error, in the
question file and in the annotation file alike: joining by a key that is not unique silently scores
answers against another question's references (the VizWiz mismatch). A record without an answer, a
missing or unreadable image and an unknown record form are errors naming the record id and the file;
``--on-error skip`` leaves them out and counts them in the manifest. A record without an ``image`` key
is text-only (LLaVA's rule; CoIN's ScienceQA and LLaVA's text conversations have such records): kept,
marked ``"text_only": true`` and stored without an image.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from data_prep.common import RecordError, read_image_file, write_shards
from mcit.data.instructions import reference_stats, turns
from mcit.data.shards import DataError

LETTERS = "ABCDEFGHIJ"


@dataclass(frozen=True)
class TaskPreset:
    """Where a benchmark task's files are and how it is scored."""

    name: str            # the shard directory name (and the config's task name)
    folder: str          # its folder in the benchmark's instruction tree
    scorer: str
    test_file: str = "test"  # the stem of the file the benchmark's own evaluation reads as the test split
    test_folder: str = ""    # the test file's folder when not ``folder`` (MLLM-ACL's <Ability>_test)
    images_here: bool = False  # image paths are relative to the split file's folder (MLLM-CL), not --images
    needs_annotations: str = ""  # why the test split cannot be converted without --annotations TASK=FILE


# CoIN's evaluation scripts (zackschen/CoIN scripts/LLaVA/Eval/*.sh) read val.json for TextVQA, VizWiz and VQAv2
# and test.json for the others; the scorers are those scripts' (mcit.core.scorers, coin_*).
COIN = [TaskPreset("scienceqa", "ScienceQA", "coin_scienceqa"), TaskPreset("textvqa", "TextVQA", "coin_textvqa", "val"),
        TaskPreset("imagenet", "ImageNet", "coin_imagenet"), TaskPreset("gqa", "GQA", "coin_gqa"),
        TaskPreset("vizwiz", "VizWiz", "coin_vizwiz", "val"), TaskPreset("grounding", "Grounding", "coin_grounding"),
        TaskPreset("vqav2", "VQAv2", "coin_vqav2", "val"), TaskPreset("ocrvqa", "OCRVQA", "coin_ocrvqa")]
# UCIT as MCITlib lays it out (Ghy0501/MCITlib README and configs/data_configs/UCIT/*.json:
# <UCIT>/<Task>/{train,test}.json, images under <UCIT>/datasets).
# The accuracy tasks are scored as MCITlib's eval_deepseek_r1.py (ucit_accuracy), the captioning tasks as its
# eval_caption.py (ucit_caption: the mean of BLEU-1..4, METEOR, ROUGE-L, CIDEr; mcit.core.caption_metrics).
UCIT = [TaskPreset("imagenet_r", "ImageNet-R", "ucit_accuracy"), TaskPreset("arxivqa", "ArxivQA", "ucit_accuracy"),
        TaskPreset("vizwiz_caption", "VizWiz", "ucit_caption"), TaskPreset("iconqa", "IconQA", "ucit_accuracy"),
        TaskPreset("clevr_math", "CLEVR-Math", "ucit_accuracy"), TaskPreset("flickr30k", "Flickr30k", "ucit_caption")]
# MLLM-CL (bjzhb666/MLLM-CL 80bf389 README; MCITlib's Domain_data/<X>/{train,test}.json): every task folder holds its
# images (paths relative to it), each task scored by MLLM-CL's own script (mcit.core.scorers, mllm_cl_*).
# MLLM-DCL in the order of its scripts (RS, Med, AD, Sci, Fin).
MLLM_DCL = [TaskPreset("rs", "RS", "mllm_cl_ai2d", images_here=True),
            TaskPreset("med", "Med", "mllm_cl_pvqa", images_here=True),
            TaskPreset("ad", "AD", "mllm_cl_ai2d", images_here=True),
            TaskPreset("sci", "Sci", "mllm_cl_sci", images_here=True),
            TaskPreset("fin", "Fin", "mllm_cl_finvis", images_here=True)]
# MLLM-ACL: <Ability>/train.json and <Ability>_test/test.json. Its Math (a GPT judge over MathVista's table) and
# APP (MMT-Bench's evaluation server) have no local rule; MLLM_ACL_EXTERNAL says so when they are asked for.
MLLM_ACL = [TaskPreset("ocr", "OCR", "mllm_cl_ocrbench", test_folder="OCR_test", images_here=True),
            TaskPreset("math", "Math", "mllm_cl_math", test_folder="Math_test", images_here=True,
                       needs_annotations="MLLM-ACL Math's answers are in MathVista's table (MLLM-CL's "
                                         "llava_v1.5_7b_MathVista_MINI.xlsx, or VLMEvalKit's MathVista_MINI.tsv): "
                                         "pass --annotations math=<that file>"),
            TaskPreset("vp", "VP", "mllm_cl_vp", test_folder="VP_test", images_here=True)]
MLLM_ACL_EXTERNAL = {
    "app": "MLLM-ACL APP is scored by MMT-Bench's evaluation server (convert_result_to_submission.py), not locally"}


def _safe(x: Any) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in str(x))


def _answers(value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [str(a["answer"] if isinstance(a, dict) else a) for a in value]
    return [str(value)]


def _box(value: Any) -> list[float]:
    if isinstance(value, str):
        value = [v for v in value.replace("[", " ").replace("]", " ").replace(",", " ").split()]
    box = [float(v) for v in value]
    if len(box) != 4:
        raise ValueError(f"a box has 4 numbers, got {len(box)}")
    return box


META_KEYS = ("answer_type", "task", "type", "question_type")  # kept from test records for their scorers
IMAGE_KEY = "image:"  # annotation keys of a file joined by image file name (VizWiz)
POSITION_KEY = "position:"  # annotation keys of a COCO caption file: image_id k is the k-th record (1-based)


class Annotations(dict):
    """Annotation records by join key; ``format`` says how they were read (``question_id``, ``image``,
    ``coco_captions``), recorded in the split's manifest."""

    format: str = "question_id"


def is_coco_captions(data: Any) -> bool:
    """A COCO caption file (captions_val2014.json's shape): {"annotations": [{"image_id", "caption"}, ...]}."""
    anns = data.get("annotations") if isinstance(data, dict) else None
    return (isinstance(anns, list) and bool(anns)
            and all(isinstance(a, dict) and "image_id" in a and "caption" in a for a in anns))


def load_coco_captions(path: Path, data: dict) -> Annotations:
    """A COCO caption file as MCITlib's eval_caption.py reads it (its ``anno_path``): the captions of each
    ``image_id``. There the k-th answer of the result file (the k-th record of the test file) is numbered
    image_id k, so that is the join here (``POSITION_KEY`` + k); where the file names its images
    (``images[].file_name``) the name is kept so the join can be checked against the record's image."""
    names = {int(im["id"]): str(im["file_name"]) for im in data.get("images") or []
             if isinstance(im, dict) and "id" in im and "file_name" in im}
    out = Annotations()
    out.format = "coco_captions"
    for n, a in enumerate(data["annotations"]):
        try:
            image_id = int(a["image_id"])
        except (TypeError, ValueError):
            raise DataError(f"{path} annotation {n}: image_id {a['image_id']!r} is not an integer") from None
        rec = out.setdefault(f"{POSITION_KEY}{image_id}", {"answers": [], "image_id": image_id})
        rec["answers"].append(str(a["caption"]))
        if image_id in names:
            rec["file_name"] = names[image_id]
    return out


_LOADED: dict[tuple, Annotations] = {}  # a file read once per conversion (planning and the manifest)


def load_annotations(path: Path) -> Annotations:
    """Original annotation records keyed by question_id, or by ``IMAGE_KEY`` + the image's file name when
    no record has a question_id and every one an image (VizWiz), or a COCO caption file's captions by
    position (``load_coco_captions``); a duplicate key is an error naming it."""
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    except OSError as e:
        raise DataError(f"cannot read {path}: {e}") from None
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = _load_annotations(path)
    return _LOADED[key]


MATHVISTA_KEY = "row:"  # a MathVista answer table's rows by their 0-based label (MLLM-CL's testmini_<n>)
MATHVISTA_COLUMNS = ("question", "answer", "question_type", "answer_type")


def load_mathvista_table(path: Path) -> Annotations:
    """MathVista's testmini answer table as MLLM-CL's eval_math.py reads it: its repository's
    llava_v1.5_7b_MathVista_MINI.xlsx (VLMEvalKit's export; reading .xlsx needs openpyxl) or VLMEvalKit's
    MathVista_MINI.tsv. model_math.py writes the answer to question ``testmini_<n>`` into row label n (the
    0-based row), so rows are keyed by that label; each keeps what the judged scorer reads."""
    import ast

    import pandas as pd

    try:
        if path.suffix.lower() == ".xlsx":
            df = pd.read_excel(path)
        else:
            df = pd.read_csv(path, sep="\t")
    except ImportError as e:
        raise DataError(f"cannot read {path}: {e} (pip install openpyxl, or pass VLMEvalKit's MathVista_MINI.tsv)") \
            from None
    except Exception as e:  # noqa: BLE001 - pandas raises many types; one line names the file
        raise DataError(f"cannot read {path}: {e.__class__.__name__}: {e}") from None
    missing = [c for c in MATHVISTA_COLUMNS if c not in df.columns]
    if missing:
        raise DataError(f"{path}: not a MathVista answer table (no column {missing[0]!r})")
    out = Annotations()
    out.format = "mathvista"

    def cell(v: Any) -> str | None:
        return None if v is None or (isinstance(v, float) and v != v) else str(v)

    for label, row in df.iterrows():
        choices = cell(row.get("choices"))
        out[f"{MATHVISTA_KEY}{label}"] = {
            "answer": cell(row["answer"]), "judge_question": cell(row["question"]) or "",
            "question_type": cell(row["question_type"]), "answer_type": cell(row["answer_type"]),
            "answer_option": cell(row.get("answer_option")),
            "choices": [str(c) for c in ast.literal_eval(choices)] if choices else None}
    return out


def _load_annotations(path: Path) -> Annotations:
    if path.suffix.lower() in (".xlsx", ".tsv"):
        return load_mathvista_table(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    if is_coco_captions(data):
        return load_coco_captions(path, data)
    if isinstance(data, dict):
        data = data.get("data", data.get("annotations"))
    if not isinstance(data, list):
        raise DataError(f"{path}: unknown format (expected a list, or a dict with 'data' or 'annotations')")
    by_image = bool(data) and all(isinstance(r, dict) and "question_id" not in r and isinstance(r.get("image"), str)
                                  for r in data)
    out = Annotations()
    out.format = "image" if by_image else "question_id"
    for n, rec in enumerate(data):
        if by_image:
            key = IMAGE_KEY + Path(rec["image"]).name
        else:
            qid = rec.get("question_id") if isinstance(rec, dict) else None
            if qid is None:
                raise DataError(f"{path} item {n}: no 'question_id' (and not every record has an 'image' to join on)")
            key = str(qid)
        if key in out:
            what = "image" if by_image else "question_id"
            raise RecordError(key.removeprefix(IMAGE_KEY), path, f"duplicate {what} in the annotation file")
        out[key] = rec
    return out


def mathvista_row(rid: str, text: str, where: Path, table: dict[str, dict]) -> dict:
    """The answer-table row of MLLM-ACL Math question ``testmini_<n>``: row label n, as model_math.py writes it.
    Its question must be the record's (whitespace aside): a table that is not the test file's, or ids counted
    from another base, would otherwise score every answer against another question's."""
    n = rid.removeprefix("testmini_")
    if not n.isdigit():
        raise RecordError(rid, where, "MLLM-ACL Math ids are testmini_<n> (the answer table's row n)")
    row = table.get(f"{MATHVISTA_KEY}{int(n)}")
    if row is None:
        raise RecordError(rid, where, f"the answer table has no row {int(n)}")

    def squash(t: str) -> str:
        return " ".join(t.split())

    q, t = squash(row["judge_question"]), squash(text)
    if not q or (q not in t and t not in q):
        raise RecordError(rid, where, f"the answer table's row {int(n)} asks another question ({q[:60]!r}); "
                                      f"MLLM-CL joins testmini_<n> to row n")
    return row


def record_reference(item: dict, where: Path, annotations: dict[str, dict] | None,
                     position: int = 0) -> tuple[str, dict]:
    """(record id, the sample's reference) of a record in either form; RecordError if malformed. A
    multi-turn conversation stays one sample (its later turns keep their history); a record without an
    ``image`` key is text-only, as LLaVA's own loader decides (``'image' in sources[0]``), and is marked
    ``text_only``. ``position`` (0-based, in its file) joins a COCO caption file."""
    if not isinstance(item, dict):
        raise RecordError("?", where, "unknown format (a record is not a JSON object)")
    rid = str(item.get("question_id", item.get("id", "?")))
    text_only = "image" not in item
    extra: dict[str, Any] = {"text_only": True} if text_only else {}
    try:
        if "conversations" in item:
            pairs = turns(item["conversations"], f"record {rid!r} ({where})")
        elif "text" in item or "question" in item:
            q = str(item.get("text", item.get("question")))
            ans = item.get("answer")
            if ans is None and "answers" in item:
                ans = _answers(item["answers"])[0]
            if ans is None and "answer_bbox" in item:
                ans = "[" + ", ".join(f"{v:.3f}" for v in _box(item["answer_bbox"])) + "]"
            ann = annotations.get(rid) if annotations is not None else None
            if ann is None and annotations is not None and isinstance(item.get("image"), str):
                ann = annotations.get(IMAGE_KEY + Path(item["image"]).name)
            if ann is None and annotations is not None and getattr(annotations, "format", "") == "coco_captions":
                ann = annotations.get(f"{POSITION_KEY}{position + 1}")
                if ann is None:
                    raise RecordError(rid, where, f"the caption file has no image_id {position + 1} (MCITlib's "
                                                  f"eval_caption.py numbers the k-th test record image_id k)")
                name = ann.get("file_name")
                if name and isinstance(item.get("image"), str) and Path(name).name != Path(item["image"]).name:
                    raise RecordError(rid, where, f"the caption file's image_id {position + 1} is {name!r}, the "
                                                  f"record's image {item['image']!r} (the files are out of order)")
            if annotations is not None and getattr(annotations, "format", "") == "mathvista":
                ann = mathvista_row(rid, str(item.get("text", item.get("question"))), where, annotations)
                extra.update({k: v for k, v in ann.items() if k != "answer" and v is not None})
                ans = ann["answer"]
            if annotations is not None and ann is None:
                raise RecordError(rid, where, "neither its question_id nor its image is in the annotation file")
            if ann is not None:
                extra["answers"] = _answers(ann.get("answers", ann.get("answer")))
                ans = ans if ans is not None else extra["answers"][0]
            if ans is None:
                raise RecordError(rid, where, "record has no answer")
            if isinstance(ans, int) and "choices" in item:
                ans = LETTERS[ans]
            if isinstance(ans, list):  # several accepted answers (MLLM-ACL OCR, OCRBench): the first is trained
                if not ans:
                    raise RecordError(rid, where, "record has an empty answer list")
                extra["answers"] = _answers(ans)
                ans = ans[0]
            pairs = [(q if "<image>" in q or text_only else f"<image>\n{q}", str(ans))]
        else:
            raise RecordError(rid, where, "unknown format (neither 'conversations' nor 'text'/'question')")
        if "answers" in item:
            extra["answers"] = _answers(item["answers"])
        for k in ("box", "answer_bbox"):
            if k in item:
                extra["box"] = _box(item[k])
        if "choices" in item:
            extra["choices"] = [str(c) for c in item["choices"]]
        for k in META_KEYS:  # what a benchmark's scorer reads beside the answer (OCRBench's category, ...)
            if isinstance(item.get(k), str):
                extra[k] = item[k]
        if isinstance(item.get("image"), str):  # MLLM-DCL Sci's scorer picks its rule by the image's file name
            extra["image_name"] = item["image"]
        if "size" in item:  # (width, height): CoIN's grounding score scales both boxes by max(size)
            size = [float(v) for v in item["size"]]
            if len(size) != 2 or min(size) <= 0:
                raise ValueError(f"'size' is (width, height), got {item['size']!r}")
            extra["size"] = size
    except RecordError:
        raise
    except (DataError, ValueError, TypeError, KeyError, IndexError) as e:
        raise RecordError(rid, where, str(e).split(": ", 1)[-1] if isinstance(e, DataError) else
                          f"malformed ({e.__class__.__name__}: {e})") from None
    for t, (_, a) in enumerate(pairs):
        if not a.strip():
            raise RecordError(rid, where, f"turn {t} has no answer")
    conv = [m for q, a in pairs for m in ({"from": "human", "value": q}, {"from": "gpt", "value": a})]
    return rid, {"conversations": conv, **extra}


def read_items(path: Path) -> list[Any]:
    """Records of a JSON list, a JSON-lines file, or a dataset ``datasets`` loads (parquet/arrow/json)."""
    if not path.exists():
        raise DataError(f"missing file: {path}")
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".arrow") or path.is_dir():
        return load_with_datasets(path)
    if suffix == ".jsonl":
        try:
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise DataError(f"cannot read {path}: {e}") from None
    if suffix != ".json":
        raise DataError(f"{path}: unknown format (expected .json, .jsonl, .parquet, .arrow or a saved dataset)")
    try:
        items = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    if isinstance(items, dict) and isinstance(items.get("data"), list):
        items = items["data"]
    if not isinstance(items, list):
        raise DataError(f"{path}: unknown format (expected a JSON list of records)")
    return items


def load_with_datasets(path: Path) -> list[dict]:
    """A local dataset through ``datasets``, never the hub: parquet / arrow files (their arrow cache goes
    to a temporary folder, not ~/.cache) or a ``save_to_disk`` folder. An ``Image`` column is read
    undecoded, so its bytes go into the shards unchanged."""
    import os
    import tempfile

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    with tempfile.TemporaryDirectory(prefix="mcit-datasets-") as cache:
        try:
            if path.is_dir():
                ds = datasets.load_from_disk(str(path))
            else:
                fmt = {".parquet": "parquet", ".arrow": "arrow"}[path.suffix.lower()]
                ds = datasets.load_dataset(fmt, data_files=str(path), split="train", cache_dir=cache)
        except Exception as e:  # noqa: BLE001 - datasets raises many types; one line names the file
            raise DataError(f"{path}: cannot load with datasets ({e.__class__.__name__}: {e})") from None
        if isinstance(ds, datasets.DatasetDict):
            raise DataError(f"{path}: holds several splits ({', '.join(ds)}); point at one split's folder")
        if isinstance(ds.features.get("image"), datasets.Image):
            ds = ds.cast_column("image", datasets.Image(decode=False))
        return [dict(r) for r in ds]


def _image_ref(item: dict, rid: str, where: Path, images: Path | None) -> tuple[str, Any]:
    """('path', str), ('bytes', bytes), or ('none', None) for a text-only record (no ``image`` key)."""
    if "image" not in item:
        return "none", None
    img = item.get("image")
    if isinstance(img, dict) and img.get("bytes"):
        return "bytes", img["bytes"]
    if isinstance(img, dict):
        img = img.get("path")
    if isinstance(img, (list, tuple)) and len(img) == 1:
        img = img[0]  # a one-image list is one image
    if isinstance(img, (list, tuple)):  # the pipeline's samples hold one image each (mcit.data.types.Batch)
        raise RecordError(rid, where, f"record has {len(img)} images ({', '.join(map(repr, img[:3]))}"
                                      f"{' ...' if len(img) > 3 else ''}); multi-image records are not supported: "
                                      f"leave them out of the split, or make one record per image")
    if not img:
        raise RecordError(rid, where, "record has an empty image")
    if images is None:
        raise RecordError(rid, where, f"image {img!r} is a path but no --images folder was given")
    path = images / str(img)
    root = images.resolve()
    if not path.resolve().is_relative_to(root):  # "../x", an absolute path or a link leading outside --images
        raise RecordError(rid, where, f"image path {img!r} leads outside --images {images}")
    if not path.is_file():  # found before anything is written; unreadable files are found while encoding
        raise RecordError(rid, where, f"image file not found: {path}")
    return "path", str(path)


def encode(spec: tuple[str, str, str, tuple[str, Any], dict]) -> dict:
    """(key, record id, source, image ref, reference) -> a shard sample (image bytes as stored + json)."""
    from PIL import Image

    key, rid, source, (kind, ref), rec = spec
    if kind == "none":  # text-only
        return {"__key__": key, "json": json.dumps({"id": rid, **rec}).encode()}
    if kind == "path":
        ext, data = read_image_file(rid, ref)
    else:
        try:
            with Image.open(io.BytesIO(ref)) as im:
                fmt = (im.format or "").upper()
                im.load()
        except Exception as e:  # noqa: BLE001
            raise RecordError(rid, source, f"unreadable image bytes ({e.__class__.__name__}: {e})") from None
        if fmt not in ("JPEG", "PNG"):
            raise RecordError(rid, source, f"image bytes are {fmt or 'unknown'}, not JPEG or PNG")
        ext, data = ("jpg" if fmt == "JPEG" else "png"), ref
    return {"__key__": key, ext: data, "json": json.dumps({"id": rid, **rec}).encode()}


def specs_of(path: Path, images: Path | None, annotations: Path | None, on_error: str, *, unique_ids: bool = True,
             items: list[Any] | None = None, positions: list[int] | None = None) -> tuple[list[tuple], list[str]]:
    """Shard specs of one split file (or of ``items`` read from it, at ``positions`` in it) and the ids of
    the records left out under ``on_error=skip``. ``unique_ids=False`` (training mixes such as LLaVA's,
    never joined with annotations) keys samples by their position as well, so a repeated id is not an error."""
    ann = load_annotations(annotations) if annotations is not None else None
    specs, skipped, seen = [], [], set()
    for n, item in enumerate(read_items(path) if items is None else items):
        try:
            rid, ref = record_reference(item, path, ann, n)
            if rid == "?":
                rid = f"item{n}"
            if unique_ids and rid in seen:
                raise RecordError(rid, path, "duplicate id (an earlier record has the same id)")
            seen.add(rid)
            image = _image_ref(item, rid, path, images)
        except RecordError as e:
            if on_error == "fail":
                raise
            skipped.append(e.record_id)
            continue
        pos = positions[n] if positions is not None else n
        specs.append((_safe(rid) if unique_ids else f"{pos:07d}_{_safe(rid)}", rid, str(path), image, ref))
    return specs, skipped


def write_planned(specs: list[tuple], skipped: list[str], path: Path, out: Path, *, scorer: str,
                  annotations: Path | None = None, shard_size: int = 1000, workers: int = 1, on_error: str = "fail",
                  progress: bool = True, task: str = "", limit: int = 0, extra: dict | None = None) -> dict:
    """Write the specs of one split file (from ``specs_of``) as an instruction split."""
    if limit:
        specs = specs[:limit]
    fmt = load_annotations(annotations).format if annotations is not None else None
    references = reference_stats([spec[4] for spec in specs], fmt)
    return write_shards(out, specs, encode, shard_size=shard_size, label_space=[], on_error=on_error,
                        workers=workers, progress=progress, desc=f"{task or out.parent.name}/{out.name}",
                        extra={"kind": "instruction", "scorer": scorer, "task": task, "source": str(path),
                               "annotations": str(annotations) if annotations else None,
                               "source_skipped": len(skipped), "source_skipped_records": skipped[:1000],
                               "references": references, **(extra or {})})


def convert_split(path: Path, out: Path, *, images: Path | None, scorer: str, annotations: Path | None = None,
                  on_error: str = "fail", **kw) -> dict:
    """One split file -> one split directory (every record is checked before anything is written)."""
    specs, skipped = specs_of(path, images, annotations, on_error)
    return write_planned(specs, skipped, path, out, scorer=scorer, annotations=annotations, on_error=on_error, **kw)


def iter_split_files(folder: Path, test_file: str = "test", *,
                     train_folder: Path | None = None) -> Iterator[tuple[str, Path]]:
    """(split, file) of a task folder: ``train`` and ``test_file`` (the file the benchmark's evaluation
    reads, e.g. CoIN's val.json for TextVQA) as .json, .jsonl, .parquet, .arrow or a saved dataset. Only
    that file is the test split, whatever else the folder holds. ``train_folder``: where train is, when
    not in ``folder`` (MLLM-ACL keeps its test files in <Ability>_test)."""
    for split, stem in (("train", "train"), ("test", test_file)):
        where = (train_folder or folder) if split == "train" else folder
        found = [where / f"{stem}{ext}" for ext in (".json", ".jsonl", ".parquet", ".arrow", "")
                 if (where / f"{stem}{ext}").exists()]
        if not found:
            raise DataError(f"{where}: no {stem}.json (or .jsonl/.parquet/.arrow/saved dataset)"
                            + (f" (the {split} split)" if stem != split else ""))
        yield split, found[0]


def benchmark_main(benchmark: str, presets: list[TaskPreset], doc: str, argv: list[str] | None = None,
                   unsupported: dict[str, str] | None = None) -> int:
    """The command of one benchmark: ``--task NAME|all`` converts each task's train and test file.
    ``unsupported``: tasks of the benchmark that cannot be converted, with the reason given when asked for."""
    import sys

    from data_prep import inference_prompts
    from data_prep.common import converter_arguments, run_cli

    by_name = {p.name: p for p in presets} | {p.folder.lower(): p for p in presets}
    ap = converter_arguments(doc)
    ap.add_argument("--task", nargs="+", default=["all"], help=f"all, or some of: {', '.join(p.name for p in presets)}")
    ap.add_argument("--instructions", type=Path, help="the folder holding <Task>/train.json and <Task>/test.json")
    ap.add_argument("--images", type=Path, help="the folder the records' 'image' paths are relative to")
    ap.add_argument("--annotations", nargs="*", default=[],
                    help="TASK=FILE: original annotation file joined on question_id into the test split")
    ap.add_argument("--out", type=Path, default=Path(f"data/shards/{benchmark}"))
    ap.add_argument("--limit", type=int, default=0, help="convert only the first N samples per split (0 = all)")
    ap.add_argument("--inference-prompts", choices=["official", "none"], default="official",
                    help="official: test questions as the benchmark's evaluation script asks them (its added "
                         "instruction, data_prep/inference_prompts.py); none: the test file's text as it is")

    def build(args: Any) -> None:
        names = [p.name for p in presets] if args.task == ["all"] else args.task
        for t in names:
            if t.lower() in (unsupported or {}):
                raise DataError(f"task {t!r}: {(unsupported or {})[t.lower()]}")
        if args.task == ["all"]:
            for t, why in (unsupported or {}).items():
                print(f"{t}: not converted ({why})", file=sys.stderr)
        unknown = [t for t in names if t.lower() not in by_name]
        if unknown:
            raise DataError(f"unknown task {unknown[0]!r}; {benchmark} has {', '.join(p.name for p in presets)}")
        ann: dict[str, Path] = {}
        for a in args.annotations:
            task, _, f = a.partition("=")
            if not f or task.lower() not in by_name:
                raise DataError(f"--annotations {a!r}: expected TASK=FILE with a task of {benchmark}")
            ann[by_name[task.lower()].name] = Path(f)
        for t in list(names):
            preset = by_name[t.lower()]
            if preset.needs_annotations and preset.name not in ann:
                if args.task != ["all"]:
                    raise DataError(f"task {t!r}: {preset.needs_annotations}")
                print(f"{preset.name}: not converted ({preset.needs_annotations})", file=sys.stderr)
                names.remove(t)
        todo = []  # every file is found and every record checked before anything is written
        for t in names:
            preset = by_name[t.lower()]
            folder = args.instructions / preset.folder
            folders = [folder] + ([args.instructions / preset.test_folder] if preset.test_folder else [])
            for d in folders:
                if not d.is_dir():
                    raise DataError(f"missing directory: {d} (task {preset.name})")
            for split, f in iter_split_files(folders[-1] if preset.test_folder else folder, preset.test_file,
                                             train_folder=folder):
                a = ann.get(preset.name) if split == "test" else None
                images = args.images or (f.parent if preset.images_here else None)
                todo.append((preset, split, f, a, *specs_of(f, images, a, args.on_error)))
        for preset, split, f, a, specs, skipped in todo:
            extra = None
            if split == "test" and args.inference_prompts == "official":
                rule = inference_prompts.official(benchmark, preset.name)
                specs, extra = inference_prompts.apply_to_specs(specs, rule), {"inference_prompt": rule.record()}
            m = write_planned(specs, skipped, f, args.out / preset.name / split, scorer=preset.scorer, annotations=a,
                              shard_size=args.shard_size, workers=args.workers, on_error=args.on_error,
                              progress=not args.no_progress, task=preset.name, limit=args.limit, extra=extra)
            print(f"{preset.name}/{split}: {m['num_samples']} samples in {len(m['shards'])} shards "
                  f"(scorer {preset.scorer}, skipped {m['skipped'] + m['source_skipped']})", file=sys.stderr)

    return run_cli(ap, argv, build, lambda args, _: f"{benchmark} at {args.out}", required=("instructions",))
