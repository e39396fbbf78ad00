"""Qwen3-VL (mcit/models/qwen3_vl.py) beyond the generic family tests (tests/unit/test_families.py):

* its chat template is Qwen/Qwen3-VL-8B-Instruct's, byte for byte, and its chat format is what its own processor
  makes of it (no default system prompt), with a byte-level tokenizer; the loss is on the answers and <|im_end|>;
* DeepStack: the image-token mask and the deepstack features the wrapper carries are those transformers' own forward
  gives its text model, with and without prompts (the prompt slots are no image tokens); they matter -- without
  them, or with them zeroed, the logits are not transformers' -- so the generic equality tests would catch a family
  that dropped them; on a batch with a text-only row the wrapper still equals transformers (logits, generation);
  prompts train through the deepstack path;
* the vision tower runs once per batch (``input_embeddings`` then ``positions``), and the features it keeps never
  travel with a collate's pickled view of the backbone.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import replace

import pytest
import torch

from tests.unit.test_families import (
    _decode,
    _embedding_replaced,
    _prompts,
    _scale_close,
    _with_stand_ins,
)
from tests.unit.test_family_qwen2_5_vl import check_chat_format, mixed_samples


def test_template_is_qwen3_vl_8b_instructs_own():
    """The template of Qwen/Qwen3-VL-8B-Instruct-GGUF (its byte count and SHA-256 as zhongkaifu/TensorSharp's tests
    pin them), which is the checkpoint's chat_template.json."""
    from mcit.models.qwen3_vl import QWEN3_VL_TEMPLATE

    data = QWEN3_VL_TEMPLATE.encode()
    assert len(data) == 5292
    assert hashlib.sha256(data).hexdigest() == "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4"


def test_chat_format_is_qwen3_vl_8b_instructs_own(tmp_path):
    from mcit.models.qwen3_vl import QWEN3_VL_TEMPLATE, Qwen3VLBackbone

    check_chat_format(Qwen3VLBackbone, tmp_path, QWEN3_VL_TEMPLATE,
                      "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what colour is the shape?"
                      "<|im_end|>\n<|im_start|>assistant\nblue<|im_end|>\n<|im_start|>user\nhow many dots?")


@pytest.fixture(scope="module")
def qwen3():
    from mcit.data import tiny_mcit as B
    from mcit.models.qwen3_vl import Qwen3VLBackbone

    return Qwen3VLBackbone(*Qwen3VLBackbone.tiny(B.corpus(), seed=2))


