"""LLaVA-OneVision (mcit.models.llava_onevision) against transformers' own code, on a tiny model with a byte-level
(Qwen-like) tokenizer, saved and loaded like a checkpoint (its processor: the offline AnyresImageTokenProcessor):

* the chat format: a two-turn training sample and an evaluation prompt are what LlavaOnevisionProcessor makes of
  llava-hf/llava-onevision-qwen2-0.5b-ov-hf's published template; the loss covers each answer and its <|im_end|>;
* anyres: for images of many sizes and aspect ratios and three ``vision_aspect_ratio`` caps, the processor's image
  token count equals transformers' processor count and the model's feature count (unpadding, newlines, shrink);
* a batch row carries its own patches (count and original size recorded), its image features are those of its
  image alone, and the wrapper's logits on a batch of mixed grids (and a text-only row) equal transformers' forward;
* the pooled image query is the tower's mean output over the base crop (a zero image for a text-only row).

transformers' LlavaOnevisionProcessor is built here without its video processor (which needs torchvision) by
skipping ProcessorMixin's class check of its sub-processors; nothing else of it changes.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

IGNORE = -100
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
# (width, height): square, tall, wide, very elongated both ways, tiny, beyond the largest pinpoint
SIZES = [(32, 32), (64, 96), (96, 64), (17, 64), (64, 17), (200, 30), (30, 200), (33, 65), (5, 7), (64, 64),
         (150, 200)]


def byte_level_tokenizer():
    """Qwen2-like: byte-level BPE (" \\n" and "\\n" differ), ChatML tokens, <image> / <video>, no BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["user assistant what colour is the shape? blue how many dots? three the left right"] * 5,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens={"image_token": "<image>"})


def transformers_processor(tokenizer, image_processor, num_image_tokens: int, vision_aspect_ratio: str):
    """transformers' own LlavaOnevisionProcessor over these parts, with no video processor."""
    from transformers import LlavaOnevisionProcessor
    from transformers.processing_utils import ProcessorMixin

    from mcit.models.llava_onevision import ONEVISION_TEMPLATE

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
        return LlavaOnevisionProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                       num_image_tokens=num_image_tokens, vision_feature_select_strategy="full",
                                       vision_aspect_ratio=vision_aspect_ratio, chat_template=ONEVISION_TEMPLATE)


def image(w: int, h: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8))


def sample(key: str, pairs: list[tuple[str, str]], img=None) -> dict:
    conversations = [m for q, a in pairs for m in ({"from": "human", "value": q}, {"from": "gpt", "value": a})]
    s = {"__key__": key, "json": json.dumps({"conversations": conversations,
                                             **({} if img is not None else {"text_only": True})}).encode()}
    if img is not None:
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        s["png"] = buf.getvalue()
    return s


@pytest.fixture(scope="module")
def ov(tmp_path_factory):
    """(the tiny LLaVA-OneVision loaded from its saved directory, transformers' processor for it)."""
    from mcit.models.base import load_backbone
    from mcit.models.llava_onevision import AnyresImageTokenProcessor, build_llava_onevision

    model, proc = build_llava_onevision(byte_level_tokenizer(), seed=3)
    d = tmp_path_factory.mktemp("llava_onevision")
    model.save_pretrained(d)
    proc.save_pretrained(d)
    bb = load_backbone("llava_onevision", str(d))
    assert isinstance(bb.processor, AnyresImageTokenProcessor)  # no torchvision here: the offline processor
    cfg = bb.model.config
    n = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2
    return bb, transformers_processor(bb.tokenizer, bb.processor.image_processor, n, cfg.vision_aspect_ratio)


