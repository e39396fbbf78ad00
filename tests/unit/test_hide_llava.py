"""HiDe-LLaVA on the tiny LLaVA with the tiny CLIP as its auxiliary backbone: CLIP's own features feed the anchors,
a training step moves only the current task's pairs, the subspace stage folds a task's features into its anchors,
inference is fused and routed per sample, and pre-flight resolves the CLIP. (Numbers against the official code:
tests/reference/test_hide_llava_reference.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcit.core.registry import METHODS
from mcit.data.types import TaskSequence

SMALL = {"r": 4, "alpha": 8, "dropout": 0.0}


@pytest.fixture(scope="module")
def llava(mcit_assets):
    from mcit.data.shards import iter_samples, open_split
    from mcit.models.mllm import MLLMBackbone

    bb = MLLMBackbone.from_path(str(mcit_assets["backbone"]))  # its own: the method injects its layers into it
    split = open_split(mcit_assets["shards"] / "colour" / "train")
    samples = list(iter_samples(split, 0, 1, policy="sample"))[:6]
    return bb, split, samples


def _method(bb, clip, clip_backbone, tasks: int = 2, seed: int = 0, **over):
    cls = METHODS.get("hide_llava")
    torch.manual_seed(seed)
    seq = TaskSequence.from_label_spaces([f"t{i}" for i in range(tasks)], [[] for _ in range(tasks)])
    return cls(cls.Params(**{**SMALL, "clip_path": str(clip_backbone), **over}), bb, seq, auxiliary={"clip": clip})


def test_guide_features_are_clips_own_and_per_sample(llava, clip, clip_backbone):
    """The image feature is CLIP's image embedding of the sample's image (re-normalised from the LLaVA processor's
    pixels), the text feature CLIP's text pooler output of the question without its <image> placeholder; each row
    is its sample's alone. The tiny CLIP's caption vocabulary knows few of the instruction words (most become
    <unk>), yet every task's instruction fits its 16 positions and gets its own text feature."""
    from mcit.data.tiny_mcit import CONTINUAL_TASKS, QUESTIONS

    bb, split, samples = llava
    m = _method(bb, clip, clip_backbone)
    batch = bb.make_collate(split, 0, train=True)(samples[:3])
    image, text = m.guide_features(batch)
    ip = bb.processor.image_processor
    px = clip.from_pixels_of(batch.pixel_values, torch.tensor(ip.image_mean).view(3, 1, 1),
                             torch.tensor(ip.image_std).view(3, 1, 1))
    want = clip.model.visual_projection(clip.model.vision_model(pixel_values=px).pooler_output)
    assert torch.allclose(image, want, atol=1e-6)
    questions = [s["question"] for s in batch.meta]
    assert all(q.startswith("<image>") for q in questions)
    enc = clip.tokenize([q.replace("<image>", "").strip() for q in questions])
    assert torch.allclose(text, clip.model.text_model(**enc).pooler_output, atol=1e-6)
    alone = [m.guide_features(bb.make_collate(split, 0, train=True)([s])) for s in samples[:3]]
    assert torch.allclose(image, torch.cat([a[0] for a in alone]), atol=1e-6)
    assert torch.allclose(text, torch.cat([a[1] for a in alone]), atol=1e-6)
    instructions = [QUESTIONS[t] for t in CONTINUAL_TASKS]
    ids = clip.tokenizer(instructions)["input_ids"]
    assert max(len(x) for x in ids) <= clip.model.config.text_config.max_position_embeddings
    f = F.normalize(clip.model.text_model(**clip.tokenize(instructions)).pooler_output, dim=-1)
    assert (f @ f.T - torch.eye(len(instructions))).abs().max() < 1 - 1e-4  # no two the same