class _TextModelInputs:
    """The visual mask and deepstack features transformers' forward gives the text model (a pre-hook)."""

    def __init__(self, bb) -> None:
        self.lm = bb.model.model.language_model
        self.calls: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def __enter__(self) -> "_TextModelInputs":
        def hook(module, args, kwargs):
            self.calls.append((kwargs.get("visual_pos_masks"), kwargs.get("deepstack_visual_embeds")))

        self.handle = self.lm.register_forward_pre_hook(hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def _same_deepstack(mine, pos, theirs) -> None:
    mask, feats = theirs
    assert torch.equal(pos.visual_mask, mask)
    assert len(pos.deepstack) == len(feats) == len(mine.model.config.vision_config.deepstack_visual_indexes) == 2
    for a, b in zip(pos.deepstack, feats):
        assert a.shape == (int(mask.sum()), mine.hidden_size)
        assert torch.equal(a, b)


@torch.no_grad()
def test_deepstack_features_are_transformers_own_and_matter(qwen3, mcit_assets):
    bb = qwen3
    batch = bb.make_collate(None, 0, train=False)(mixed_samples(mcit_assets))
    assert batch.inputs["has_image"].tolist() == [True, False, True]
    embeds, _ = bb.input_embeddings(batch)
    mask = batch.inputs["attention_mask"]
    pos = bb.positions(batch)
    assert pos.position_ids.shape == (3, *mask.shape)
    ref_in = bb.model_inputs(batch)
    with _TextModelInputs(bb) as seen:
        ref = bb.model(**ref_in).logits
    _same_deepstack(bb, pos, seen.calls[0])
    assert not pos.visual_mask[1].any()  # the text-only row
    real = mask.bool()
    _scale_close(bb.logits(embeds, mask, pos)[real], ref[real])
    # without deepstack (the features zeroed, or the causal LM on embeddings alone) the logits are not transformers'
    scale = float(ref[real].abs().max())
    zeroed = replace(pos, deepstack=[torch.zeros_like(f) for f in pos.deepstack])
    for wrong in (bb.logits(embeds, mask, zeroed), bb.model(inputs_embeds=embeds, attention_mask=mask,
                                                             position_ids=pos.position_ids).logits):
        assert float((wrong - ref)[real].abs().max()) > 1e-2 * scale
        assert float((wrong - ref)[[0, 2], -1].abs().max()) > 1e-3 * scale  # the answer's logits too
    hf = bb.model.generate(**ref_in, max_new_tokens=4, do_sample=False, num_beams=1,
                           pad_token_id=int(bb.tokenizer.pad_token_id))
    mine = bb.generate(embeds, mask, 4, pos)
    assert mine == _decode(bb, hf, ref_in["input_ids"].shape[1]) and any(mine)


@torch.no_grad()
def test_prompts_leave_the_deepstack_features_on_the_image_tokens(qwen3, mcit_assets):
    bb = qwen3
    batch = bb.make_collate(None, 0, train=False)(mixed_samples(mcit_assets))
    embeds, _ = bb.input_embeddings(batch)
    prompts = _prompts(bb, 3)
    e, m, _, pos = bb.insert_prompts(embeds, batch.inputs["attention_mask"], prompts, None, bb.positions(batch))
    ref_in, where = _with_stand_ins(bb, bb.model_inputs(batch))
    assert not pos.visual_mask[where].any()
    with _TextModelInputs(bb) as seen, _embedding_replaced(bb, where, prompts):
        ref = bb.model(**ref_in).logits
    _same_deepstack(bb, pos, seen.calls[0])
    _scale_close(bb.logits(e, m, pos)[m.bool()], ref[m.bool()])


def test_prompts_train_through_the_deepstack_path(qwen3, mcit_assets):
    bb = qwen3
    batch = bb.make_collate(None, 0, train=True)(mixed_samples(mcit_assets))
    embeds, _ = bb.input_embeddings(batch)
    prompts = _prompts(bb, 3).requires_grad_(True)
    e, m, lab, pos = bb.insert_prompts(embeds, batch.inputs["attention_mask"], prompts, batch.labels,
                                       bb.positions(batch))
    loss = bb.lm_loss(e, m, lab, pos)
    loss.mean().backward()
    assert torch.isfinite(loss).all() and bool((prompts.grad.abs().sum((1, 2)) > 0).all())


@torch.no_grad()
def test_the_tower_runs_once_per_batch_and_its_features_stay_home(qwen3, mcit_assets):
    from mcit.data.shards import iter_samples, open_split

    bb = qwen3
    calls = []
    handle = bb.model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    try:
        collate = bb.make_collate(None, 0, train=False)
        batch = collate(mixed_samples(mcit_assets))
        bb.input_embeddings(batch)
        pos = bb.positions(batch)
        assert len(calls) == 1
        assert bb.positions(collate(mixed_samples(mcit_assets))).deepstack is pos.deepstack  # the same images
        split = open_split(mcit_assets["shards"] / "count" / "test")
        other = collate(list(iter_samples(split, 0, 1, policy="sample"))[:2])  # images the tower has not seen
        fresh = bb.positions(other)
        assert len(calls) == 2
        bb.kept_images.key = None
        again = bb.positions(other)
        assert all(torch.equal(a, b) for a, b in zip(fresh.deepstack, again.deepstack))
    finally:
        handle.remove()
    view = pickle.loads(pickle.dumps(collate))
    assert view.func.__self__.kept_images.key is None and bb.kept_images.key is not None