def test_training_sample_and_prompt_are_the_published_templates(ov):
    """A two-turn sample is what LlavaOnevisionProcessor makes of the template's rendering of the conversation;
    the evaluation prompt what it makes of the rendering with the generation prompt; the loss covers exactly
    "blue" <|im_end|> "three" <|im_end|> (not the "\\n" the template writes before each answer)."""
    bb, hf = ov
    tok = bb.tokenizer
    pairs = [("<image>\nwhat colour is the shape?", "blue"), ("how many dots?", "three")]
    img = image(40, 24, 0)
    assert bb.render(pairs, train=True, has_image=True).text == (
        "<|im_start|>user <image>\nwhat colour is the shape?<|im_end|><|im_start|>assistant \nblue<|im_end|>"
        "<|im_start|>user \nhow many dots?<|im_end|><|im_start|>assistant \nthree<|im_end|>")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the shape?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "blue"}]},
            {"role": "user", "content": [{"type": "text", "text": "how many dots?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "three"}]}]
    batch = bb.make_collate(None, 0, train=True)([sample("q", pairs, img)])
    own = hf(text=[hf.apply_chat_template(msgs)], images=[img], return_tensors="pt")["input_ids"][0].tolist()
    assert batch.inputs["input_ids"][0].tolist() == own
    end = tok.convert_tokens_to_ids("<|im_end|>")
    labels = batch.labels[0]
    trained = labels[labels != IGNORE].tolist()
    assert trained == (tok("blue", add_special_tokens=False)["input_ids"] + [end]
                       + tok("three", add_special_tokens=False)["input_ids"] + [end])
    assert torch.equal(labels[labels != IGNORE], batch.inputs["input_ids"][0][labels != IGNORE])

    ev = bb.make_collate(None, 0, train=False)([sample("q", pairs, img)])
    prompt = hf.apply_chat_template(msgs[:3], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user \nhow many dots?<|im_end|><|im_start|>assistant\n")
    own = hf(text=[prompt], images=[img], return_tensors="pt")["input_ids"][0].tolist()
    assert ev.inputs["input_ids"][0].tolist() == own and (ev.labels == IGNORE).all()

    text_only = bb.make_collate(None, 0, train=False)([sample("t", [("what is the left colour?", "blue")])])
    want = tok(hf.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "what is the left "
                                                                                           "colour?"}]}],
                                      add_generation_prompt=True))["input_ids"]
    assert text_only.inputs["input_ids"][0].tolist() == want and bb.image_token_id not in want


@torch.no_grad()
def test_image_token_count_is_transformers_own_for_every_size():
    """For every size and three feature caps (anyres_max_1 and _2 shrink the 2 x 2 grid's features, _9 does not):
    the offline processor gives what transformers' processor gives (ids, patches, sizes), and each image's token
    count is transformers' processor count and the model's feature count."""
    from mcit.models.llava_onevision import build_llava_onevision

    tok = byte_level_tokenizer()
    imgs = [image(w, h, i) for i, (w, h) in enumerate(SIZES)]
    counts = {}
    for ratio in ("anyres_max_1", "anyres_max_2", "anyres_max_9"):
        model, proc = build_llava_onevision(tok, vision_aspect_ratio=ratio)
        hf = transformers_processor(tok, proc.image_processor, proc.num_image_tokens, ratio)
        mine = proc(text=["<image> what"] * len(imgs), images=imgs)
        ref = hf(text=["<image> what"] * len(imgs), images=imgs, return_tensors="pt", padding=True)
        for k in ("input_ids", "attention_mask", "pixel_values", "image_sizes"):
            assert torch.equal(torch.as_tensor(mine[k]), torch.as_tensor(ref[k])), k
        n_tokens = (mine["input_ids"] == model.config.image_token_index).sum(1).tolist()
        assert n_tokens == hf._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in SIZES])["num_image_tokens"]
        feats = model.model.get_image_features(pixel_values=mine["pixel_values"], image_sizes=mine["image_sizes"])
        assert n_tokens == [len(f) for f in feats.pooler_output]
        counts[ratio] = n_tokens
    assert all(a <= b <= c for a, b, c in zip(*counts.values()))
    assert counts["anyres_max_1"] != counts["anyres_max_2"] != counts["anyres_max_9"]  # the shrink did act


