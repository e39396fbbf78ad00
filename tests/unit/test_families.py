"""Every multimodal LLM family (``MLLMBackbone.families()``: one file each under mcit/models) against
transformers' own model code, on the family's tiny model (``Family.tiny``) saved and loaded like a checkpoint:

* the wrapper's logits on image + text equal transformers' forward (``model_inputs``) to 1e-5 of their scale;
* its greedy generation gives the tokens transformers' ``generate`` gives;
* with prompts inserted, both equal transformers' own forward / ``generate`` on the same ids with stand-in tokens
  where the prompts go, whose embeddings a hook on the embedding layer replaces by the prompts: transformers
  computes everything else (image features, their placement, M-RoPE positions, deepstack) itself;
* a batch's rows are what each sample collated alone gives, and answers do not depend on the batch.

A family registered later (in a test module, a plug-in) is picked up by the parametrisation.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from mcit.models.mllm import MLLMBackbone

KINDS = [f.kind for f in MLLMBackbone.families()]
PROMPTS = 3


@pytest.fixture(scope="module", params=KINDS)
def family(request, tmp_path_factory):
    """(backbone loaded from a saved tiny checkpoint, an evaluation batch of three image samples)."""
    from mcit.data import tiny_mcit as B
    from mcit.data.shards import iter_samples, open_split
    from mcit.models.base import load_backbone

    assets = request.getfixturevalue("mcit_assets")
    fam = next(f for f in MLLMBackbone.families() if f.kind == request.param)
    model, processor = fam.tiny(B.corpus(), seed=1)
    d = tmp_path_factory.mktemp(f"family_{fam.kind}")
    model.save_pretrained(d)
    processor.save_pretrained(d)
    bb = load_backbone(fam.kind, str(d))
    assert type(bb) is fam
    split = open_split(assets["shards"] / "count" / "test")
    samples = list(iter_samples(split, 0, 1, policy="sample"))[:3]
    return bb, samples, split


def _scale_close(mine: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    scale = float(ref.abs().max())
    assert scale > 1e-2 and float(ref.std()) > 1e-3, "a trivial reference"
    assert float((mine - ref).abs().max()) <= rel * scale, float((mine - ref).abs().max()) / scale


def _prompts(bb, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = float(bb.token_embeddings().detach().std())
    return (torch.randn(n, PROMPTS, bb.hidden_size, generator=g) * scale * 3).to(bb.dtype)


def _stand_in_id(bb) -> int:
    """An ordinary text token, for where the prompts go."""
    return bb.tokenizer("the", add_special_tokens=False)["input_ids"][0]


def _with_stand_ins(bb, inputs: dict) -> tuple[dict, torch.Tensor]:
    """transformers' inputs with PROMPTS stand-in tokens before each row's first real token; their mask (B, L+P)."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    first = (mask.cumsum(1) == 0).sum(1)
    rows, masks, where = [], [], []
    for i in range(ids.shape[0]):
        f = int(first[i])
        stand = ids.new_full((PROMPTS,), _stand_in_id(bb))
        rows.append(torch.cat([ids[i, :f], stand, ids[i, f:]]))
        masks.append(torch.cat([mask[i, :f], mask.new_ones(PROMPTS), mask[i, f:]]))
        w = torch.zeros(len(rows[-1]), dtype=torch.bool)
        w[f:f + PROMPTS] = True
        where.append(w)
    out = dict(inputs)
    out["input_ids"], out["attention_mask"] = torch.stack(rows), torch.stack(masks)
    if "mm_token_type_ids" in out:
        out["mm_token_type_ids"] = (out["input_ids"] == bb.image_token_id).int()
    return out, torch.stack(where)


@contextmanager
def _embedding_replaced(bb, where: torch.Tensor, prompts: torch.Tensor) -> Iterator[None]:
    """While active, the embedding layer's output at ``where`` (on a call over the whole prompt) is ``prompts``."""
    def hook(module, args, out):
        if out.shape[:2] != where.shape:
            return out  # a decoding step
        out = out.clone()
        out[where] = prompts.reshape(-1, out.shape[-1]).to(out.dtype)
        return out

    handle = bb.model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _decode(bb, out: torch.Tensor, start: int) -> list[str]:
    return [t.strip() for t in bb.tokenizer.batch_decode(out[:, start:], skip_special_tokens=True)]


@torch.no_grad()
def test_logits_and_greedy_generation_equal_transformers_own(family):
    bb, samples, split = family
    batch = bb.make_collate(split, 0, train=False)(samples)
    embeds, _ = bb.input_embeddings(batch)
    mask = batch.inputs["attention_mask"]
    pos = bb.positions(batch)
    ref_in = bb.model_inputs(batch)
    real = mask.bool()
    _scale_close(bb.logits(embeds, mask, pos)[real], bb.model(**ref_in).logits[real])
    ids = ref_in["input_ids"]
    hf = bb.model.generate(**ref_in, max_new_tokens=4, do_sample=False, num_beams=1,
                           pad_token_id=int(bb.tokenizer.pad_token_id))
    mine = bb.generate(embeds, mask, 4, pos)
    assert mine == _decode(bb, hf, ids.shape[1]) and any(mine)


