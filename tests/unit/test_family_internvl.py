"""InternVL's own (mcit/models/internvl.py), against transformers' own code: its InternVLProcessor (built here
without the video processor it cannot build without torchvision) and GotOcr2's tiling, InternVL's published
chat template, and the model's own forward on a batch whose rows have different numbers of tiles."""

from __future__ import annotations

import io
import json
from unittest import mock

import pytest
import torch

IGNORE = -100
WORDS = "what colour is the shape ? blue how many dots three describe the image a red square"
# (width, height): square, tall, wide, very wide / tall, one tile, and a size with more tiles than a 2x2 grid
SIZES = [(32, 32), (64, 96), (40, 16), (100, 20), (20, 100), (16, 16), (48, 32), (12, 40)]


def hf_processor(proc):
    """transformers' own InternVLProcessor over the same tokenizer and image processor (its check that a video
    processor is given is skipped: the video processor needs torchvision, and images never reach it)."""
    from transformers import InternVLProcessor

    with mock.patch.object(InternVLProcessor, "check_argument_for_proper_class", lambda self, name, arg: None):
        return InternVLProcessor(image_processor=proc.image_processor, tokenizer=proc.tokenizer,
                                 image_seq_length=proc.image_seq_length, chat_template=proc.chat_template)


def image(size: tuple[int, int], colour: tuple[int, int, int] = (200, 30, 30)):
    """A picture with structure (a gradient and a square), so that tiles and thumbnails differ."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, colour)
    draw = ImageDraw.Draw(img)
    for x in range(size[0]):
        draw.line([(x, 0), (x, size[1] // 3)], fill=(x * 255 // size[0], 90, 255 - x * 255 // size[0]))
    draw.rectangle([size[0] // 4, size[1] // 2, size[0] // 2, size[1] - 2], fill=(20, 220, 40))
    return img


def sample(key: str, pairs: list[tuple[str, str]], size: tuple[int, int] | None = (32, 32)) -> dict:
    conversations = [m for q, a in pairs for m in ({"from": "human", "value": q}, {"from": "gpt", "value": a})]
    s = {"__key__": key, "json": json.dumps({"conversations": conversations,
                                             **({} if size else {"text_only": True})}).encode()}
    if size:
        buf = io.BytesIO()
        image(size).save(buf, format="PNG")
        s["png"] = buf.getvalue()
    return s


def messages(pairs: list[tuple[str, str]], last_answer: bool = True) -> list[dict]:
    msgs = []
    for i, (q, a) in enumerate(pairs):
        content = [{"type": "text", "text": q.replace("<image>", "").strip()}]
        msgs.append({"role": "user", "content": ([{"type": "image"}] if i == 0 else []) + content})
        if i < len(pairs) - 1 or last_answer:
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": a}]})
    return msgs


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    """The family's tiny model and processor, saved and loaded as a checkpoint (the offline processor)."""
    from mcit.models.base import load_backbone
    from mcit.models.internvl import InternVLBackbone

    model, proc = InternVLBackbone.tiny([WORDS], seed=3)
    d = tmp_path_factory.mktemp("internvl")
    model.save_pretrained(d)
    proc.save_pretrained(d)
    return load_backbone("internvl", str(d))


