"""Instruction samples (an image + a LLaVA-style conversation) in webdataset shards.

A sample in a shard is ``<key>.<png|jpg|jpeg>`` (the image bytes, unchanged) and ``<key>.json``::

    {"conversations": [{"from": "human", "value": "<image>\\nQuestion"}, {"from": "gpt", "value": "answer"}],
     "answers": ["annotator 1", ...],      # optional: VQA-style reference answers
     "box": [x0, y0, x1, y1],              # optional: grounding reference
     "size": [width, height],              # optional: the image's size (CoIN's grounding score scales by it)
     "id": "...",                          # optional: the source record's id (data_prep writes it; CoIN's
                                           #   answer files carry it as question_id)
     "choices": ["...", ...],              # optional: a multiple-choice question's options (their count scores)
     "image_name": "images/AI2D_1.png",    # optional: the record's image path (MLLM-DCL Sci's rule reads it)
     "answer_type": "...", "task": "...",  # optional: what a benchmark's scorer reads (OCRBench's category, ...)
     "text_only": true}                    # a question without an image (CoIN ScienceQA, LLaVA's text
                                           #   conversations): the sample then has no image file

The manifest of an instruction split has ``"kind": "instruction"``, an empty ``label_space`` and the
task's default ``"scorer"`` (see mcit.core.scorers). A multi-turn conversation is one sample: training
learns every answer with the turns before it as history (as LLaVA trains), evaluation answers the last
question after the others and their answers (``answers``, ``box``, ``choices`` refer to that question).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from mcit.data.shards import DataError, write_split

IMAGE_EXTS = ("png", "jpg", "jpeg")
# what a scorer may read beside the answers: an OCRBench category, MLLM-CL VP's task, the image's file name
SCORER_KEYS = ("box", "size", "choices", "text_only", "image_name", "answer_type", "task", "type", "question_type",
               "answer_option", "judge_question")
RECORD_KEYS = ("conversations", "answers", "id", *SCORER_KEYS)


def reference_stats(records: list[dict[str, Any]], annotations_format: str | None = None) -> dict[str, Any]:
    """What a split's references hold, for its manifest's ``"references"``: the sample count, the fewest and
    most reference answers of a sample, how many carry an image ``size``, an ``image_name``, an ``answer_type``,
    and how an annotation file was joined in (None without one). A scorer that needs more (m4c's ten TextVQA
    answers, CoIN's image sizes, MCITlib's caption file: mcit.core.scorers.REQUIRES) refuses the split at
    pre-flight from these."""
    counts = [len(r.get("answers") or [None]) for r in records]
    return {"samples": len(records), "answers_min": min(counts, default=0), "answers_max": max(counts, default=0),
            "with_size": sum(1 for r in records if "size" in r), "annotations_format": annotations_format,
            **{f"with_{k}": sum(1 for r in records if k in r) for k in ("image_name", "answer_type")}}


def write_instruction_split(directory: Path, samples: list[dict[str, Any]], *, shard_size: int,
                            scorer: str, extra: dict[str, Any] | None = None) -> dict:
    """Shard ``samples`` (dicts with __key__, png/jpg bytes, conversations, optional answers/box)."""
    rows = []
    for s in samples:
        rec = {k: s[k] for k in RECORD_KEYS if k in s}
        row = {"__key__": s["__key__"], "json": json.dumps(rec).encode()}
        for ext in IMAGE_EXTS:
            if ext in s:
                row[ext] = s[ext]
        rows.append(row)
    return write_split(directory, rows, shard_size=shard_size, label_space=[],
                       extra={"kind": "instruction", "scorer": scorer, "references": reference_stats(samples),
                              **(extra or {})})


def turns(conversations: list[dict[str, str]], where: str) -> list[tuple[str, str]]:
    """(question, answer) pairs of a LLaVA conversation; a clear error names ``where`` if malformed."""
    out = []
    if not isinstance(conversations, list) or len(conversations) < 2:
        raise DataError(f"{where}: 'conversations' must hold at least one human and one gpt turn")
    for i in range(0, len(conversations) - 1, 2):
        h, g = conversations[i], conversations[i + 1]
        if h.get("from") != "human" or g.get("from") != "gpt":
            raise DataError(f"{where}: turn {i // 2} is not a human/gpt pair (got {h.get('from')!r}/{g.get('from')!r})")
        out.append((str(h.get("value", "")), str(g.get("value", ""))))
    return out


def decode_instruction(sample: dict) -> tuple[Any, dict[str, Any], str]:
    """(PIL RGB image or None for a text-only sample, {"turns": [(question, answer), ...], "question",
    "answer" (the last turn's), "answers", "box"?, "size"?, "question_id"?, "choices"?, "text_only"?}, key) of a raw
    shard sample."""
    from PIL import Image

    key = sample.get("__key__", "?")
    where = f"sample {key} in {sample.get('__url__', '?')}"
    try:
        rec = json.loads(sample["json"])
        data = next((sample[e] for e in IMAGE_EXTS if e in sample), None)
        if data is None and not rec.get("text_only"):
            raise DataError(f"{where}: no image (expected one of {', '.join(IMAGE_EXTS)}, or \"text_only\": true)")
        image = None if data is None else Image.open(io.BytesIO(data))
        if image is not None:
            image.load()  # decoded here, so that a corrupt file names its sample
            image = image if image.mode == "RGB" else image.convert("RGB")
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - any decoding failure names the sample
        raise DataError(f"{where}: cannot decode ({e.__class__.__name__}: {e})") from None
    pairs = turns(rec.get("conversations"), where)
    question, answer = pairs[-1]
    out: dict[str, Any] = {"turns": pairs, "question": question, "answer": answer,
                           "answers": rec.get("answers") or [answer]}
    for k in SCORER_KEYS:
        if k in rec:
            out[k] = rec[k]
    if "id" in rec:
        out["question_id"] = rec["id"]
    return image, out, key
