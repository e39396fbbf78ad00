"""Decoding one instruction sample of a shard: what it yields and how it fails."""

import io
import json

import pytest
from PIL import Image

from mcit.data.instructions import decode_instruction
from mcit.data.shards import DataError


def _sample(conversations, key="k7", url="shards/t/shard-000003.tar", **extra):
    buf = io.BytesIO()
    Image.new("L", (4, 4), 128).save(buf, format="PNG")  # a grey-scale image: the model wants RGB
    return {"__key__": key, "__url__": url, "png": buf.getvalue(),
            "json": json.dumps({"conversations": conversations, **extra}).encode()}


def test_a_sample_decodes_to_an_rgb_image_and_its_turns():
    conv = [{"from": "human", "value": "<image>\nQ1"}, {"from": "gpt", "value": "A1"},
            {"from": "human"}, {"from": "gpt"}]  # a turn without a value reads as empty text, not "None"
    image, rec, key = decode_instruction(_sample(conv, id="q9"))
    assert image.mode == "RGB" and key == "k7"
    assert rec["turns"] == [("<image>\nQ1", "A1"), ("", "")] and rec["question_id"] == "q9"


@pytest.mark.parametrize("conv, why", [
    ([{"from": "human", "value": "Q"}], "'conversations' must hold at least one human and one gpt turn"),
    ("not a list of turns", "'conversations' must hold at least one human and one gpt turn"),
    ([{"from": "gpt", "value": "A"}, {"from": "human", "value": "Q"}], "turn 0 is not a human/gpt pair"),
    ([{"from": "human", "value": "Q"}, {"from": "human", "value": "Q2"}], "turn 0 is not a human/gpt pair"),
    ([{"from": "gpt", "value": "A"}, {"from": "gpt", "value": "A2"}], "turn 0 is not a human/gpt pair"),
])
def test_a_malformed_conversation_names_the_sample_and_its_shard(conv, why):
    with pytest.raises(DataError) as e:
        decode_instruction(_sample(conv))
    assert str(e.value).startswith(f"sample k7 in shards/t/shard-000003.tar: {why}")