def test_hide_llava_trains_its_task_pair_folds_anchors_and_generates_per_sample(llava, clip, clip_backbone):
    """Untrained (B = 0) it is the pre-trained model; a training step on task 0 moves task 0's pairs (and the
    projector) only; the subspace stage's sums move task 0's anchors; routing then prefers task 0 for task 0's
    samples; generation is per sample; a rebuilt method loading the state generates the same."""
    bb, split, samples = llava
    train = bb.make_collate(split, 0, train=True)
    batch = train(samples[:4])
    plain = METHODS.get("prompt_tuning")(METHODS.get("prompt_tuning").Params(), bb,
                                         TaskSequence.from_label_spaces(["a"], [[]])).eval()
    with torch.no_grad(), plain.zero_shot():
        pretrained = plain(batch).per_sample
    m = _method(bb, clip, clip_backbone)
    assert m.top_layer == bb.language_model.config.num_hidden_layers - 1
    m.eval()
    with torch.no_grad():
        assert torch.allclose(m(batch).per_sample, pretrained, atol=1e-6)
        with m.zero_shot():
            assert torch.equal(m(batch).per_sample, pretrained)
    m.set_task(0)
    m.train()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.SGD(m.trainable_parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        loss = m(batch).per_sample.mean()
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
    moved = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(n.endswith(".task0") or n.startswith("projector.") for n in moved)
    assert any(n.endswith("B.task0") for n in moved) and any(n.startswith("projector.") for n in moved)
    # the subspace stage of task 0
    anchors = m.image_anchors.clone()
    stats = [m.statistics(train(samples[i:i + 2])) for i in (0, 2, 4)]
    sums = {k: sum(s[k].double() for s in stats) for k in stats[0]}
    m.finalize_statistics(sums, 0)
    assert float(m.anchor_count[0]) == 1 + len(samples) and float(m.anchor_count[1]) == 1
    assert not torch.allclose(m.image_anchors[0], anchors[0]) and torch.equal(m.image_anchors[1], anchors[1])
    m.eval()
    w = m.route(*m.guide_features(batch))
    assert torch.allclose(w.sum(-1), torch.ones(len(batch))) and bool((w[:, 0] > 0.5).all())
    with torch.no_grad():
        assert not torch.allclose(m(batch).per_sample, pretrained)
    collate = bb.make_collate(split, 0, train=False)
    together = m.generate(collate(samples), 4)
    alone = [m.generate(collate([s]), 4)[0] for s in samples]
    assert together == alone
    again = _method(bb, clip, clip_backbone, seed=1)
    again.load_state_dict(m.state_dict())
    again.eval()
    assert again.generate(collate(samples), 4) == together


def test_hide_llava_checks_the_rank_against_the_tasks_and_declares_its_clip(llava, clip, clip_backbone):
    bb, _, _ = llava
    with pytest.raises(ValueError, match=r"method.r: 4 does not split over the 3 tasks"):
        _method(bb, clip, clip_backbone, tasks=3)
    cls = METHODS.get("hide_llava")
    spec = cls.auxiliary_backbones(cls.Params(clip_path="x", clip_tag="t"))["clip"]
    assert (spec.kind, spec.path, spec.tag, spec.key) == ("clip", "x", "t", "method.clip_path")
    with pytest.raises(ValueError, match="needs its auxiliary backbone 'clip'"):
        cls(cls.Params(**SMALL, clip_path="x"), bb, TaskSequence.from_label_spaces(["a"], [[]]))


def test_preflight_resolves_the_hide_llava_clip(mcit_assets, clip_backbone, tmp_path):
    import yaml
    from conftest import mcit_config

    from mcit.core.config import ConfigError, load_config
    from mcit.run.preflight import preflight

    def cfg(path):
        file = mcit_config(mcit_assets, tmp_path, "hide")
        data = yaml.safe_load(file.read_text())
        data["method"] = {"name": "hide_llava", "r": 4, "alpha": 8, "clip_path": str(path), "clip_tag": "tiny_clip"}
        file.write_text(yaml.safe_dump(data))
        return load_config(file)

    plan = preflight(cfg(clip_backbone))
    assert plan.auxiliary["clip"].record["tag"] == "tiny_clip"
    with pytest.raises(ConfigError, match=r"method.clip_path: .*nope"):
        preflight(cfg(tmp_path / "nope"))