def test_template_answers_have_no_leading_space_and_ids_are_internvl_processors_own(tmp_path):
    """InternVL3-hf's ChatML turns, ``<|im_start|>assistant\\n<answer><|im_end|>``, with a byte-level tokenizer
    (where " blue" and "blue" differ): the target is each answer's own tokens and <|im_end|>, and a two-turn
    training sample and an evaluation prompt are what transformers' InternVLProcessor makes of the published
    template (``<IMG_CONTEXT>`` expanded to ``<img>`` + the image's tokens + ``</img>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from mcit.models.base import load_backbone
    from mcit.models.internvl import IMAGE_SPECIALS, INTERNVL_TEMPLATE, build_internvl

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *IMAGE_SPECIALS.values()]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["user assistant what colour is the shape? blue how many dots? three"] * 5,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  chat_template=INTERNVL_TEMPLATE, extra_special_tokens=dict(IMAGE_SPECIALS))
    assert tok(" blue", add_special_tokens=False)["input_ids"] != tok("blue", add_special_tokens=False)["input_ids"]
    model, proc = build_internvl(tok)
    model.save_pretrained(tmp_path / "ivl")
    proc.save_pretrained(tmp_path / "ivl")
    bb = load_backbone("internvl", str(tmp_path / "ivl"))
    tok = bb.tokenizer
    ref = hf_processor(bb.processor)
    pairs = [("<image>\nwhat colour is the shape?", "blue"), ("how many dots?", "three")]
    size = (64, 96)
    batch = bb.make_collate(None, 0, train=True)([sample("q", pairs, size)])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    trained = batch.labels[0][batch.labels[0] != IGNORE].tolist()
    assert trained == (tok("blue", add_special_tokens=False)["input_ids"] + [end]
                       + tok("three", add_special_tokens=False)["input_ids"] + [end])
    text = ref.apply_chat_template(messages(pairs), tokenize=False)
    assert text.startswith("<|im_start|>user\n<IMG_CONTEXT>\nwhat colour")
    own = ref(text=[text], images=[image(size)], return_tensors="pt")["input_ids"][0].tolist()
    assert batch.inputs["input_ids"][0].tolist() == own
    tiles = bb.processor.image_processor.get_number_of_image_patches(size[1], size[0], {"crop_to_patches": True})
    assert own.count(bb.image_token_id) == tiles * bb.processor.image_seq_length and tiles > 1
    assert own.count(tok.start_image_token_id) == own.count(tok.end_image_token_id) == 1
    ev = bb.make_collate(None, 0, train=False)([sample("q", pairs, size)])
    text = ref.apply_chat_template(messages(pairs, last_answer=False), add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    own = ref(text=[text], images=[image(size)], return_tensors="pt")["input_ids"][0].tolist()
    assert ev.inputs["input_ids"][0].tolist() == own
    assert (ev.labels == IGNORE).all()


def test_tiles_and_text_expansion_are_transformers_own(internvl):
    """The offline processor gives what transformers' InternVLProcessor gives (ids and tiles) for images of
    several aspect ratios, two images in one text included; each image's tile count is GotOcr2's
    (``get_number_of_image_patches``: the grid crop_image_to_patches cuts, plus the thumbnail), and its
    ``<img>...</img>`` holds image_seq_length tokens per tile."""
    import numpy

    proc = internvl.processor
    ref = hf_processor(proc)
    ip = proc.image_processor
    images = [image(s) for s in SIZES]
    want = [ip.get_number_of_image_patches(h, w, {"crop_to_patches": True}) for w, h in SIZES]
    assert want == [len(ip.crop_image_to_patches(numpy.asarray(im), 1, ip.max_patches, patch_size=ip.size))
                    for im in images]
    assert len(set(want)) >= 3 and max(want) == internvl.max_tiles() and min(want) == 1
    texts = ["<IMG_CONTEXT>\nwhat colour is the shape?"] * 6 + ["<IMG_CONTEXT> and <IMG_CONTEXT>"]
    mine = proc(text=texts, images=images, return_tensors="pt", padding=True)
    theirs = ref(text=texts, images=images, return_tensors="pt", padding=True)
    assert torch.equal(mine["input_ids"], theirs["input_ids"])
    assert torch.equal(mine["attention_mask"], theirs["attention_mask"])
    assert torch.equal(mine["pixel_values"], theirs["pixel_values"]) and mine["pixel_values"].shape[0] == sum(want)
    seq = proc.image_seq_length
    assert seq == internvl.model.config.image_seq_length == 4
    tok = proc.tokenizer
    for row, n in enumerate(want[:6]):
        ids = mine["input_ids"][row][mine["attention_mask"][row].bool()].tolist()
        s, e = ids.index(tok.start_image_token_id), ids.index(tok.end_image_token_id)
        assert ids[s + 1:e] == [internvl.image_token_id] * (n * seq) and ids.count(internvl.image_token_id) == n * seq
    last = mine["input_ids"][6].tolist()
    assert last.count(internvl.image_token_id) == (want[6] + want[7]) * seq
    assert last.count(tok.start_image_token_id) == last.count(tok.end_image_token_id) == 2


@torch.no_grad()
def test_rows_carry_their_own_tiles_and_logits_equal_transformers_own(internvl):
    """A batch of images with different tile counts and a text-only sample: each row carries its image's tiles
    (padded to the most an image can have, ``num_tiles`` real) and ``<img>`` + tiles x image_seq_length tokens +
    ``</img>``; the image features are transformers' get_image_features (pixel shuffle, projector) of those tiles,
    the pooled query their mean (zero without an image); the logits are transformers' forward on the batch."""
    from mcit.models.internvl import InternVLBackbone

    bb = internvl
    assert isinstance(bb, InternVLBackbone) and bb.image_query_dim == bb.hidden_size
    sizes = [(64, 96), (32, 32), None, (100, 20), (16, 16)]
    pairs = [("<image>\nwhat colour is the shape?", "blue")]
    samples = [sample(f"s{i}", pairs if s else [("how many dots?", "three")], s) for i, s in enumerate(sizes)]
    batch = bb.make_collate(None, 0, train=False)(samples)
    ip = bb.processor.image_processor
    tiles = [ip.get_number_of_image_patches(s[1], s[0], {"crop_to_patches": True}) if s else 0 for s in sizes]
    assert batch.inputs["num_tiles"].tolist() == tiles and len(set(tiles)) == 4
    assert batch.pixel_values.shape == (len(sizes), bb.max_tiles(), 3, 16, 16)
    seq = bb.processor.image_seq_length
    tok = bb.tokenizer
    for i, (s, n) in enumerate(zip(sizes, tiles)):
        ids = batch.inputs["input_ids"][i][batch.inputs["attention_mask"][i].bool()].tolist()
        assert ids.count(bb.image_token_id) == n * seq
        assert ids.count(tok.start_image_token_id) == ids.count(tok.end_image_token_id) == (1 if s else 0)
        if s:
            start = ids.index(tok.start_image_token_id)
            assert ids[start + 1 + n * seq] == tok.end_image_token_id
            alone = bb.processor.tiles([image(s)])["pixel_values"]
            assert torch.equal(batch.pixel_values[i, :n], alone)
        assert not batch.pixel_values[i, n:].any()
    feats, pooled = bb.vision(batch)
    real = torch.cat([batch.pixel_values[i, :n] for i, n in enumerate(tiles) if n])
    own = bb.model.model.get_image_features(pixel_values=real, return_dict=True).pooler_output
    assert feats.shape == (sum(tiles), seq, bb.hidden_size) and torch.equal(feats, own)
    parts = torch.split(own, [n for n in tiles if n])
    rows = [i for i, n in enumerate(tiles) if n]
    for i, part in zip(rows, parts):
        torch.testing.assert_close(pooled[i], part.reshape(-1, bb.hidden_size).mean(0))
    assert not pooled[2].any() and pooled[0].abs().sum() > 0
    assert not torch.allclose(pooled[0], pooled[1])
    embeds, _ = bb.input_embeddings(batch)
    mask = batch.inputs["attention_mask"]
    at = batch.inputs["input_ids"] == bb.image_token_id
    assert torch.equal(embeds[at], own.reshape(-1, bb.hidden_size))  # row by row, tile by tile
    ref = bb.model(**bb.model_inputs(batch)).logits
    mine = bb.logits(embeds, mask, bb.positions(batch))
    scale = float(ref[mask.bool()].abs().max())
    assert float((mine - ref)[mask.bool()].abs().max()) <= 1e-5 * scale


def test_text_query_leaves_the_image_markup_out(internvl):
    """The instruction's text query is the same with or without an image: ``<img>``, ``</img>`` and the image
    tokens are not instruction."""
    bb = internvl
    pairs = [("<image>\nwhat colour is the shape?", "blue")]
    with_image = bb.make_collate(None, 0, train=False)([sample("a", pairs, (48, 32))])
    without = bb.make_collate(None, 0, train=False)([sample("b", pairs, None)])
    q = [bb.text_query(b, bb.model.get_input_embeddings()(b.inputs["input_ids"])) for b in (with_image, without)]
    torch.testing.assert_close(q[0], q[1])
