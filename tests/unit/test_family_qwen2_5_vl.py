"""Qwen2.5-VL (mcit/models/qwen2_5_vl.py) beyond the generic family tests (tests/unit/test_families.py):

* its chat format is what its own processor makes of Qwen/Qwen2.5-VL-7B-Instruct's published template (the default
  system prompt included), with a byte-level tokenizer where " blue" and "blue" differ; the loss is on the answers
  and their <|im_end|> only;
* the tiny model exercises the ViT's window attention (several windows per image, windowed and full-attention
  blocks), so the generic logits / generation equalities cover it; on a batch mixing image sizes (windows padded
  at the image's edge), a text-only row and left padding, the wrapper still equals transformers.
"""

from __future__ import annotations

import io
import json

import pytest
import torch

from tests.unit.test_chat_format import IGNORE, conv, sample

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                 "<|video_pad|>"]


def byte_level_qwen_tokenizer(chat_template: str):
    """A byte-level BPE tokenizer as Qwen's (no BOS, <|im_end|> its EOS, <|endoftext|> its padding), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["system You are a helpful assistant. user assistant what colour is the shape? blue "
                             "how many dots? three"] * 5,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=QWEN_SPECIALS,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = chat_template
    assert tok(" blue", add_special_tokens=False)["input_ids"] != tok("blue", add_special_tokens=False)["input_ids"]
    return tok


def check_chat_format(family, tmp_path, template: str, head: str) -> None:
    """A 2-turn training sample and an evaluation prompt of ``family`` (tiny, over a byte-level tokenizer with the
    ``template``, saved and loaded) are what its processor makes of the template; the rendered text opens with
    ``head``; the loss covers each answer and its <|im_end|>, nothing else."""
    from PIL import Image

    from mcit.models.base import load_backbone

    model, proc = family.tiny_from_tokenizer(byte_level_qwen_tokenizer(template))
    model.save_pretrained(tmp_path / "m")
    proc.save_pretrained(tmp_path / "m")
    bb = load_backbone(family.kind, str(tmp_path / "m"))
    assert bb.processor.chat_template == template
    tok = bb.tokenizer
    pairs = [("<image>\nwhat colour is the shape?", "blue"), ("how many dots?", "three")]
    assert bb.render(pairs, train=True, has_image=True).text.startswith(head)
    batch = bb.make_collate(None, 0, train=True)([sample("q", conv(*pairs))])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    trained = batch.labels[0][batch.labels[0] != IGNORE].tolist()
    assert trained == (tok("blue", add_special_tokens=False)["input_ids"] + [end]
                       + tok("three", add_special_tokens=False)["input_ids"] + [end])
    image = Image.new("RGB", (16, 16), (200, 30, 30))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the shape?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "blue"}]},
            {"role": "user", "content": [{"type": "text", "text": "how many dots?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "three"}]}]
    own = bb.processor(text=[bb.processor.apply_chat_template(msgs)], images=[image])["input_ids"][0].tolist()
    assert batch.inputs["input_ids"][0].tolist() == own
    assert int((batch.inputs["input_ids"][0] == bb.image_token_id).sum()) == 16  # 32 x 32 pixels: 4 x 4 merged
    ev = bb.make_collate(None, 0, train=False)([sample("q", conv(*pairs))])
    own = bb.processor(text=[bb.processor.apply_chat_template(msgs[:3], add_generation_prompt=True)],
                       images=[image])["input_ids"][0].tolist()
    assert ev.inputs["input_ids"][0].tolist() == own
    assert (ev.labels == IGNORE).all()


def test_chat_format_is_qwen2_5_vl_7b_instructs_own(tmp_path):
    from mcit.models.qwen2_5_vl import QWEN2_5_VL_TEMPLATE, Qwen2_5_VLBackbone

    check_chat_format(Qwen2_5_VLBackbone, tmp_path, QWEN2_5_VL_TEMPLATE,
                      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                      "<|vision_start|><|image_pad|><|vision_end|>what colour is the shape?<|im_end|>\n"
                      "<|im_start|>assistant\nblue<|im_end|>\n")


@pytest.fixture(scope="module")
def qwen25():
    from mcit.data import tiny_mcit as B
    from mcit.models.qwen2_5_vl import Qwen2_5_VLBackbone

    return Qwen2_5_VLBackbone(*Qwen2_5_VLBackbone.tiny(B.corpus(), seed=2))


def mixed_samples(mcit_assets) -> list[dict]:
    """An image sample, a text-only one, and one with a 2:1 image and a longer question (another grid)."""
    from PIL import Image

    from mcit.data.shards import iter_samples, open_split

    split = open_split(mcit_assets["shards"] / "colour" / "test")
    a, b, c = list(iter_samples(split, 0, 1, policy="sample"))[:3]
    rec = json.loads(b["json"])
    text_only = {"__key__": "t", "json": json.dumps({**rec, "text_only": True}).encode()}
    wide, rec = dict(c), json.loads(c["json"])
    image = Image.open(io.BytesIO(c["png"]))
    buf = io.BytesIO()
    image.resize((image.width * 2, image.height)).save(buf, format="PNG")
    rec["conversations"][0]["value"] += " Say the colour of the shape, please."
    wide.update({"__key__": "wide", "png": buf.getvalue(), "json": json.dumps(rec).encode()})
    return [a, text_only, wide]


@torch.no_grad()
def test_the_vit_attends_within_windows(qwen25):
    """The tiny ViT has several windows per image and both kinds of block: its image features differ from those of
    the same weights with full attention in every block, so the wrapper-vs-transformers tests cover the windows."""
    from transformers.vision_utils import get_vision_window_index

    vis = qwen25.model.model.visual
    cfg = vis.config
    assert 0 < len(cfg.fullatt_block_indexes) < cfg.depth
    grid = torch.tensor([[1, 8, 8]])
    _, cu = get_vision_window_index(grid, cfg.spatial_merge_size, cfg.window_size, cfg.patch_size)
    assert len(cu) - 1 == 4  # 4 x 4 merged tokens in windows of 2 x 2
    pixels = torch.randn(64, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(0))
    windowed = torch.cat(qwen25.model.model.get_image_features(pixels, grid, return_dict=True).pooler_output)
    full = list(vis.fullatt_block_indexes)
    vis.fullatt_block_indexes = list(range(cfg.depth))
    try:
        everywhere = torch.cat(qwen25.model.model.get_image_features(pixels, grid, return_dict=True).pooler_output)
    finally:
        vis.fullatt_block_indexes = full
    assert float((windowed - everywhere).abs().max()) > 1e-3 * float(windowed.abs().max())


@torch.no_grad()
def test_mixed_sizes_text_only_row_and_prompts_equal_transformers(qwen25, mcit_assets):
    from tests.unit.test_families import _decode, _embedding_replaced, _prompts, _scale_close, _with_stand_ins

    bb = qwen25
    batch = bb.make_collate(None, 0, train=False)(mixed_samples(mcit_assets))
    grid = batch.inputs["image_grid_thw"]
    assert batch.inputs["has_image"].tolist() == [True, False, True] and grid[2].tolist() != grid[0].tolist()
    assert grid[2, 2] // 2 % 2 == 1 or grid[2, 1] // 2 % 2 == 1  # an odd number of merged tokens: a padded window
    embeds, _ = bb.input_embeddings(batch)
    mask = batch.inputs["attention_mask"]
    ref_in = bb.model_inputs(batch)
    _scale_close(bb.logits(embeds, mask, bb.positions(batch))[mask.bool()], bb.model(**ref_in).logits[mask.bool()])
    prompts = _prompts(bb, 3)
    e, m, _, pos = bb.insert_prompts(embeds, mask, prompts, None, bb.positions(batch))
    ref_in, where = _with_stand_ins(bb, ref_in)
    with _embedding_replaced(bb, where, prompts):
        ref = bb.model(**ref_in).logits
        hf = bb.model.generate(**ref_in, max_new_tokens=4, do_sample=False, num_beams=1,
                               pad_token_id=int(bb.tokenizer.pad_token_id))
    _scale_close(bb.logits(e, m, pos)[m.bool()], ref[m.bool()])
    assert bb.generate(e, m, 4, pos) == _decode(bb, hf, ref_in["input_ids"].shape[1])
