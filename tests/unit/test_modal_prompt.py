"""ModalPrompt on the tiny LLaVA: a training step with either guide (the backbone's features, an auxiliary CLIP),
what trains at a task boundary, the fusion order, prompts right after BOS, per-sample generation, rebuilds from the
state, and the parameter checks. (Against the official code: tests/reference/test_modal_prompt_reference.py.)"""

from __future__ import annotations

import pytest
import torch

from mcit.core.registry import METHODS
from mcit.data.types import TaskSequence


@pytest.fixture(scope="module")
def llava(mcit_assets):
    from mcit.data.shards import iter_samples, open_split
    from mcit.models.mllm import MLLMBackbone

    bb = MLLMBackbone.from_path(str(mcit_assets["backbone"]))
    split = open_split(mcit_assets["shards"] / "count" / "test")
    samples = list(iter_samples(split, 0, 1, policy="sample"))[:4]
    return bb, split, samples


@pytest.fixture(scope="module")
def clip(clip_backbone):
    from mcit.models.base import load_backbone

    return load_backbone("clip", str(clip_backbone))


def _method(bb, tasks: int = 3, clip=None, seed: int = 0, **params):
    cls = METHODS.get("modal_prompt")
    params = {"prefix_len": 2, "guide": "backbone", **params}
    if clip is not None:
        params.update(guide="clip", clip_path="unused-here")
    torch.manual_seed(seed)
    seq = TaskSequence.from_label_spaces([f"t{i}" for i in range(tasks)], [[] for _ in range(tasks)])
    return cls(cls.Params(**params), bb, seq, **({"auxiliary": {"clip": clip}} if clip is not None else {}))


def _state(m) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("guide", ["backbone", "clip"])
def test_a_training_step_moves_the_current_task_only(llava, clip, guide):
    """Task 1 of 3 (transfer_num 2: task 0's prompt and task 1's own): one Adam step changes task 1's prompt and
    head and the projector, and nothing of task 0 or task 2, although task 0's prompt is in the input."""
    bb, split, samples = llava
    m = _method(bb, clip=clip if guide == "clip" else None, transfer_num=2, lam=0.8)
    assert m.shared_prototype is False  # 32-wide pooled image / 64-wide text; the CLIP's 16 / 32: split heads
    m.set_task(1)
    m.before_task(1)
    m.train()
    names = {n for n, p in m.named_parameters() if p.requires_grad}
    assert names == {"prompt1", *[f"transforms.1.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")]} | \
        {n for n, _ in m.named_parameters() if n.startswith("projector.")}
    assert {id(p) for p in m.trainable_parameters()} == {id(p) for n, p in m.named_parameters() if n in names}
    before = _state(m)
    opt = torch.optim.Adam([g["params"] for g in m.param_groups()][0], lr=1e-2)
    batch = bb.make_collate(split, 1, train=True)(samples)
    out = m.train_outputs(batch)
    assert out["selected"].tolist() == [[0, 1]] * len(samples)  # t < K: every seen task in task order
    assert torch.allclose(out["guide"], 0.8 * out["cos_image"] + 0.2 * out["cos_text"])  # lam weighs the image
    terms = m.loss(batch, out)
    assert torch.isfinite(terms.per_sample).all() and terms.per_sample.shape == (len(samples),)
    assert torch.allclose(terms.per_sample, out["lm_loss"] + out["align_image"] + out["align_text"])
    assert float(out["align_image"].detach().min()) > 0 and float(out["align_text"].detach().min()) > 0
    opt.zero_grad()
    terms.per_sample.mean().backward()
    opt.step()
    after = m.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {k for k in before if k in names}
    assert any(k.startswith("projector.") for k in changed)


def test_fusion_order_follows_the_official_branches():
    from mcit.methods.modal_prompt import fusion_order

    g = torch.tensor([[0.1, 0.9, 0.5, 0.3, 0.0], [0.8, 0.2, 0.4, 0.1, 0.7]])
    # training, K = 3: before the third task every seen prompt in task order; then the 2 best earlier tasks,
    # least similar first, and the current task's own last
    assert fusion_order(g[:, :2], 1, 3, True).tolist() == [[0, 1], [0, 1]]
    assert fusion_order(g, 4, 3, True).tolist() == [[2, 1, 4], [2, 0, 4]]
    assert fusion_order(g, 4, 1, True).tolist() == [[4], [4]]  # MCITlib's transfer_num 1
    # inference: the K best of every seen task, least similar first
    assert fusion_order(g, 4, 3, False).tolist() == [[3, 2, 1], [2, 4, 0]]
    assert fusion_order(g[:, :2], 1, 3, False).tolist() == [[0, 1], [1, 0]]
    assert fusion_order(g, 4, 1, False).tolist() == [[1], [0]]