@torch.no_grad()
def test_a_row_carries_its_own_patches_and_a_mixed_batch_is_transformers_own(ov):
    """Images with different grids and a text-only sample in one batch: each row's patches are its image's own
    (zero beyond), ``image_patches`` / ``image_sizes`` are its count and original (H, W), the features written
    over its image tokens are transformers' for its image alone, and the logits equal transformers' forward."""
    bb, hf = ov
    imgs = [image(32, 32, 1), image(64, 96, 2), None, image(200, 30, 3)]
    samples = [sample(f"s{i}", [("<image>\nwhat colour is the shape?", "blue")] if im is not None else
                      [("what colour is the shape?", "blue")], im) for i, im in enumerate(imgs)]
    for train in (True, False):
        batch = bb.make_collate(None, 0, train=train)(samples)
        embeds, pooled = bb.input_embeddings(batch)
        ids, mask = batch.inputs["input_ids"], batch.inputs["attention_mask"]
        assert batch.inputs["has_image"].tolist() == [True, True, False, True]
        assert batch.pixel_values.shape[1] == bb.max_patches == 5
        for i, im in enumerate(imgs):
            n = int(batch.inputs["image_patches"][i])
            if im is None:
                assert n == 0 and batch.inputs["image_sizes"][i].tolist() == [0, 0]
                assert not batch.pixel_values[i].any() and not (ids[i] == bb.image_token_id).any()
                assert torch.equal(embeds[i], bb.model.get_input_embeddings()(ids[i]))
                continue
            alone = hf(text=["<image>"], images=[im], return_tensors="pt")
            assert n == alone["pixel_values"].shape[1] and batch.inputs["image_sizes"][i].tolist() == [im.height,
                                                                                                       im.width]
            assert torch.equal(batch.pixel_values[i, :n], alone["pixel_values"][0])
            assert not batch.pixel_values[i, n:].any()
            feats = bb.model.model.get_image_features(pixel_values=alone["pixel_values"],
                                                      image_sizes=alone["image_sizes"]).pooler_output[0]
            assert int((ids[i] == bb.image_token_id).sum()) == len(feats)
            assert torch.allclose(embeds[i][ids[i] == bb.image_token_id], feats, atol=1e-5)
        assert sorted(set(batch.inputs["image_patches"].tolist())) == [0, 2, 3, 5]  # three grids and no image
        ref = bb.model(**bb.model_inputs(batch)).logits[mask.bool()]
        mine = bb.logits(embeds, mask)[mask.bool()]
        assert float((mine - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@torch.no_grad()
def test_pooled_query_is_the_towers_mean_over_the_base_crop(ov):
    """Each row's pooled query is the vision tower's mean output token over its image's base crop (the whole
    image resized; the same whatever its grid); a text-only row's is that of a zero image."""
    bb, hf = ov
    imgs = [image(64, 96, 4), None, image(30, 200, 5)]
    samples = [sample(f"p{i}", [("<image>\nhow many dots?", "three")] if im is not None else
                      [("how many dots?", "three")], im) for i, im in enumerate(imgs)]
    _, pooled = bb.input_embeddings(bb.make_collate(None, 0, train=False)(samples))
    tower = bb.model.model.vision_tower
    assert pooled.shape == (3, bb.model.config.vision_config.hidden_size) == (3, bb.image_query_dim)
    for i, im in enumerate(imgs):
        base = torch.zeros(1, 3, 32, 32) if im is None else hf(text=["<image>"], images=[im],
                                                               return_tensors="pt")["pixel_values"][:, 0]
        want = tower(base).last_hidden_state.mean(1)[0]
        assert torch.allclose(pooled[i], want, atol=1e-6)
    assert not torch.allclose(pooled[0], pooled[2], atol=1e-3)
