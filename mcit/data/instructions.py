"""Instruction samples (an image + a LLaVA-style conversation) in webdataset shards.

A sample in a shard is ``<key>.<png|jpg|jpeg>`` (the image bytes, unchanged) and ``<key>.json``::

    {"conversations": [{"from": "human", "value": "<image>\\nQuestion"}, {"from": "gpt", "value": "answer"}],
     "answers": ["annotator 1", ...],      # optional: VQA-style reference answers
     "box": [x0, y0, x1, y1],              # optional: grounding reference
     "id": "...",                          # optional: the source record's id (data_prep writes it; CoIN's
                                           #   answer files carry it as question_id)
     "choices": ["...", ...]}              # optional: a multiple-choice question's options (their count scores)

The manifest of an instruction split has ``"kind": "instruction"``, an empty ``label_space`` and the
task's default ``"scorer"`` (see mcit.scorers). Multi-turn conversations are cut into one sample per
(human, gpt) turn by the converters (data_prep.instruction_sets).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from mcit.data.shards import DataError, write_split

IMAGE_EXTS = ("png", "jpg", "jpeg")
RECORD_KEYS = ("conversations", "answers", "box", "id", "choices")


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
                       extra={"kind": "instruction", "scorer": scorer, **(extra or {})})


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
    """(PIL RGB image, {"question", "answer", "answers", "box"?, "question_id"?, "choices"?}, key) of a raw
    shard sample."""
    from PIL import Image

    key = sample.get("__key__", "?")
    where = f"sample {key} in {sample.get('__url__', '?')}"
    try:
        rec = json.loads(sample["json"])
        data = next(sample[e] for e in IMAGE_EXTS if e in sample)
        image = Image.open(io.BytesIO(data)).convert("RGB")
    except StopIteration:
        raise DataError(f"{where}: no image (expected one of {', '.join(IMAGE_EXTS)})") from None
    except Exception as e:  # noqa: BLE001 - any decoding failure names the sample
        raise DataError(f"{where}: cannot decode ({e.__class__.__name__}: {e})") from None
    question, answer = turns(rec.get("conversations"), where)[0]
    out = {"question": question, "answer": answer, "answers": rec.get("answers") or [answer]}
    for k in ("box", "choices"):
        if k in rec:
            out[k] = rec[k]
    if "id" in rec:
        out["question_id"] = rec["id"]
    return image, out, key