def test_prompts_go_right_after_bos_and_generation_is_per_sample(llava):
    bb, split, samples = llava
    m = _method(bb, transfer_num=2)
    m.set_task(2)
    m.eval()
    for train in (True, False):  # right padding to train, left padding to generate
        batch = bb.make_collate(split, 2, train=train)(samples[:3])
        e, mask, lab, _, extra = m.prompted_inputs(batch)
        embeds, _ = bb.input_embeddings(batch)
        ids, am = batch.inputs["input_ids"], batch.inputs["attention_mask"]
        P = extra["selected"].shape[1] * m.params.prefix_len
        for i in range(3):
            f = int((am[i].cumsum(0) == 0).sum())  # leading pads
            assert int(ids[i, f]) == bb.tokenizer.bos_token_id
            assert torch.equal(e[i, f], embeds[i, f]) and int(mask[i, f]) == 1  # BOS first, attended
            want = torch.cat([m.prompt(int(t)) for t in extra["selected"][i]]).to(e.dtype)
            assert torch.equal(e[i, f + 1: f + 1 + P], want) and bool(mask[i, f + 1: f + 1 + P].all())
            assert torch.equal(e[i, f + 1 + P:], embeds[i, f + 1:]) and bool((lab[i, : f + 1 + P] == -100).all())
    collate = bb.make_collate(split, 2, train=False)
    together = m.generate(collate(samples), 4)
    assert together == [m.generate(collate([s]), 4)[0] for s in samples]
    first = _method(bb, transfer_num=2, prompt_position="first")  # before BOS instead
    first.load_state_dict(m.state_dict())
    first.set_task(2)
    first.eval()
    batch = collate(samples[:1])
    e1, _, _, _, _ = m.prompted_inputs(batch)
    e2, _, _, _, _ = first.prompted_inputs(batch)
    f = int((batch.inputs["attention_mask"][0].cumsum(0) == 0).sum())
    assert torch.equal(e2[0, f: f + P], e1[0, f + 1: f + 1 + P]) and torch.equal(e2[0, f + P], e1[0, f])


def test_prompts_start_as_vocabulary_rows_and_a_rebuild_loads_the_state(llava):
    bb, split, samples = llava
    m = _method(bb, tasks=2)
    table = bb.token_embeddings().detach().float()
    for t in range(2):
        rows = m.prompt(t).detach()
        assert all(bool((table == r).all(1).any()) for r in rows)
    m.set_task(1)
    m.eval()
    batch = bb.make_collate(split, 1, train=False)(samples)
    want = m.generate(batch, 4)
    again = _method(bb, tasks=2, seed=5)
    again.load_state_dict(m.state_dict())
    again.set_task(1)
    again.eval()
    assert again.generate(batch, 4) == want
    with m.zero_shot():  # the pre-trained model alone
        e, mask, _, _, extra = m.prompted_inputs(batch)
    embeds, _ = bb.input_embeddings(batch)
    assert extra == {} and torch.equal(e, embeds)


def test_frozen_projector_is_the_pretrained_one(llava):
    bb, _, _ = llava
    m = _method(bb, train_projector=False)
    assert m.projector is None and m.projector_parameters() == []
    assert all(not p.requires_grad for p in bb.projector().parameters())
    lr = _method(bb, projector_lr=2e-5)
    assert [g.get("lr") for g in lr.param_groups()] == [None, 2e-5]


def test_parameters_are_checked():
    cls = METHODS.get("modal_prompt")
    with pytest.raises(ValueError, match="clip_path"):
        cls.Params()
    with pytest.raises(ValueError, match="guide: clip"):
        cls.Params(guide="backbone", clip_path="x")
    p = cls.Params(clip_path="x", clip_tag="t")
    aux = cls.auxiliary_backbones(p)["clip"]
    assert (aux.kind, aux.path, aux.tag, aux.key) == ("clip", "x", "t", "method.clip_path")
    assert cls.auxiliary_backbones(cls.Params(guide="backbone")) == {}


def test_trains_with_its_weights_in_bf16_as_deepspeed_casts_them(llava, clip):
    """DeepSpeed's bf16 casts the method's weights (prompts, heads, the projector copy) to bf16; the frozen backbone
    and CLIP keep theirs."""
    bb, split, samples = llava
    m = _method(bb, clip=clip, transfer_num=2).to(torch.bfloat16)
    m.set_task(1)
    m.train()
    batch = bb.make_collate(split, 1, train=True)(samples)
    m.loss(batch, m.train_outputs(batch)).per_sample.mean().backward()
    assert torch.isfinite(m.prompt(1).grad.float()).all() and m.prompt(1).grad.dtype == torch.bfloat16
    assert all(p.grad is not None for p in m.projector_parameters())
    _method(bb, train_projector=False)  # the pre-trained projector back for the other tests