@torch.no_grad()
def test_generation_honours_the_checkpoint_s_generation_config(family):
    """A generation_config with a repetition penalty and two EOS ids (Qwen's instruct checkpoints ship several EOS
    ids): the answers equal transformers' ``generate`` on the same config (which counts the prompt's ids in the
    penalty), and the config does change answers (mcit used to apply neither)."""
    import copy

    bb, samples, split = family
    batch = bb.make_collate(split, 0, train=False)(samples)
    embeds, _ = bb.input_embeddings(batch)
    mask, pos, ref_in = batch.inputs["attention_mask"], bb.positions(batch), bb.model_inputs(batch)
    start, pad = ref_in["input_ids"].shape[1], int(bb.tokenizer.pad_token_id)

    def hf() -> list[str]:
        out = bb.model.generate(**ref_in, max_new_tokens=6, do_sample=False, num_beams=1, pad_token_id=pad)
        return _decode(bb, out, start)

    plain = bb.model.generate(**ref_in, max_new_tokens=6, do_sample=False, num_beams=1, pad_token_id=pad)[:, start:]
    owner = bb.causal_lm  # whose generation_config the family's transformers generate reads
    saved = copy.deepcopy(owner.generation_config)
    try:
        gc = owner.generation_config
        gc.repetition_penalty = 1.3
        gc.eos_token_id = [int(bb.tokenizer.eos_token_id), int(plain[0, 2])]  # a token the first answer says third
        want = hf()
        mine = bb.generate(embeds, mask, 6, pos, seen_ids=batch.inputs["input_ids"])
    finally:
        owner.generation_config = saved
    assert mine == want
    assert want != _decode(bb, plain, 0) and mine != bb.generate(embeds, mask, 6, pos)  # the config mattered


@torch.no_grad()
def test_with_prompts_equal_transformers_own_with_the_prompts_as_token_embeddings(family):
    bb, samples, split = family
    batch = bb.make_collate(split, 0, train=False)(samples)
    embeds, _ = bb.input_embeddings(batch)
    prompts = _prompts(bb, len(samples))
    e, m, _, pos = bb.insert_prompts(embeds, batch.inputs["attention_mask"], prompts, None, bb.positions(batch))
    ref_in, where = _with_stand_ins(bb, bb.model_inputs(batch))
    assert torch.equal(m, ref_in["attention_mask"])
    with _embedding_replaced(bb, where, prompts):
        ref = bb.model(**ref_in).logits
        hf = bb.model.generate(**ref_in, max_new_tokens=4, do_sample=False, num_beams=1,
                               pad_token_id=int(bb.tokenizer.pad_token_id))
    real = m.bool()
    mine = bb.logits(e, m, pos)
    _scale_close(mine[real], ref[real])
    without = bb.logits(embeds, batch.inputs["attention_mask"], bb.positions(batch))
    assert float((mine[:, -1] - without[:, -1]).abs().max()) > 1e-3  # the prompts do change the answer's logits
    assert bb.generate(e, m, 4, pos) == _decode(bb, hf, ref_in["input_ids"].shape[1])


def test_a_batch_is_its_samples_alone(family, mcit_assets):
    from tests.unit.test_mcit import _batch_rows_equal_one_sample_batches

    bb, samples, split = family
    _batch_rows_equal_one_sample_batches(bb, mcit_assets)
    collate = bb.make_collate(split, 0, train=False)
    with torch.no_grad():
        e, _ = bb.input_embeddings(collate(samples))
        alone = [bb.input_embeddings(collate([s]))[0] for s in samples]
    prompts = _prompts(bb, len(samples), seed=1)
    batch = collate(samples)
    e, m, _, pos = bb.insert_prompts(e, batch.inputs["attention_mask"], prompts, None, bb.positions(batch))
    together = bb.generate(e, m, 3, pos)
    for i, s in enumerate(samples):
        one = collate([s])
        ei, mi, _, pi = bb.insert_prompts(alone[i], one.inputs["attention_mask"], prompts[i:i + 1], None,
                                          bb.positions(one))
        assert bb.generate(ei, mi, 3, pi) == together[i:i + 1]


def test_repetition_penalty_leaves_the_prompt_s_left_padding_out_as_generate_does():
    """transformers' generate passes each row's padding length as ``prompt_ignore_length``: a padding id in the
    left padding is not penalised, an id in the prompt's real tokens and one generated are (a random tiny Qwen
    answered differently from generate when mcit counted the padding)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from mcit.models.mllm import Decoding

    pad = 0
    seen = torch.tensor([[pad, pad, 5, 6], [7, 8, 9, 5]])  # row 0 left-padded, row 1 full
    generated = torch.tensor([[3], [pad]])
    scores = torch.full((2, 12), 2.0)
    (proc,) = Decoding(eos=[1], pad=pad, repetition_penalty=1.5).processors(seen)
    got = proc(generated, scores.clone())
    want = RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=torch.tensor([2, 0]))(
        torch.cat([seen, generated], 1), scores.clone())
    assert torch.equal(got, want)
    assert got[0, pad] == 2.0 and got[0, 5] == got[0, 3] == 2.0 / 1.5 and got[1, pad] == 2.0 / 1.5


def test_a_conversation_s_kept_tokens_equal_a_fresh_encoding_and_never_travel_to_the_workers(family):
    """``PROMPT_MEMO``: a conversation encoded again (train: labels on the answer; eval: up to it) gives what a
    backbone without the memo gives (a family hook that changed the kept tokens in place would show here), and a
    collate's pickled view of the backbone carries none of the entries."""
    import copy
    import json
    import pickle

    from mcit.data.instructions import turns

    bb, samples, split = family
    convs = [turns(json.loads(s["json"])["conversations"], s["__key__"]) for s in samples]
    for train in (True, False):
        first = [bb.encode(c, None, train=train)[:2] for c in convs]  # (ids, labels)
        again = [bb.encode(c, None, train=train)[:2] for c in convs]
        fresh = copy.copy(bb)
        fresh.__dict__.pop("_prompt_memo", None)
        assert first == again == [fresh.encode(c, None, train=train)[:2] for c in convs]
    assert len(bb.__dict__["_prompt_memo"]) >= 2
    view = pickle.loads(pickle.dumps(bb.collation_view()))
    assert not view.__dict__.get("_prompt_memo")
